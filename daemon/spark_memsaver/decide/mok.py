"""Secure Boot / MOK: the pure verdict. Parsed variables + the certificate -> ``Decision(state, reason, remedy,
where)``; the named MOK errors; :func:`require_installable` (unknown blocks installing). No I/O, no clock, no
environment: observe/mok.py reads, act/enroll.py acts.

States: not-needed, no-key, not-enrolled, pending-enroll, enrolled, pending-delete, blocked, unknown.
``unknown`` (a variable or certificate that cannot be read or parsed) never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spark_memsaver.errors import EXIT_PROBLEM, EXIT_USAGE, MemsaverError, SecureBootUnknown
from spark_memsaver import efi as ev

STATES = ("not-needed", "no-key", "not-enrolled", "pending-enroll", "enrolled", "pending-delete", "blocked",
          "unknown")
LOADABLE = ("not-needed", "enrolled")
PASSWORD_MIN, PASSWORD_MAX = 1, 256          # mokutil's limits for an import password

EFI_DIR = "/sys/firmware/efi"
EFIVARS_DIR = "/sys/firmware/efi/efivars"
MOKVAR_DIR = "/sys/firmware/efi/mok-variables"

# Variables we read: name -> GUID. MokListRT continuations (MokListRT1, ...) are found by listing.
SCALARS = {"SecureBoot": ev.EFI_GLOBAL_VARIABLE, "SetupMode": ev.EFI_GLOBAL_VARIABLE,
           "MokSBStateRT": ev.SHIM_LOCK_GUID}
LISTS = {"MokListRT": ev.SHIM_LOCK_GUID, "MokListXRT": ev.SHIM_LOCK_GUID, "MokNew": ev.SHIM_LOCK_GUID,
         "MokDel": ev.SHIM_LOCK_GUID, "db": ev.EFI_IMAGE_SECURITY_DATABASE, "dbx": ev.EFI_IMAGE_SECURITY_DATABASE}
PRESENCE = {"MokAuth": ev.SHIM_LOCK_GUID, "MokDelAuth": ev.SHIM_LOCK_GUID, "MokListTrustedRT": ev.SHIM_LOCK_GUID,
            "MokTimeout": ev.SHIM_LOCK_GUID}
MOKVAR_NAMES = ("MokListRT", "MokListXRT")    # shim's config table, preferred by mokutil when present

# --- named errors ------------------------------------------------------------------------------------

class MokError(MemsaverError):
    code = "mok-error"


class MokNotNeeded(MokError):
    code = "mok-not-needed"
    remedy = "Nothing to do: modules load without an enrolled key on this host."


class MokNoKey(MokError):
    code = "mok-no-key"
    remedy = ("Create the signing key first: build once with DKMS (it generates the key pair), or on Ubuntu run "
              "'sudo update-secureboot-policy --new-key'; or give --cert PATH.")


class MokAlreadyEnrolled(MokError):
    code = "mok-already-enrolled"
    remedy = "Nothing to do: the key is trusted at boot."


class MokAlreadyPending(MokError):
    code = "mok-already-pending"
    remedy = ("Reboot with a person at the console and confirm it in MokManager: our module becomes active by itself "
              "at that boot; or run 'sudo spark-memsaver mok cancel' and enroll again to set a new password.")


class MokPendingDelete(MokError):
    code = "mok-pending-delete"
    remedy = "Run 'sudo mokutil --revoke-delete' to keep the key, or reboot to complete the deletion first."


class MokKeyBlocked(MokError):
    code = "mok-key-blocked"
    remedy = ("The firmware forbids this key (dbx or MokListXRT). Create a new signing key, point DKMS at it "
              "(mok_signing_key/mok_certificate in /etc/dkms/framework.conf.d/) and enroll that one.")


class MokBadPassword(MokError):
    code = "mok-bad-password"
    exit_code = EXIT_USAGE
    remedy = (f"Use {PASSWORD_MIN}-{PASSWORD_MAX} printable ASCII characters (MokManager reads the keyboard with a "
              "US layout before any OS is running).")


class MokBadTimeout(MokError):
    code = "mok-bad-timeout"
    exit_code = EXIT_USAGE
    remedy = ("Give one of --console-timeout SECONDS (1..32767: MokManager counts down that long, then boots on "
              "without enrolling) or --wait-at-console (MokManager waits at its menu until someone comes).")


class MokutilFailed(MokError):
    code = "mokutil-failed"
    exit_code = 3
    remedy = ("Read mokutil's message above. 'Failed to write MokAuth'/'Failed to enroll new keys' usually means "
              "the firmware's variable store is full or write-protected.")

SYSFS_MISSING_REMEDY = ("A system image carries no firmware variables: run 'spark-memsaver mok status' on the "
                        "booted node itself, or bind-mount its /sys (sudo mount --rbind /sys ROOT/sys) before "
                        "inspecting with --root.")

# --- what was read (observe/mok.py fills it) ---------------------------------------------------------

@dataclass
class RawEfi:
    """Exactly what was read, nothing interpreted. files: name -> bytes | None (absent) | str (read error)."""
    efi: bool
    efivarfs: bool                     # efivars directory exists and lists at least one variable
    listing_error: str | None = None
    files: dict = field(default_factory=dict)
    continuations: list = field(default_factory=list)   # MokListRT<N> names present, sorted by N
    mokvar: dict = field(default_factory=dict)          # name -> bytes | str (read error)


# --- parsing (pure) --------------------------------------------------------------------------------------

@dataclass
class Var:
    name: str
    present: bool
    source: str = ""                   # "efivarfs" or "mok-variables"
    error: str | None = None           # why it could not be used (unknown)
    attributes: int | None = None
    value: int | None = None           # scalars
    lists: list = field(default_factory=list)

    def summary(self) -> dict:
        d = {"present": self.present}
        if not self.present and not self.error:
            return d
        d["source"] = self.source
        if self.attributes is not None:
            d["attributes"] = f"0x{self.attributes:08x}"
        if self.value is not None:
            d["value"] = self.value
        if self.lists:
            d.update(ev.summarize(self.lists))
        if self.error:
            d["error"] = self.error
        return d


@dataclass
class ParsedEfi:
    efi: bool
    efivarfs: bool
    listing_error: str | None
    vars: dict                          # name -> Var
    moklist_parts: list                 # names making up MokListRT, in order


def _parse_scalar(name: str, raw) -> Var:
    if raw is None:
        return Var(name, False)
    if isinstance(raw, str):
        return Var(name, True, "efivarfs", error=raw)
    try:
        v = ev.parse_efivarfs(raw, name)
        return Var(name, True, "efivarfs", attributes=v.attributes, value=ev.parse_uint_flag(v))
    except ev.EfiFormatError as e:
        return Var(name, True, "efivarfs", error=e.message)


def _parse_list(name: str, raw, source: str = "efivarfs") -> Var:
    if raw is None:
        return Var(name, False)
    if isinstance(raw, str):
        return Var(name, True, source, error=raw)
    try:
        if source == "efivarfs":
            v = ev.parse_efivarfs(raw, name)
            return Var(name, True, source, attributes=v.attributes,
                       lists=ev.parse_signature_lists(v.data, name, base_offset=4))
        return Var(name, True, source, lists=ev.parse_signature_lists(raw, name))
    except ev.EfiFormatError as e:
        return Var(name, True, source, error=e.message)


def parse_efi(raw: RawEfi) -> ParsedEfi:
    vs: dict = {}
    for name in SCALARS:
        vs[name] = _parse_scalar(name, raw.files.get(name))
    parts = ["MokListRT"]
    for name in LISTS:
        if name in raw.mokvar:
            vs[name] = _parse_list(name, raw.mokvar[name], "mok-variables")
        else:
            vs[name] = _parse_list(name, raw.files.get(name))
    if "MokListRT" not in raw.mokvar:
        for name in raw.continuations:
            vs[name] = _parse_list(name, raw.files.get(name))
            parts.append(name)
    for name in PRESENCE:
        r = raw.files.get(name)
        vs[name] = Var(name, r is not None, "efivarfs", error=r if isinstance(r, str) else None)
    return ParsedEfi(raw.efi, raw.efivarfs, raw.listing_error, vs, parts)


# --- certificate ----------------------------------------------------------------------------------------

@dataclass
class CertInfo:
    path: str | None
    origin: str                         # "--cert", "config signing_cert", "dkms framework.conf", default...
    present: bool = False
    error: str | None = None            # unreadable / not a certificate / unresolvable path -> unknown
    cert: ev.Certificate | None = None
    encoding: str | None = None

    def summary(self) -> dict:
        d = {"path": self.path, "origin": self.origin, "present": self.present}
        if self.cert is not None:
            c = self.cert
            d.update({"encoding": self.encoding, "sha256": c.sha256, "sha1": c.sha1, "subject": c.subject_text,
                      "issuer": c.issuer_text, "serial": c.serial.hex(), "not_before": c.not_before,
                      "not_after": c.not_after, "key_id": c.skid.hex() if c.skid is not None else None,
                      "kernel_description": c.kernel_key_description})
        if self.error:
            d["error"] = self.error
        return d


# --- decision (pure) -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    state: str
    reason: str
    remedy: str = ""
    where: tuple = ()


def _matches(cert: ev.Certificate, var: Var) -> bool:
    """Exact DER among x509 entries (what mokutil and the kernel load), or the SHA-256 of the
    TBSCertificate among x509-sha256 entries (how dbx revokes a certificate)."""
    for sl in var.lists:
        if sl.type_guid == ev.EFI_CERT_X509:
            if any(e.data == cert.der for e in sl.entries):
                return True
        elif sl.type_guid == ev.EFI_CERT_X509_SHA256:
            if any(e.data[:32] == cert.tbs_sha256 for e in sl.entries):
                return True
    return False


# The next step when a firmware variable cannot be read (the reason names which and why). Not 'run mok status':
# this is what mok status prints.
EFIVARS_REMEDY = ("Check that efivarfs is mounted and readable by root (if it is not mounted: 'sudo mount -t "
                  "efivarfs efivarfs /sys/firmware/efi/efivars'); if it is and the variable named above is "
                  "malformed, check the Secure Boot settings in the firmware's setup menu or update the firmware.")


def _unknown(reason: str, remedy: str | None = None) -> Decision:
    return Decision("unknown", reason, "Installing is refused until the state can be read. " +
                    (remedy or EFIVARS_REMEDY))


def _request_from_earlier_boot(c: CertInfo, request: dict | None, boot_id: str | None) -> dict | None:
    """Our record of an enrollment request for this certificate made in an earlier boot, if any."""
    if not request or c.cert is None or not boot_id:
        return None
    if request.get("cert_sha256") != c.cert.sha256 or request.get("boot_id") in (None, boot_id):
        return None
    return request


def decide(p: ParsedEfi, c: CertInfo, request: dict | None = None, boot_id: str | None = None) -> Decision:
    """Parsed variables + certificate -> state. Pure; the order of the checks is the documented precedence.

    ``request``/``boot_id``: our record of the last enrollment request (REQUEST_RECORD) and the current boot's
    id; they only sharpen the reason of not-enrolled (the prompt was missed) and pending-enroll (MokManager
    did not run at the last boot)."""
    if not p.efi and p.listing_error:
        return _unknown(p.listing_error, SYSFS_MISSING_REMEDY)
    if not p.efi:
        return Decision("not-needed", "no EFI firmware (booted in legacy/BIOS mode): modules are not "
                        "signature-checked against firmware keys")
    if p.listing_error:
        return _unknown(p.listing_error)
    if not p.efivarfs:
        return _unknown(f"EFI firmware is present but {EFIVARS_DIR} is empty: efivarfs is not mounted")
    sbv, smv, mokv = p.vars["SecureBoot"], p.vars["SetupMode"], p.vars["MokSBStateRT"]
    if sbv.error:
        return _unknown(f"SecureBoot variable: {sbv.error}")
    if not sbv.present:
        return Decision("not-needed", "the firmware has no SecureBoot variable (no Secure Boot support)")
    if smv.error:
        return _unknown(f"SetupMode variable: {smv.error}")
    if sbv.value == 0:
        return Decision("not-needed", "Secure Boot is disabled in the firmware")
    if smv.present and smv.value == 1:
        return Decision("not-needed", "the firmware is in Setup Mode (no Platform Key): Secure Boot is not enforced")
    if mokv.error:
        return _unknown(f"MokSBStateRT variable: {mokv.error}")
    if mokv.present and mokv.value == 1 and mokv.attributes is not None \
            and not mokv.attributes & ev.ATTR_NON_VOLATILE:
        return Decision("not-needed", "shim validation is disabled (MokSBStateRT, 'mokutil --disable-validation'): "
                        "the kernel does not enforce Secure Boot")
    if c.error:
        return _unknown(f"signing certificate {c.path}: {c.error}",
                        f"Make {c.path} a readable regular file holding one X.509 certificate (DER or PEM), "
                        "or set signing_cert in /etc/spark-memsaver/config.yaml (or pass --cert) to the right one.")
    if not c.present or c.cert is None:
        return Decision("no-key", f"no signing certificate at {c.path} ({c.origin})", MokNoKey.remedy)
    for name, v in p.vars.items():
        if name in SCALARS or name in PRESENCE:
            continue
        if v.error:
            return _unknown(f"{name} variable: {v.error}")
    conts = [n for n in p.moklist_parts if n != "MokListRT"]
    for i, name in enumerate(conts, start=1):
        if name != f"MokListRT{i}":
            return _unknown(f"{name} exists but MokListRT{i} does not: the split MokListRT is incomplete")
    if conts and not p.vars["MokListRT"].present:
        return _unknown(f"{conts[0]} exists without MokListRT: the split MokListRT is incomplete")
    cert = c.cert
    blocked = [n for n in ("dbx", "MokListXRT") if _matches(cert, p.vars[n])]
    if blocked:
        return Decision("blocked", f"the certificate is revoked in {' and '.join(blocked)}: the firmware and "
                        "kernel refuse anything it signs", MokKeyBlocked.remedy, tuple(blocked))
    in_mok = [n for n in p.moklist_parts if _matches(cert, p.vars[n])]
    in_db = ["db"] if _matches(cert, p.vars["db"]) else []
    if in_mok and _matches(cert, p.vars["MokDel"]):
        return Decision("pending-delete", f"the certificate is enrolled ({', '.join(in_mok)}) and a deletion "
                        "request (MokDel) is waiting for the next boot: after it, modules it signs stop loading",
                        MokPendingDelete.remedy, tuple(in_mok + ["MokDel"]))
    if in_mok or in_db:
        where = in_mok + in_db
        return Decision("enrolled", f"the certificate is trusted at boot (found in {', '.join(where)})",
                        "", tuple(where))
    if _matches(cert, p.vars["MokNew"]):
        reason = ("an enrollment request (MokNew) is waiting: on the next boot confirm it at the console in "
                  "MokManager")
        if not p.vars["MokAuth"].present:
            reason += "; but MokAuth (the request's password) is missing, so MokManager cannot verify it"
        earlier = _request_from_earlier_boot(c, request, boot_id)
        if earlier:
            reason += (f"; it was requested at {earlier.get('requested_at', '?')}, before the last reboot, so "
                       "MokManager did not run then (boot entry without mmx64.efi/mmaa64.efi next to shim, or "
                       "network boot first)")
        return Decision("pending-enroll", reason, MokAlreadyPending.remedy, ("MokNew",))
    reason = "the certificate is in neither MokListRT nor db"
    earlier = _request_from_earlier_boot(c, request, boot_id)
    if earlier:
        reason += (f"; the enrollment requested at {earlier.get('requested_at', '?')} was not confirmed at the "
                   "console on the following boot (countdown expired, 'Continue boot' chosen, or the password "
                   "was wrong 3 times), and MokManager discarded it")
    if not p.vars["MokListRT"].present:
        reason += " (MokListRT is absent: this boot did not go through shim, so MokManager cannot enroll it)"
    return Decision("not-enrolled", reason + ": modules signed with it will not load while Secure Boot is on",
                    ENROLL_STEPS[:1].upper() + ENROLL_STEPS[1:] + ".")

# The Secure Boot path, always in this order: request (sudo) -> reboot and confirm at the console -> ours
# becomes active by itself at that boot. Until then the guard keeps the stock nvidia-uvm loaded.
ENROLL_STEPS = ("run 'sudo spark-memsaver mok enroll', then reboot with a person at the console and confirm the "
                "key in MokManager: our module becomes active by itself at that boot")
CONFIRM_STEPS = ("reboot with a person at the console and confirm the key in MokManager: our module becomes "
                 "active by itself at that boot")


KERNEL_DISTRUST_REMEDY = (
    "The stock nvidia-uvm stays in use meanwhile. Check that MOK trust is on: 'sudo mokutil --trust-mok', then "
    "reboot and confirm it at the console (shim creates MokListTrustedRT; kernels with "
    "CONFIG_INTEGRITY_MACHINE_KEYRING then load MOKs into .machine; Ubuntu's kernels trust .platform); "
    "'sudo keyctl show %:.machine' and 'sudo keyctl show %:.platform' show what the kernel holds.")

# The guard's causes (systemd/guard/uvm-guard, "ours-load-failed: ... [cause]") in words.
LOAD_FAILURE_CAUSES = {
    "key-not-trusted": "key not trusted",
    "signature-required": "a signature the kernel trusts is required (lockdown)",
    "abi-mismatch": "built against another kernel or driver (unknown or mismatched symbol)",
    "bad-format": "not a module this kernel can load (format or version magic)",
}


def enrollment_remedy(sb: dict) -> str:
    """What makes a module we sign loadable, from the Secure Boot section: the next step of the order above
    for the state (the verdict's own remedy where the state needs something else first)."""
    state = (sb or {}).get("state")
    if state == "not-enrolled":
        return ENROLL_STEPS[:1].upper() + ENROLL_STEPS[1:] + "."
    if state == "pending-enroll":
        return (CONFIRM_STEPS[:1].upper() + CONFIRM_STEPS[1:] + " (or 'sudo spark-memsaver mok cancel' and enroll "
                "again to set a new password).")
    if state == "no-key":
        return ("Create the signing key (build once: 'sudo spark-memsaver install' signs with DKMS's key, creating "
                "it), then " + ENROLL_STEPS + ".")
    return (sb or {}).get("remedy") or (ENROLL_STEPS[:1].upper() + ENROLL_STEPS[1:] + ".")


def require_installable(sb: dict) -> None:
    """Raise SecureBootUnknown when the state is unknown (or missing): installing then would be a guess."""
    state = (sb or {}).get("state")
    if state not in STATES or state == "unknown":
        raise SecureBootUnknown("Secure Boot / MOK state is unknown: " + ((sb or {}).get("reason")
                                                                          or "it was not observed"),
                                remedy=(sb or {}).get("remedy") or None)


def exit_code(sb: dict) -> int:
    state = sb.get("state")
    if state in LOADABLE:
        return 0
    return EXIT_USAGE if state == "unknown" else EXIT_PROBLEM

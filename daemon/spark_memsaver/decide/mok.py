"""Secure Boot / MOK: the pure verdict. Parsed variables + the certificate -> ``Decision(state, reason, remedy,
where)``; the named MOK errors; :func:`require_installable` (unknown blocks installing). No I/O, no clock, no
environment: observe/mok.py reads, act/enroll.py acts.

States: not-needed, no-key, not-enrolled, pending-enroll, enrolled, pending-delete, blocked, unknown.
``unknown`` (a variable or certificate that cannot be read or parsed) never guesses.
"""

from __future__ import annotations

from spark_memsaver.record import Record

from spark_memsaver.errors import EXIT_PROBLEM, EXIT_USAGE, MokError, SecureBootUnknown
from spark_memsaver import efi as ev
# what was read, typed (re-exported: decide/mok.parse_efi, RawEfi, CertInfo ... stay importable from here)
from spark_memsaver.efi.mokvars import (EFI_DIR, EFIVARS_DIR, LISTS, MOKVAR_DIR, MOKVAR_NAMES,  # noqa: F401
                                        PRESENCE, SCALARS, CertInfo, MokReading, ParsedEfi, RawEfi, Var, parse_efi)

STATES = ("not-needed", "no-key", "not-enrolled", "pending-enroll", "enrolled", "pending-delete", "blocked",
          "unknown")
LOADABLE = ("not-needed", "enrolled")       # the states in which a module signed by our key loads


def state_loadable(state: str | None) -> bool:
    """The ONE rule: does a module signed by our key load in this Secure Boot / MOK state (status, installability,
    activate, the section's ``loadable``, which also asks the running kernel's trust)."""
    return state in LOADABLE


def _key_id(text) -> str | None:
    """A serial or key id as hex without separators or leading zero bytes (DER keeps a 00 before a serial whose
    top bit is set; modinfo prints the bytes as they are)."""
    if not isinstance(text, str) or not text:
        return None
    h = text.replace(":", "").lower()
    while len(h) > 2 and h.startswith("00"):
        h = h[2:]
    return h or None


def signed_with(sel, certificate: dict | None) -> bool | None:
    """The ONE rule of "is this module file signed with the configured certificate": the module's signature key
    id (modinfo ``sig_key``, observe/modules: the serial sign-file writes, or the subject key id with ``-k``)
    against the certificate's serial and key id (the secure_boot section's ``certificate``). None when either
    side cannot tell (no module, an unsigned module, no certificate)."""
    sig = _key_id(sel.get("sig_key") if isinstance(sel, dict) else getattr(sel, "sig_key", None))
    cert = certificate if isinstance(certificate, dict) else {}
    mine = {x for x in (_key_id(cert.get("serial")), _key_id(cert.get("key_id"))) if x}
    if sig is None or not mine:
        return None
    return sig in mine


PASSWORD_MIN, PASSWORD_MAX = 1, 256          # mokutil's limits for an import password

# --- named errors ------------------------------------------------------------------------------------

class MokNotNeeded(MokError):
    code = "mok-not-needed"
    remedy = "Nothing to do: modules load without an enrolled key on this host."


class MokNoKey(MokError):
    code = "mok-no-key"
    remedy = ("Create the signing key first: run 'sudo spark-memsaver install' (DKMS creates its key pair when it "
              "signs our module; on Ubuntu also 'sudo update-secureboot-policy --new-key'), then "
              "'sudo spark-memsaver mok enroll'; or enroll a certificate you have: "
              "'sudo spark-memsaver mok enroll --cert PATH'.")


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
    remedy = ("The firmware forbids this key (dbx or MokListXRT). Make a new key pair, root-only: 'sudo install -d -m "
              "0700 /etc/spark-memsaver/private' and 'sudo openssl req -new -x509 -nodes -days 36500 -subj "
              "/CN=spark-memsaver-signing -newkey rsa:2048 -keyout /etc/spark-memsaver/private/signing.key -out "
              "/etc/spark-memsaver/signing.crt'; set signing_key and signing_cert in /etc/spark-memsaver/config.yaml "
              "to those two paths; then run 'sudo spark-memsaver build --force' and 'sudo spark-memsaver install' "
              "(ours, signed with the new key), then 'sudo spark-memsaver mok enroll'.")


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

# --- decision (pure) -------------------------------------------------------------------------------------

class Decision(Record, frozen=True):
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

def _sb_flag(parsed: ParsedEfi, value: int | None) -> bool | None:
    if not parsed.efi:
        return None if parsed.listing_error else False
    if value is not None:
        return bool(value)
    if parsed.efivarfs and not parsed.vars["SecureBoot"].present:
        return False
    return None


def section(r: MokReading) -> dict:
    """The ``secure_boot`` section of the snapshot and the status document: the verdict over one reading
    (observe/mok.read), with what it was decided from."""
    parsed, ci, kern = r.parsed, r.cert, r.kernel
    d = decide(parsed, ci, r.request, r.boot_id)
    v = parsed.vars
    sb = v["SecureBoot"].value if v["SecureBoot"].present and not v["SecureBoot"].error else None
    sm = v["SetupMode"].value if v["SetupMode"].present and not v["SetupMode"].error else None
    mokv = v["MokSBStateRT"]
    reason = d.reason
    if d.state == "enrolled" and kern.get("trusted_by_kernel") == "yes":
        reason += "; trusted by the running kernel (" + kern["trust_reason"] + ")"
    elif d.state == "enrolled" and kern.get("trusted_by_kernel") == "no":
        reason += "; but the running kernel does not trust it: " + kern["trust_reason"]
    elif d.state == "not-enrolled" and kern.get("trusted_by_kernel") == "yes":
        reason += ("; the running kernel trusts it all the same (" + kern["trust_reason"] + "), but the firmware's "
                   "lists do not hold it, so another kernel, or this one after an update, may not")
    return {
        "state": d.state,
        "reason": reason,
        "remedy": d.remedy,
        "loadable": state_loadable(d.state) and not (d.state == "enrolled" and kern.get("trusted_by_kernel") == "no"),
        "efi": parsed.efi,
        "secure_boot": _sb_flag(parsed, sb),
        "setup_mode": bool(sm) if sm is not None else None,
        "validation_disabled": (bool(mokv.value) and not mokv.attributes & ev.ATTR_NON_VOLATILE)
        if mokv.present and not mokv.error else (False if parsed.efi and parsed.efivarfs else None),
        "certificate": ci.summary(),
        "where": list(d.where),
        "last_request": r.request,
        "variables": {n: x.summary() for n, x in v.items()} if parsed.efi else {},
        "moklist_trusted": v["MokListTrustedRT"].present if parsed.efivarfs else None,
        "kernel": kern,
    }


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
    if state_loadable(state):
        return 0
    return EXIT_USAGE if state == "unknown" else EXIT_PROBLEM

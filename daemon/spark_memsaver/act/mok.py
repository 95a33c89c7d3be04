"""Secure Boot / MOK: is the key DKMS signs our module with trusted at boot, and guided enrollment.

Three layers, kept apart:

* **I/O** (:func:`read_efi`, :func:`locate_certificate`, :func:`read_kernel`): bytes from efivarfs
  (``/sys/firmware/efi/efivars/<Name>-<guid>``), shim's MOK config table (``/sys/firmware/efi/mok-variables``),
  the certificate file, ``/sys/kernel/security/lockdown``, ``/proc/keys`` — all through ``host.path()``.
* **Pure** (:func:`parse_efi`, :func:`decide`): raw bytes -> parsed variables; parsed variables + certificate ->
  ``Decision(state, reason, where, remedy)``. No I/O, no clock, no environment.
* **Acting** (:func:`request_enrollment`, :func:`cancel_enrollment`): the real ``mokutil`` through ``Host.run``.

States: not-needed, no-key, not-enrolled, pending-enroll, enrolled, pending-delete, blocked, unknown.
``unknown`` (a variable or certificate that cannot be read or parsed) never guesses and blocks installation
(:func:`require_installable`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass, field

from spark_memsaver.observe import efivars as ev
from spark_memsaver.errors import EXIT_PROBLEM, EXIT_USAGE, MemsaverError, NotPermitted, SecureBootUnknown, Unsupported, UsageError

STATES = ("not-needed", "no-key", "not-enrolled", "pending-enroll", "enrolled", "pending-delete", "blocked",
          "unknown")
LOADABLE = ("not-needed", "enrolled")

EFI_DIR = "/sys/firmware/efi"
EFIVARS_DIR = "/sys/firmware/efi/efivars"
MOKVAR_DIR = "/sys/firmware/efi/mok-variables"
UBUNTU_DEFAULT_CERT = "/var/lib/shim-signed/mok/MOK.der"
DKMS_DEFAULT_CERT = "/var/lib/dkms/mok.pub"
FRAMEWORK_CONF = "/etc/dkms/framework.conf"
FRAMEWORK_CONF_D = "/etc/dkms/framework.conf.d"
REQUEST_RECORD = "/var/lib/spark-memsaver/mok-request.json"   # what we asked mokutil for, and in which boot
BOOT_ID = "/proc/sys/kernel/random/boot_id"

# Variables we read: name -> GUID. MokListRT continuations (MokListRT1, ...) are found by listing.
SCALARS = {"SecureBoot": ev.EFI_GLOBAL_VARIABLE, "SetupMode": ev.EFI_GLOBAL_VARIABLE,
           "MokSBStateRT": ev.SHIM_LOCK_GUID}
LISTS = {"MokListRT": ev.SHIM_LOCK_GUID, "MokListXRT": ev.SHIM_LOCK_GUID, "MokNew": ev.SHIM_LOCK_GUID,
         "MokDel": ev.SHIM_LOCK_GUID, "db": ev.EFI_IMAGE_SECURITY_DATABASE, "dbx": ev.EFI_IMAGE_SECURITY_DATABASE}
PRESENCE = {"MokAuth": ev.SHIM_LOCK_GUID, "MokDelAuth": ev.SHIM_LOCK_GUID, "MokListTrustedRT": ev.SHIM_LOCK_GUID,
            "MokTimeout": ev.SHIM_LOCK_GUID}
MOKVAR_NAMES = ("MokListRT", "MokListXRT")    # shim's config table, preferred by mokutil when present
_CONT_RE = re.compile(r"^MokListRT([1-9][0-9]{0,3})-" + re.escape(ev.SHIM_LOCK_GUID) + "$")

PASSWORD_MIN, PASSWORD_MAX = 1, 256          # mokutil's limits for an import password

CONSOLE_STEPS = (
    "Reboot this node with a screen and a (US-layout) keyboard attached; stay at the console.",
    "The blue 'Shim UEFI key management' screen appears: 'Press any key to perform MOK management' counts down "
    "10 s: press a key. (With --wait-at-console there is no countdown: the 'Perform MOK management' menu opens "
    "and waits.)",
    "Choose 'Enroll MOK'.",
    "Optionally 'View key 0' to check the subject and fingerprint printed below; then choose 'Continue'.",
    "'Enroll the key(s)?': choose 'Yes'.",
    "'Password:': type the one-time password given to 'spark-memsaver mok enroll' and press Enter.",
    "Choose 'Reboot'.",
)


# --- named errors ------------------------------------------------------------------------------------

class MokError(MemsaverError):
    code = "mok-error"


class MokNotNeeded(MokError):
    code = "mok-not-needed"
    remedy = "Nothing to do: modules load without an enrolled key on this host."


class MokNoKey(MokError):
    code = "mok-no-key"
    remedy = ("Create the signing key first: build once with DKMS (it generates the key pair), or on Ubuntu run "
              "'update-secureboot-policy --new-key'; or give --cert PATH.")


class MokAlreadyEnrolled(MokError):
    code = "mok-already-enrolled"
    remedy = "Nothing to do: the key is trusted at boot."


class MokAlreadyPending(MokError):
    code = "mok-already-pending"
    remedy = ("Reboot with a person at the console and confirm it in MokManager; or run 'spark-memsaver mok "
              "cancel' and enroll again to set a new password.")


class MokPendingDelete(MokError):
    code = "mok-pending-delete"
    remedy = "Run 'mokutil --revoke-delete' to keep the key, or reboot to complete the deletion first."


class MokKeyBlocked(MokError):
    code = "mok-key-blocked"
    remedy = ("The firmware forbids this key (dbx or MokListXRT). Create a new signing key, point DKMS at it "
              "(mok_signing_key/mok_certificate in /etc/dkms/framework.conf.d/) and enroll that one.")


class MokBadPassword(MokError):
    code = "mok-bad-password"
    exit_code = EXIT_USAGE
    remedy = (f"Use {PASSWORD_MIN}-{PASSWORD_MAX} printable ASCII characters (MokManager reads the keyboard with a "
              "US layout before any OS is running).")


class MokutilFailed(MokError):
    code = "mokutil-failed"
    exit_code = 3
    remedy = ("Read mokutil's message above. 'Failed to write MokAuth'/'Failed to enroll new keys' usually means "
              "the firmware's variable store is full or write-protected.")


# --- SHA-512-crypt (the format of `mokutil --generate-hash` and of --hash-file) --------------------------

_ITOA64 = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_SHA512_ORDER = ((0, 21, 42), (22, 43, 1), (44, 2, 23), (3, 24, 45), (25, 46, 4), (47, 5, 26), (6, 27, 48),
                 (28, 49, 7), (50, 8, 29), (9, 30, 51), (31, 52, 10), (53, 11, 32), (12, 33, 54), (34, 55, 13),
                 (56, 14, 35), (15, 36, 57), (37, 58, 16), (59, 17, 38), (18, 39, 60), (40, 61, 19),
                 (62, 20, 41))


def sha512_crypt(password: str, salt: str | None = None) -> str:
    """``$6$<salt>$<86 chars>`` (Drepper's SHA-crypt, 5000 rounds), as crypt(3) and mokutil produce it."""
    pw = password.encode("utf-8")
    s = (salt if salt is not None else "".join(secrets.choice(_ITOA64) for _ in range(16)))[:16].encode()
    n = len(pw)
    b = hashlib.sha512(pw + s + pw).digest()
    a = hashlib.sha512(pw + s)
    for _ in range(n // 64):
        a.update(b)
    a.update(b[:n % 64])
    k = n
    while k:
        a.update(b if k & 1 else pw)
        k >>= 1
    da = a.digest()
    dp = hashlib.sha512(pw * n).digest()
    p = (dp * (n // 64 + 1))[:n]
    ds = hashlib.sha512(s * (16 + da[0])).digest()
    sb = (ds * (len(s) // 64 + 1))[:len(s)]
    c = da
    for i in range(5000):
        h = hashlib.sha512(p if i & 1 else c)
        if i % 3:
            h.update(sb)
        if i % 7:
            h.update(p)
        h.update(c if i & 1 else p)
        c = h.digest()
    out = []
    for b2, b1, b0 in _SHA512_ORDER:
        w = (c[b2] << 16) | (c[b1] << 8) | c[b0]
        for _ in range(4):
            out.append(_ITOA64[w & 0x3F])
            w >>= 6
    w = c[63]
    for _ in range(2):
        out.append(_ITOA64[w & 0x3F])
        w >>= 6
    return f"$6${s.decode()}${''.join(out)}"


def check_password(password: str) -> None:
    if not (PASSWORD_MIN <= len(password) <= PASSWORD_MAX):
        raise MokBadPassword(f"the one-time password must be {PASSWORD_MIN}-{PASSWORD_MAX} characters long "
                             f"(got {len(password)})")
    bad = sorted({ch for ch in password if not (" " <= ch <= "~")})
    if bad:
        raise MokBadPassword("the one-time password contains characters MokManager may not be able to type "
                             "(only printable ASCII is safe)")


# --- raw reading (I/O) -----------------------------------------------------------------------------------

@dataclass
class RawEfi:
    """Exactly what was read, nothing interpreted. files: name -> bytes | None (absent) | str (read error)."""
    efi: bool
    efivarfs: bool                     # efivars directory exists and lists at least one variable
    listing_error: str | None = None
    files: dict = field(default_factory=dict)
    continuations: list = field(default_factory=list)   # MokListRT<N> names present, sorted by N
    mokvar: dict = field(default_factory=dict)          # name -> bytes | str (read error)


def _read_var(host, name: str, guid: str):
    path = host.path(f"{EFIVARS_DIR}/{name}-{guid}")
    try:
        return ev.read_efivarfs_file(path, name)
    except FileNotFoundError:
        return None
    except ev.OversizedVariable as e:
        return f"oversized: {e.reason}"
    except OSError as e:
        return f"cannot read {EFIVARS_DIR}/{name}-{guid}: {e.strerror or e}"


def sysfs_mounted(host) -> bool:
    """A mounted sysfs always has /sys/kernel and /sys/devices; an unpacked or mounted image has neither."""
    return any(host.path(p).is_dir() for p in ("/sys/kernel", "/sys/devices", "/sys/firmware"))


SYSFS_MISSING_REMEDY = ("A system image carries no firmware variables: run 'spark-memsaver mok status' on the "
                        "booted node itself, or bind-mount its /sys (mount --rbind /sys ROOT/sys) before "
                        "inspecting with --root.")


def read_efi(host) -> RawEfi:
    efi = host.path(EFI_DIR).is_dir()
    if not efi:
        if not sysfs_mounted(host):
            return RawEfi(efi=False, efivarfs=False,
                          listing_error=f"{host.path('/sys')} is not a mounted sysfs (no kernel/ or devices/): "
                                        "whether the machine boots with EFI firmware cannot be told")
        return RawEfi(efi=False, efivarfs=False)
    try:
        names = os.listdir(host.path(EFIVARS_DIR))
    except FileNotFoundError:
        names = []
    except OSError as e:
        return RawEfi(efi=True, efivarfs=False, listing_error=f"cannot list {EFIVARS_DIR}: {e.strerror or e}")
    raw = RawEfi(efi=True, efivarfs=bool(names))
    if not names:
        return raw
    for table in (SCALARS, LISTS, PRESENCE):
        for name, guid in table.items():
            raw.files[name] = _read_var(host, name, guid)
    conts = sorted((int(m.group(1)), m.group(0)) for m in map(_CONT_RE.match, names) if m)
    for num, fname in conts:
        name = f"MokListRT{num}"
        raw.continuations.append(name)
        raw.files[name] = _read_var(host, name, ev.SHIM_LOCK_GUID)
    for name in MOKVAR_NAMES:
        p = host.path(f"{MOKVAR_DIR}/{name}")
        try:
            with open(p, "rb") as f:
                data = f.read(ev.MAX_VARIABLE_SIZE + 1)
            if len(data) > ev.MAX_VARIABLE_SIZE:
                raw.mokvar[name] = f"oversized: more than {ev.MAX_VARIABLE_SIZE} bytes"
            elif data:                        # mokutil treats an empty entry as absent
                raw.mokvar[name] = data
        except FileNotFoundError:
            pass
        except OSError as e:
            raw.mokvar[name] = f"cannot read {MOKVAR_DIR}/{name}: {e.strerror or e}"
    return raw


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


def _unknown(reason: str, remedy: str | None = None) -> Decision:
    return Decision("unknown", reason, "Installing is refused until the state can be read. " +
                    (remedy or SecureBootUnknown.remedy))


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
                    "Run 'spark-memsaver mok enroll' and confirm the key at the console on the next boot.")


# --- certificate location (I/O) -----------------------------------------------------------------------

MAX_CERT_BYTES = 1 << 20


class CertFileRefused(MokError):
    code = "mok-cert-file-refused"
    remedy = ("Name a regular file (not a FIFO, device, directory or symlink) holding one X.509 certificate, "
              "DER or PEM, of at most 1 MiB.")


def read_cert_file(path) -> bytes:
    """The certificate file's bytes, never blocking: O_NONBLOCK|O_NOFOLLOW (a FIFO or a symlink planted in
    its place cannot wedge or redirect the job), a regular file only, at most MAX_CERT_BYTES.
    FileNotFoundError when absent; CertFileRefused (named) for everything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CertFileRefused(f"{path} is a symbolic link; it is not followed") from None
        raise CertFileRefused(f"cannot open {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise CertFileRefused(f"{path} is {kind}, not a regular file")
        if st.st_size > MAX_CERT_BYTES:
            raise CertFileRefused(f"{path} is {st.st_size} bytes, more than {MAX_CERT_BYTES} (not a certificate)")
        chunks, total = [], 0
        while total <= MAX_CERT_BYTES:
            try:
                b = os.read(fd, 65536)
            except OSError as e:
                raise CertFileRefused(f"cannot read {path}: {e.strerror or e}") from None
            if not b:
                break
            chunks.append(b)
            total += len(b)
        if total > MAX_CERT_BYTES:
            raise CertFileRefused(f"{path} grew past {MAX_CERT_BYTES} bytes while being read")
        return b"".join(chunks)
    finally:
        os.close(fd)


_ASSIGN_RE = re.compile(r"^\s*(?:export\s+)?(mok_certificate|mok_signing_key)=(.*)$")


def _shell_value(v: str) -> str:
    v = v.strip()
    if v[:1] in ("'", '"'):
        q = v[0]
        end = v.find(q, 1)
        return v[1:end] if end > 0 else v[1:]
    return re.split(r"\s+#", v, 1)[0].strip()


def dkms_signing_config(host) -> dict:
    """mok_signing_key / mok_certificate as DKMS reads them: framework.conf, then framework.conf.d/*.conf."""
    files = [FRAMEWORK_CONF] + [f"{FRAMEWORK_CONF_D}/{n}" for n in host.listdir(FRAMEWORK_CONF_D)
                                if n.endswith(".conf")]
    out: dict = {}
    for f in files:
        text = host.read_text(f)
        if text is None:
            continue
        for line in text.splitlines():
            m = _ASSIGN_RE.match(line)
            if m:
                out[m.group(1)] = _shell_value(m.group(2))
                out[m.group(1) + "_file"] = f
    return out


def _distro_id(host) -> str:
    for line in (host.read_text("/etc/os-release") or host.read_text("/usr/lib/os-release") or "").splitlines():
        if line.startswith("ID="):
            return _shell_value(line[3:]).lower()
    return ""


def locate_certificate(host, cert: str | None = None, config=None) -> CertInfo:
    if cert:
        path, origin = cert, "--cert"
    elif config is not None and getattr(config, "signing_cert", None):
        path, origin = config.signing_cert, "config signing_cert"
    else:
        conf = dkms_signing_config(host)
        if conf.get("mok_certificate"):
            path, origin = conf["mok_certificate"], f"mok_certificate in {conf['mok_certificate_file']}"
        elif _distro_id(host).startswith("ubuntu"):
            path, origin = UBUNTU_DEFAULT_CERT, "Ubuntu DKMS default"
        else:
            path, origin = DKMS_DEFAULT_CERT, "DKMS default"
    if "$" in path:
        rel = (host.read_text("/proc/sys/kernel/osrelease") or "").strip() or os.uname().release
        path = path.replace("${kernelver}", rel).replace("$kernelver", rel)
        if "$" in path:
            return CertInfo(path, origin, error="the path uses a shell variable other than $kernelver, "
                                                "which cannot be resolved outside DKMS")
    if not path.startswith("/"):
        return CertInfo(path, origin, error="the path is not absolute")
    # --cert names a file on this machine; every other path is on the inspected host.
    p = path if origin == "--cert" else host.path(path, follow=False)   # the final link is refused, not followed
    try:
        data = read_cert_file(p)
    except FileNotFoundError:
        return CertInfo(path, origin, present=False)
    except CertFileRefused as e:
        return CertInfo(path, origin, present=True, error=e.message)
    try:
        c, enc = ev.load_certificate(data, path)
    except ev.EfiFormatError as e:
        return CertInfo(path, origin, present=True, error=e.reason)
    return CertInfo(path, origin, present=True, cert=c, encoding=enc)


# --- kernel side (I/O + small parsers) ------------------------------------------------------------------

def parse_lockdown(text: str | None) -> str | None:
    if not text:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


def parse_proc_keys(text: str) -> tuple[dict, list]:
    """/proc/keys -> ({keyring name: (id, count)}, [(id, description)] of asymmetric keys)."""
    rings, keys = {}, []
    for line in text.splitlines():
        parts = line.split(None, 8)
        if len(parts) < 9:
            continue
        kid, ktype, desc = parts[0], parts[7], parts[8]
        if ktype == "keyring" and desc.startswith("."):
            name, _, rest = desc.partition(":")
            rest = rest.strip()
            rings[name] = (kid, int(rest) if rest.isdigit() else 0)
        elif ktype.startswith("asymmetri"):
            keys.append((kid, desc))
    return rings, keys


def read_kernel(host, cert: ev.Certificate | None) -> dict:
    out: dict = {"lockdown": parse_lockdown(host.read_text("/sys/kernel/security/lockdown"))}
    se = host.read_text("/sys/module/module/parameters/sig_enforce")
    out["sig_enforce"] = None if se is None else se.strip() == "Y"
    text = host.read_text("/proc/keys")
    if text is None:
        out["keyrings"] = None
        return out
    rings, keys = parse_proc_keys(text)
    out["keyrings"] = {n: {"present": n in rings, "keys": rings[n][1] if n in rings else None}
                       for n in (".builtin_trusted_keys", ".secondary_trusted_keys", ".platform", ".machine",
                                 ".blacklist")}
    if cert is None:
        return out
    want = cert.kernel_key_description
    ids = [kid for kid, desc in keys if desc == want or desc.startswith(want + ":")]
    out["key_description"] = want
    out["key_loaded"] = bool(ids) if keys or rings else None
    out["key_in"] = None            # which keyring holds it: /proc/keys does not say; keyctl does (live only)
    if ids and host.is_live and host.runner.which("keyctl"):
        found = []
        for ring, (rid, _n) in rings.items():
            if ring not in (".platform", ".machine", ".builtin_trusted_keys", ".secondary_trusted_keys"):
                continue
            try:
                r = host.run(["keyctl", "rlist", "0x" + rid], timeout=5)
            except MemsaverError:
                continue
            members = {f"{int(x):08x}" for x in r.stdout.split() if x.isdigit()} if r.ok else set()
            if members & set(ids):
                found.append(ring)
        out["key_in"] = found
    return out


# --- observation ----------------------------------------------------------------------------------------

def _load_config(host):
    try:
        from spark_memsaver import config as cfg
        return cfg.load(None, root=str(host.root))
    except MemsaverError:
        return None


def read_request_record(host) -> dict | None:
    text = host.read_text(REQUEST_RECORD)
    if not text:
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        return None              # a damaged record only loses a hint; the state comes from the variables
    return rec if isinstance(rec, dict) else None


def write_request_record(host, cert_sha256: str) -> None:
    """Remember the request (no secret in it) so a later boot can tell that the prompt was missed."""
    import datetime

    rec = {"cert_sha256": cert_sha256, "boot_id": (host.read_text(BOOT_ID) or "").strip() or None,
           "requested_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    from spark_memsaver.host.fsutil import atomic_write

    try:
        atomic_write(host.path(REQUEST_RECORD), json.dumps(rec) + "\n", 0o644)
    except OSError:
        pass                     # only a hint is lost


def clear_request_record(host) -> None:
    try:
        host.path(REQUEST_RECORD).unlink()
    except OSError:
        pass


def _sb_flag(parsed: ParsedEfi, value: int | None) -> bool | None:
    if not parsed.efi:
        return None if parsed.listing_error else False
    if value is not None:
        return bool(value)
    if parsed.efivarfs and not parsed.vars["SecureBoot"].present:
        return False
    return None


def observe(host, cert: str | None = None, config=None) -> dict:
    """The ``secure_boot`` section of the status document."""
    if config is None and cert is None:
        config = _load_config(host)
    parsed = parse_efi(read_efi(host))
    ci = locate_certificate(host, cert, config)
    request = read_request_record(host)
    d = decide(parsed, ci, request, (host.read_text(BOOT_ID) or "").strip() or None)
    v = parsed.vars
    sb = v["SecureBoot"].value if v["SecureBoot"].present and not v["SecureBoot"].error else None
    sm = v["SetupMode"].value if v["SetupMode"].present and not v["SetupMode"].error else None
    mokv = v["MokSBStateRT"]
    out = {
        "state": d.state,
        "reason": d.reason,
        "remedy": d.remedy,
        "loadable": d.state in LOADABLE,
        "efi": parsed.efi,
        "secure_boot": _sb_flag(parsed, sb),
        "setup_mode": bool(sm) if sm is not None else None,
        "validation_disabled": (bool(mokv.value) and not mokv.attributes & ev.ATTR_NON_VOLATILE)
        if mokv.present and not mokv.error else (False if parsed.efi and parsed.efivarfs else None),
        "certificate": ci.summary(),
        "where": list(d.where),
        "last_request": request,
        "variables": {n: x.summary() for n, x in v.items()} if parsed.efi else {},
        "moklist_trusted": v["MokListTrustedRT"].present if parsed.efivarfs else None,
        "kernel": read_kernel(host, ci.cert),
    }
    return out


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


# --- acting: mokutil ------------------------------------------------------------------------------------

def _refuse_for(sb: dict) -> None:
    state, reason = sb["state"], sb["reason"]
    if state == "unknown":
        raise SecureBootUnknown(f"refusing to enroll: the Secure Boot state is unknown ({reason})",
                                remedy=sb.get("remedy") or None)
    if state == "not-needed":
        raise MokNotNeeded(f"no enrollment needed: {reason}")
    if state == "no-key":
        raise MokNoKey(f"nothing to enroll: {reason}")
    if state == "enrolled":
        raise MokAlreadyEnrolled(f"the key is already enrolled ({', '.join(sb['where'])})")
    if state == "pending-enroll":
        raise MokAlreadyPending("an enrollment request for this key is already waiting for the next boot")
    if state == "pending-delete":
        raise MokPendingDelete("the key is enrolled but a deletion request is pending")
    if state == "blocked":
        raise MokKeyBlocked(f"the key is blocked ({', '.join(sb['where'])}) and cannot be enrolled")


def _require_live_root(host, what: str) -> None:
    if not host.is_live:
        raise Unsupported(f"{what} writes the running machine's firmware variables; --root is for inspection only",
                          remedy="Run it on the node itself, without --root.")
    if os.geteuid() != 0:
        raise NotPermitted(f"{what} needs root (mokutil writes EFI variables)")


def _mokutil_message(r) -> str:
    lines = [x.strip() for x in (r.stdout + "\n" + r.stderr).splitlines() if x.strip()]
    return " | ".join(lines[-6:]) or f"exit code {r.returncode}"


def run_mokutil_import(host, der_path: str, password: str, timeout: float = 120) -> dict:
    """``mokutil --import DER --hash-file F``; the password never reaches argv, the environment or a log.
    The hash file (SHA-512-crypt of the password) lives in a 0700 directory and is removed afterwards."""
    check_password(password)
    d = tempfile.mkdtemp(prefix="spark-memsaver-mok.")
    try:
        hf = os.path.join(d, "hash")
        fd = os.open(hf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(sha512_crypt(password) + "\n")
        r = host.run(["mokutil", "--import", der_path, "--hash-file", hf], timeout=timeout)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    msg = _mokutil_message(r)
    if r.returncode != 0:
        raise MokutilFailed(f"mokutil --import failed (exit {r.returncode}): {msg}", returncode=r.returncode)
    return {"argv": ["mokutil", "--import", der_path, "--hash-file", "<one-time hash file>"],
            "returncode": r.returncode, "message": msg}


def _der_file(ci_path: str, cert: ev.Certificate, workdir: str) -> str:
    p = os.path.join(workdir, "key.der")
    with open(p, "wb") as f:
        f.write(cert.der)
    os.chmod(p, 0o644)
    return p


def request_enrollment(host, config, password: str, cert: str | None = None,
                       wait_at_console: bool = False) -> dict:
    """Queue the signing certificate for enrollment at the next boot (MokNew + MokAuth).

    Refuses (named error) unless the state is not-enrolled; verifies afterwards that the request is recorded."""
    before = observe(host, cert=cert, config=config)
    _refuse_for(before)
    check_password(password)
    _require_live_root(host, "mok enroll")
    ci = locate_certificate(host, cert, config)
    if ci.cert is None:  # raced with a file change since observe()
        raise MokNoKey(f"the certificate at {ci.path} disappeared or changed")
    work = tempfile.mkdtemp(prefix="spark-memsaver-cert.")
    try:
        der = _der_file(ci.path, ci.cert, work)
        imp = run_mokutil_import(host, der, password)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    warnings = []
    timeout_set = None
    if wait_at_console:
        r = host.run(["mokutil", "--timeout", "-1"], timeout=60)
        timeout_set = r.returncode == 0
        if not timeout_set:
            warnings.append("mokutil --timeout -1 failed (" + _mokutil_message(r) + "): MokManager will wait only "
                            "10 seconds for a key press")
    after = observe(host, cert=cert, config=config)
    if after["state"] != "pending-enroll":
        raise MokutilFailed(f"mokutil reported success but the key is not in MokNew (state {after['state']}: "
                            f"{after['reason']}); mokutil said: {imp['message']}",
                            remedy="mokutil skips keys the kernel already trusts ('Already in kernel trusted "
                                   "keyring') and keys already enrolled; read its message.")
    write_request_record(host, after["certificate"]["sha256"])
    return {
        "requested": True,
        "certificate": after["certificate"],
        "mokutil": imp,
        "wait_at_console": bool(timeout_set),
        "warnings": warnings,
        "state_before": before["state"],
        "state_now": after["state"],
        "state_after_confirmed_reboot": "enrolled",
        "state_after_missed_prompt": "not-enrolled",
        "console_steps": list(CONSOLE_STEPS),
    }


def cancel_enrollment(host, config=None, cert: str | None = None) -> dict:
    """``mokutil --revoke-import``: drop the pending request (all keys in MokNew, and MokAuth)."""
    before = observe(host, cert=cert, config=config)
    v = before.get("variables", {})
    pending = bool(v.get("MokNew", {}).get("present")) or bool(v.get("MokAuth", {}).get("present"))
    if not pending:
        return {"cancelled": False, "message": "no enrollment request is pending", "state": before["state"]}
    _require_live_root(host, "mok cancel")
    r = host.run(["mokutil", "--revoke-import"], timeout=60)
    if r.returncode != 0:
        raise MokutilFailed(f"mokutil --revoke-import failed (exit {r.returncode}): {_mokutil_message(r)}",
                            returncode=r.returncode)
    clear_request_record(host)
    after = observe(host, cert=cert, config=config)
    return {"cancelled": True, "dropped_entries": v.get("MokNew", {}).get("entries", {}),
            "state_before": before["state"], "state": after["state"]}


# --- CLI ------------------------------------------------------------------------------------------------

def render_text(sb: dict) -> str:
    c = sb.get("certificate") or {}
    k = sb.get("kernel") or {}
    rows = [("State", sb["state"]), ("Reason", sb["reason"])]
    if sb.get("remedy"):
        rows.append(("Remedy", sb["remedy"]))
    rows += [("EFI", "yes" if sb["efi"] else "no"),
             ("Secure Boot", {True: "on", False: "off", None: "unknown"}[sb["secure_boot"]]),
             ("Setup mode", {True: "yes", False: "no", None: "n/a"}[sb["setup_mode"]]),
             ("Validation disabled", {True: "yes (MokSBStateRT)", False: "no", None: "n/a"}[sb["validation_disabled"]]),
             ("Certificate", f"{c.get('path')} ({c.get('origin')}" + ("" if c.get("present") else ", missing") + ")")]
    if c.get("sha256"):
        rows += [("  subject", c["subject"]), ("  sha256", c["sha256"]), ("  not after", c["not_after"])]
    if sb.get("where"):
        rows.append(("Found in", ", ".join(sb["where"])))
    if k:
        rows.append(("Kernel", f"lockdown={k.get('lockdown') or 'n/a'} sig_enforce="
                               f"{ {True: 'Y', False: 'N', None: 'n/a'}[k.get('sig_enforce')] }"
                     + ("" if k.get("key_loaded") is None else f" key loaded={'yes' if k['key_loaded'] else 'no'}")))
    w = max(len(r[0]) for r in rows) + 2
    return "\n".join(f"{a + ':':<{w}}{b}" for a, b in rows)

"""Module signing through DKMS's own mechanism (framework.conf ``mok_signing_key`` / ``mok_certificate``).

Decisions (pure: :func:`plan`), then I/O (:func:`ensure`):

* Which key: the config's ``signing_key``/``signing_cert`` when set; else what DKMS's framework files
  already set (``/etc/dkms/framework.conf`` and ``framework.conf.d/*.conf``, last assignment wins, as
  DKMS sources them); else DKMS's own default for the distro -- Ubuntu: the shim-signed MOK
  ``/var/lib/shim-signed/mok/MOK.priv`` + ``MOK.der`` (the key Ubuntu users already enrolled), other
  distros: ``/var/lib/dkms/mok.key`` + ``mok.pub``. So an existing host key is always reused.
* Creating a key: only when neither file exists, with openssl (RSA-2048, DER certificate, key 0600
  root-owned, code-signing EKU + the module-signing-only EKU Ubuntu's shim honours). When exactly one
  of the two exists we refuse (:class:`SigningKeyIncomplete`): DKMS itself would silently regenerate
  BOTH, replacing a key that may be enrolled.
* DKMS's signing settings are global (they apply to every DKMS module). We write our drop-in
  ``/etc/dkms/framework.conf.d/spark-memsaver.conf`` only when the chosen paths differ from what DKMS
  would use anyway; the result then says ``changes_global_signing: true`` and why (never silent). A
  later drop-in that overrides ours is a refusal (:class:`SigningConfigConflict`).
* The record ``/var/lib/spark-memsaver/signing.json`` names the certificate (path, subject, serial,
  SHA-256 fingerprint; never key material). The PRE_INSTALL guard and :func:`check_module` compare a
  module's ``sig_key`` with that serial, because DKMS never fails a build when signing fails.
  Each signed build is appended to ``/var/lib/spark-memsaver/signed.json`` (what was signed by which
  certificate).

Private keys are never read, printed or logged here: openssl writes them, sign-file (run by DKMS) reads them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import time

from spark_memsaver.errors import MemsaverError
from spark_memsaver.decide.installability import SIGNING_PAIR_REMEDY
from spark_memsaver.host import Host, paths, records

FRAMEWORK_CONF = "/etc/dkms/framework.conf"
FRAMEWORK_DIR = "/etc/dkms/framework.conf.d"
DROPIN_NAME = "spark-memsaver.conf"
DROPIN = f"{FRAMEWORK_DIR}/{DROPIN_NAME}"
STATE_DIR = paths.STATE_DIR
RECORD = paths.SIGNING_RECORD
SIGNED_LOG = paths.SIGNED_LOG
UBUNTU_KEY, UBUNTU_CERT = "/var/lib/shim-signed/mok/MOK.priv", "/var/lib/shim-signed/mok/MOK.der"
DKMS_KEY, DKMS_CERT = "/var/lib/dkms/mok.key", "/var/lib/dkms/mok.pub"
MODULE_SIGNING_EKU = "1.3.6.1.4.1.2312.16.1.2"

_ASSIGN = re.compile(r"""^\s*(mok_signing_key|mok_certificate|sign_file)=(?:"([^"]*)"|'([^']*)'|(\S*))\s*(?:#.*)?$""")
_ASSIGN_ANY = re.compile(r"^\s*(mok_signing_key|mok_certificate|sign_file)=(.*)$")
# C0/C1 controls, DEL, and the bidi overrides/isolates: never in a path bash sources or a person reads.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
OURS_MARK = "Written by spark-memsaver"


class SigningError(MemsaverError):
    code = "signing-failed"
    remedy = "Check the key and certificate files and openssl; 'spark-memsaver mok status' shows the key state."


class SigningKeyIncomplete(SigningError):
    code = "signing-key-incomplete"
    remedy = SIGNING_PAIR_REMEDY       # decide/installability: status names the same pair the same way


class SigningConfigConflict(SigningError):
    code = "signing-config-conflict"
    remedy = ("Another /etc/dkms/framework.conf.d file sets mok_signing_key/mok_certificate after ours; remove "
              "one of them, or set signing_key/signing_cert in /etc/spark-memsaver/config.yaml to the same paths.")


class SigningPathRefused(SigningError):
    code = "signing-path-refused"
    remedy = ("Set signing_key/signing_cert in /etc/spark-memsaver/config.yaml to absolute paths without control "
              "characters (or signing_key to a pkcs11: URI).")


class SigningKeyUnsafe(SigningError):
    code = "signing-key-unsafe"
    remedy = "The private key must be a regular file owned by root with mode 0600: chown root:root KEY; chmod 600 KEY."


class KernelSigningUnknown(SigningError):
    code = "kernel-signing-unknown"
    remedy = ("Install the kernel's headers (linux-headers-KERNEL) or /boot/config-KERNEL so that whether it checks "
              "module signatures can be read; nothing is built unsigned on a guess.")


class ModuleNotSigned(SigningError):
    code = "module-not-signed"
    remedy = ("DKMS did not sign the module with the configured key (it never fails a build for that). Check "
              "the make.log for 'Sign command'/'Signing key' lines, that sign-file exists for the kernel, and "
              "that the key/certificate pair matches; then rebuild.")


def os_id(host: Host) -> tuple[str, list[str]]:
    text = host.read_text("/etc/os-release") or host.read_text("/usr/lib/os-release") or ""
    fields = {}
    for line in text.splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            fields[k.strip()] = v.strip().strip('"')
    return fields.get("ID", ""), fields.get("ID_LIKE", "").split()


def dkms_distro(host: Host) -> str:
    """What DKMS's distro_version() would say, reduced to the families that matter for signing."""
    ident, like = os_id(host)
    for name in [ident] + like:
        if name.startswith("ubuntu"):
            return "ubuntu"
        if name.startswith("debian"):
            return "debian"
    return ident or "unknown"


def _assignment(line: str) -> tuple[str, str] | None:
    """(var, value) of one framework assignment, read as bash would for a single word (shlex, so a value we
    wrote with shlex.quote reads back exactly); the old regex for anything shlex cannot take as one word."""
    m = _ASSIGN_ANY.match(line)
    if not m:
        return None
    try:
        words = shlex.split(m.group(2), comments=True)
    except ValueError:
        words = None
    if words is not None and len(words) == 1:
        return m.group(1), words[0]
    m = _ASSIGN.match(line)
    if m:
        return m.group(1), next(g for g in m.groups()[1:] if g is not None)
    return None


def framework_settings(host: Host, override: dict | None = None) -> dict:
    """{var: (value, file)} for mok_signing_key / mok_certificate / sign_file, last assignment wins (files in
    DKMS's order: framework.conf, then framework.conf.d/*.conf sorted). override: {file: text} read instead
    of the file (a file not on disk is inserted in its sorted place): what DKMS would see after a write."""
    override = override or {}
    names = set(host.listdir(FRAMEWORK_DIR)) | {f.rsplit("/", 1)[1] for f in override if f.startswith(FRAMEWORK_DIR + "/")}
    files = [FRAMEWORK_CONF] + [f"{FRAMEWORK_DIR}/{n}" for n in sorted(names) if n.endswith(".conf")]
    out: dict[str, tuple[str, str]] = {}
    for f in files:
        text = override[f] if f in override else (host.read_text(f) or "")
        for line in text.splitlines():
            a = _assignment(line)
            if a:
                out[a[0]] = (a[1], f)
    return out


def dkms_default_pair(host: Host) -> tuple[str, str]:
    return (UBUNTU_KEY, UBUNTU_CERT) if dkms_distro(host) == "ubuntu" else (DKMS_KEY, DKMS_CERT)


def plan(host: Host, config) -> dict:
    """Which key/cert DKMS will sign with once we are done, and what must change. No writes."""
    current = framework_settings(host)
    others = {k: v for k, v in current.items() if not v[1].endswith("/" + DROPIN_NAME)}
    default_key, default_cert = dkms_default_pair(host)
    if config.signing_key or config.signing_cert:
        if not (config.signing_key and config.signing_cert):
            raise SigningError("config sets only one of signing_key / signing_cert",
                               remedy="Set both signing_key and signing_cert, or neither.")
        key, cert, source = config.signing_key, config.signing_cert, f"config {config.source}"
    elif "mok_signing_key" in others or "mok_certificate" in others:
        key = others.get("mok_signing_key", (default_key, ""))[0]
        cert = others.get("mok_certificate", (default_cert, ""))[0]
        source = "dkms framework configuration (" + ", ".join(sorted({v[1] for v in others.values()})) + ")"
    else:
        key, cert, source = default_key, default_cert, f"DKMS default for {dkms_distro(host)}"
    # What DKMS would use without our drop-in:
    eff_key = others.get("mok_signing_key", (default_key, ""))[0]
    eff_cert = others.get("mok_certificate", (default_cert, ""))[0]
    needs_dropin = (key, cert) != (eff_key, eff_cert)
    pkcs11 = key.startswith("pkcs11:")
    key_exists = pkcs11 or host.exists(key)
    cert_exists = host.exists(cert)
    return {
        "key": key, "cert": cert, "source": source, "pkcs11": pkcs11,
        "key_exists": key_exists, "cert_exists": cert_exists,
        "create": not key_exists and not cert_exists,
        "incomplete": key_exists != cert_exists,
        "needs_dropin": needs_dropin,
        "changes_global_signing": needs_dropin,
        "replaces": {"mok_signing_key": eff_key, "mok_certificate": eff_cert} if needs_dropin else None,
        "distro": dkms_distro(host),
    }


def cert_info(host: Host, cert: str) -> dict:
    """subject CN, serial (hex, upper), sha256 fingerprint of a DER or PEM certificate."""
    path = str(host.path(cert))
    for form in ("DER", "PEM"):
        r = host.run(["openssl", "x509", "-inform", form, "-in", path, "-noout", "-serial", "-subject",
                      "-fingerprint", "-sha256", "-nameopt", "multiline"], timeout=30)
        if r.ok:
            break
    else:
        raise SigningError(f"{cert} is not a readable X.509 certificate (DER or PEM)")
    serial = re.search(r"^serial=([0-9A-Fa-f]+)", r.stdout, re.M)
    cn = re.search(r"commonName\s*=\s*(.+)$", r.stdout, re.M)
    fp = re.search(r"Fingerprint=([0-9A-Fa-f:]+)", r.stdout)
    return {"cert": cert, "format": form, "serial": serial.group(1).upper() if serial else None,
            "subject": cn.group(1).strip() if cn else None,
            "sha256": fp.group(1).replace(":", "").lower() if fp else None}


def _create_pair(host: Host, key: str, cert: str, distro: str) -> None:
    kpath, cpath = host.path(key), host.path(cert)
    for p in (kpath, cpath):
        p.parent.mkdir(parents=True, exist_ok=True)
    if distro == "ubuntu":
        hn = (os.uname().nodename.split(".")[0])[:31]
        subject = f"/CN={hn} Secure Boot Module Signature key"
    else:
        subject = "/CN=DKMS module signing key"
    tmpk, tmpc = kpath.with_name(f".{kpath.name}.tmp"), cpath.with_name(f".{cpath.name}.tmp")
    old = os.umask(0o077)
    try:
        r = host.run(["openssl", "req", "-new", "-x509", "-nodes", "-days", "36500", "-subj", subject,
                      "-newkey", "rsa:2048", "-keyout", str(tmpk), "-outform", "DER", "-out", str(tmpc),
                      "-addext", f"extendedKeyUsage=codeSigning,{MODULE_SIGNING_EKU}",
                      "-addext", "basicConstraints=critical,CA:FALSE"], timeout=120)
    finally:
        os.umask(old)
    if not r.ok:
        for p in (tmpk, tmpc):
            p.unlink(missing_ok=True)
        # openssl's stderr carries no key material
        raise SigningError(f"openssl could not create a signing key: {r.stderr.strip()[-300:]}")
    os.chmod(tmpk, 0o600)
    os.chmod(tmpc, 0o644)
    if hasattr(os, "chown") and os.geteuid() == 0:
        os.chown(tmpk, 0, 0)
    os.rename(tmpk, kpath)
    os.rename(tmpc, cpath)


def _write_atomic(host: Host, path: str, text: str, mode: int = 0o644) -> None:
    from spark_memsaver.host.fsutil import atomic_write

    atomic_write(host.path(path), text, mode)


def check_path_value(what: str, value: str, *, pkcs11_ok: bool = False) -> None:
    """A value that goes into a file bash sources: absolute (or a pkcs11: URI), no control/bidi characters."""
    if not isinstance(value, str) or not value:
        raise SigningPathRefused(f"the {what} path is empty")
    bad = _UNSAFE.search(value)
    if bad:
        raise SigningPathRefused(f"the {what} path {value!r} contains the control character "
                                 f"U+{ord(bad.group()):04X}")
    if not (value.startswith("/") or (pkcs11_ok and value.startswith("pkcs11:"))):
        raise SigningPathRefused(f"the {what} path {value!r} is not absolute")


def check_key_file(host: Host, key: str) -> None:
    """The private key: a regular file (no symlink), owned by root, mode 0600 or stricter. Never read."""
    try:
        st = os.lstat(host.path(key, follow=False))
    except FileNotFoundError:
        raise SigningKeyIncomplete(f"the signing key {key} does not exist", key=key) from None
    except OSError as e:
        raise SigningKeyUnsafe(f"cannot stat the signing key {key}: {e.strerror or e}", key=key) from None
    if not stat.S_ISREG(st.st_mode):
        raise SigningKeyUnsafe(f"the signing key {key} is not a regular file (a symlink or special file)", key=key)
    owner_ok = st.st_uid == 0 or (os.geteuid() != 0 and st.st_uid == os.geteuid())
    if not owner_ok:
        raise SigningKeyUnsafe(f"the signing key {key} is owned by uid {st.st_uid}, not root", key=key)
    if st.st_mode & 0o077:
        raise SigningKeyUnsafe(f"{key} is readable by group or others (mode {st.st_mode & 0o777:o})",
                               remedy=f"chmod 600 {key} (the private key must be root-only).", key=key)


def dropin_text(p: dict) -> str:
    """The drop-in bash sources for every DKMS module: every value shlex-quoted (a `$(...)`, a backtick or a
    quote in a path stays a literal character); comments carry no control character that could end them."""
    def comment(v) -> str:
        return _UNSAFE.sub("?", str(v))
    return (f"# {OURS_MARK}: the key DKMS signs modules with (ALL DKMS modules).\n"
            f"# Chosen from: {comment(p['source'])}. Previously effective: {comment(p['replaces'])}.\n"
            f"mok_signing_key={shlex.quote(p['key'])}\nmok_certificate={shlex.quote(p['cert'])}\n")


def _remove_our_dropin(host: Host) -> None:
    path = host.path(DROPIN, follow=False)
    try:
        if OURS_MARK in (host.read_text(DROPIN) or ""):
            path.unlink()
    except OSError:
        pass


def _effective(settings: dict, host: Host) -> tuple[str, str]:
    dk, dc = dkms_default_pair(host)
    return settings.get("mok_signing_key", (dk, ""))[0], settings.get("mok_certificate", (dc, ""))[0]


def ensure(host: Host, config) -> dict:
    """Make DKMS sign with the planned key; create it if needed; write the record. Returns the plan + cert.

    Order: validate everything (paths, key file, certificate, the outcome DKMS would see), then write the
    drop-in last (atomically). Any refusal removes a drop-in of ours, so no half-checked value stays sourced."""
    try:
        return _ensure(host, config)
    except SigningError:
        _remove_our_dropin(host)
        raise


def _ensure(host: Host, config) -> dict:
    p = plan(host, config)
    check_path_value("signing key", p["key"], pkcs11_ok=True)
    check_path_value("certificate", p["cert"])
    if p["incomplete"]:
        have, lack = (p["key"], p["cert"]) if p["key_exists"] else (p["cert"], p["key"])
        raise SigningKeyIncomplete(f"{have} exists but {lack} does not: DKMS would silently replace both",
                                   key=p["key"], cert=p["cert"])
    created = False
    if p["create"]:
        _create_pair(host, p["key"], p["cert"], p["distro"])
        created = True
    if not p["pkcs11"]:
        check_key_file(host, p["key"])
    info = cert_info(host, p["cert"])
    text = dropin_text(p) if p["needs_dropin"] else None
    would = framework_settings(host, {DROPIN: text if text is not None else ""})
    eff = _effective(would, host)
    if eff != (p["key"], p["cert"]):
        raise SigningConfigConflict(f"DKMS would sign with {eff[0]} / {eff[1]}, not {p['key']} / {p['cert']}")
    if text is not None:
        _write_atomic(host, DROPIN, text)
    else:
        _remove_our_dropin(host)
    eff = _effective(framework_settings(host), host)
    if eff != (p["key"], p["cert"]):           # changed under us between the check and the write
        raise SigningConfigConflict(f"DKMS would sign with {eff[0]} / {eff[1]}, not {p['key']} / {p['cert']}")
    record = {"format": 1, "key": p["key"], "cert": p["cert"], "subject": info["subject"],
              "serial": info["serial"], "sha256": info["sha256"], "source": p["source"],
              "created_by_spark_memsaver": created or _previous_created(host, p),
              "changes_global_signing": p["changes_global_signing"], "updated": _now()}
    _write_atomic(host, RECORD, json.dumps(record, indent=2) + "\n")
    return {**p, **{k: record[k] for k in ("subject", "serial", "sha256")}, "created": created, "record": RECORD}


def kernel_signs(host: Host, kernel: str) -> bool:
    """Whether DKMS signs for `kernel` (its .config: CONFIG_MODULE_SIG), through the kotool the PRE_INSTALL
    guard runs. A config that cannot be read is KernelSigningUnknown (named), never "does not sign"."""
    from spark_memsaver.act.dkms_run import kotool

    kt = kotool()
    try:
        return bool(kt.kernel_signs_modules(kernel, root=None if host.is_live else str(host.root)))
    except kt.KoError as e:
        raise KernelSigningUnknown(str(e), remedy=KernelSigningUnknown.remedy.replace("KERNEL", kernel),
                                   kernel=kernel) from None


def _previous_created(host: Host, p: dict) -> bool:
    old = read_record(host)
    return bool(old and old.get("created_by_spark_memsaver")) and old.get("cert") == p["cert"]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_record(host: Host) -> dict | None:
    """The signing record, typed (host/records.py), or None when absent or bad."""
    return records.one(host, "signing", RECORD)


def record_signed(host: Host, entry: dict) -> None:
    """Append {module path, dkms version, kernel, signer, serial, cert sha256, time} to signed.json."""
    doc = records.one(host, "signed-log", SIGNED_LOG) or {"format": 1, "signed": []}
    doc["signed"] = [e for e in doc["signed"] if isinstance(e, dict) and e.get("module") != entry.get("module")][-199:]
    doc["signed"].append({**entry, "time": _now()})
    _write_atomic(host, SIGNED_LOG, json.dumps(doc, indent=2) + "\n")

"""Secure Boot / MOK, the reading: efivarfs (``/sys/firmware/efi/efivars/<Name>-<guid>``), shim's MOK config
table (``/sys/firmware/efi/mok-variables``), the signing certificate file (opened without blocking or following
a link), ``/sys/kernel/security/lockdown``, ``/proc/keys`` -- all through ``host.path()``.

:func:`read` gathers one ``MokReading`` (efi/mokvars.py); decide/mok.section is the verdict over it, and
spark_memsaver/world.secure_boot the two together. The certificate is the caller's (``--cert``, or the
``config`` it runs with); the host's config file is read only when no config is given.
"""

from __future__ import annotations

import errno
import os
import re
import stat

from spark_memsaver.efi.mokvars import (EFI_DIR, EFIVARS_DIR, LISTS, MOKVAR_DIR, MOKVAR_NAMES, PRESENCE, SCALARS,
                                        CertInfo, MokReading, RawEfi, parse_efi)
from spark_memsaver.errors import MemsaverError, MokError
from spark_memsaver import record
from spark_memsaver.host import paths
from spark_memsaver import efi as ev

UBUNTU_DEFAULT_CERT = "/var/lib/shim-signed/mok/MOK.der"
DKMS_DEFAULT_CERT = "/var/lib/dkms/mok.pub"
UBUNTU_DEFAULT_KEY = "/var/lib/shim-signed/mok/MOK.priv"
DKMS_DEFAULT_KEY = "/var/lib/dkms/mok.key"
FRAMEWORK_CONF = "/etc/dkms/framework.conf"
FRAMEWORK_CONF_D = "/etc/dkms/framework.conf.d"
REQUEST_RECORD = paths.MOK_REQUEST   # what we asked mokutil for, and in which boot
BOOT_ID = paths.BOOT_ID
_CONT_RE = re.compile(r"^MokListRT([1-9][0-9]{0,3})-" + re.escape(ev.SHIM_LOCK_GUID) + "$")
# --- raw reading (I/O) -----------------------------------------------------------------------------------

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
    """One shell word as bash reads it (shlex: so a value act/signing.py wrote shlex-quoted reads back
    exactly); a simple quote/comment split for anything shlex cannot take as one word."""
    try:
        import shlex

        words = shlex.split(v, comments=True)
    except ValueError:
        words = None
    if words is not None and len(words) == 1:
        return words[0]
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
    ci = _locate_certificate(host, cert, config)
    if ci.present and ci.key_path is not None:      # DKMS signs with the pair: a certificate alone cannot sign
        k = ci.key_path                             # the probe act/signing.plan makes (host.exists); a path DKMS
        present = True if k.startswith("pkcs11:") else \
            None if "$" in k or not k.startswith("/") else host.exists(k)   # resolves itself: not known here
        ci = record.replace(ci, key_present=present)
    return ci


def _key_beside(host, origin: str, config, conf: dict) -> str | None:
    """The private key DKMS signs with beside the certificate ``origin`` names (None for --cert: not known)."""
    if origin == "--cert":
        return None
    if origin == "config signing_cert":
        return getattr(config, "signing_key", None) or None
    default = UBUNTU_DEFAULT_KEY if _distro_id(host).startswith("ubuntu") else DKMS_DEFAULT_KEY
    return conf.get("mok_signing_key") or default


def _locate_certificate(host, cert: str | None = None, config=None) -> CertInfo:
    conf: dict = {}
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
    key = _key_beside(host, origin, config, conf)
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
    return CertInfo(path, origin, present=True, cert=c, encoding=enc, key_path=key)


# --- kernel side (I/O + small parsers) ------------------------------------------------------------------

def parse_lockdown(text: str | None) -> str | None:
    if not text:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


def parse_proc_keys(text: str) -> tuple[dict, list]:
    """/proc/keys -> ({keyring name: (id, count)}, [(id, description)] of asymmetric keys).

    Only keys and keyrings owned by uid 0 count: the kernel's system keyrings and the keys it loads into them
    (built in, from firmware, from MokListRT) belong to root, while any local user may add an asymmetric key
    with any description to a keyring of its own (``keyctl padd asymmetric "<CN>: <SKID>" @s``), and root's
    /proc/keys lists it too."""
    rings, keys = {}, []
    for line in text.splitlines():
        parts = line.split(None, 8)
        if len(parts) < 9 or parts[5] != "0":
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
        out["trusted_by_kernel"], out["trust_reason"] = "unknown", "/proc/keys cannot be read"
        return out
    rings, keys = parse_proc_keys(text)
    out["keyrings"] = {n: {"present": n in rings, "keys": rings[n][1] if n in rings else None}
                       for n in (".builtin_trusted_keys", ".secondary_trusted_keys", ".platform", ".machine",
                                 ".blacklist")}
    if cert is None:
        out["trusted_by_kernel"], out["trust_reason"] = "unknown", "no signing certificate to look for"
        return out
    want = cert.kernel_key_description
    ids = [kid for kid, desc in keys if desc == want or desc.startswith(want + ":")]
    out["key_description"] = want
    out["key_loaded"] = bool(ids) if keys or rings else None
    out["key_in"] = None            # which keyring holds it: /proc/keys does not say; keyctl does (live only)
    out["trusted_by_kernel"], out["trust_reason"] = "unknown", None
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
    out["trusted_by_kernel"], out["trust_reason"] = kernel_trust(rings, ids, out["key_in"])
    return out


SYSTEM_RINGS = (".builtin_trusted_keys", ".secondary_trusted_keys", ".machine", ".platform")


def kernel_trust(rings: dict, ids: list, key_in: list | None) -> tuple[str, str]:
    """Whether the running kernel trusts our certificate's key for modules: 'yes', 'no' or 'unknown', and why.
    ``rings``/``ids`` from /proc/keys (system keyrings seen; ids of keys with our description), ``key_in``
    the system keyrings keyctl found it in (None: keyctl not consulted)."""
    if not any(r in rings for r in SYSTEM_RINGS):
        return "unknown", ("/proc/keys shows none of the kernel's system keyrings (they are visible to root "
                           "only, and need CONFIG_KEYS)")
    if not ids:
        return "no", "no key with our certificate's description is in the kernel's keyrings (/proc/keys)"
    if key_in is None:
        return "yes", ("a key of root's with our certificate's description is loaded (/proc/keys; keyctl, of "
                       "keyutils, is not installed to say which keyring holds it)")
    if key_in:
        return "yes", "our certificate's key is in " + ", ".join(key_in) + (
            " (Ubuntu's and Debian's kernels check modules against .platform too)" if key_in == [".platform"] else "")
    return "no", "our certificate's key is loaded, but in none of " + ", ".join(SYSTEM_RINGS)


# --- observation ----------------------------------------------------------------------------------------

def _load_config(host):
    try:
        from spark_memsaver import config as cfg
        return cfg.load(None, root=str(host.root))
    except MemsaverError:
        return None


def read_request_record(host) -> dict | None:
    from spark_memsaver.host import records     # the typed reader of every record
    return records.one(host, "mok-request", REQUEST_RECORD)   # a damaged one only loses a hint



def read(host, cert: str | None = None, config=None) -> MokReading:
    """Everything the verdict needs, read once: the EFI variables (parsed), the certificate, our request record,
    the boot id and the kernel's keyrings."""
    if config is None and cert is None:
        config = _load_config(host)
    parsed = parse_efi(read_efi(host))
    ci = locate_certificate(host, cert, config)
    return MokReading(parsed, ci, read_request_record(host), (host.read_text(BOOT_ID) or "").strip() or None,
                      read_kernel(host, ci.cert))

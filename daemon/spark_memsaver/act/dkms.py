"""DKMS: render, build, sign, install and remove the patched nvidia-uvm (package ``spark-memsaver-uvm``).

Entry points (``progress`` is an optional ``callable(fraction: float, message: str)``):

* :func:`build` (host, config, kernel=None, driver_version=None, progress=None) -> dict
* :func:`install` (host, config, kernel=None, all_kernels=False, progress=None) -> dict
* :func:`remove` (host, config, kernel=None, all_kernels=False, progress=None) -> dict
  (restores and VERIFIES the stock module)
* :func:`verify_installed` (host, kernel) -> dict
* :func:`register` (cli): ``spark-memsaver build|install|remove [--kernel K | --all] [--json]``

The path a build takes, each step refusing with a named error before anything is compiled:
headers present (:class:`HeadersMissing`) -> kernel inside the config's policy
(:class:`KernelOutsidePolicy`) -> an nvidia.ko is selected for the kernel; its version is THE driver
version (:class:`NoNvidiaDriver`, :class:`DriverMismatch`) -> that version's NVIDIA open tree is under
/usr/src and intact (:class:`DriverSourceMissing`, :class:`DriverSourceCorrupt`) -> the manifest has a
patch and it applies with zero fuzz (uvm_patch's ``UnknownDriverVersion``, ``PatchDoesNotApply``) ->
signing key settled (signing.py) -> our tree rendered into ``/usr/src/spark-memsaver-uvm-<ver>/`` ->
``dkms add`` / ``dkms build`` -> the built module verified (version, vermagic, parameters,
``depends: nvidia``, nvidia.ko's CRCs, signer). DKMS exit codes map to named errors
(:data:`DKMS_EXIT_ERRORS`). Install then proves the override with ``modinfo -k K -n nvidia-uvm``;
remove proves the stock module is selected again (and repairs what DKMS versions leave wrong).

DKMS version string: ``<driver>-sm<spark-memsaver version>``, e.g. ``550.163.01-sm0.1.0``: one
registration per driver version, so a driver upgrade gets its own tree, and version sorting (DKMS
autoinstall picks the highest) puts the newest driver first, then our newest release.
See dkms/README.md for location/priority, signing and the exit-code table.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path


from spark_memsaver import __version__
from spark_memsaver.act import signing as sig
from spark_memsaver.errors import EXIT_FAILED, EXIT_PROBLEM, EXIT_USAGE, MemsaverError, NotPermitted, SecureBootUnknown
from spark_memsaver.host import Host
from spark_memsaver.observe import modules

log = logging.getLogger("spark_memsaver.act.dkms")

PACKAGE = "spark-memsaver-uvm"
MODULE = "nvidia-uvm"
PATCH_ID = modules.PATCH_ID
DKMS_TREE = "/var/lib/dkms"
SRC_ROOT = "/usr/src"
STATE_DIR = "/var/lib/spark-memsaver/dkms"
LOG_DIR = "/var/lib/spark-memsaver/logs"
LOCK = "/run/lock/spark-memsaver-dkms.lock"
FORCE_FILE = f"/usr/share/dkms/modules_to_force_install/{PACKAGE}"
DEPMOD_FILE = f"/usr/lib/depmod.d/{PACKAGE}.conf"
DEST = "/updates/dkms"
TIERS = {"4k": 1, "256": 2}
BUILD_TIMEOUT = 3600
NICE = "5"
_SUFFIXES = ("", ".xz", ".zst", ".gz")


# ------------------------------------------------------------------------------------------------
# Named errors

class DkmsError(MemsaverError):
    code = "dkms-failed"
    exit_code = EXIT_FAILED
    remedy = "Run 'dkms status' and read the log named above; then retry."


class DkmsMissing(DkmsError):
    code = "dkms-missing"
    exit_code = EXIT_USAGE
    remedy = "Install DKMS: apt install dkms."


class HeadersMissing(DkmsError):
    code = "headers-missing"
    exit_code = EXIT_PROBLEM
    remedy = "Install the kernel's headers (e.g. apt install linux-headers-<kernel>), then retry."


class KernelOutsidePolicy(DkmsError):
    code = "kernel-outside-policy"
    exit_code = EXIT_PROBLEM
    remedy = ("Packing saves memory on 64 KiB-page arm64 kernels; set 'kernels: all' in "
              "/etc/spark-memsaver/config.yaml to build for other kernels too.")


class NoNvidiaDriver(DkmsError):
    code = "no-nvidia-driver"
    exit_code = EXIT_PROBLEM
    remedy = "Install the NVIDIA open driver's kernel modules for this kernel first."


class DriverMismatch(DkmsError):
    code = "driver-mismatch"
    exit_code = EXIT_PROBLEM
    remedy = ("An nvidia-uvm is only ever built for the version of the nvidia.ko it will load beside; "
              "omit --driver, or install that driver version for this kernel.")


class DriverSourceMissing(DkmsError):
    code = "driver-source-missing"
    exit_code = EXIT_PROBLEM
    remedy = ("Install the NVIDIA open kernel-module source package of the same version "
              "(Ubuntu: nvidia-kernel-source-<branch>-open; Debian: nvidia-open-kernel-dkms).")


class DriverSourceCorrupt(DkmsError):
    code = "driver-source-corrupt"
    exit_code = EXIT_PROBLEM
    remedy = "Reinstall the NVIDIA open kernel-module source package (apt install --reinstall ...)."


class BuildSkipped(DkmsError):
    code = "dkms-build-skipped"
    exit_code = EXIT_PROBLEM
    remedy = KernelOutsidePolicy.remedy


class BuildFailed(DkmsError):
    code = "dkms-build-failed"
    remedy = "Read the build log named above (the last lines are shown); fix the cause, then run 'spark-memsaver build' again."


class BuiltModuleMissing(DkmsError):
    code = "dkms-built-module-missing"
    remedy = BuildFailed.remedy


class PreInstallRefused(DkmsError):
    code = "dkms-pre-install-refused"
    exit_code = EXIT_PROBLEM
    remedy = "The guard's reasons are shown above; rebuild with 'spark-memsaver build' after fixing them."


class InstallRefused(DkmsError):
    code = "dkms-install-refused"
    exit_code = EXIT_PROBLEM
    remedy = (f"DKMS did not put the override in place (its version sanity check). Make sure "
              f"{FORCE_FILE} exists (shipped by the spark-memsaver package), then retry.")


class InstallAborted(DkmsError):
    code = "dkms-install-aborted"
    remedy = "Read DKMS's message above; 'dkms status' shows the state. Nothing was left selected."


class DkmsTreeBroken(DkmsError):
    code = "dkms-tree-broken"
    remedy = "Run 'spark-memsaver remove --all' to clear our registration, then build again."


class DkmsConfInvalid(DkmsError):
    code = "dkms-conf-invalid"
    remedy = "Reinstall spark-memsaver (its DKMS templates are damaged)."


class VerificationFailed(DkmsError):
    code = "module-verification-failed"
    exit_code = EXIT_PROBLEM
    remedy = "The module was not installed. Rebuild with 'spark-memsaver build'; report the problems if they persist."


class StockNotRestored(DkmsError):
    code = "stock-not-restored"
    remedy = ("Reinstall the NVIDIA driver's kernel-module package for this kernel (it restores the stock "
              "nvidia-uvm), then run 'depmod -a <kernel>'.")


class NothingToDo(DkmsError):
    code = "nothing-to-do"
    exit_code = EXIT_PROBLEM
    remedy = "Nothing is built or installed for that kernel; see 'spark-memsaver status'."


# dkms exit status -> (error class, what it means). 3.0.x exits 1 for missing headers (HEAD: 21).
DKMS_EXIT_ERRORS = {
    1: (DkmsError, "generic DKMS failure (3.0.x also: kernel headers missing; not root)"),
    2: (DkmsTreeBroken, "source directory missing"),
    3: (DkmsError, "already added/built"),
    4: (DkmsTreeBroken, "dkms.conf missing or module broken"),
    5: (DkmsError, "already installed / patch missing"),
    6: (InstallAborted, "installation aborted / patch failed / kernel missing / depmod failed"),
    7: (BuiltModuleMissing, "built module not found after make"),
    8: (DkmsConfInvalid, "bad dkms.conf / empty source directory"),
    10: (BuildFailed, "make failed"),
    11: (DkmsError, "autoinstall had failures"),
    12: (DkmsError, "unknown architecture"),
    13: (DkmsError, "BUILD_DEPENDS missing"),
    14: (DkmsError, "kernel hook failure"),
    16: (DkmsError, "empty kernel version or architecture"),
    21: (HeadersMissing, "kernel headers missing"),
    77: (BuildSkipped, "skipped: BUILD_EXCLUSIVE does not match this kernel"),
    101: (PreInstallRefused, "PRE_INSTALL guard refused"),
}


# ------------------------------------------------------------------------------------------------
# Small pure helpers

def dkms_version_string(driver: str, ours: str = __version__) -> str:
    return f"{driver}-sm{ours}"


def parse_dkms_version(v: str) -> tuple[str, str] | None:
    m = re.match(r"^(\d+\.\d+(?:\.\d+)?)-sm(.+)$", v)
    return (m.group(1), m.group(2)) if m else None


def data_dir() -> Path:
    """dkms/ (templates, kotool, depmod.d, force file): $SPARK_MEMSAVER_DKMS_DIR, the checkout, or the
    installed copy under /usr/share/spark-memsaver/dkms."""
    env = os.environ.get("SPARK_MEMSAVER_DKMS_DIR")
    cands = ([Path(env)] if env else []) + [Path(__file__).resolve().parents[3] / "dkms",
                                             Path("/usr/share/spark-memsaver/dkms")]
    for c in cands:
        if (c / "templates" / "dkms.conf.j2").is_file():
            return c
    raise DkmsConfInvalid("DKMS templates not found (looked in: " + ", ".join(map(str, cands)) + ")")


_KOTOOL = None


def kotool():
    """dkms/spark-memsaver-kotool imported as a module (the same code the PRE_INSTALL guard runs)."""
    global _KOTOOL
    if _KOTOOL is None:
        path = data_dir() / "spark-memsaver-kotool"
        loader = importlib.machinery.SourceFileLoader("spark_memsaver_kotool", str(path))
        spec = importlib.util.spec_from_loader(loader.name, loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        _KOTOOL = mod
    return _KOTOOL


def sha256(path: str | Path) -> str | None:
    try:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


def _tail(text: str, n: int = 25, relevant: bool = True) -> list[str]:
    lines = [l for l in text.splitlines() if l.strip()]
    if relevant:
        pick = [l for l in lines if re.search(r"error|Error|ERROR|refus|fail|FAILED|WARNING: modpost|"
                                              r"spark-memsaver: |guard", l)]
        if pick:
            return pick[-n:]
    return lines[-n:]


def _noop(fraction: float, message: str) -> None:
    pass


def _scaled(progress, lo: float, hi: float):
    progress = progress or _noop
    return lambda f, m: progress(lo + (hi - lo) * max(0.0, min(1.0, f)), m)


# ------------------------------------------------------------------------------------------------
# Observation (through the host)

def running_kernel(host: Host) -> str:
    from spark_memsaver.observe.snapshot import observe_host
    k = observe_host(host)["kernel"]
    if not k:
        raise HeadersMissing("cannot tell the running kernel; pass --kernel")
    return k


def dkms_cmd() -> str:
    """The dkms program: $SPARK_MEMSAVER_DKMS (tests run other real DKMS releases this way), else dkms."""
    return os.environ.get("SPARK_MEMSAVER_DKMS") or "dkms"


def dkms_version(host: Host) -> str:
    exe = host.runner.which(dkms_cmd()) if "/" not in dkms_cmd() else (dkms_cmd() if os.access(dkms_cmd(), os.X_OK) else None)
    if not exe:
        raise DkmsMissing("dkms is not installed")
    r = host.run([dkms_cmd(), "--version"], timeout=30)
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", r.stdout + r.stderr)
    return m.group(1) if m else "unknown"


def _modinfo_path(host: Host, kernel: str, name: str) -> str | None:
    """The file modprobe selects for ``name`` (observe/modules.py), or None when none can be read."""
    return modules.read_selected(host, kernel, name).get("path")


def selected(host: Host, kernel: str, name: str, digest: bool = True) -> dict | None:
    """The file module loading selects for `name` on `kernel` (observe/modules.py, the one reader), or None
    when nothing is selected or the selection cannot be read (callers treat both as "not ours", never as a
    verified stock file: verification compares paths and digests)."""
    sel = modules.read_selected(host, kernel, name, digest=digest)
    if sel["state"] in ("none", "builtin", "unreadable"):
        return None
    return {"path": sel["path"], "version": sel.get("version"), "srcversion": sel.get("srcversion"),
            "vermagic": (sel.get("vermagic") or "").split(" ")[0], "patch_id": sel.get("patch_id"),
            "ours": sel["state"] == "ours", "state": sel["state"], "sha256": sel.get("sha256")}


def kernel_config(host: Host, kernel: str) -> dict:
    from spark_memsaver.observe.snapshot import kernel_config as kc
    return kc(host, kernel)


def policy_check(host: Host, config, kernel: str) -> None:
    if config.kernels == "all":
        return
    cfg = kernel_config(host, kernel)
    if cfg.get("CONFIG_ARM64") == "y" and cfg.get("CONFIG_ARM64_64K_PAGES") == "y":
        return
    what = ("an arm64 kernel without 64 KiB pages" if cfg.get("CONFIG_ARM64") == "y"
            else "not an arm64 kernel" if cfg else "a kernel whose configuration cannot be read")
    raise KernelOutsidePolicy(f"kernel {kernel} is {what}; policy 'kernels: 64k-only' builds only for "
                              "arm64 kernels with CONFIG_ARM64_64K_PAGES", kernel=kernel)


def source_candidates(driver: str) -> list[str]:
    return [f"{SRC_ROOT}/nvidia-{driver}", f"{SRC_ROOT}/nvidia-open-{driver}",
            f"{SRC_ROOT}/nvidia-current-open-{driver}", f"{SRC_ROOT}/nvidia-current-{driver}"]


def find_driver_source(host: Host, driver: str) -> str:
    from spark_memsaver.act import patch as uvm_patch
    found = [c for c in source_candidates(driver) if host.path(c).is_dir()]
    if not found:
        raise DriverSourceMissing(f"the NVIDIA {driver} open kernel-module source is not installed "
                                  f"(looked for {', '.join(source_candidates(driver))})", driver=driver)
    src = found[0]
    try:
        v = uvm_patch.read_tree_version(host.path(src))
    except uvm_patch.SourceTreeInvalid as e:
        raise DriverSourceCorrupt(f"{src} is damaged: {e.message}", source=src) from None
    if v != driver:
        raise DriverSourceCorrupt(f"{src} holds NVIDIA {v}, not {driver}", source=src)
    kb = host.read_text(f"{src}/nvidia/nvidia.Kbuild") or ""
    if not re.search(r"^NV_CONFTEST_", kb, re.M):
        raise DriverSourceCorrupt(f"{src} is damaged: nvidia/nvidia.Kbuild is missing or has no conftest lists",
                                  source=src)
    for f in ("conftest.sh", "Makefile", "nvidia-uvm/uvm.c"):
        p = host.path(f"{src}/{f}")
        if not p.is_file() or p.stat().st_size == 0:
            raise DriverSourceCorrupt(f"{src} is damaged: {f} is missing or empty", source=src)
    return src


def registered_versions(host: Host) -> list[str]:
    base = host.path(f"{DKMS_TREE}/{PACKAGE}")
    try:
        return sorted(n for n in os.listdir(base) if not n.startswith(("kernel-", "original_module"))
                      and (base / n).is_dir())
    except OSError:
        return []


def _arch_dirs(host: Host, ver: str, kernel: str) -> list[Path]:
    return sorted(p for p in host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}/{kernel}").glob("*") if p.is_dir())


def built_module(host: Host, ver: str, kernel: str) -> Path | None:
    for a in _arch_dirs(host, ver, kernel):
        for s in _SUFFIXES:
            p = a / "module" / f"{MODULE}.ko{s}"
            if p.is_file():
                return p
    return None


def installed_version(host: Host, kernel: str) -> str | None:
    """Our DKMS version installed for `kernel` (DKMS's kernel-<k>-<arch> link), else None."""
    base = host.path(f"{DKMS_TREE}/{PACKAGE}")
    for link in base.glob(f"kernel-{kernel}-*"):
        if link.is_symlink():
            return os.readlink(link).split("/")[0]
    return None


def kernels_of(host: Host, ver: str) -> list[str]:
    base = host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}")
    try:
        return sorted(n for n in os.listdir(base) if n not in ("source", "build", "log") and (base / n).is_dir())
    except OSError:
        return []


def installed_path(host: Host, kernel: str, suffix: str = "") -> str:
    return f"/lib/modules/{kernel}{DEST}/{MODULE}.ko{suffix}"


# ------------------------------------------------------------------------------------------------
# Acting helpers

@contextlib.contextmanager
def _locked(host: Host):
    p = host.path(LOCK)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _require_root(host: Host) -> None:
    if host.is_live and os.geteuid() != 0:
        raise NotPermitted("building and installing modules needs root")


def _raise_for_dkms(res, what: str, log_path: str | None = None, extra: str = "") -> None:
    cls, meaning = DKMS_EXIT_ERRORS.get(res.returncode, (DkmsError, "unexpected exit status"))
    out = (res.stdout or "") + "\n" + (res.stderr or "")
    if res.returncode == 1 and re.search(r"kernel headers .* cannot be found", out):
        cls, meaning = HeadersMissing, "kernel headers missing"
    logtext = ""
    if log_path:
        try:
            logtext = Path(log_path).read_text(errors="replace")
        except OSError:
            logtext = ""
    lines = _tail(logtext or out)
    msg = f"{what}: dkms exited {res.returncode} ({meaning})"
    if log_path and logtext:
        msg += f"; log: {log_path}"
    if extra:
        msg += f"; {extra}"
    msg += "\n" + "\n".join("  | " + l for l in lines)
    raise cls(msg, dkms_exit=res.returncode, log=log_path, last_lines=lines)


def _dkms(host: Host, args: list[str], timeout: float = 600, poll=None):
    """Run dkms; while it runs, call poll() every second (progress)."""
    if poll is None:
        return host.run([dkms_cmd()] + args, timeout=timeout)
    box: dict = {}

    def target():
        try:
            box["res"] = host.run(["nice", "-n", NICE, dkms_cmd()] + args, timeout=timeout)
        except BaseException as e:  # re-raised in the caller's thread
            box["err"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    while t.is_alive():
        t.join(1.0)
        try:
            poll()
        except Exception:  # progress must never break a build
            pass
    if "err" in box:
        raise box["err"]
    return box["res"]


def _depmod(host: Host, kernel: str) -> None:
    argv = ["depmod", "-a"]
    if not host.is_live:
        argv += ["-b", str(host.root)]
    sm = f"/boot/System.map-{kernel}"
    if host.exists(sm):
        argv += ["-F", str(host.path(sm))]
    r = host.run(argv + [kernel], timeout=600)
    if not r.ok:
        raise DkmsError(f"depmod -a {kernel} failed: {r.stderr.strip()[-500:]}",
                        remedy="Check /lib/modules/<kernel> and run depmod by hand.")


def refresh_initramfs(host: Host, kernel: str) -> str:
    """update-initramfs -u -k K when the host uses initramfs-tools and K has an initramfs."""
    if not host.is_live:
        return "skipped (not the live system)"
    if not host.runner.which("update-initramfs") or not host.exists(f"/boot/initrd.img-{kernel}"):
        return "not used"
    r = host.run(["update-initramfs", "-u", "-k", kernel], timeout=900)
    if not r.ok:
        raise DkmsError(f"update-initramfs -u -k {kernel} failed: {r.stderr.strip()[-500:]}",
                        remedy=f"Run 'update-initramfs -u -k {kernel}' by hand and read its output.")
    return "refreshed"


def _write_json(host: Host, path: str, doc: dict) -> None:
    p = host.path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.rename(tmp, p)


def _read_json(host: Host, path: str) -> dict | None:
    try:
        return json.loads(host.read_text(path) or "")
    except ValueError:
        return None


def ensure_host_files(host: Host) -> list[str]:
    """The force-install file (so DKMS's version check lets our same-version module replace the stock
    one; the PRE_INSTALL guard still runs) and the depmod.d override. The package ships both; write
    them when missing (running from a checkout)."""
    d = data_dir()
    written = []
    for src, dst in ((d / "modules_to_force_install" / PACKAGE, FORCE_FILE),
                     (d / "depmod.d" / f"{PACKAGE}.conf", DEPMOD_FILE)):
        p = host.path(dst)
        want = src.read_text()
        if p.exists() and p.read_text() == want:
            continue
        if p.exists():
            log.info("%s differs from the shipped copy; leaving it as the administrator set it", dst)
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(want)
        written.append(dst)
    return written


# ------------------------------------------------------------------------------------------------
# Rendering our source tree

def render(host: Host, config, driver: str, nvidia_source: str) -> dict:
    """Write /usr/src/spark-memsaver-uvm-<ver>/ (only our files; never a link into /usr/src/nvidia-*).
    Atomic (temp dir + rename); unchanged content is left alone. Returns {"version", "path", "changed"}."""
    import jinja2

    from spark_memsaver.act import patch as uvm_patch

    ver = dkms_version_string(driver)
    dest = f"{SRC_ROOT}/{PACKAGE}-{ver}"
    d = data_dir()
    manifest = uvm_patch.load_manifest()
    pyroot = str(Path(__file__).resolve().parents[2])
    values = {
        "package": PACKAGE, "dkms_version": ver, "driver_version": driver, "our_version": __version__,
        "nvidia_source": nvidia_source, "kernels_policy": config.kernels,
        "source_candidates": source_candidates(driver), "pythonpath": pyroot,
        "tier_default": TIERS.get(str(config.tier), 1),
    }
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(d / "templates")), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    files: dict[str, tuple[bytes, int]] = {
        "dkms.conf": (env.get_template("dkms.conf.j2").render(**values).encode(), 0o644),
        "spark-memsaver-build": (env.get_template("spark-memsaver-build.j2").render(**values).encode(), 0o755),
        "spark-memsaver-kotool": ((d / "spark-memsaver-kotool").read_bytes(), 0o755),
    }
    mroot = manifest.root
    for rel in ["manifest.yaml"] + [str(p.relative_to(mroot)) for p in manifest.pool_files] + \
               [str(p.relative_to(mroot)) for ps in manifest.branches.values() for p in ps]:
        files[f"uvm_patch/{rel}"] = ((mroot / rel).read_bytes(), 0o644)
    content = hashlib.sha256()
    for name in sorted(files):
        content.update(name.encode() + b"\0" + files[name][0] + b"\0")
    meta = {"format": 1, "package": PACKAGE, "dkms_version": ver, "driver_version": driver,
            "our_version": __version__, "tier": str(config.tier), "tier_default": values["tier_default"],
            "kernels_policy": config.kernels, "nvidia_source": nvidia_source, "patch_id": PATCH_ID,
            "signing_record": sig.RECORD, "content_sha256": content.hexdigest()}
    files["spark-memsaver.json"] = (json.dumps(meta, indent=2).encode() + b"\n", 0o644)
    target = host.path(dest)
    old = _read_json(host, f"{dest}/spark-memsaver.json")
    if target.is_dir() and not target.is_symlink() and old and old.get("content_sha256") == meta["content_sha256"] \
            and all((target / n).is_file() for n in files):
        return {"version": ver, "path": dest, "changed": False}
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, (data, mode) in files.items():
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.chmod(p, mode)
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    os.rename(tmp, target)
    return {"version": ver, "path": dest, "changed": True}


def recover_broken(host: Host, config) -> list[str]:
    """Registrations whose /usr/src tree vanished (DKMS 3.0.x then fails `status`/`autoinstall` for EVERY
    module): re-render our tree for them so DKMS works again. Returns the versions repaired."""
    repaired = []
    for ver in registered_versions(host):
        if host.path(f"{SRC_ROOT}/{PACKAGE}-{ver}/dkms.conf").is_file():
            continue
        parsed = parse_dkms_version(ver)
        if parsed is None or parsed[1] != __version__:
            # Not a tree this release can reproduce: drop DKMS's record of it without running dkms
            # (which would fail on it), after taking back any file it installed.
            _forget_registration(host, ver)
            repaired.append(ver)
            continue
        drv = parsed[0]
        src = next((c for c in source_candidates(drv) if host.path(c).is_dir()), source_candidates(drv)[0])
        render(host, config, drv, src)
        repaired.append(ver)
        log.warning("re-created %s/%s-%s (it was deleted behind DKMS's back)", SRC_ROOT, PACKAGE, ver)
    return repaired


def _forget_registration(host: Host, ver: str) -> None:
    for kernel in kernels_of(host, ver):
        if installed_version(host, kernel) == ver:
            built = built_module(host, ver, kernel)
            for s in _SUFFIXES:
                inst = host.path(installed_path(host, kernel, s))
                if inst.is_file() and built is not None and sha256(inst) == sha256(built):
                    inst.unlink()
            for link in host.path(f"{DKMS_TREE}/{PACKAGE}").glob(f"kernel-{kernel}-*"):
                link.unlink()
            _depmod(host, kernel)
    shutil.rmtree(host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}"), ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Build

def _preflight(host: Host, config, kernel: str, driver_version: str | None) -> dict:
    """Every check that can refuse before anything is written or compiled."""
    from spark_memsaver.act import patch as uvm_patch
    if not host.exists(f"/lib/modules/{kernel}/build/Makefile"):
        raise HeadersMissing(f"kernel headers for {kernel} are not installed (/lib/modules/{kernel}/build)",
                             kernel=kernel)
    policy_check(host, config, kernel)
    nv = selected(host, kernel, "nvidia", digest=False)
    if nv is None or not nv.get("version"):
        raise NoNvidiaDriver(f"no nvidia.ko is installed for kernel {kernel}", kernel=kernel)
    driver = nv["version"]
    if driver_version and driver_version != driver:
        raise DriverMismatch(f"kernel {kernel} loads nvidia.ko {driver} ({nv['path']}), not {driver_version}",
                             kernel=kernel, driver=driver)
    src = find_driver_source(host, driver)
    try:
        chk = uvm_patch.check_source(host.path(src), runner=host.runner)
    except uvm_patch.SourceTreeInvalid as e:
        raise DriverSourceCorrupt(f"{src}: {e.message}", source=src) from None
    chk.pop("_selection", None)
    return {"kernel": kernel, "driver": driver, "nvidia_ko": nv["path"], "source": src, "patch": chk}


def _signing_for(host: Host, config, kernel: str) -> dict:
    if host.is_live:
        signs = kotool().kernel_signs_modules(kernel)
    else:
        signs = kernel_config(host, kernel).get("CONFIG_MODULE_SIG") == "y"
    if not signs:
        return {"applies": False, "reason": f"kernel {kernel} does not check module signatures (CONFIG_MODULE_SIG unset)"}
    s = sig.ensure(host, config)
    s["applies"] = True
    return s


def _progress_poller(host: Host, ver: str, progress):
    logp = host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}/build/make.log")
    state = {"total": 0, "frac": 0.0, "msg": "starting dkms build"}

    def poll():
        try:
            text = logp.read_text(errors="replace")
        except OSError:
            return
        for m in re.finditer(r"^spark-memsaver-progress-total: (\d+)", text, re.M):
            state["total"] = int(m.group(1))
        marks = re.findall(r"^spark-memsaver-progress: ([0-9.]+) (.*)$", text, re.M)
        if marks:
            state["frac"], state["msg"] = max(state["frac"], float(marks[-1][0])), marks[-1][1]
        cc = len(re.findall(r"^\s+CC \[M\]\s+\S+/nvidia-uvm/", text, re.M))
        frac, msg = state["frac"], state["msg"]
        if state["total"] and cc:
            frac = max(frac, 0.10 + 0.85 * min(1.0, cc / state["total"]))
            msg = f"compiling nvidia-uvm ({cc}/{state['total']})"
        if "LD [M]" in text and "nvidia-uvm.ko" in text:
            frac, msg = max(frac, 0.96), "linking nvidia-uvm.ko"
        progress(frac, msg)
    return poll


def _save_log(host: Host, ver: str, kernel: str) -> str | None:
    for cand in (f"{DKMS_TREE}/{PACKAGE}/{ver}/build/make.log",
                 *[str(a / "log" / "make.log") for a in _arch_dirs(host, ver, kernel)]):
        p = host.path(cand) if cand.startswith("/var") else Path(cand)
        if p.is_file():
            dst = host.path(f"{LOG_DIR}/dkms-build-{ver}-{kernel}.log")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, dst)
            return f"{LOG_DIR}/dkms-build-{ver}-{kernel}.log"
    return None


def _verify_built(host: Host, ver: str, kernel: str, driver: str, signing: dict) -> dict:
    ko = built_module(host, ver, kernel)
    if ko is None:
        raise BuiltModuleMissing(f"DKMS reports a build for {kernel} but no {MODULE}.ko is in its tree")
    nv = _modinfo_path(host, kernel, "nvidia")
    record = sig.read_record(host) if signing.get("applies") else None
    res = kotool().verify(str(ko), kernel, driver, nvidia_ko=str(host.path(nv)) if nv else None,
                          signing=record, tag=PATCH_ID)
    if signing.get("applies") and not res["facts"].get("signing_applies") and host.is_live:
        res["problems"].append("the kernel signs modules but the signing check did not run")
        res["ok"] = False
    res["module"] = str(ko)
    return res


def _unbuild(host: Host, ver: str, kernel: str) -> None:
    r = _dkms(host, ["unbuild", "-m", PACKAGE, "-v", ver, "-k", kernel], timeout=600)
    if not r.ok and built_module(host, ver, kernel) is not None:
        _raise_for_dkms(r, f"dkms unbuild {PACKAGE}/{ver} -k {kernel}")


def _drop_if_empty(host: Host, ver: str) -> None:
    """Remove the registration (and our /usr/src tree) when no kernel has a build of it."""
    if kernels_of(host, ver):
        return
    if host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}").exists():
        r = _dkms(host, ["remove", "-m", PACKAGE, "-v", ver, "--all"], timeout=600)
        if not r.ok and host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}").exists():
            _forget_registration(host, ver)
    src = host.path(f"{SRC_ROOT}/{PACKAGE}-{ver}")
    if src.is_dir() and (src / "spark-memsaver.json").exists():
        shutil.rmtree(src)
    base = host.path(f"{DKMS_TREE}/{PACKAGE}")
    if base.is_dir() and not any(base.iterdir()):
        base.rmdir()


def _jobs() -> str:
    env = os.environ.get("SPARK_MEMSAVER_BUILD_JOBS", "")
    return env if env.isdigit() and int(env) > 0 else str(os.cpu_count() or 1)


def _build_locked(host: Host, config, kernel: str, driver_version: str | None, progress, force: bool) -> dict:
    t0 = time.monotonic()
    progress = progress or _noop
    progress(0.0, f"checking {kernel}")
    dv = dkms_version(host)
    recovered = recover_broken(host, config)
    pre = _preflight(host, config, kernel, driver_version)
    driver = pre["driver"]
    ver = dkms_version_string(driver)
    progress(0.01, "settling the signing key")
    signing = _signing_for(host, config, kernel)
    rendered = render(host, config, driver, pre["source"])
    result = {"kernel": kernel, "driver": driver, "dkms_version": ver, "dkms": dv, "package": PACKAGE,
              "source": rendered["path"], "nvidia_source": pre["source"], "patch": pre["patch"],
              "signing": {k: signing.get(k) for k in ("applies", "reason", "key", "cert", "subject", "serial",
                                                       "sha256", "created", "changes_global_signing", "replaces")
                          if k in signing},
              "recovered": recovered}
    if not force and not rendered["changed"] and built_module(host, ver, kernel) is not None:
        v = _verify_built(host, ver, kernel, driver, signing)
        if v["ok"]:
            result.update(status="already-built", module=v["module"], verification=v, seconds=0.0,
                          log=None)
            progress(1.0, "already built" + (" and installed" if installed_version(host, kernel) == ver else ""))
            return result
    if not host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}").exists():
        r = _dkms(host, ["add", "-m", PACKAGE, "-v", ver], timeout=120)
        if not r.ok:
            _raise_for_dkms(r, f"dkms add {PACKAGE}/{ver}")
    if installed_version(host, kernel) == ver:
        _uninstall_kernel(host, ver, kernel)  # rebuilding: `install` puts the new build in place
        result["uninstalled_for_rebuild"] = True
    if kernel in kernels_of(host, ver):
        _unbuild(host, ver, kernel)
    progress(0.02, "dkms build")
    res = _dkms(host, ["build", "-m", PACKAGE, "-v", ver, "-k", kernel, "-j", _jobs()], timeout=BUILD_TIMEOUT,
                poll=_progress_poller(host, ver, _scaled(progress, 0.02, 0.97)))
    logp = _save_log(host, ver, kernel)
    result["log"] = logp
    if not res.ok:
        try:
            _raise_for_dkms(res, f"dkms build {PACKAGE}/{ver} for {kernel}", str(host.path(logp)) if logp else None)
        finally:
            if kernel in kernels_of(host, ver) and built_module(host, ver, kernel) is None:
                _unbuild(host, ver, kernel)
            _drop_if_empty(host, ver)
    ver_res = _verify_built(host, ver, kernel, driver, signing)
    result["verification"] = ver_res
    if not ver_res["ok"]:
        _unbuild(host, ver, kernel)
        _drop_if_empty(host, ver)
        raise VerificationFailed(f"the module DKMS built for {kernel} failed verification: "
                                 + "; ".join(ver_res["problems"]), problems=ver_res["problems"], log=logp)
    if signing.get("applies"):
        sig.record_signed(host, {"module": ver_res["module"], "dkms_version": ver, "kernel": kernel,
                                 "signer": ver_res["facts"].get("signer"), "serial": ver_res["facts"].get("sig_key"),
                                 "cert": signing.get("cert"), "cert_sha256": signing.get("sha256")})
    result.update(status="built", module=ver_res["module"], seconds=round(time.monotonic() - t0, 1))
    progress(1.0, f"built {PACKAGE}/{ver} for {kernel}")
    return result


def build(host: Host, config, kernel: str | None = None, driver_version: str | None = None, progress=None,
          force: bool = False) -> dict:
    """Render, register and build the patched nvidia-uvm for `kernel` (default: the running kernel).

    The driver version is the version of the nvidia.ko selected for that kernel; ``driver_version``, when
    given, must equal it. Returns a dict (kernel, driver, dkms_version, module, log, signing, verification,
    seconds, status 'built'|'already-built'). Raises a named error, leaving nothing registered that was
    not there before, when anything refuses or fails.
    """
    _require_root(host)
    kernel = kernel or running_kernel(host)
    with _locked(host):
        return _build_locked(host, config, kernel, driver_version, progress, force)


# ------------------------------------------------------------------------------------------------
# Install / remove

def _stock_record_path(kernel: str) -> str:
    return f"{STATE_DIR}/{kernel}.json"


def _other_dkms_owner(host: Host, kernel: str, path: str) -> dict | None:
    """Another DKMS package's built copy identical to the file at `path` (e.g. Ubuntu's `nvidia` package
    installs nvidia-uvm to the same updates/dkms path)."""
    digest = sha256(host.path(path))
    if digest is None:
        return None
    for cand in host.path(DKMS_TREE).glob(f"*/*/{kernel}/*/module/{MODULE}.ko*"):
        if cand.parts[-6] == PACKAGE:
            continue
        if sha256(cand) == digest:
            return {"package": cand.parts[-6], "version": cand.parts[-5], "copy": str(cand)}
    return None


def _protect_foreign(host: Host, kernel: str, ours_digest: str | None):
    """Files at our install path that are not ours (another DKMS package's): move aside, return restorer."""
    moved = []
    for s in _SUFFIXES:
        p = host.path(installed_path(host, kernel, s))
        if p.is_file() and sha256(p) != ours_digest:
            aside = p.with_name(f".{p.name}.spark-memsaver-aside")
            os.rename(p, aside)
            moved.append((aside, p))

    def restore():
        for aside, p in moved:
            if not p.exists():
                os.rename(aside, p)
            else:
                aside.unlink()
    return restore


def _uninstall_kernel(host: Host, ver: str, kernel: str) -> None:
    _backup_originals(host, kernel)  # DKMS 3.0.x deletes original_module/ on uninstall without restoring it
    built = built_module(host, ver, kernel)
    restore = _protect_foreign(host, kernel, sha256(built) if built else None)
    try:
        r = _dkms(host, ["uninstall", "-m", PACKAGE, "-v", ver, "-k", kernel], timeout=600)
    finally:
        restore()
    if not r.ok and installed_version(host, kernel) == ver:
        _raise_for_dkms(r, f"dkms uninstall {PACKAGE}/{ver} -k {kernel}")


def verify_installed(host: Host, kernel: str) -> dict:
    """What is selected for `kernel` and whether it is our verified override.

    Returns {"kernel", "selected": path|None, "ours": bool, "installed_version": dkms version|None,
    "matches_dkms_copy": bool, "nvidia": {...}, "ok": bool, "problems": [...], "facts": {...}}.
    ``ok`` means: our module is selected, identical to DKMS's built copy, and passes the same checks
    as the PRE_INSTALL guard against the nvidia.ko selected for that kernel.
    """
    raw = modules.read_selected(host, kernel, MODULE)
    sel = selected(host, kernel, MODULE)
    nv = selected(host, kernel, "nvidia", digest=False)
    ver = installed_version(host, kernel)
    out = {"kernel": kernel, "selected": sel and sel.get("path"), "ours": bool(sel and sel.get("ours")),
           "state": raw["state"], "installed_version": ver, "nvidia": nv, "matches_dkms_copy": False,
           "ok": False, "problems": []}
    if raw["state"] == "unreadable":
        out["problems"].append(f"the {MODULE} selected for {kernel} cannot be read: {raw.get('error')}")
        return out
    if sel is None:
        out["problems"].append(f"no {MODULE} is selected for {kernel}")
        return out
    if not out["ours"]:
        out["problems"].append(f"the selected {MODULE} ({sel['path']}) is not ours")
        return out
    built = built_module(host, ver, kernel) if ver else None
    out["matches_dkms_copy"] = bool(built and sha256(built) == sel.get("sha256"))
    if not out["matches_dkms_copy"]:
        out["problems"].append("the selected file differs from DKMS's built copy (another package overwrote it?)")
    parsed = parse_dkms_version(ver) if ver else None
    driver = parsed[0] if parsed else (sel.get("version") or "")
    record = sig.read_record(host)
    v = kotool().verify(str(host.path(sel["path"])), kernel, driver,
                        nvidia_ko=str(host.path(nv["path"])) if nv and nv.get("path") else None,
                        signing=record, tag=PATCH_ID)
    out["facts"] = v["facts"]
    out["problems"] += v["problems"]
    out["ok"] = not out["problems"]
    return out


def _target_kernels(host: Host, config, kernel: str | None, all_kernels: bool, for_remove: bool) -> tuple[list, list]:
    from spark_memsaver.observe.snapshot import installed_kernels
    if kernel and all_kernels:
        raise MemsaverError("give --kernel or --all, not both", remedy="Pick one.")
    if kernel:
        return [kernel], []
    if not all_kernels:
        return [running_kernel(host)], []
    if for_remove:
        ks = set()
        for ver in registered_versions(host):
            ks.update(kernels_of(host, ver))
        for link in host.path(f"{DKMS_TREE}/{PACKAGE}").glob("kernel-*"):
            ks.add(re.sub(r"-[^-]+$", "", link.name[len("kernel-"):]))
        return sorted(ks), []
    ks, skipped = [], []
    for k in installed_kernels(host):
        why = None
        if not host.exists(f"/lib/modules/{k}/build/Makefile"):
            why = "headers not installed"
        else:
            try:
                policy_check(host, config, k)
            except KernelOutsidePolicy as e:
                why = e.message
        if why is None and selected(host, k, "nvidia", digest=False) is None:
            why = "no nvidia.ko"
        (skipped.append({"kernel": k, "reason": why}) if why else ks.append(k))
    return ks, skipped


def _install_one(host: Host, config, kernel: str, progress) -> dict:
    sb = _secure_boot(host)
    if sb.get("state") == "unknown":
        raise SecureBootUnknown("Secure Boot state is unknown: " + (sb.get("reason") or "unreadable")
                                + "; refusing to install a module that might not load")
    b = _build_locked(host, config, kernel, None, _scaled(progress, 0.0, 0.9), False)
    ver = b["dkms_version"]
    progress(0.9, f"installing {PACKAGE}/{ver} for {kernel}")
    before = selected(host, kernel, MODULE)
    rec = _read_json(host, _stock_record_path(kernel)) or {}
    if before and not before.get("ours"):
        rec = {"kernel": kernel, "stock_path": before["path"], "stock_sha256": before["sha256"],
               "stock_version": before.get("version"),
               "stock_owner_dkms": _other_dkms_owner(host, kernel, before["path"]) if DEST in before["path"] else None,
               "recorded": sig._now()}
    elif not before:
        rec = {"kernel": kernel, "stock_path": None, "stock_sha256": None, "recorded": sig._now()}
    _write_json(host, _stock_record_path(kernel), rec)
    written = ensure_host_files(host)
    if written:
        _depmod(host, kernel)
    if installed_version(host, kernel) not in (None, ver):
        _uninstall_kernel(host, installed_version(host, kernel), kernel)
    if installed_version(host, kernel) != ver:
        built = built_module(host, ver, kernel)
        ours = sha256(built) if built else None
        # A foreign copy at our path (another DKMS package's nvidia-uvm) is restored on remove from its
        # DKMS tree (recorded above); DKMS itself just overwrites it.
        r = _dkms(host, ["install", "-m", PACKAGE, "-v", ver, "-k", kernel], timeout=900)
        if not r.ok:
            restore_stock(host, kernel)
            _raise_for_dkms(r, f"dkms install {PACKAGE}/{ver} -k {kernel}")
        out = r.stdout + r.stderr
    else:
        out = ""
    v = verify_installed(host, kernel)
    if not v["ok"]:
        refusal = [l for l in out.splitlines() if re.search(r"exactly matches|not newer|will not replace|obsoleted"
                                                            r"|--force", l)]
        if installed_version(host, kernel) == ver:
            _uninstall_kernel(host, ver, kernel)
        restore_stock(host, kernel)
        if refusal or not v["ours"]:
            raise InstallRefused(f"dkms install exited 0 but {PACKAGE}/{ver} is not the selected {MODULE} for "
                                 f"{kernel} (selected: {v['selected']})" + ("; DKMS said: " + " ".join(refusal)
                                                                            if refusal else ""),
                                 selected=v["selected"], dkms_output=refusal)
        raise VerificationFailed(f"the installed override for {kernel} failed verification: "
                                 + "; ".join(v["problems"]), problems=v["problems"])
    _depmod(host, kernel)
    initramfs = refresh_initramfs(host, kernel)
    progress(1.0, f"installed for {kernel}")
    return {"kernel": kernel, "dkms_version": ver, "driver": b["driver"], "build": b["status"],
            "selected": v["selected"], "verification": v, "stock": rec, "initramfs": initramfs,
            "host_files_written": written, "signing": b["signing"], "log": b.get("log")}


def _secure_boot(host: Host) -> dict:
    from spark_memsaver.observe.snapshot import observe_secure_boot
    try:
        return observe_secure_boot(host)
    except Exception as e:
        return {"state": "unknown", "reason": str(e)}


def install(host: Host, config, kernel: str | None = None, all_kernels: bool = False, progress=None) -> dict:
    """Build (if needed) and install the override; prove it is selected (modinfo -k K -n nvidia-uvm)."""
    _require_root(host)
    progress = progress or _noop
    with _locked(host):
        kernels, skipped = _target_kernels(host, config, kernel, all_kernels, for_remove=False)
        if not kernels:
            raise NothingToDo("no kernel qualifies for installation: "
                              + "; ".join(f"{s['kernel']}: {s['reason']}" for s in skipped))
        results = []
        for i, k in enumerate(kernels):
            results.append(_install_one(host, config, k, _scaled(progress, i / len(kernels), (i + 1) / len(kernels))))
        return {"installed": results, "skipped": skipped}


def restore_stock(host: Host, kernel: str) -> dict:
    """Make the stock nvidia-uvm the selected one for `kernel` again, whatever DKMS did; verify it."""
    rec = _read_json(host, _stock_record_path(kernel)) or {}
    actions = []
    # 1. Any copy of ours left at our install path (DKMS 3.0.x refused/partial runs) goes.
    for s in _SUFFIXES:
        p = host.path(installed_path(host, kernel, s))
        if p.is_file():
            if modules.read_file(host, installed_path(host, kernel, s))["state"] == "ours" \
                    and installed_version(host, kernel) is None:
                p.unlink()
                actions.append(f"removed leftover {installed_path(host, kernel, s)}")
    # 2. The stock file must be back where the driver package put it (DKMS >= 3.1 moves it to
    #    original_module/; 3.1.0-3.1.6 restore it to DEST_MODULE_LOCATION instead of its origin).
    stock_path, stock_sha = rec.get("stock_path"), rec.get("stock_sha256")
    cur_sha = sha256(host.path(stock_path)) if stock_path else None
    replaced = False
    if stock_path and stock_sha and cur_sha is not None and cur_sha != stock_sha and not _file_is_ours(host, stock_path):
        # Another stock file stands there now: a driver package replaced it since we recorded it (a driver
        # update, e.g. plain dpkg -i). It is the stock module of the installed driver. Putting the recorded
        # one back would pair the OLD driver's nvidia-uvm with the NEW nvidia.ko: never.
        replaced = True
        actions.append(f"kept {stock_path}: a driver package replaced the recorded stock file since")
    if stock_path and stock_sha and cur_sha != stock_sha and not replaced:
        cands = list(host.path(f"{DKMS_TREE}/{PACKAGE}/original_module/{kernel}").rglob(f"{MODULE}.ko*")) + \
            [host.path(installed_path(host, kernel, s)) for s in _SUFFIXES] + \
            list(host.path(STATE_DIR).glob(f"original/{kernel}/**/{MODULE}.ko*"))
        owner = rec.get("stock_owner_dkms")
        if owner and owner.get("copy"):
            cands.append(Path(owner["copy"]))
        for c in cands:
            if c.is_file() and sha256(c) == stock_sha:
                dst = host.path(stock_path)
                dst.parent.mkdir(parents=True, exist_ok=True)
                tmp = dst.with_name(f".{dst.name}.spark-memsaver-tmp")
                shutil.copy2(c, tmp)
                os.rename(tmp, dst)
                if c.parent != dst.parent and str(c).startswith(str(host.path(f"/lib/modules/{kernel}"))):
                    c.unlink()
                actions.append(f"restored {stock_path} from {c}")
                break
    _depmod(host, kernel)
    after = selected(host, kernel, MODULE)
    problems = []
    if after and after.get("ours"):
        problems.append(f"our module {after['path']} is still selected")
    if stock_path and stock_sha:
        if after is None or after.get("path") != stock_path or (after.get("sha256") != stock_sha and not replaced):
            problems.append(f"the stock {stock_path} is not the selected {MODULE} "
                            f"(selected: {after and after.get('path')})")
    return {"kernel": kernel, "selected": after and after.get("path"), "actions": actions,
            "ok": not problems, "problems": problems, "stock": rec}


def _file_is_ours(host: Host, path: str) -> bool:
    """Whether the module file at ``path`` is our patched nvidia-uvm (observe/modules.py's test)."""
    return modules.is_ours_file(host, path)


def _backup_originals(host: Host, kernel: str) -> None:
    src = host.path(f"{DKMS_TREE}/{PACKAGE}/original_module/{kernel}")
    if src.is_dir():
        dst = host.path(f"{STATE_DIR}/original/{kernel}")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)


def remove(host: Host, config, kernel: str | None = None, all_kernels: bool = False, progress=None) -> dict:
    """Uninstall and unregister our module for the kernel(s); restore and VERIFY the stock module."""
    _require_root(host)
    progress = progress or _noop
    with _locked(host):
        dkms_version(host)
        recovered = recover_broken(host, config)
        kernels, _ = _target_kernels(host, config, kernel, all_kernels, for_remove=True)
        if kernel and not any(kernel in kernels_of(host, v) or installed_version(host, kernel)
                              for v in registered_versions(host)) \
                and not _read_json(host, _stock_record_path(kernel)):
            res = restore_stock(host, kernel)
            if not res["ok"]:
                raise StockNotRestored("; ".join(res["problems"]), kernel=kernel)
            return {"removed": [], "restored": [res], "recovered": recovered, "registrations_left": registered_versions(host)}
        done, restored = [], []
        for i, k in enumerate(kernels):
            progress(i / max(1, len(kernels)), f"removing from {k}")
            for ver in registered_versions(host):
                if installed_version(host, k) == ver:
                    _uninstall_kernel(host, ver, k)
                    done.append({"kernel": k, "dkms_version": ver, "action": "uninstalled"})
                if k in kernels_of(host, ver):
                    _unbuild(host, ver, k)
                    done.append({"kernel": k, "dkms_version": ver, "action": "unbuilt"})
            res = restore_stock(host, k)
            restored.append(res)
            if not res["ok"]:
                raise StockNotRestored(f"after removing our module from {k}: " + "; ".join(res["problems"]),
                                       kernel=k, actions=res["actions"])
            res["initramfs"] = refresh_initramfs(host, k)
            host.path(_stock_record_path(k)).unlink(missing_ok=True)
            shutil.rmtree(host.path(f"{STATE_DIR}/original/{k}"), ignore_errors=True)
        for ver in registered_versions(host):
            _drop_if_empty(host, ver)
        progress(1.0, "removed")
        return {"removed": done, "restored": restored, "recovered": recovered,
                "registrations_left": registered_versions(host)}

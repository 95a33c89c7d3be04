"""What the DKMS engines share: the dkms data dir and kotool, the one dkms/depmod/initramfs runners, the kernel
policy check before a build, the driver source lookup, record I/O (through host/fsutil.atomic_write)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from pathlib import Path

from spark_memsaver.errors import NotPermitted
from spark_memsaver.host import Host, datadir
from spark_memsaver.host import fsutil
from spark_memsaver.host.fsutil import sha256_file
from spark_memsaver.observe import modules
from spark_memsaver.observe.dkms import DEPMOD_FILE, DKMS_TREE, FORCE_FILE, PACKAGE, SRC_ROOT, _SUFFIXES, built_module, installed_version
from spark_memsaver.act.dkms_errors import DKMS_EXIT_ERRORS, DkmsConfInvalid, DkmsError, DkmsMissing, DriverSourceCorrupt, DriverSourceMissing, HeadersMissing
from spark_memsaver.host import paths


log = logging.getLogger("spark_memsaver.act.dkms")


PATCH_ID = modules.PATCH_ID


STATE_DIR = paths.DKMS_STATE   # host/paths.py is the one list


LOG_DIR = paths.LOG_DIR   # host/paths.py is the one list




BUILD_TIMEOUT = 3600


NICE = "5"


def data_dir() -> Path:
    """dkms/ (host/datadir.py finds it); DkmsConfInvalid when it is missing."""
    try:
        return datadir.dkms_dir()
    except datadir.DataMissing as e:
        raise DkmsConfInvalid(e.message) from None


kotool = datadir.kotool     # dkms/spark-memsaver-kotool as a module (host/datadir.py loads it once)


sha256 = sha256_file   # one implementation (host/fsutil.py)


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


def dkms_present(host: Host) -> bool:
    """The dkms program is there to run (found on PATH, or $SPARK_MEMSAVER_DKMS executable); nothing is run."""
    return bool(host.runner.which(dkms_cmd()) if "/" not in dkms_cmd() else os.access(dkms_cmd(), os.X_OK))


def dkms_version(host: Host) -> str:
    if not dkms_present(host):
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
    verified stock file: verification compares paths and digests). Whether it is ours: decide/ours.py, on this
    dict."""
    return shape(modules.read_selected(host, kernel, name, digest=digest))


def shape(sel: dict) -> dict | None:
    """:func:`selected`'s view of an observe/modules answer (a world/refresh.kernel's "uvm" or "nvidia")."""
    if sel["state"] in ("none", "builtin", "unreadable"):
        return None
    return {"path": sel["path"], "version": sel.get("version"), "srcversion": sel.get("srcversion"),
            "vermagic": (sel.get("vermagic") or "").split(" ")[0], "patch_id": sel.get("patch_id"),
            "state": sel["state"], "patched": sel.get("patched"), "sha256": sel.get("sha256")}


def kernel_config(host: Host, kernel: str) -> dict:
    from spark_memsaver.observe.snapshot import kernel_config as kc
    return kc(host, kernel)


from spark_memsaver.world.tree import complete_source, source_candidates, tree_problem  # noqa: E402,F401  (the one tree)


def find_driver_source(host: Host, driver: str) -> str:
    """The first complete candidate (a leftover incomplete /usr/src/nvidia-<v> never hides a complete fetched
    tree); DriverSourceCorrupt naming the first incomplete one if none is; DriverSourceMissing if none exists."""
    found = [c for c in source_candidates(driver) if host.path(c).is_dir()]
    if not found:
        from spark_memsaver.decide.sources import search_packages   # the one package rule, per branch
        raise DriverSourceMissing(f"the NVIDIA {driver} open kernel-module source is not installed "
                                  f"(looked for {', '.join(source_candidates(driver))})", driver=driver,
                                  remedy=("'spark-memsaver status' names the exact package and version; to look "
                                          f"it up: 'apt-cache policy {' '.join(search_packages(driver))}' (Ubuntu, "
                                          "NVIDIA's repository) or 'apt-cache policy nvidia-open-kernel-dkms' "
                                          f"(Debian), and install that package at the version it lists for {driver}."))
    problems = [(c, tree_problem(host, c, driver)) for c in found]
    good = next((c for c, why in problems if why is None), None)
    if good is None:
        raise DriverSourceCorrupt(problems[0][1], source=problems[0][0])
    return good


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
                        remedy=f"Check /lib/modules/{kernel} and run 'sudo depmod -a {kernel}' by hand.")


def refresh_initramfs(host: Host, kernel: str) -> str:
    """update-initramfs -u -k K when the host uses initramfs-tools and K has an initramfs."""
    if not host.is_live:
        return "skipped (not the live system)"
    if not host.runner.which("update-initramfs") or not host.exists(f"/boot/initrd.img-{kernel}"):
        return "not used"
    r = host.run(["update-initramfs", "-u", "-k", kernel], timeout=900)
    if not r.ok:
        raise DkmsError(f"update-initramfs -u -k {kernel} failed: {r.stderr.strip()[-500:]}",
                        remedy=f"Run 'sudo update-initramfs -u -k {kernel}' by hand and read its output.")
    return "refreshed"


def _write_json(host: Host, path: str, doc: dict) -> None:
    """A record (the stock record the guard reads too) through the one atomic writer (fsync, unique temp)."""
    p = host.path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fsutil.atomic_write(p, json.dumps(doc, indent=2) + "\n", mode=0o644)


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


def _protect_foreign(host: Host, kernel: str, ours_digest: str | None):
    """Files at our install path that are not ours (another DKMS package's): move aside, return restorer."""
    moved = []
    for s in _SUFFIXES:
        p = host.path(paths.dkms_installed(kernel, s))
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


def _origin_path(host: Host, kernel: str, recorded: str) -> Path | None:
    """The file a DKMS ``.origin`` record names, inside this host's /lib/modules/<kernel>, else None."""
    rec = Path(recorded.strip())
    for base in (host.path(f"/lib/modules/{kernel}"), host.path(f"/usr/lib/modules/{kernel}")):
        for cand in (rec, host.path(str(rec))):
            if str(cand).startswith(str(base) + "/"):
                return cand
    return None


def _protect_replaced_stock(host: Host, kernel: str):
    """DKMS >= 3.1.7 moves the stock file it replaces into original_module/ (with a ``.origin`` record) and on
    uninstall moves it back there with ``mv -f``: over a newer stock file that a driver package put there since
    (plain ``dpkg -i`` of a new driver, no APT door). That would pair the OLD driver's nvidia-uvm with the NEW
    nvidia.ko. Such a newer file is moved aside before the uninstall and put back over DKMS's copy after it
    (tests/FAULTS.md d4). DKMS 3.0.x keeps no .origin records: nothing to do there."""
    kept = []
    for origin in host.path(f"{DKMS_TREE}/{PACKAGE}/original_module/{kernel}").rglob("nvidia-uvm.ko*.origin"):
        archived = origin.with_name(origin.name[:-len(".origin")])
        try:
            target = _origin_path(host, kernel, origin.read_text().splitlines()[0])
        except (OSError, IndexError):
            continue
        if target is None or not target.is_file() or not archived.is_file() or sha256(target) == sha256(archived):
            continue
        aside = target.with_name(f".{target.name}.spark-memsaver-newer")
        os.rename(target, aside)
        kept.append((aside, target))
        log.info("%s is newer than DKMS's archived original: kept aside during the uninstall", target)

    def restore():
        for aside, target in kept:
            os.replace(aside, target)
    return restore


def _uninstall_kernel(host: Host, ver: str, kernel: str, built=...) -> None:
    """``built``: DKMS's built module of ``ver`` for ``kernel`` as the operation read it (None: none), else read."""
    _backup_originals(host, kernel)  # DKMS 3.0.x deletes original_module/ on uninstall without restoring it
    if built is ...:
        built = built_module(host, ver, kernel)
    restore = _protect_foreign(host, kernel, sha256(built) if built else None)
    keep_newer = _protect_replaced_stock(host, kernel)
    try:
        r = _dkms(host, ["uninstall", "-m", PACKAGE, "-v", ver, "-k", kernel], timeout=600)
    finally:
        keep_newer()
        restore()
    if not r.ok and installed_version(host, kernel) == ver:
        _raise_for_dkms(r, f"dkms uninstall {PACKAGE}/{ver} -k {kernel}")


def _backup_originals(host: Host, kernel: str) -> None:
    src = host.path(f"{DKMS_TREE}/{PACKAGE}/original_module/{kernel}")
    if src.is_dir():
        dst = host.path(paths.stock_original(kernel))
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)

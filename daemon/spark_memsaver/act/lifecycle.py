"""Lifecycle: execute reconcile plans, roll back on driver changes, activate, recover interrupted work.

Decisions are made in reconcile.py (pure); this module performs them through dkms.py, wrapping every
multi-step operation in an intent record (intents.py) so an interruption is finished or undone at the
next start. Entry points (each returns a JSON-able dict of what was done):

  reconcile(host, config)          daemon start, events, `spark-memsaver reconcile`, dpkg trigger, apt post
  rollback(host, config, reason=)  `spark-memsaver rollback`: take our module away, record why
  activate(host, config)           `spark-memsaver activate`: swap the loaded stock UVM for ours
  apt_pre_install(host, config, text)   APT's DPkg::Pre-Install-Pkgs hook (before dpkg unpacks)

All of them serialize on one lock (/run/spark-memsaver/lifecycle.lock), so the daemon, the APT hooks
and the CLI never act at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import sys
import time

from spark_memsaver.host import intents
from spark_memsaver.observe import snapshot as observe
from spark_memsaver.decide import plan as rc
from spark_memsaver.config import Config
from spark_memsaver.errors import EXIT_FAILED, Busy, MemsaverError, SafetyRefusal
from spark_memsaver.host import Host

log = logging.getLogger("spark_memsaver.act.lifecycle")

LOCK = "/run/spark-memsaver/lifecycle.lock"
STOCK_DIR = "/var/lib/spark-memsaver/stock"
UVM_DEVICE = "/dev/nvidia-uvm"


class ActivationRefused(SafetyRefusal):
    code = "activation-refused"
    remedy = "Run 'spark-memsaver status' to see what is selected and loaded."


class ActivationFailed(MemsaverError):
    code = "activation-failed"
    exit_code = EXIT_FAILED
    remedy = ("The guard loads a safe nvidia-uvm on the next 'modprobe nvidia_uvm' or at boot; "
              "run 'spark-memsaver status' and the kernel log (journalctl -k) for the reason.")


class StepFailed(MemsaverError):
    code = "reconcile-step-failed"
    exit_code = EXIT_FAILED
    remedy = "Run 'spark-memsaver status'; the stock module stays selected until the cause is fixed."


# --- plumbing ------------------------------------------------------------------------------------

def _say(progress, msg: str) -> None:
    """progress follows the jobs contract: progress(fraction, message); progress(message) is accepted."""
    log.info("%s", msg)
    if progress is not None:
        with contextlib.suppress(Exception):
            progress(msg)


def _fwd(progress):
    """A progress callable for dkms.py (which calls progress(fraction, message))."""
    if progress is None:
        return None

    def f(*args, **kw):
        with contextlib.suppress(Exception):
            progress(*args, **kw)
    return f


@contextlib.contextmanager
def locked(host: Host, wait: float = 3600.0, progress=None):
    """Serialize lifecycle operations across processes (daemon, hooks, CLI)."""
    p = host.path(LOCK)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    fh = open(p, "a+")
    deadline = time.monotonic() + wait
    told = False
    try:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise Busy("another spark-memsaver operation holds the lifecycle lock")
                if not told:
                    _say(progress, "waiting for another spark-memsaver operation to finish")
                    told = True
                time.sleep(0.2)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


def _dkms():
    from spark_memsaver.act import dkms  # the DKMS engineer's module; imported late so pure paths work without it
    return dkms


def support_for(versions) -> dict:
    """Manifest verdict per driver version: {version: {"supported": bool, "reason": str}}."""
    out = {}
    try:
        from spark_memsaver.act import patch as uvm_patch
        manifest = uvm_patch.load_manifest()
    except Exception as e:  # no manifest = nothing supported, with the reason
        return {v: {"supported": False, "reason": f"patch manifest unavailable: {e}"} for v in versions if v}
    for v in versions:
        if not v:
            continue
        try:
            sel = uvm_patch.select(manifest, v)
        except Exception as e:
            sel, err = None, e
        else:
            err = None
        if sel is None:
            out[v] = {"supported": False, "reason": f"NVIDIA driver {v} is not in this release's patch manifest"
                      + (f" ({err})" if err else "")}
        else:
            out[v] = {"supported": True, "branch": sel.branch, "qualification": sel.qualification}
    return out


def _versions_in(snap: dict) -> set[str]:
    vs = {rc.base_version((k.get("nvidia_selected") or {}).get("version")) for k in snap.get("kernels", [])}
    vs |= {s.get("version") for s in (snap.get("driver") or {}).get("sources", [])}
    return {v for v in vs if v}


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a recycled pid: only count it if it is one of ours
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
    except OSError:
        return False
    return b"spark-memsaver" in cmd or b"spark_memsaver" in cmd


DPKG_LOCKS = ("/var/lib/dpkg/lock-frontend", "/var/lib/dpkg/lock")


def dpkg_running(host: Host) -> int | None:
    """pid of a dpkg/apt holding the dpkg lock (F_GETLK: tests without taking it), else None."""
    import struct
    for lock in DPKG_LOCKS:
        try:
            fd = os.open(host.path(lock), os.O_RDONLY)
        except OSError:
            continue
        try:
            req = struct.pack("@hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0)
            res = fcntl.fcntl(fd, fcntl.F_GETLK, req)
            ltype, _, _, _, pid = struct.unpack("@hhqqi", res)
            if ltype != fcntl.F_UNLCK:
                return pid
        except OSError:
            continue
        finally:
            os.close(fd)
    return None


def _kernel(snap: dict, release: str) -> dict | None:
    return next((k for k in snap.get("kernels", []) if k["release"] == release), None)


# --- stock module record (read by the guard) -------------------------------------------------------

def record_stock(host: Host, kernel: str, snap: dict | None = None) -> str | None:
    """Remember which stock nvidia-uvm file depmod selected for ``kernel`` before our override existed."""
    info = observe.describe_module(observe.module_info(host, kernel, "nvidia_uvm"))
    if not info or not info.get("path") or info.get("patched"):
        return None
    intents.atomic_write(host.path(f"{STOCK_DIR}/{kernel}"), info["path"] + "\n")
    return info["path"]


# --- executing plans ---------------------------------------------------------------------------

def _remove(host: Host, config: Config, kernel: str | None, progress) -> dict:
    d = _dkms()
    if kernel is None:
        return d.remove(host, config, all_kernels=True, progress=_fwd(progress)) or {}
    return d.remove(host, config, kernel=kernel, progress=_fwd(progress)) or {}


def _still_ours(host: Host, kernel: str) -> bool:
    info = observe.describe_module(observe.module_info(host, kernel, "nvidia_uvm")) or {}
    return bool(info.get("patched"))


def _do_remove(host, config, step: rc.Step, progress, op="remove") -> dict:
    with intents.intent(host, op, step.kernel, reason=step.reason, driver_from=step.driver_from,
                        driver_to=step.driver_to):
        _say(progress, f"{step.kernel}: removing our nvidia-uvm ({step.reason})")
        res = _remove(host, config, step.kernel, progress)
        if step.kernel and _still_ours(host, step.kernel):
            raise StepFailed(f"kernel {step.kernel}: our nvidia-uvm is still selected after removal")
    return res


def _do_build_install(host, config, step: rc.Step, snap: dict, progress) -> dict:
    d = _dkms()
    k = step.kernel
    record_stock(host, k)
    try:
        with intents.intent(host, "build", k, driver_version=step.driver_to):
            _say(progress, f"{k}: building our nvidia-uvm for driver {step.driver_to}")
            d.build(host, config, kernel=k, driver_version=step.driver_to, progress=_fwd(progress))
    except MemsaverError as e:
        with contextlib.suppress(Exception):
            _remove(host, config, k, progress)  # leave nothing half-built behind
        intents.clear_intent(host, intents.intent_id("build", k))
        code = "patch-failed" if "patch" in type(e).__name__.lower() else "build-failed"
        rec = intents.write_rollback(host, k, f"building for driver {step.driver_to} failed: {e.message}",
                                     remedy=e.remedy or "", code=code, driver_from=step.driver_from,
                                     driver_to=step.driver_to)
        return {"ok": False, "error": e.to_dict(), "rollback": _public(rec)}
    try:
        with intents.intent(host, "install", k, driver_version=step.driver_to):
            _say(progress, f"{k}: installing our nvidia-uvm for driver {step.driver_to}")
            d.install(host, config, kernel=k, progress=_fwd(progress))
            info = observe.describe_module(observe.module_info(host, k, "nvidia_uvm")) or {}
            nv = rc.base_version((observe.describe_module(observe.module_info(host, k, "nvidia")) or {})
                                 .get("version"))
            if not info.get("patched") or rc.base_version(info.get("version")) != nv:
                raise StepFailed(f"kernel {k}: after install the selected nvidia-uvm is "
                                 f"{info.get('path')} ({info.get('version')}), not ours for {nv}")
    except MemsaverError as e:
        with contextlib.suppress(Exception):
            _remove(host, config, k, progress)
        intents.clear_intent(host, intents.intent_id("install", k))
        rec = intents.write_rollback(host, k, f"installing for driver {step.driver_to} failed: {e.message}",
                                     remedy=e.remedy or "", code="install-failed",
                                     driver_from=step.driver_from, driver_to=step.driver_to)
        return {"ok": False, "error": e.to_dict(), "rollback": _public(rec)}
    if intents.clear_rollback(host, k):
        _say(progress, f"{k}: the patched module is back; rollback record cleared")
    for op in ("build", "install", "remove", "rollback", "register"):
        # an older interruption for this kernel whose undo failed is moot now: state is verified good
        intents.clear_intent(host, intents.intent_id(op, k))
    return {"ok": True, "selected": info.get("path"), "version": info.get("version"),
            "signer": info.get("signer"), "srcversion": info.get("srcversion")}


def _public(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.startswith("_")}


def _reload_uvm(host: Host, progress) -> dict:
    """Unload nvidia_uvm if nobody uses it, then load it through the guard (which picks a safe file)."""
    if not host.is_live:
        return {"ok": False, "skipped": "not the running system"}
    holders = observe.uvm_holders(host)
    if holders:
        return {"ok": False, "holders": holders, "skipped": "in use; happens at next boot"}
    if host.exists("/sys/module/nvidia_uvm"):
        r = host.run(["modprobe", "-r", "nvidia_uvm"], timeout=60)
        if not r.ok:
            return {"ok": False, "error": (r.stderr or r.stdout).strip()}
    if host.exists("/sys/module/nvidia"):
        r = host.run(["modprobe", "nvidia_uvm"], timeout=120)
        return {"ok": r.ok, "output": (r.stderr or r.stdout).strip()[-500:]}
    return {"ok": True, "skipped": "nvidia is not loaded"}


def execute(host: Host, config: Config, steps: list[rc.Step], snap: dict, progress=None) -> list[dict]:
    done = []
    for s in steps:
        entry = s.to_dict()
        try:
            if s.action == "drop-record":
                intents.drop_unreadable(host, s.path)
            elif s.action == "clear-intent":
                intents.clear_intent(host, s.intent)
            elif s.action in ("undo-intent", "finish-intent"):
                res = _remove(host, config, s.kernel, progress) if s.kernel else {}
                if s.kernel and _still_ours(host, s.kernel) and s.action == "finish-intent":
                    raise StepFailed(f"kernel {s.kernel}: our nvidia-uvm is still selected")
                if s.action == "finish-intent" and s.kernel and s.driver_from and s.driver_from != s.driver_to:
                    intents.write_rollback(host, s.kernel, s.reason, code=s.code or "stock-selected",
                                           remedy=s.remedy, driver_from=s.driver_from, driver_to=s.driver_to)
                intents.clear_intent(host, s.intent)
                entry["result"] = res if isinstance(res, dict) else {}
            elif s.action == "remove-override":
                entry["result"] = _do_remove(host, config, s, progress)
            elif s.action == "record-rollback":
                intents.write_rollback(host, s.kernel, s.reason, remedy=s.remedy, code=s.code or "stock-selected",
                                       driver_from=s.driver_from, driver_to=s.driver_to)
                _say(progress, f"{s.kernel}: rolled back to stock: {s.reason}")
            elif s.action == "clear-rollback":
                intents.clear_rollback(host, s.kernel)
            elif s.action == "build-install":
                entry["result"] = _do_build_install(host, config, s, snap, progress)
                entry["ok"] = entry["result"].get("ok", False)
            elif s.action == "reload-uvm":
                entry["result"] = _reload_uvm(host, progress)
                if s.intent:
                    intents.clear_intent(host, s.intent)
            entry.setdefault("ok", True)
        except MemsaverError as e:
            entry["ok"] = False
            entry["error"] = e.to_dict()
            _say(progress, f"{s.action} {s.kernel or ''}: {e.message}")
        done.append(entry)
        if s.action in rc.ACTING:
            intents.append_history(host, {"event": s.action, "time": intents.now(), "kernel": s.kernel,
                                          "reason": s.reason, "ok": entry.get("ok")})
    return done


# --- entry points ------------------------------------------------------------------------------

def reconcile(host: Host, config: Config, progress=None, *, kernels: list[str] | None = None,
              rebuild: bool | None = None, dry_run: bool = False, inside_dpkg: bool = False) -> dict:
    """Bring every kernel to a safe state and rebuild where supported. Idempotent.

    While dpkg runs (and we are not its trigger), only safety steps are taken: the package set is in
    flux, and our dpkg trigger reconciles fully when dpkg has finished."""
    deferred = None
    if not inside_dpkg and not dry_run and host.is_live and rebuild is not False:
        pid = dpkg_running(host)
        if pid:
            rebuild, deferred = False, f"dpkg (pid {pid}) is running: rebuilds wait for its trigger"
            _say(progress, deferred)
    with (contextlib.nullcontext() if dry_run else locked(host, progress=progress)):
        snap = observe.snapshot(host)
        alive = {r.get("pid") for r in snap["records"]["intents"] if _alive(r.get("pid"))}
        support = support_for(_versions_in(snap))
        steps = rc.plan(snap, config, support, alive_pids=alive, kernels=kernels, rebuild=rebuild)
        if dry_run:
            return {"dry_run": True, "support": support, **rc.summarize(steps)}
        results = execute(host, config, steps, snap, progress)
    ok = all(r.get("ok", True) for r in results)
    doc = {"ok": ok, "acting": sum(1 for s in steps if s.action in rc.ACTING), "steps": results,
           "support": support}
    if deferred:
        doc["deferred"] = deferred
    return doc


def rollback(host: Host, config: Config, reason: str = "requested by the administrator", progress=None, *,
             kernel: str | None = None, code: str = "requested", remedy: str = "") -> dict:
    """Take our module away from ``kernel`` (default: every kernel where it is selected) and record why."""
    with locked(host, progress=progress):
        snap = observe.snapshot(host)
        targets = [k for k in snap["kernels"] if (kernel is None or k["release"] == kernel)
                   and ((k.get("uvm_selected") or {}).get("patched")
                        or any(b.get("kernel") == k["release"] and b.get("installed")
                               for r in snap["dkms"]["registrations"] for b in r["builds"]))]
        if kernel is not None and not _kernel(snap, kernel):
            raise rc_error_unknown_kernel(kernel)
        done = []
        for k in targets:
            rel = k["release"]
            sel = k.get("uvm_selected") or {}
            step = rc.Step("remove-override", rel, reason, driver_from=rc.base_version(sel.get("version")),
                           driver_to=rc.base_version((k.get("nvidia_selected") or {}).get("version")))
            try:
                with intents.intent(host, "rollback", rel, reason=reason, code=code, remedy=remedy,
                                    driver_from=step.driver_from, driver_to=step.driver_to):
                    _remove(host, config, rel, progress)
                    if _still_ours(host, rel):
                        raise StepFailed(f"kernel {rel}: our nvidia-uvm is still selected after removal")
                    intents.write_rollback(host, rel, reason, remedy=remedy, code=code,
                                           driver_from=step.driver_from, driver_to=step.driver_to)
                done.append({"kernel": rel, "ok": True})
            except MemsaverError as e:
                done.append({"kernel": rel, "ok": False, "error": e.to_dict()})
        reload = None
        uvm = snap["uvm"]
        if uvm.get("loaded") and uvm.get("patched") and host.is_live:
            reload = _reload_uvm(host, progress)
    return {"ok": all(d["ok"] for d in done), "kernels": done, "reason": reason, "reload": reload,
            "nothing_to_do": not targets}


def rc_error_unknown_kernel(kernel: str) -> MemsaverError:
    from spark_memsaver.errors import UsageError
    return UsageError(f"kernel {kernel} is not installed (no /lib/modules/{kernel})",
                      remedy="List kernels with 'spark-memsaver status'.")


def activate(host: Host, config: Config, progress=None, *, uvm_device: str = UVM_DEVICE,
             proc_host: Host | None = None, dry_run: bool = False) -> dict:
    """Load our installed module in place of the loaded stock one, if nothing uses /dev/nvidia-uvm."""
    snap = observe.snapshot(host)
    rel = snap["host"]["kernel"]
    k = _kernel(snap, rel) or {}
    sel = k.get("uvm_selected") or {}
    if not sel.get("patched"):
        raise ActivationRefused(f"our nvidia-uvm is not selected for the running kernel {rel} "
                                f"(selected: {sel.get('path') or 'none'})",
                                remedy="Run 'spark-memsaver install' (or 'reconcile') first.")
    drv = rc.base_version(sel.get("version"))
    loaded_nv = rc.base_version(snap["driver"].get("loaded_version"))
    disk_nv = rc.base_version((k.get("nvidia_selected") or {}).get("version"))
    if loaded_nv and loaded_nv != drv:
        raise ActivationRefused(f"the loaded nvidia is {loaded_nv} but our nvidia-uvm is built for {drv}",
                                remedy="Reboot into the installed driver first (nvidia.ko on disk is "
                                f"{disk_nv or 'unknown'}), then run 'spark-memsaver reconcile'.")
    uvm = snap["uvm"]
    if uvm.get("loaded") and uvm.get("srcversion") and uvm.get("srcversion") == sel.get("srcversion"):
        return {"activated": True, "already": True, "srcversion": uvm["srcversion"], "path": sel.get("path")}
    holders = observe.uvm_holders(proc_host or host, uvm_device)
    if holders:
        names = ", ".join(f"{h['comm']}[{h['pid']}]" for h in holders)
        return {"activated": False, "at_next_boot": True, "holders": holders,
                "message": f"{uvm_device} is in use by {names}; our module is selected and will be loaded at "
                           "next boot (or run 'spark-memsaver activate' again after those processes exit)."}
    cmds = []
    if uvm.get("loaded"):
        cmds.append(["modprobe", "-r", "nvidia_uvm"])
    cmds.append(["modprobe", "nvidia_uvm"])
    if dry_run or not host.is_live:
        return {"activated": False, "dry_run": True, "would_run": cmds, "expect_srcversion": sel.get("srcversion")}
    with locked(host, progress=progress), intents.intent(host, "activate", rel, srcversion=sel.get("srcversion")):
        for argv in cmds:
            _say(progress, "running " + " ".join(argv))
            r = host.run(argv, timeout=120)
            if not r.ok:
                raise ActivationFailed(f"'{' '.join(argv)}' failed: {(r.stderr or r.stdout).strip()[-300:]}")
        loaded = (host.read_text("/sys/module/nvidia_uvm/srcversion") or "").strip()
        if loaded != sel.get("srcversion"):
            raise ActivationFailed(f"after loading, /sys/module/nvidia_uvm/srcversion is {loaded or 'absent'}, "
                                   f"not {sel.get('srcversion')} of {sel.get('path')}")
    return {"activated": True, "srcversion": loaded, "path": sel.get("path")}


def apt_pre_install(host: Host, config: Config, text: str, progress=None) -> dict:
    """DPkg::Pre-Install-Pkgs: remove our override before dpkg unpacks a different NVIDIA driver."""
    actions = rc.parse_apt_hook(text)
    changes = rc.driver_changes(actions)
    if not changes:
        return {"ok": True, "changes": [], "steps": []}
    with locked(host, progress=progress):
        snap = observe.snapshot(host)
        steps = rc.pre_install_plan(snap, changes)
        results = execute(host, config, steps, snap, progress)
        # what the system looked like when we acted: proves the removal came before dpkg unpacked
        intents.append_history(host, {"event": "apt-pre-install", "time": intents.now(),
                                      "packages": [f"{c['name']} {c['old'] or '-'} -> {c['new'] or '-'}"
                                                   for c in changes],
                                      "sources_seen": sorted(s["version"] for s in snap["driver"]["sources"]),
                                      "removed": [s.kernel for s, r in zip(steps, results) if r.get("ok")]})
        for s, r in zip(steps, results):
            if r.get("ok"):
                # say why in status even if the post step never runs (e.g. the upgrade is aborted)
                intents.write_rollback(host, s.kernel, s.reason, code="driver-changing",
                                       remedy="spark-memsaver rebuilds for the new driver after the upgrade "
                                       "when it is supported.", driver_from=s.driver_from, driver_to=s.driver_to)
    return {"ok": all(r.get("ok") for r in results), "changes": changes, "steps": results}

"""The ONE entry for every module mutation: plan -> lock("lifecycle") -> intent -> act -> verify -> record.

    perform(op, host, config, *, progress=None, **args) -> dict

op            args                                               callers
"build"       kernel, driver_version (or driver), force           D-Bus Build, root `spark-memsaver build`
"install"     kernel, all_kernels                                 D-Bus Install, root `install`
"remove"      kernel, all_kernels                                 D-Bus Remove, root `remove`
"activate"    dry_run, uvm_device, proc_host                      D-Bus Activate, root `activate`
"rollback"    kernel, reason, code, remedy                        D-Bus Rollback, root `rollback`
"reconcile"   kernels, rebuild, dry_run, inside_dpkg              daemon start/events, dpkg/kernel hooks, CLI
"apt-pre-install"  text (APT's Pre-Install-Pkgs v3 list)          the APT door (systemd/apt/)

Every op but a dry run holds the "lifecycle" lock (bounded wait; :class:`LockTimeout` names the holder);
build/install/remove write an intent record before the engine runs, so a kill midway is finished or
undone by the next perform (every op first recovers what an earlier one left, see :func:`recover`).
The result is a JSON-able dict; it carries ``record_problems`` (and ``findings``) when a record could
not be written -- a removal toward stock goes on without its record (defect 4).

Engines (act/dkms.py) take no lock and write no intent of their own; nothing here talks to D-Bus:
the CLI decides whether to call this (root, --root) or the daemon (cli/client.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time

from spark_memsaver.act import records_io as rio
from spark_memsaver.act import steps as st
from spark_memsaver.config import Config
from spark_memsaver.decide import plan as rc
from spark_memsaver.errors import Busy, UsageError
from spark_memsaver.host import Host, intents
from spark_memsaver.observe import snapshot as observe

OPS = ("build", "install", "remove", "activate", "rollback", "reconcile", "apt-pre-install")
LOCK = "/run/spark-memsaver/lifecycle.lock"
LOCK_WAIT = 1800.0      # a build of nvidia-uvm takes minutes on 2 cores: wait for it, but never forever


class LockTimeout(Busy):
    code = "lock-timeout"
    remedy = ("Another spark-memsaver operation holds the lifecycle lock; wait for it (spark-memsaver status "
              "shows it) or stop the process named above if it is stuck.")


# --- the lock ----------------------------------------------------------------------------------

def _holder(fh) -> str:
    with contextlib.suppress(OSError, ValueError):
        fh.seek(0)
        return fh.read(200).strip()
    return ""


@contextlib.contextmanager
def locked(host: Host, wait: float = LOCK_WAIT, progress=None, purpose: str = "spark-memsaver"):
    """Serialize every module mutation across processes (daemon, hooks, CLI). host/locks.py replaces the
    file handling when it lands; the name, the bounded wait and the named error stay."""
    p = host.path(LOCK)
    os.makedirs(os.path.dirname(p), mode=0o700, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fh = os.fdopen(fd, "r+")
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
                    who = _holder(fh)
                    raise LockTimeout("another spark-memsaver operation holds the lifecycle lock"
                                      + (f" ({who})" if who else "") + f"; waited {wait:.0f} s")
                if not told:
                    st.say(progress, "waiting for another spark-memsaver operation to finish")
                    told = True
                time.sleep(0.2)
        with contextlib.suppress(OSError):
            fh.seek(0)
            fh.truncate()
            fh.write(f"pid {os.getpid()}: {purpose}\n")
            fh.flush()
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


# --- observation for the planner ----------------------------------------------------------------

def alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
    except OSError:
        return False
    return b"spark-memsaver" in cmd or b"spark_memsaver" in cmd


def observe_for_plan(host: Host) -> dict:
    """The snapshot plus what the planner needs that the snapshot does not carry yet: each kernel's
    policy facts (decide/policy.py) and the build records (what the installed builds were made with)."""
    from spark_memsaver.decide import policy
    snap = observe.snapshot(host)
    for k in snap.get("kernels", []):
        if "kconfig" not in k:
            k.update(policy.kernel_facts(observe.kernel_config(host, k["release"])))
    recs = snap.setdefault("records", {})
    if "builds" not in recs:
        builds = {b["kernel"]: b for b in rio.read_builds(host)}
        for k in snap.get("kernels", []):
            sel = k.get("uvm_selected") or {}
            if sel.get("patched") and k["release"] not in builds:
                meta = rio.dkms_meta(host, rc.base_version(sel.get("version")))
                if meta:
                    builds[k["release"]] = {"kernel": k["release"], **meta}
        recs["builds"] = list(builds.values())
    return snap


def _versions_in(snap: dict) -> set[str]:
    vs = {rc.base_version((k.get("nvidia_selected") or {}).get("version")) for k in snap.get("kernels", [])}
    vs |= {s.get("version") for s in (snap.get("driver") or {}).get("sources", [])}
    return {v for v in vs if v}


def plan_now(host: Host, config: Config, **kw) -> tuple[dict, dict, list]:
    snap = observe_for_plan(host)
    live = {r.get("pid") for r in snap["records"].get("intents", []) if alive(r.get("pid"))}
    support = st.support_for(_versions_in(snap))
    return snap, support, rc.plan(snap, config, support, alive_pids=live, **kw)


def recover(host: Host, config: Config, progress, problems: list) -> list[dict]:
    """Finish or undo what an interrupted operation left (its intent record), before acting anew."""
    snap, support, steps = plan_now(host, config, rebuild=False)
    todo = [s for s in steps if s.action in ("undo-intent", "finish-intent", "clear-intent", "drop-record",
                                             "reload-uvm") and (s.intent or s.path)]
    return st.execute(host, config, todo, snap, progress, problems) if todo else []


# --- the ops -----------------------------------------------------------------------------------

def _target(host: Host, kernel: str | None) -> str:
    if kernel:
        if not host.path(f"/lib/modules/{kernel}").is_dir():
            raise UsageError(f"kernel {kernel} is not installed (no /lib/modules/{kernel})",
                             remedy="List kernels with 'spark-memsaver status'.")
        return kernel
    return st.dkms().running_kernel(host)


def _build(host, config, progress, problems, kernel=None, driver_version=None, driver=None, force=False):
    k = _target(host, kernel)
    dv = driver_version or driver
    with rio.safe_intent(host, "build", k, removal=False, problems=problems, driver_version=dv):
        return st.dkms().build(host, config, kernel=k, driver_version=dv, progress=st.fwd(progress), force=force)


def _install(host, config, progress, problems, kernel=None, all_kernels=False):
    k = None if all_kernels else _target(host, kernel)
    with rio.safe_intent(host, "install", k, removal=False, problems=problems):
        doc = st.dkms().install(host, config, kernel=k, all_kernels=all_kernels, progress=st.fwd(progress))
        for r in doc.get("installed", []):
            ok, info, nv = st.ours_matches(host, r["kernel"])
            if not ok:
                raise st.StepFailed(f"kernel {r['kernel']}: after install the selected nvidia-uvm is "
                                    f"{info.get('path')} ({info.get('version')}), not ours for {nv}")
            st.installed(host, config, r["kernel"], info, problems, progress)
    return doc


def _remove(host, config, progress, problems, kernel=None, all_kernels=False):
    k = None if all_kernels else _target(host, kernel)
    with rio.safe_intent(host, "remove", k, removal=True, problems=problems, reason="requested"):
        doc = st.remove(host, config, k, progress)
        for r in doc.get("restored", []):
            if st.still_ours(host, r["kernel"]):
                raise st.StepFailed(f"kernel {r['kernel']}: our nvidia-uvm is still selected after removal")
            rio.clear_build(host, r["kernel"])
    return doc


def _reconcile(host, config, progress, problems, kernels=None, rebuild=None, dry_run=False, inside_dpkg=False,
               _deferred=None):
    snap, support, steps = plan_now(host, config, kernels=kernels, rebuild=rebuild)
    if dry_run:
        return {"dry_run": True, "support": support, **rc.summarize(steps)}
    results = st.execute(host, config, steps, snap, progress, problems)
    doc = {"ok": all(r.get("ok", True) for r in results),
           "acting": sum(1 for s in steps if s.action in rc.ACTING), "steps": results, "support": support}
    if _deferred:
        doc["deferred"] = _deferred
    return doc


def _apt_pre_install(host, config, chg: list[dict], progress, problems: list) -> dict:
    """APT's DPkg::Pre-Install-Pkgs door: remove our override before dpkg unpacks a different NVIDIA
    driver. The removals go on when no record can be written (defect 4): a failed record must never leave
    the override in place across a driver upgrade."""
    snap = observe.snapshot(host)
    steps = rc.pre_install_plan(snap, chg)
    results = st.execute(host, config, steps, snap, progress, problems)
    # what the system looked like when we acted: proves the removal came before dpkg unpacked
    intents.append_history(host, {"event": "apt-pre-install", "time": intents.now(),
                                  "packages": [f"{c['name']} {c['old'] or '-'} -> {c['new'] or '-'}" for c in chg],
                                  "sources_seen": sorted(s["version"] for s in snap["driver"]["sources"]),
                                  "removed": [s.kernel for s, r in zip(steps, results) if r.get("ok")]})
    for s, r in zip(steps, results):
        if r.get("ok"):
            # say why in status even if the post step never runs (e.g. the upgrade is aborted)
            rio.write_rollback(host, s.kernel, s.reason, problems, code="driver-changing",
                               remedy="spark-memsaver rebuilds for the new driver after the upgrade when it is "
                               "supported.", driver_from=s.driver_from, driver_to=s.driver_to)
    return {"ok": all(r.get("ok") for r in results), "changes": chg, "steps": results}


def perform(op: str, host: Host, config: Config, *, progress=None, lock_wait: float = LOCK_WAIT, **args) -> dict:
    """Do ``op`` (see the module docstring) and return what was done. Named errors on refusal/failure.
    Every finished operation but a dry run or a no-op becomes one event (host/events.py)."""
    if op not in OPS:
        raise UsageError(f"unknown operation {op!r} (one of: {', '.join(OPS)})")
    from spark_memsaver.host import events
    try:
        doc = _perform(op, host, config, progress=progress, lock_wait=lock_wait, **args)
    except Exception as e:
        events.record(host, op, args, error=e)
        raise
    if not doc.get("dry_run") and not args.get("dry_run") and (doc.get("steps") or op not in ("reconcile",
                                                                                              "apt-pre-install")):
        events.record(host, op, args, result=doc)
    return doc


def _perform(op: str, host: Host, config: Config, *, progress=None, lock_wait: float = LOCK_WAIT, **args) -> dict:
    from spark_memsaver.act import activate as act_activate, rollback as act_rollback
    problems: list = []
    if op == "reconcile":
        args = dict(args)
        if not args.get("inside_dpkg") and not args.get("dry_run") and host.is_live and args.get("rebuild") \
                is not False:
            pid = dpkg_running(host)
            if pid:
                args["rebuild"] = False
                args["_deferred"] = f"dpkg (pid {pid}) is running: rebuilds wait for its trigger"
                st.say(progress, args["_deferred"])
        if args.get("dry_run"):
            return _reconcile(host, config, progress, problems, **args)
    if op == "activate" and (args.get("dry_run") or not host.is_live):
        return act_activate.activate(host, config, progress, **args)
    if op == "apt-pre-install":
        changes = rc.driver_changes(rc.parse_apt_hook(args.get("text", "")))
        if not changes:
            return {"ok": True, "changes": [], "steps": []}
    with locked(host, wait=lock_wait, progress=progress, purpose=op):
        recovered = [] if op in ("reconcile",) else recover(host, config, progress, problems)
        if op == "build":
            doc = _build(host, config, progress, problems, **args)
        elif op == "install":
            doc = _install(host, config, progress, problems, **args)
        elif op == "remove":
            doc = _remove(host, config, progress, problems, **args)
        elif op == "reconcile":
            doc = _reconcile(host, config, progress, problems, **args)
        elif op == "rollback":
            doc = act_rollback.rollback(host, config, progress=progress, problems=problems, **args)
        elif op == "activate":
            doc = act_activate.activate(host, config, progress, **args)
        else:
            doc = _apt_pre_install(host, config, changes, progress, problems)
    if recovered:
        doc["recovered"] = recovered
    if problems:
        doc["record_problems"] = problems
        doc.setdefault("findings", []).extend(problems)
    return doc


# --- dpkg ----------------------------------------------------------------------------------------

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

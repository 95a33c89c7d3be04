"""The ONE entry for every module mutation: plan -> lock("lifecycle") -> intent -> act -> verify -> record.

    perform(op, host, config, *, progress=None, **args) -> dict

op            args                                               callers (opnames.py: the one list; TABLE below)
"build"       kernel, all_kernels, driver_version (or driver), force  D-Bus Build, root `spark-memsaver build`
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

Engines (act/build.py, act/override.py) take no lock and write no intent of their own; nothing here talks to D-Bus:
the CLI decides whether to call this (root, --root) or the daemon (cli/client.py).
"""

from __future__ import annotations

import contextlib
import os

from spark_memsaver.act import installable
from spark_memsaver.act import records_io as rio
from spark_memsaver.act import steps as st
from spark_memsaver import config as cfgmod
from spark_memsaver.config import Config
from spark_memsaver.decide import plan as rc
from spark_memsaver.errors import LockTimeout, NotPermitted, UsageError
from spark_memsaver.host import Host, holds, locks
from spark_memsaver.observe import snapshot as observe
from spark_memsaver import world
from spark_memsaver.act.recovery import intent_alive, plan_now, recovery_steps  # noqa: F401  (their names here too)

from spark_memsaver.opnames import EXECUTOR as OPS  # noqa: E402  (the one list of operation names)
# toward stock: these run on the built-in defaults when the config file cannot be used (config.load_for_safety)
from spark_memsaver.opnames import SAFETY as SAFETY_OPS  # noqa: E402
LOCK_WAIT = 1800.0      # a build of nvidia-uvm takes minutes on 2 cores: wait for it, but never forever


# --- the lock: host/locks.py's "lifecycle" (RUN_DIR, O_NOFOLLOW, bounded wait, errors.LockTimeout) -------

@contextlib.contextmanager
def locked(host: Host, wait: float = LOCK_WAIT, progress=None, purpose: str = "spark-memsaver"):
    """Serialize every module mutation across processes (daemon, hooks, CLI) with the one lifecycle lock."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(locks.hold(host, "lifecycle", timeout=0, purpose=purpose))
        except LockTimeout:
            st.say(progress, "waiting for another spark-memsaver operation to finish")
            stack.enter_context(locks.hold(host, "lifecycle", timeout=wait, purpose=purpose))
        yield


# --- observation for the planner ----------------------------------------------------------------

def recover(host: Host, config: Config, progress, problems: list, seen: dict | None = None) -> list[dict]:
    """Finish or undo what an interrupted operation left (its intent record), before acting anew. ``seen``
    receives the snapshot it planned from ("snap"): when nothing was recovered it is still the host's state."""
    snap, support, steps = plan_now(host, config, rebuild=False)
    if seen is not None:
        seen["snap"], seen["support"] = snap, support
    todo = recovery_steps(steps)
    return st.execute(host, config, todo, snap, progress, problems) if todo else []


# --- the ops -----------------------------------------------------------------------------------

def _target(host: Host, kernel: str | None) -> str:
    if kernel:
        return installable.check_kernel(host, kernel)     # the one unknown-kernel refusal (exit 2)
    from spark_memsaver.act import dkms_run
    return dkms_run.running_kernel(host)


def _one_world(seen: dict, recovered: list) -> tuple | None:
    """(snapshot, support) of recovery's observation while it is still the host's state (recovery acted on
    nothing), else None: the operation decides from it instead of observing again."""
    return (seen["snap"], seen["support"]) if seen.get("snap") is not None and not recovered else None


def _build(host, config, progress, problems, args: dict, seen: dict, recovered: list):
    """build: refused or fetched from the operation's one observation, prepared before its first step."""
    if args.get("all_kernels"):     # --kernel K's build for each kernel the one installability decision allows
        cfgmod.refuse_invalid(config, "build")
        decided, skipped = installable.targets(host, config, None, True, ignore=("secure-boot-unknown",),
                                               facts=_one_world(seen, recovered))
        installable.fetch_missing(host, config, decided, progress=st.fwd(progress))
        # each kernel as --kernel K decides it, from the host as the fetches and the earlier builds left it
        each = [{"kernel": d["kernel"], "force": args.get("force")} for d in decided]
        return {"built": [_build(host, config, progress, problems, a, {}, recovered) for a in each],
                "skipped": skipped}
    k = _target(host, args.get("kernel"))
    cfgmod.refuse_invalid(config, "build")
    facts = _one_world(seen, recovered)
    installable.require(host, config, k, progress=st.fwd(progress), ignore=("secure-boot-unknown",), facts=facts)
    dv = args.get("driver_version") or args.get("driver")
    prep = installable.prepare(host, config, facts[0] if facts else None, k, driver_version=dv)
    with rio.safe_intent(host, "build", k, removal=False, problems=problems, driver_version=dv):
        return st.engine_build().build(host, config, kernel=k, driver_version=dv, progress=st.fwd(progress),
                                       force=bool(args.get("force")), prep=prep)


def _hold(host, by: str, kernel: str | None, reason: str, problems: list, progress) -> None:
    """The administrator's word (host/holds.py), recorded before acting: automation leaves the kernel(s)
    stock until `install`. Toward stock goes on when it cannot be written; the result says so."""
    try:
        holds.hold(host, by, kernel, reason)
        st.say(progress, f"{kernel or 'every kernel'}: held by {by} until 'sudo spark-memsaver install'")
    except OSError as e:
        rio.record_problem(problems, f"the hold of {kernel or 'every kernel'} ({by})", e)


def _install(host, config, progress, problems, args: dict, seen: dict, recovered: list):
    """install: decided, fetched and prepared from the operation's one observation (recovery's, when it acted
    on nothing); the engine reads the host again only through world/refresh after a step (issue 34 item 3)."""
    kernel, all_kernels = args.get("kernel"), args.get("all_kernels", False)
    k = None if all_kernels else _target(host, kernel)
    cfgmod.refuse_invalid(config, "install")
    facts = _one_world(seen, recovered)
    # refused with status's code and remedy (decide/installability.py), per kernel for --all as for --kernel
    decided, skipped = installable.targets(host, config, k, all_kernels, facts=facts)
    installable.fetch_missing(host, config, decided, progress=st.fwd(progress))   # a missing source, fetched
    released = holds.release(host, k)        # the administrator's install ends their rollback/remove hold
    if released:
        st.say(progress, "hold released: " + ", ".join(released))
    preps = [installable.prepare(host, config, facts[0] if facts else None, d["kernel"]) for d in decided]
    with rio.safe_intent(host, "install", k, removal=False, problems=problems):
        doc = st.engine_override().install(host, config, kernel=k, all_kernels=all_kernels, progress=st.fwd(progress),
                                           kernels=[d["kernel"] for d in decided], skipped=skipped, preps=preps)
        for r, p in zip(doc.get("installed", []), preps):
            ok, info, nv = st.ours_matches(host, r["kernel"])     # the version-match check: a fresh read
            if not ok:
                raise st.StepFailed(f"kernel {r['kernel']}: after install the selected nvidia-uvm is "
                                    f"{info.get('path')} ({info.get('version')}), not ours for {nv}")
            st.installed(host, config, r["kernel"], info, problems, progress, settings=p["settings"])
    return doc


def _remove(host, config, progress, problems, kernel=None, all_kernels=False):
    k = None if all_kernels else _target(host, kernel)
    _hold(host, "remove", k, "requested", problems, progress)
    prep = st.engine_override().remove_prepare(host, k, all_kernels)     # read before the first step
    reload = st.engine_override().reloads_after(host, prep["kernels"])
    with rio.safe_intent(host, "remove", k, removal=True, problems=problems, reason="requested"):
        doc = st.remove(host, config, k, progress, prep)
        for r in doc.get("restored", []):
            if st.still_ours(host, r["kernel"]):      # the stock module selected again: a fresh read
                raise st.StepFailed(f"kernel {r['kernel']}: our nvidia-uvm is still selected after removal")
            rio.clear_build(host, r["kernel"])
    if reload:     # ours loaded: the stock module takes its place now where /dev/nvidia-uvm is unused (as rollback)
        doc["reload"] = st.reload_uvm(host, progress)
    return doc


def _reconcile(host, config, progress, problems, kernels=None, rebuild=None, dry_run=False, inside_dpkg=False,
               _deferred=None):
    snap, support, steps = plan_now(host, config, kernels=kernels, rebuild=rebuild, why=_deferred)
    if dry_run:
        return {"dry_run": True, "support": support, **rc.summarize(steps)}
    results = st.execute(host, config, steps, snap, progress, problems)
    doc = {"ok": all(r.get("ok", True) for r in results),
           "acting": sum(1 for s in steps if s.action in rc.ACTING), "steps": results, "support": support}
    from spark_memsaver.act import source_fetch   # the source cache keeps the installed drivers' trees only
    pruned = (source_fetch.prune_installed(host, snap) or {}).get("removed")
    if pruned:
        doc["sources_pruned"] = pruned
    if _deferred:
        doc["deferred"] = _deferred
    return doc


def _apt_pre_install(host, config, chg: list[dict], progress, problems: list, snap=None) -> dict:
    """APT's DPkg::Pre-Install-Pkgs door: remove our override before dpkg unpacks a different NVIDIA
    driver for ITS kernel (decide/apt.assess, from the facts act/apt_facts.py reads out of the .debs): a
    package for a new kernel never touches another kernel's override. The removals go on when no record can
    be written (defect 4): a failed record must never leave the override in place across a driver upgrade."""
    from spark_memsaver.act import apt_facts
    from spark_memsaver.decide import apt as apt_plan
    chg = apt_facts.gather(host, chg)
    for c in chg:
        c["effect"] = apt_plan.package_effect(c)
    snap = snap if snap is not None else world.snapshot(host, config)   # one snapshot per door run
    verdict = apt_plan.assess(snap, chg)
    steps = verdict["steps"]
    results = st.execute(host, config, steps, snap, progress, problems)
    for s, r in zip(steps, results):
        if r.get("ok"):
            # say why in status even if the post step never runs (e.g. the upgrade is aborted)
            rio.write_rollback(host, s.kernel, s.reason, problems, code=s.code or "driver-changing",
                               remedy="spark-memsaver rebuilds for the new driver after the upgrade when it is "
                               "supported.", driver_from=s.driver_from, driver_to=s.driver_to)
    # what the system looked like when we acted (the door's event carries it: the removal came before dpkg unpacked)
    return {"ok": all(r.get("ok") for r in results), "changes": [{k: v for k, v in c.items() if k != "facts"}
                                                                  for c in chg],
            "steps": results, "notes": verdict["notes"],
            "packages": [f"{c['name']} {c['old'] or '-'} -> {c['new'] or '-'}" for c in chg],
            "sources_seen": sorted(s.version for s in snap.driver.sources),
            "removed": [s.kernel for s, r in zip(steps, results) if r.get("ok")],
            "kept": [n["kernel"] for n in verdict["notes"] if n["kind"] == "kept"]}


def perform(op: str, host: Host, config: Config, *, progress=None, lock_wait: float = LOCK_WAIT, **args) -> dict:
    """Do ``op`` (see the module docstring) and return what was done. Named errors on refusal/failure.
    Every finished operation but a dry run or a no-op becomes one event (host/events.py)."""
    row = TABLE.get(op)           # the one dispatch on the operation's name: everything else is the row's
    if row is None:
        raise UsageError(f"unknown operation {op!r} (one of: {', '.join(OPS)})")
    from spark_memsaver.host import events
    try:
        doc = _perform(op, row, host, config, progress=progress, lock_wait=lock_wait, **args)
        found = config_finding(config)
        if found and isinstance(doc, dict):
            doc.setdefault("findings", []).append(found)
    except (UsageError, NotPermitted):
        raise                    # bad usage (a typo'd --kernel), no root: not a lifecycle event, nothing was attempted
    except Exception as e:
        if not args.get("dry_run"):      # a refused plan changed nothing either
            events.record(host, op, args, error=e)
        raise
    if not doc.get("dry_run") and not args.get("dry_run") and (doc.get("steps") or "packages" in doc
                                                                or row.always_an_event):
        # reconcile and the APT door: an event when a step acted or NVIDIA packages changed
        events.record(host, op, args, result=doc)
    return doc


def _early_reconcile(host, config, progress, problems, args: dict):
    """reconcile: rebuilds wait for dpkg's trigger while dpkg runs; a dry run plans without the lock."""
    if not args.get("inside_dpkg") and not args.get("dry_run") and host.is_live and args.get("rebuild") is not False:
        pid = locks.dpkg_running(host)
        if pid:
            args["rebuild"] = False
            args["_deferred"] = f"dpkg (pid {pid}) is running: rebuilds wait for its trigger"
            st.say(progress, args["_deferred"])
    return _reconcile(host, config, progress, problems, **args) if args.get("dry_run") else None


def _early_activate(host, config, progress, problems, args: dict):
    """activate: the running kernel must have its modules; a dry run or an inspected root plans, unlocked."""
    from spark_memsaver.act import activate as act_activate
    running = observe.observe_host(host)["kernel"]
    if running:
        installable.check_kernel(host, running)   # the running kernel's modules gone
    if args.get("dry_run") or not host.is_live:
        return act_activate.activate(host, config, progress, **args)
    return None


def _early_apt(host, config, progress, problems, args: dict):
    """the APT door: nothing to do (and no lock taken) unless an NVIDIA driver package changes."""
    args["_changes"] = rc.driver_changes(rc.parse_apt_hook(args.get("text", "")))
    return None if args["_changes"] else {"ok": True, "changes": [], "steps": []}


def _act_rollback(host, config, progress, problems, args: dict, seen: dict, recovered: list):
    from spark_memsaver.act import rollback as act_rollback
    _hold(host, "rollback", args.get("kernel"), args.get("reason") or "requested", problems, progress)
    one = _one_world(seen, recovered)          # recovery's world, still the host's state: observed once
    return act_rollback.rollback(host, config, progress=progress, problems=problems, snap=one and one[0], **args)


def _act_activate(host, config, progress, problems, args: dict, seen: dict, recovered: list):
    from spark_memsaver.act import activate as act_activate
    return act_activate.activate(host, config, progress, **args)


def _act_apt(host, config, progress, problems, args: dict, seen: dict, recovered: list):
    # recovery planned from a snapshot; it is still the host's state unless recovery acted
    return _apt_pre_install(host, config, args.pop("_changes"), progress, problems,
                            snap=None if recovered else seen.get("snap"))


def _plain(fn):
    return lambda host, config, progress, problems, args, seen, recovered: fn(host, config, progress, problems,
                                                                               **args)


def _dryrun():
    from spark_memsaver.act import dryrun        # imported when a dry run asks for it
    return dryrun


class _Op:
    """One row of the executor's table: what runs before the lock (may answer alone), what runs under it, a dry
    run's planner (act/dryrun.py; None: the operation plans its own dry run), whether an earlier operation's
    leftovers are recovered first, whether each finished run is an event (else only one that acted)."""
    __slots__ = ("early", "act", "dryrun", "recover", "always_an_event")

    def __init__(self, act, early=None, dryrun=None, recover=True, always_an_event=True):
        self.act, self.early, self.dryrun, self.recover = act, early, dryrun, recover
        self.always_an_event = always_an_event


# The ONE table of operations: its keys are opnames.EXECUTOR, in order (tests/test_executor.py).
TABLE = {
    "build": _Op(_build, dryrun=lambda: _dryrun().build),
    "install": _Op(_install, dryrun=lambda: _dryrun().install),
    "remove": _Op(_plain(_remove), dryrun=lambda: _dryrun().remove),
    "activate": _Op(_act_activate, early=_early_activate),
    "rollback": _Op(_act_rollback, dryrun=lambda: _dryrun().rollback),
    "reconcile": _Op(_plain(_reconcile), early=_early_reconcile, recover=False, always_an_event=False),
    "apt-pre-install": _Op(_act_apt, early=_early_apt, always_an_event=False),
}


def _perform(op: str, row: _Op, host: Host, config: Config, *, progress=None, lock_wait: float = LOCK_WAIT,
             **args) -> dict:
    problems: list = []
    for k in ([args["kernel"]] if args.get("kernel") else []) + list(args.get("kernels") or []):
        installable.check_kernel(host, k)        # every op that names a kernel: unknown-kernel, exit 2
    if args.get("kernel") and args.get("all_kernels"):
        from spark_memsaver import remedy as rm
        one, every = rm.sm(f"{op} --kernel {args['kernel']}"), rm.sm(f"{op} --all")
        raise UsageError("--kernel and --all exclude each other",
                         remedy=f"Give one: '{one}' for that kernel, or '{every}' for every kernel.")
    if args.get("all_kernels") and (args.get("driver_version") or args.get("driver")):
        from spark_memsaver import remedy as rm
        raise UsageError("--driver and --all exclude each other: each kernel builds for its own nvidia.ko",
                         remedy=f"Give one: '{rm.sm('build --kernel K --driver VERSION')}' for that kernel, or "
                                f"'{rm.sm('build --all')}' for every kernel.")
    if args.get("dry_run") and row.dryrun is not None:
        from spark_memsaver.act import dryrun     # the same targets and refusals as the run, nothing written
        return dryrun.plan(op, row.dryrun(), host, config, **args)
    args = dict(args)
    if row.early is not None:
        doc = row.early(host, config, progress, problems, args)
        if doc is not None:
            return doc
    require_root(host, op)     # before the lock (/run/spark-memsaver is root's)
    with locked(host, wait=lock_wait, progress=progress, purpose=op):
        seen: dict = {}
        recovered = recover(host, config, progress, problems, seen) if row.recover else []
        doc = row.act(host, config, progress, problems, args, seen, recovered)
    if recovered:
        doc["recovered"] = recovered
    if problems:
        doc["record_problems"] = problems
        doc.setdefault("findings", []).extend(problems)
    return doc


def config_finding(config: Config) -> dict | None:
    """The one ``config-invalid`` finding of a safety path that ran on the built-in defaults (config.invalid):
    file and line, what still ran, the file's remedy."""
    bad = getattr(config, "invalid", None)
    if not bad:
        return None
    return {"code": "config-invalid", "severity": "warning", "file": bad.get("file"), "line": bad.get("line"),
            "message": f"{bad.get('message')}; the built-in defaults were used for what safety needs, and "
                       "nothing is built until the file is fixed",
            "remedy": bad.get("remedy") or ""}


def require_root(host: Host, op: str, command: str | None = None) -> None:
    """A change to the live system needs root: ``not-permitted`` (exit 1) with the sudo form, before any lock or
    record is touched. ``command``: the command line to give with sudo (the CLI's, as typed)."""
    if host.is_live and os.geteuid() != 0:
        from spark_memsaver import remedy as rm
        raise NotPermitted(f"'{op}' changes kernel modules and needs root",
                           remedy=f"Run it as root: '{command or rm.sm(op)}'.")

"""Acting on plan steps (decide/plan.py) through the engines (act/build.py, act/override.py), each under an intent record.

Called only by act/executor.py, which holds the "lifecycle" lock. Every step that moves toward stock
(remove-override, finish-intent, undo-intent) goes on even when no record can be written (defect 4):
the failure lands in ``problems`` and the result says so.
"""

from __future__ import annotations

import contextlib
import logging

from spark_memsaver.act import records_io as rio
from spark_memsaver.config import Config
from spark_memsaver.decide import plan as rc
from spark_memsaver.decide import ours, policy
from spark_memsaver.errors import EXIT_FAILED, MemsaverError
from spark_memsaver.host import Host, events, intents
from spark_memsaver.observe import snapshot as observe

log = logging.getLogger("spark_memsaver.act.steps")


class StepFailed(MemsaverError):
    code = "reconcile-step-failed"
    exit_code = EXIT_FAILED
    remedy = "Run 'spark-memsaver status'; the stock module stays selected until the cause is fixed."


def say(progress, msg: str) -> None:
    """progress follows the jobs contract: progress(fraction, message); progress(message) is accepted."""
    log.info("%s", msg)
    if progress is not None:
        with contextlib.suppress(Exception):
            progress(msg)


def fwd(progress):
    """A progress callable for the engines (which call progress(fraction, message))."""
    if progress is None:
        return None

    def f(*args, **kw):
        with contextlib.suppress(Exception):
            progress(*args, **kw)
    return f


def engine_build():
    from spark_memsaver.act import build  # imported late: pure paths and the idle daemon never load it
    return build


def engine_override():
    from spark_memsaver.act import override  # imported late, as engine_build
    return override


# --- verification: the ONE reader of the selection (observe/modules.py) ------------------------

def selected(host: Host, kernel: str, name: str = "nvidia_uvm") -> dict:
    from spark_memsaver.observe import modules
    return modules.describe(modules.read_selected(host, kernel, name)) or {}


def still_ours(host: Host, kernel: str) -> bool:
    """True unless the selection is proven not ours (stock, none, builtin): an unreadable selection after a
    removal is a failure, never taken for stock. A fresh read (world/refresh.kernel)."""
    from spark_memsaver.world import refresh
    now = refresh.kernel(host, kernel)
    return now["uvm"]["state"] == "unreadable" or now["is_ours"]


def ours_matches(host: Host, kernel: str) -> tuple[bool, dict, str | None]:
    """Ours, built here, for the nvidia.ko beside it: the version-match check after an install, read fresh
    (world/refresh.kernel: kmod's own answer now, never the operation's earlier reading)."""
    from spark_memsaver.world import refresh
    now = refresh.kernel(host, kernel)
    nv = rc.base_version((now["nvidia"] or {}).get("version"))
    return now["built_here"] and now["versions_match"] is True, now["described"] or {}, nv


# --- engines, wrapped --------------------------------------------------------------------------

def remove(host: Host, config: Config, kernel: str | None, progress, prep: dict | None = None) -> dict:
    """``prep``: act/override.remove_prepare's answer, read before the step began (else read by the engine)."""
    d = engine_override()
    if kernel is None:
        res = d.remove(host, config, all_kernels=True, progress=fwd(progress), prep=prep) or {}
    else:
        res = d.remove(host, config, kernel=kernel, progress=fwd(progress), prep=prep) or {}
        rio.clear_build(host, kernel)
    return res


def support_for(versions, trees: dict | None = None) -> dict:
    """Manifest verdict per driver version: {version: {"supported": bool, "reason": str, "qualification": ...}};
    with trees ({version: host path}, source_trees()) by content too (world/support.support_for)."""
    from spark_memsaver.world import support
    return support.support_for(versions, trees)


def source_trees(host: Host, snap) -> dict:
    from spark_memsaver.world import support
    return support.source_trees(host, snap)


def record_stock(host: Host, kernel: str, state: dict | None = None) -> str | None:
    """The stock record before a build-install: act/override.record_stock, its one writer (which never records a
    packing module of any tag as stock). The stock file it names, or None. ``state``: world/refresh.kernel."""
    rec = engine_override().record_stock(host, kernel, state)
    return rec.get("stock_path") if rec else None


def _public(rec: dict | None) -> dict | None:
    return {k: v for k, v in rec.items() if not k.startswith("_")} if rec else rec


def do_remove(host, config, step: rc.Step, progress, problems: list, op: str = "remove") -> dict:
    prep = engine_override().remove_prepare(host, step.kernel, step.kernel is None)    # before the first step
    with rio.safe_intent(host, op, step.kernel, removal=True, problems=problems, reason=step.reason,
                         driver_from=step.driver_from, driver_to=step.driver_to):
        say(progress, f"{step.kernel}: removing our nvidia-uvm ({step.reason})")
        res = remove(host, config, step.kernel, progress, prep)
        if step.kernel and still_ours(host, step.kernel):
            raise StepFailed(f"kernel {step.kernel}: our nvidia-uvm is still selected after removal")
    return res


def _failed(host, config, step, progress, problems, op, e: MemsaverError, code: str) -> dict:
    k = step.kernel
    with contextlib.suppress(Exception):
        remove(host, config, k, progress)      # leave nothing half-built behind
    rio.clear_intent(host, intents.intent_id(op, k), problems)
    rec = rio.write_rollback(host, k, f"{'building' if op == 'build' else 'installing'} for driver "
                             f"{step.driver_to} failed: {e.message}", problems, remedy=e.remedy or "", code=code,
                             driver_from=step.driver_from, driver_to=step.driver_to)
    return {"ok": False, "error": e.to_dict(), "rollback": _public(rec)}


def do_build_install(host, config, step: rc.Step, progress, problems: list, snap=None) -> dict:
    """Build, then install, for ``step.kernel``: both engines take what was prepared before the first step
    (act/installable.prepare over ``snap``, the plan's world); DKMS's tree is read again after the build."""
    from spark_memsaver.act import installable
    from spark_memsaver.world import refresh
    k = step.kernel
    prep = installable.prepare(host, config, snap, k, driver_version=step.driver_to)
    try:
        record_stock(host, k, prep["state"])
    except OSError as e:
        raise rio.RecordWriteFailed(f"cannot write the stock record for {k}: {e.strerror or e}; nothing was "
                                    "changed")
    try:
        with rio.safe_intent(host, "build", k, removal=False, problems=problems, driver_version=step.driver_to):
            say(progress, f"{k}: building our nvidia-uvm for driver {step.driver_to}")
            # a configuration change (tier, policy) must rebuild even when DKMS holds a build of this version
            engine_build().build(host, config, kernel=k, driver_version=step.driver_to, progress=fwd(progress),
                                 force=step.code == "config-changed", prep=prep)
    except rio.RecordWriteFailed:
        raise
    except MemsaverError as e:
        code = "patch-failed" if "patch" in type(e).__name__.lower() else "build-failed"
        return _failed(host, config, step, progress, problems, "build", e, code)
    try:
        with rio.safe_intent(host, "install", k, removal=False, problems=problems, driver_version=step.driver_to):
            say(progress, f"{k}: installing our nvidia-uvm for driver {step.driver_to}")
            prep = dict(prep, state=refresh.kernel(host, k))       # the build step changed DKMS's tree
            engine_override().install(host, config, kernel=k, progress=fwd(progress), kernels=[k], preps=[prep])
            ok, info, nv = ours_matches(host, k)
            if not ok:
                raise StepFailed(f"kernel {k}: after install the selected nvidia-uvm is "
                                 f"{info.get('path')} ({info.get('version')}), not ours for {nv}")
    except rio.RecordWriteFailed:
        raise
    except MemsaverError as e:
        return _failed(host, config, step, progress, problems, "install", e, "install-failed")
    return installed(host, config, k, info, problems, progress, settings=prep["settings"])


def installed(host, config, k: str, info: dict, problems: list, progress=None, settings: dict | None = None) -> dict:
    """Bookkeeping after a verified install: build record, rollback record and stale intents cleared. ``settings``:
    decide/policy.build_settings(config), when the operation prepared it before its first step."""
    rio.write_build(host, k, settings or policy.build_settings(config), driver=rc.base_version(info.get("version")),
                    problems=problems, srcversion=info.get("srcversion"), path=info.get("path"))
    try:
        if intents.clear_rollback(host, k):
            say(progress, f"{k}: the patched module is back; rollback record cleared")
    except OSError as e:
        rio.record_problem(problems, f"the removal of the rollback record of {k}", e)
    for op in (o for o in intents.OPS if o != "activate"):
        # an older interruption for this kernel whose undo failed is moot now: state is verified good
        rio.clear_intent(host, intents.intent_id(op, k), problems)
    return {"ok": True, "selected": info.get("path"), "version": info.get("version"),
            "signer": info.get("signer"), "srcversion": info.get("srcversion")}


def reload_uvm(host: Host, progress) -> dict:
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


# --- one handler per acting step (decide/step.ACTING); fetch-source is run by execute(), which also holds back the
# builds waiting for it. Each handler returns the entry's fields ("result", and "ok" where the step can fail softly).

def _drop_record(host, config, s: rc.Step, progress, problems: list, **_) -> dict:
    """The one quarantine (host/records.py): the record is renamed aside, never deleted."""
    from spark_memsaver.host import records
    res = records.quarantine(host, s.path, s.code or "record", s.reason)
    if s.code == "hold" and res.get("moved_to"):
        # the administrator's hold outlives its unreadable record: one of the scope its name gives takes its place
        import os
        from spark_memsaver.host import holds
        name = os.path.basename(s.path)[:-len(".json")] if s.path.endswith(".json") else "all"
        res["hold"] = holds.hold(host, "remove", None if name == "all" else name,
                                 f"kept from an unreadable hold record, set aside as {res['moved_to']}")
    return {"result": res}


def _clear_intent(host, config, s: rc.Step, progress, problems: list, **_) -> dict:
    rio.clear_intent(host, s.intent, problems)
    return {}


def _undo_or_finish_intent(host, config, s: rc.Step, progress, problems: list, **_) -> dict:
    res = remove(host, config, s.kernel, progress) if s.kernel else {}
    if s.kernel and s.action == "finish-intent" and still_ours(host, s.kernel):
        raise StepFailed(f"kernel {s.kernel}: our nvidia-uvm is still selected")
    if s.action == "finish-intent" and s.kernel and s.driver_from and s.driver_from != s.driver_to:
        rio.write_rollback(host, s.kernel, s.reason, problems, code=s.code or "stock-selected",
                           remedy=s.remedy, driver_from=s.driver_from, driver_to=s.driver_to)
    rio.clear_intent(host, s.intent, problems)
    return {"result": res if isinstance(res, dict) else {}}


def _remove_override(host, config, s: rc.Step, progress, problems: list, **_) -> dict:
    return {"result": do_remove(host, config, s, progress, problems)}


def _record_rollback(host, config, s: rc.Step, progress, problems: list, **_) -> dict:
    rio.write_rollback(host, s.kernel, s.reason, problems, remedy=s.remedy, code=s.code or "stock-selected",
                       driver_from=s.driver_from, driver_to=s.driver_to)
    say(progress, f"{s.kernel}: rolled back to stock: {s.reason}")
    return {}


def _clear_rollback(host, config, s: rc.Step, progress, problems: list, **_) -> dict:
    intents.clear_rollback(host, s.kernel)
    return {}


def _build_install(host, config, s: rc.Step, progress, problems: list, snap=None, **_) -> dict:
    res = do_build_install(host, config, s, progress, problems, snap)
    return {"result": res, "ok": res.get("ok", False)}


def _reload_uvm(host, config, s: rc.Step, progress, problems: list, **_) -> dict:
    res = reload_uvm(host, progress)
    if s.intent:
        rio.clear_intent(host, s.intent, problems)
    return {"result": res}


HANDLERS = {
    "drop-record": _drop_record,
    "clear-intent": _clear_intent,
    "undo-intent": _undo_or_finish_intent,
    "finish-intent": _undo_or_finish_intent,
    "remove-override": _remove_override,
    "record-rollback": _record_rollback,
    "clear-rollback": _clear_rollback,
    "build-install": _build_install,
    "reload-uvm": _reload_uvm,
}
#: run by execute() itself (it defers the builds that wait for the source)
BY_EXECUTE = ("fetch-source",)


def execute(host: Host, config: Config, steps: list[rc.Step], snap=None, progress=None,
            problems: list | None = None) -> list[dict]:
    """Run the acting steps of a plan in order; a failed step is reported and the next one runs."""
    problems = [] if problems is None else problems
    done = []
    waiting: set = set()    # drivers whose source was not fetched (failed, or deferred past apt): every
    #                         kernel's build for them waits (the plan fetches each driver once)
    for s in steps:
        entry = s.to_dict()
        if s.action == "build-install" and s.driver_to in waiting:
            done.append({**entry, "ok": True, "skipped": "its NVIDIA driver source is not fetched yet (fetch-source)"})
            continue
        try:
            if s.action in BY_EXECUTE:       # fetch-source, act/source_fetch.py: fetch, or defer past apt inside its doors
                from spark_memsaver.act import source_fetch
                entry["result"] = source_fetch.run_step(host, config, s, snap, problems, fwd(progress))
                entry["ok"] = entry["result"].get("ok", False)
                if not entry["result"].get("path"):
                    waiting.add(entry["result"].get("driver"))
            else:
                handler = HANDLERS.get(s.action)
                if handler is not None:          # an explaining step (decide/step.INFO) does nothing
                    entry.update(handler(host, config, s, progress, problems, snap=snap))
            entry.setdefault("ok", True)
        except MemsaverError as e:
            entry["ok"] = False
            entry["error"] = e.to_dict()
            say(progress, f"{s.action} {s.kernel or ''}: {e.message}")
        except OSError as e:
            if s.action not in ("record-rollback", "clear-rollback", "drop-record", "clear-intent"):
                raise
            entry["ok"] = False
            entry["error"] = rio.record_problem(problems, f"a record ({s.action} {s.kernel or ''})", e)
        done.append(entry)
        if s.action in rc.ACTING:
            events.note(host, "step", action=s.action, kernel=s.kernel, reason=s.reason, ok=entry.get("ok"))
    return done

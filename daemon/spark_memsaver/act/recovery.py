"""What every operation recovers first (act/executor.recover runs it; act/dryrun.py lists it): the planner's
world and plan (:func:`plan_now`), whether an intent's writer still runs (:func:`intent_alive`), and the recovery
steps of a plan (:func:`recovery_steps`). Reads only."""

from __future__ import annotations

import os

from spark_memsaver.act import installable
from spark_memsaver.config import Config
from spark_memsaver.decide import plan as rc
from spark_memsaver.host import Host, locks


def intent_alive(rec: dict) -> bool:
    """Does the process that wrote this intent still run? It is identified by pid AND start time
    (/proc/PID/stat), so a recycled pid -- one a local user may occupy on purpose -- never blocks recovery,
    and EPERM alone proves nothing (defect 12). Our own pid is never "alive": we hold the lifecycle lock, so
    an intent of ours is left over from an earlier, failed operation of this process.
    Rule chosen for records without a start time (written by 0.1.0), where we cannot tell by start time:
    alive only if /proc/PID exists AND is owned by root (or by us: a fixture root's writer) AND its cmdline is
    readable and names spark-memsaver; anything else -- unreadable (EPERM, hidepid), another user's process
    (who can name itself anything), another program -- counts as gone, and recovery proceeds."""
    pid = rec.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or pid == os.getpid():
        return False
    if rec.get("start_time") is not None:
        return locks.owner_alive(pid, rec["start_time"])
    try:
        if os.stat(f"/proc/{pid}").st_uid not in (0, os.getuid()):
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
    except OSError:
        return False
    return b"spark-memsaver" in cmd or b"spark_memsaver" in cmd


def plan_now(host: Host, config: Config, **kw) -> tuple:
    """(world, support, plan): the planner's world (world.facts) and its plan."""
    snap, support = installable.observe(host, config)
    live = {r.get("pid") for r in snap.records.intents if intent_alive(r)}
    return snap, support, rc.plan(snap, config, support, alive_pids=live, **kw)


def recovery_steps(steps: list) -> list:
    """The steps of a plan that every operation runs first (:func:`recover`; a dry run lists them first too)."""
    return [s for s in steps if s.action in ("undo-intent", "finish-intent", "clear-intent", "drop-record",
                                             "reload-uvm") and (s.intent or s.path)]

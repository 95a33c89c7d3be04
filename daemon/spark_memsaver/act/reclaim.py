"""Act: ``reclaim --need SIZE`` and D-Bus PrepareLaunch -- free what a launch needs (decide/reclaim.plan), then
compact when large blocks are short; figures before and after, and the time taken.

Its own door, not a module mutation: it takes the "reclaim" lock (two ExecStartPre= at once reclaim one after the
other), never the lifecycle one, so a launch does not wait behind a 10-minute build. It writes only the kernel's
memory knobs named in host/paths.py; the root (--root) maps them like every other path.
"""

from __future__ import annotations

import errno
import os
import time

from spark_memsaver.decide import memory as decide_memory
from spark_memsaver.decide import reclaim as decide
from spark_memsaver.errors import CannotReclaim, InspectionError
from spark_memsaver.host import Host, locks, paths
from spark_memsaver.observe import memory as observe

LOCK_WAIT = 120.0


def _doc(host: Host) -> dict:
    doc = decide_memory.model(observe.read(host, gpu=False, blocks=False))
    if doc["total_bytes"] is None:
        raise InspectionError("cannot read /proc/meminfo under " + str(host.root),
                              remedy="Give --root a running system's root or a fixture with proc/meminfo.")
    return doc


def _say(progress, fraction: float, message: str) -> None:
    if progress:
        progress(fraction, message)


def write_knob(host: Host, path: str, value: str) -> dict:
    """Write ``value`` to a kernel knob (never created: a knob the kernel lacks is an error, not a new file).
    memory.reclaim answers EAGAIN when it freed less than asked: reported as partial, not as a failure."""
    t0 = time.monotonic()
    try:
        fd = os.open(host.fspath(path), os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)
        out = {"ok": True}
    except OSError as e:
        out = {"ok": e.errno == errno.EAGAIN, "partial": e.errno == errno.EAGAIN,
               "error": f"{path}: {e.strerror or e}"}
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def figures(doc: dict) -> dict:
    return {"free_bytes": doc["free_now_bytes"], "free_after_reclaim_bytes": doc["free_after_reclaim_bytes"],
            "free_blocks_of": doc["free_blocks_of"]}


def reclaim(host: Host, need_bytes: int, dry_run: bool = False, progress=None) -> dict:
    """Free ``need_bytes`` (see the module docstring). Raises CannotReclaim (exit 1) when more is needed than can
    be reclaimed; returns the result (``met`` False when less was freed than needed: the CLI exits 1 then)."""
    t0 = time.monotonic()
    before = _doc(host)
    cg = paths.CGROUP_RECLAIM if host.exists(paths.CGROUP_RECLAIM) else None
    p = decide.plan(before, need_bytes, cgroup_reclaim=cg, drop_caches=paths.DROP_CACHES,
                    compact=paths.COMPACT_MEMORY)
    result = {"need_bytes": need_bytes, "method": "memory.reclaim" if cg else "drop_caches",
              "free_before_bytes": before["free_now_bytes"], "before": figures(before), "plan": p["text"],
              "steps": p["steps"]}
    if not p["possible"]:
        raise CannotReclaim(p["text"])
    if dry_run:
        return dict(result, dry_run=True, free_after_bytes=None, reclaimed_bytes=None,
                    seconds=round(time.monotonic() - t0, 3), met=None)
    done = []
    with locks.hold(host, "reclaim", timeout=LOCK_WAIT, purpose=f"reclaim {need_bytes}"):
        doc = before
        for step in p["steps"]:
            if step["action"] == "compact-if-short":
                doc = _doc(host)
                if not decide.blocks_short(doc, need_bytes):
                    done.append(dict(step, skipped="enough free memory lies in blocks of 2 MiB or more"))
                    continue
            _say(progress, 0.2 + 0.6 * len(done) / len(p["steps"]), step["why"])
            done.append(dict(step, **write_knob(host, step["path"], step["value"])))
            if step["action"] == "memory-reclaim" and not done[-1]["ok"]:
                # e.g. EROFS: spark-memsaverd's unit mounts /sys/fs/cgroup read-only (ProtectControlGroups=yes)
                fb = decide.drop_caches_step(before, need_bytes, paths.DROP_CACHES,
                                             f"memory.reclaim could not be written ({done[-1]['error']})")
                done.append(dict(fb, **write_knob(host, fb["path"], fb["value"])))
                result["method"] = "drop_caches"
        after = _doc(host)
    free_after = after["free_now_bytes"]
    return dict(result, steps=done, after=figures(after), free_after_bytes=free_after,
                reclaimed_bytes=free_after - before["free_now_bytes"], seconds=round(time.monotonic() - t0, 3),
                met=free_after >= need_bytes)


def text(result: dict) -> str:
    """The readable result of ``reclaim``: the plan, each step, before and after."""
    g = decide_memory.gib
    lines = [f"Need {g(result['need_bytes'])}: {result['plan']} (method: {result['method']})"]
    for s in result["steps"]:
        state = ("planned" if result.get("dry_run") else "skipped: " + s["skipped"] if s.get("skipped") else
                 "done" + (" (less than asked)" if s.get("partial") else "") if s.get("ok") else
                 f"failed: {s.get('error')}")
        lines.append(f"  {s['action']:<17} {s['path']} <- {s['value']}: {state}")
        lines.append(f"    {s['why']}")
    b2 = str(decide_memory.NAMED_BLOCKS[0])
    lines.append(f"Free before: {g(result['free_before_bytes'])}, "
                 f"{result['before']['free_blocks_of'].get(b2)} free 2 MiB blocks")
    if not result.get("dry_run"):
        lines.append(f"Free after:  {g(result['free_after_bytes'])}, "
                     f"{result['after']['free_blocks_of'].get(b2)} free 2 MiB blocks "
                     f"(reclaimed {g(result['reclaimed_bytes'])} in {result['seconds']:.2f} s)")
        lines.append("Met: yes" if result["met"] else
                     f"Met: no, {g(result['need_bytes'] - result['free_after_bytes'])} short")
    return "\n".join(lines)

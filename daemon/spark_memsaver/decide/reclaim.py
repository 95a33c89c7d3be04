"""Decide: what ``reclaim --need SIZE`` (D-Bus PrepareLaunch) does -- pure, over the ``memory`` document
(decide/memory.model) and what the kernel offers.

Free exactly what a launch needs: ``need - MemFree`` (and a margin) through cgroup v2's ``memory.reclaim`` where
the root cgroup has it (Linux >= 5.19, cgroup v2 mounted: DGX OS); otherwise ``drop_caches=1``, which drops the
whole clean page cache -- more than needed, and the plan says so. Then compaction when the free memory in blocks
of 2 MiB or more is less than the need. More than MemAvailable cannot be freed: refused before anything is done.
"""

from __future__ import annotations

from spark_memsaver.decide.memory import MIB, NAMED_BLOCKS, blocks_of, gib

MARGIN_MIN = 256 * MIB          # memory.reclaim may free a little less than asked, and the launch needs slack


def margin(short: int) -> int:
    return max(MARGIN_MIN, short // 16)


def blocks_short(doc: dict, need: int) -> bool:
    """Less free memory in blocks of 2 MiB or more than the need (or than what is free): compaction may help."""
    n = blocks_of(doc.get("free_blocks") or [], NAMED_BLOCKS[0])
    if n is None or doc.get("free_now_bytes") is None:
        return False
    return n * NAMED_BLOCKS[0] < min(need, doc["free_now_bytes"])


def drop_caches_step(doc: dict, need: int, path: str, reason: str) -> dict:
    """The stated fallback: drop_caches=1 drops every clean page-cache page, more than the need."""
    free, after = doc["free_now_bytes"], doc["free_after_reclaim_bytes"]
    return {"action": "drop-caches", "path": path, "value": "1",
            "why": f"{gib(max(0, need - free))} short of {gib(need)}; {reason}, so drop_caches=1: it drops the whole "
                   f"clean page cache ({gib(after - free)} reclaimable), more than needed"}


def plan(doc: dict, need: int, *, cgroup_reclaim: str | None, drop_caches: str, compact: str) -> dict:
    """{possible, need_bytes, free_before_bytes, reclaimable_bytes, short_bytes, steps: [{action, path, value,
    why}], text}; ``possible`` False with ``cannot_bytes`` when the need exceeds MemAvailable."""
    free, after = doc.get("free_now_bytes"), doc.get("free_after_reclaim_bytes")
    base = {"need_bytes": need, "free_before_bytes": free, "reclaimable_bytes": (after or 0) - (free or 0)}
    if free is None or after is None:
        return dict(base, possible=False, cannot_bytes=None, steps=[],
                    text="cannot: /proc/meminfo is not readable")
    if need > after:
        return dict(base, possible=False, cannot_bytes=need - after, steps=[],
                    text=f"cannot: {gib(need - after)} more than is reclaimable (need {gib(need)}, "
                         f"free now {gib(free)}, at most {gib(after)} after reclaim)")
    short = max(0, need - free)
    steps = []
    if short:
        ask = min(after - free, short + margin(short))
        if cgroup_reclaim:
            steps.append({"action": "memory-reclaim", "path": cgroup_reclaim, "value": str(ask),
                          "why": f"{gib(short)} short of {gib(need)}: reclaim {gib(ask)} (with a margin) from "
                                 "the root cgroup, the least recently used pages first"})
        else:
            steps.append(drop_caches_step(doc, need, drop_caches, "cgroup v2 memory.reclaim is not available here "
                                                                  "(no cgroup2 memory controller at /sys/fs/cgroup)"))
    steps.append({"action": "compact-if-short", "path": compact, "value": "1",
                  "why": "then, if less than the need lies in free blocks of 2 MiB or more: compact every zone"})
    text = (f"{gib(need)} is free already; nothing to reclaim" if not short
            else f"reclaim {gib(short)} to have {gib(need)} free")
    return dict(base, possible=True, short_bytes=short, steps=steps, text=text)

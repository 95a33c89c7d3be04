"""Boots: this boot's id, and one numbering of the earlier ones for every reader -- 0 this boot, -1 the one
before, -2 the one before that (journalctl's numbering) -- so that `history --boot -1` (the black box) and
`events --boot -1` (the lifecycle log) name the same boot after a power cycle.

A boot is known by what it left: black-box files (``<boot_id>.jsonl``, their last write) and events (each line
carries the ``boot`` it was written in, host/events.py). Boots are ordered by when they were last seen; boots do
not overlap, so that is also the order they began. A boot that left nothing is not counted: -1 is the latest
earlier boot that left a record (`events --boot -1` and `history --boot -1` say which boot id that is).
"""

from __future__ import annotations

import os
import re

from spark_memsaver.host import paths

BOOT_ID = paths.BOOT_ID
ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def current(host) -> str | None:
    """This boot's id, or None where the kernel's file is absent or not an id."""
    b = (host.read_text(BOOT_ID) or "").strip()
    return b if ID.match(b) else None


def blackbox_files(host) -> dict[str, float]:
    """Boot id -> its black-box file's last write (epoch seconds)."""
    d = host.fspath(paths.BLACKBOX_DIR)
    out = {}
    for name in host.listdir(paths.BLACKBOX_DIR):
        if name.endswith(".jsonl") and ID.match(name[:-6]):
            try:
                out[name[:-6]] = os.stat(os.path.join(d, name)).st_mtime
            except OSError:
                pass
    return out


def last_seen(host, events: list[dict]) -> dict[str, float]:
    """Every boot that left a record -> the last time it was seen: the black box's files, and ``events`` (the
    event log as host/events.read returns it, each line with its ``boot`` and its UTC ``time``)."""
    from spark_memsaver.timefmt import utc_epoch
    seen = blackbox_files(host)
    for ev in events:
        b, t = ev.get("boot"), ev.get("time")
        t = utc_epoch(t) if isinstance(t, str) else None
        if isinstance(b, str) and ID.match(b) and t is not None and t > seen.get(b, float("-inf")):
            seen[b] = t
    return seen


def order(seen: dict[str, float], cur: str | None) -> list[str]:
    """The earlier boots, oldest first (pure): this boot is never among them."""
    return [b for b, _ in sorted(seen.items(), key=lambda kv: (kv[1], kv[0])) if b != cur]


def resolve(host, n: int, events: list[dict]) -> str | None:
    """The id of boot ``n`` (0 this one, -1 the one before, ...), or None where no such boot left a record;
    ``events``: the whole event log (host/events.read), whatever a caller shows of it."""
    cur = current(host)
    if n == 0:
        return cur
    older = order(last_seen(host, events), cur)
    return older[n] if n < 0 and -n <= len(older) else None

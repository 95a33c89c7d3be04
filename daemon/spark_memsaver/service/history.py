"""The monitor's samples, persisted: STATE_DIR/history/, readable without the daemon (`spark-memsaver history`).

Layout: ``current.jsonl`` (the newest samples, one JSON object a line) and closed segments
``seg-<first sample time, ms>.jsonl``. Every write is atomic (fsutil.atomic_write: a reader sees the old or the
new file, never half of one): ``current.jsonl`` is rewritten with each sample, so it is kept short
(:data:`SEGMENT` samples), then renamed to a segment. Bounded: 7 days at the configured interval
(``RETENTION_S // interval`` samples); at each rotation, segments beyond that count, or whose newest sample
is older than 7 days before the newest one, are deleted.

A line is used only when it is a JSON object whose ``time`` is a finite epoch in :data:`TIME_RANGE` (a valid
JSON line with ``1e300``, ``NaN`` or ``Infinity`` is skipped and counted, as a torn line is); a rotation that
fails still empties the in-memory list (those samples stay in ``current.jsonl`` until the next write), and
while ``current.jsonl`` cannot be written at all the list keeps fewer than :data:`SEGMENT` samples, the newest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time

from spark_memsaver.host import paths
from spark_memsaver.host.fsutil import atomic_write, loads_strict

log = logging.getLogger(__name__)

RETENTION_S = 7 * 86400
SEGMENT = 120            # samples per file: 2 h at the default 60 s interval, ~30 KiB
CURRENT = "current.jsonl"
TIME_RANGE = (0.0, 4102444800.0)     # the epoch .. 2100-01-01: a segment's name holds the time in 15 digits


def valid_time(t) -> bool:
    return (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
            and TIME_RANGE[0] <= t < TIME_RANGE[1])


def capacity(interval: int) -> int:
    return max(1, RETENTION_S // max(1, int(interval)))


def _parse(text: str) -> list[dict]:
    return _parse_counted(text)[0]


def _parse_counted(text: str) -> tuple[list[dict], int]:
    """(the usable samples, how many other non-empty lines were skipped)."""
    out, skipped = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            d = loads_strict(line)
        except (ValueError, RecursionError):
            d = None
        if isinstance(d, dict) and valid_time(d.get("time")):
            out.append(d)
        else:
            skipped += 1
    return out, skipped


class History:
    """Owned by the monitor (main loop): append(sample) after each sample."""

    def __init__(self, host, interval: int, directory: str = paths.SAMPLES_DIR):
        self.host = host
        self.interval = interval
        self.dir = host.fspath(directory)
        self._current: list[str] = []
        self._warned = False
        self.skipped = 0                    # lines of current.jsonl that were not samples (see _parse_counted)
        with contextlib.suppress(OSError):
            with open(os.path.join(self.dir, CURRENT), encoding="utf-8", errors="replace") as f:
                rows, self.skipped = _parse_counted(f.read())
            self._current = [json.dumps(d, sort_keys=True) for d in rows]
        if self.skipped:
            log.warning("skipped %d unreadable lines of %s", self.skipped, os.path.join(self.dir, CURRENT))

    def append(self, sample: dict) -> bool:
        """Persist one sample (keys starting with _ are dropped). Never raises for I/O or odd values."""
        try:
            line = json.dumps({k: v for k, v in sample.items() if not k.startswith("_")}, sort_keys=True,
                              default=str, allow_nan=False)
        except ValueError as e:             # NaN/Infinity: not JSON; the sample is not kept
            log.warning("a sample that is not JSON was not persisted: %s", e)
            return False
        self._current.append(line)
        try:
            os.makedirs(self.dir, mode=0o755, exist_ok=True)
            cur = os.path.join(self.dir, CURRENT)
            atomic_write(cur, "\n".join(self._current) + "\n", 0o644, durable=False)
            if len(self._current) >= SEGMENT:   # rotate: the segment is closed, then old ones go
                rows = self._current
                self._current = []              # whatever happens next: never kept (and rewritten) for ever
                first = json.loads(rows[0]).get("time")
                first = first if valid_time(first) else time.time()
                os.rename(cur, os.path.join(self.dir, f"seg-{int(first * 1000):015d}.jsonl"))
                t = sample.get("time")
                self.prune(now=t if valid_time(t) else None)
            self._warned = False
            return True
        except OSError as e:
            del self._current[:max(0, len(self._current) - SEGMENT + 1)]   # unwritable: less than a segment kept
            if not self._warned:
                log.warning("cannot persist the monitoring history in %s: %s", self.dir, e.strerror or e)
                self._warned = True
            return False

    def prune(self, now: float | None = None) -> list[str]:
        """Delete closed segments beyond 7 days at the interval (by count and by age). Returns what went."""
        now = time.time() if now is None else now
        segs = segments(self.dir)
        keep_n = -(-capacity(self.interval) // SEGMENT)   # whole segments that hold the capacity
        gone = segs[:-keep_n] if len(segs) > keep_n else []
        # by age: a segment whose newest sample is older than the window (relative to the newest sample)
        for s in segs:
            if s not in gone and _last_time(os.path.join(self.dir, s)) < now - RETENTION_S:
                gone.append(s)
        for s in gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.dir, s))
        return gone


def _last_time(path: str) -> float:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            rows = _parse(f.read())
    except OSError:
        return 0.0
    return max((r["time"] for r in rows), default=0.0)


def _seg_time(name: str) -> float:
    try:
        return int(name[4:-6]) / 1000.0
    except ValueError:
        return 0.0


def segments(d: str) -> list[str]:
    try:
        names = os.listdir(d)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith("seg-") and n.endswith(".jsonl") and n[4:-6].isdigit())


def exists(host, directory: str = paths.SAMPLES_DIR) -> bool:
    return os.path.isdir(host.fspath(directory))


def read(host, since: float | None = None, directory: str = paths.SAMPLES_DIR) -> list[dict]:
    """Every persisted sample, oldest first, at or after ``since`` (epoch seconds). No daemon needed."""
    return read_counted(host, since, directory)[0]


def read_counted(host, since: float | None = None, directory: str = paths.SAMPLES_DIR) -> tuple[list[dict], int]:
    """``read``, and how many lines were skipped as unreadable (not JSON, not an object, no sane time)."""
    d = host.fspath(directory)
    out: list[dict] = []
    skipped = 0
    names = segments(d)
    if since is not None:   # skip segments that end before `since` (the next one starts before it)
        starts = [_seg_time(n) for n in names]
        names = [n for i, n in enumerate(names) if i + 1 >= len(names) or starts[i + 1] >= since]
    for n in names + [CURRENT]:
        with contextlib.suppress(OSError):
            with open(os.path.join(d, n), encoding="utf-8", errors="replace") as f:
                rows, bad = _parse_counted(f.read())
            skipped += bad
            out.extend(s for s in rows if since is None or s["time"] >= since)
    out.sort(key=lambda s: s["time"])
    return out, skipped

"""The monitor's samples, persisted: STATE_DIR/history/, readable without the daemon (`spark-memsaver history`).

Layout: ``current.jsonl`` (the newest samples, one JSON object a line) and closed segments
``seg-<first sample time, ms>.jsonl``. Every write is atomic (fsutil.atomic_write: a reader sees the old or the
new file, never half of one): ``current.jsonl`` is rewritten with each sample, so it is kept short
(:data:`SEGMENT` samples), then renamed to a segment. Bounded: 7 days at the configured interval
(``RETENTION_S // interval`` samples); at each rotation, segments beyond that count, or whose newest sample
is older than 7 days before the newest one, are deleted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

from spark_memsaver.host import paths
from spark_memsaver.host.fsutil import atomic_write

log = logging.getLogger(__name__)

RETENTION_S = 7 * 86400
SEGMENT = 120            # samples per file: 2 h at the default 60 s interval, ~30 KiB
CURRENT = "current.jsonl"


def capacity(interval: int) -> int:
    return max(1, RETENTION_S // max(1, int(interval)))


def _parse(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            d = json.loads(line)
            if isinstance(d, dict) and isinstance(d.get("time"), (int, float)):
                out.append(d)
    return out


class History:
    """Owned by the monitor (main loop): append(sample) after each sample."""

    def __init__(self, host, interval: int, directory: str = paths.SAMPLES_DIR):
        self.host = host
        self.interval = interval
        self.dir = str(host.path(directory))
        self._current: list[str] = []
        self._warned = False
        with contextlib.suppress(OSError):
            with open(os.path.join(self.dir, CURRENT), encoding="utf-8", errors="replace") as f:
                self._current = [json.dumps(d, sort_keys=True) for d in _parse(f.read())]

    def append(self, sample: dict) -> bool:
        """Persist one sample (keys starting with _ are dropped). Never raises for I/O."""
        line = json.dumps({k: v for k, v in sample.items() if not k.startswith("_")}, sort_keys=True, default=str)
        self._current.append(line)
        try:
            os.makedirs(self.dir, mode=0o755, exist_ok=True)
            cur = os.path.join(self.dir, CURRENT)
            atomic_write(cur, "\n".join(self._current) + "\n", 0o644, durable=False)
            if len(self._current) >= SEGMENT:   # rotate: the segment is closed, then old ones go
                first = json.loads(self._current[0]).get("time", time.time())
                os.rename(cur, os.path.join(self.dir, f"seg-{int(first * 1000):015d}.jsonl"))
                self._current = []
                t = sample.get("time")
                self.prune(now=t if isinstance(t, (int, float)) else None)
            self._warned = False
            return True
        except OSError as e:
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
    return os.path.isdir(host.path(directory))


def read(host, since: float | None = None, directory: str = paths.SAMPLES_DIR) -> list[dict]:
    """Every persisted sample, oldest first, at or after ``since`` (epoch seconds). No daemon needed."""
    d = str(host.path(directory))
    out: list[dict] = []
    names = segments(d)
    if since is not None:   # skip segments that end before `since` (the next one starts before it)
        starts = [_seg_time(n) for n in names]
        names = [n for i, n in enumerate(names) if i + 1 >= len(names) or starts[i + 1] >= since]
    for n in names + [CURRENT]:
        with contextlib.suppress(OSError):
            with open(os.path.join(d, n), encoding="utf-8", errors="replace") as f:
                out.extend(s for s in _parse(f.read()) if since is None or s["time"] >= since)
    out.sort(key=lambda s: s["time"])
    return out

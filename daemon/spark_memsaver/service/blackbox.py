"""The black box: while memory pressure lasts, one sample a second written durably (fsync), so that after a wedge
and a power cycle (NV_ERR_NO_MEMORY: no OOM kill, an empty pstore) `spark-memsaver history --boot -1` shows the
last minutes before it.

Started by the PSI trigger (service/floor.py; an idle node never wakes for it); stopped once no trigger event came
for QUIET_S seconds and PSI "some" avg10 is under 1 %. One file per boot, ``<boot_id>.jsonl`` in
host/paths.BLACKBOX_DIR, trimmed to the newest LIMIT samples when it reaches TRIM_AT; the newest BOOTS_KEPT files
are kept. Reading (``read_boot``) needs no daemon.
"""

from __future__ import annotations

import json
import logging
import os
import time

from spark_memsaver.host import boots as boots_, paths

log = logging.getLogger("spark_memsaver.blackbox")

LIMIT = 600            # samples kept per boot after a trim: 10 minutes at 1 Hz
TRIM_AT = 1200
BOOTS_KEPT = 4
QUIET_S = 10.0
boot_id = boots_.current          # host/boots.py: this boot's id, and one numbering of boots for every reader


def sample(host, now: float | None = None) -> dict:
    """What the black box keeps each second: MemFree, MemAvailable, page cache, anonymous, shmem, PSI memory."""
    from spark_memsaver.observe.procmem import parse_meminfo, parse_psi
    mi = parse_meminfo(host.read_text("/proc/meminfo") or "")
    psi = parse_psi(host.read_text("/proc/pressure/memory") or "")
    return {"time": round(time.time() if now is None else now, 3), "reason": "pressure",
            "mem_free": mi.get("MemFree"), "mem_available": mi.get("MemAvailable"), "cached": mi.get("Cached"),
            "anon": mi.get("AnonPages"), "shmem": mi.get("Shmem"),
            "psi_some_avg10": (psi.get("some") or {}).get("avg10"), "psi_full_avg10": (psi.get("full") or {}).get("avg10"),
            "psi_some_total_us": (psi.get("some") or {}).get("total")}


class BlackBox:
    def __init__(self, host, clock=time.monotonic):
        self.host, self.clock = host, clock
        self.boot = boot_id(host)
        self.timer = None
        self.last_event: float | None = None
        self.lines: int | None = None
        self.written = 0

    def path(self) -> str:
        return self.host.fspath(f"{paths.BLACKBOX_DIR}/{self.boot}.jsonl")

    def on_pressure(self) -> None:
        """A trigger event: record now, and each second until the pressure has subsided."""
        self.last_event = self.clock()
        if self.timer is not None or self.boot is None:
            return
        from gi.repository import GLib
        log.warning("memory pressure: black box recording at 1 Hz in %s", self.path())
        self.tick()
        self.timer = GLib.timeout_add_seconds(1, self.tick)

    def tick(self) -> bool:
        s = sample(self.host)
        self.write(s)
        quiet = self.last_event is None or self.clock() - self.last_event > QUIET_S
        if quiet and (s["psi_some_avg10"] or 0.0) < 1.0:
            log.info("memory pressure subsided: black box stopped after %d samples", self.written)
            self.timer = None
            return False
        return True

    def write(self, s: dict) -> None:
        """Append one line and fsync it (the point is to survive a power cycle); trim when the file is long."""
        path = self.path()
        try:
            if self.lines is None:
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                self._prune()
                self.lines = _count(path)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, (json.dumps(s, sort_keys=True) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            self.lines += 1
            self.written += 1
            if self.lines >= TRIM_AT:
                from spark_memsaver.host.fsutil import atomic_write
                with open(path, encoding="utf-8", errors="replace") as f:
                    keep = f.readlines()[-LIMIT:]
                atomic_write(path, "".join(keep), 0o644)
                self.lines = len(keep)
        except OSError as e:
            log.warning("black box: cannot write %s: %s", path, e.strerror or e)

    def _prune(self) -> None:
        for old in boots(self.host)[:-(BOOTS_KEPT - 1) or None]:
            if old != self.boot:
                try:
                    os.unlink(self.host.fspath(f"{paths.BLACKBOX_DIR}/{old}.jsonl"))
                except OSError:
                    pass


def _count(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def boots(host) -> list[str]:
    """Boot ids with a black-box file, oldest first (by their last write)."""
    return boots_.order(boots_.blackbox_files(host), None)


def read_boot(host, boot: int) -> tuple[str | None, list[dict]]:
    """(boot id, samples) of boot ``boot``: 0 this boot, -1 the one before (host/boots.py numbers boots by every
    record they left, the event log's included, so events --boot N names the same boot)."""
    from spark_memsaver.host import events
    bid = boots_.resolve(host, boot, events.read(host))
    if bid is None:
        return None, []
    out = []
    try:
        with open(host.fspath(f"{paths.BLACKBOX_DIR}/{bid}.jsonl"), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    s = json.loads(line)
                except ValueError:
                    continue            # a line cut by the power cycle
                if isinstance(s, dict):
                    out.append(s)
    except OSError:
        pass
    return bid, out

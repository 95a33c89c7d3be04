"""The memory-pressure watch: a PSI trigger, no timer. It starts the black box (service/blackbox.py) under
pressure, always; and the opt-in free-memory floor (config ``memory_floor``, off by default).

At daemon start, when the floor is set, a trigger is written to ``/proc/pressure/memory`` (``some 200000 2000000``:
200 ms of stall within 2 s) and the file descriptor is watched for POLLPRI on the main loop. The kernel wakes the
daemon only under pressure, so an idle node costs no wake-up at all. On a wake-up: MemFree below the floor starts
the ``prepare-launch`` job (act/reclaim.py, as ``reclaim --need FLOOR``), at most once a minute and never beside
another job; each action is one line in the journal. Nothing here imports act/ (the job does, in its thread).
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("spark_memsaver.floor")

PSI_MEMORY = "/proc/pressure/memory"
# stall threshold and window, microseconds: 200 ms of stall within 2 s. The window is a multiple of 2 s because the
# kernel refuses other windows (EINVAL) to a writer without CAP_SYS_RESOURCE, which spark-memsaverd's unit does
# not grant (CapabilityBoundingSet).
TRIGGER = b"some 200000 2000000"
MIN_GAP_S = 60.0                       # at most one reclaim a minute


def floor_bytes(value) -> int | None:
    """The configured floor in bytes; None when off."""
    if value in (None, "off"):
        return None
    from spark_memsaver.decide.memory import parse_size
    return parse_size(str(value))


def mem_free(host) -> int | None:
    from spark_memsaver.observe.procmem import parse_meminfo
    return parse_meminfo(host.read_text("/proc/meminfo") or "").get("MemFree")


class Floor:
    """``start_job(need_bytes)`` starts the reclaim (the daemon's job); it raises errors.Busy when a job runs."""

    def __init__(self, host, floor: int | None, start_job, clock=time.monotonic, on_pressure=None):
        self.host, self.floor, self.start_job, self.clock = host, floor, start_job, clock
        self.on_pressure = on_pressure        # the black box
        self.fd: int | None = None
        self.source = None
        self.wakeups = 0          # trigger events seen (the footprint: 0 on an idle node)
        self.actions = 0
        self.last: float | None = None

    def start(self) -> bool:
        """Register the trigger and watch it; False (logged) when the kernel offers none (no PSI, not root)."""
        path = self.host.fspath(PSI_MEMORY)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            os.write(self.fd, TRIGGER + b"\0")
        except OSError as e:
            (log.warning if self.floor else log.info)(
                "%s: no PSI trigger on %s (%s): no black box%s", self._what(), PSI_MEMORY, e.strerror or e,
                ", the floor is inactive" if self.floor else "")
            self.stop()
            return False
        from gi.repository import GLib
        self.source = GLib.unix_fd_add_full(GLib.PRIORITY_DEFAULT, self.fd,
                                            GLib.IOCondition.PRI | GLib.IOCondition.ERR, self._on_event)
        log.info("%s: PSI trigger '%s' on %s", self._what(), TRIGGER.decode(), PSI_MEMORY)
        return True

    def _what(self) -> str:
        return f"memory floor {self.floor >> 20} MiB" if self.floor else "memory pressure watch (no floor)"

    def stop(self) -> None:
        if self.source is not None:
            from gi.repository import GLib
            GLib.source_remove(self.source)
            self.source = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _on_event(self, _fd, cond) -> bool:
        from gi.repository import GLib
        self.wakeups += 1
        if cond & GLib.IOCondition.ERR:
            log.warning("memory pressure watch: the PSI trigger failed (POLLERR); it is inactive")
            self.source = None
            self.stop()
            return False
        if self.on_pressure is not None:
            self.on_pressure()
        self.check("memory pressure")
        return True

    def check(self, why: str) -> str:
        """Reclaim up to the floor when MemFree is below it; what was done, as a word (for the log and tests)."""
        if self.floor is None:
            return "off"
        free = mem_free(self.host)
        if free is None or free >= self.floor:
            return "above"
        now = self.clock()
        if self.last is not None and now - self.last < MIN_GAP_S:
            return "rate-limited"
        from spark_memsaver.errors import MemsaverError
        try:
            self.start_job(self.floor)
        except MemsaverError as e:       # Busy: another job runs; the next wake-up tries again
            log.info("memory floor: %s; MemFree %d MiB < %d MiB, not reclaiming now (%s)", why, free >> 20,
                     self.floor >> 20, e.message)
            return "busy"
        self.last = now
        self.actions += 1
        log.warning("memory floor: %s, MemFree %d MiB < floor %d MiB: reclaiming up to the floor", why, free >> 20,
                    self.floor >> 20)
        return "reclaiming"


def attach(core) -> Floor | None:
    """The daemon's pressure watch (service/daemon.py calls this once the monitor runs): the black box always, the
    floor when configured; None when the kernel offers no trigger."""
    from spark_memsaver.service.blackbox import BlackBox
    floor = floor_bytes(getattr(core.config, "memory_floor", "off"))

    def start_job(need: int) -> None:
        def run(progress):
            from spark_memsaver.service import operations
            return operations.run("prepare-launch", core.host, core.config, progress, need_bytes=need)
        core.jobs.start("prepare-launch", run, uid=0, then=core._after_job)

    f = Floor(core.host, floor, start_job, on_pressure=BlackBox(core.host).on_pressure)
    return f if f.start() else None

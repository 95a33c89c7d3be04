"""Monitoring: samples of the page-table counters and memory, a bounded history, Prometheus metrics, and the
event sources that wake the daemon (module uevents, new driver sources or kernels).

Event-driven by design: the only periodic timer is the sampling interval (config.interval, default 60 s,
GLib.timeout_add_seconds so wake-ups coalesce). Module load/unload arrives as a kernel uevent on netlink
(pyudev, ``source="kernel"``: works without udevd and in containers), driver sources and kernels as inotify
events (Gio.FileMonitor). A burst of file events is settled by one one-shot timer (SETTLE_S) that is armed
only by an event.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Callable

from spark_memsaver.decide.packing import packing_active  # noqa: F401  (the one reader: decide/packing.py)
from spark_memsaver.decide.ours import is_ours
from spark_memsaver.observe import snapshot as observe
from spark_memsaver.host import Host, paths

log = logging.getLogger("spark_memsaver.service.monitor")

# Kernel modules whose load/unload matters (uevent DEVPATH=/module/<name>, sys_name = module name).
WATCHED_MODULES = ("nvidia", "nvidia_uvm")
# Directories whose entries appear with a new driver source (/usr/src/nvidia-<ver>) or kernel (/lib/modules/<k>).
WATCHED_DIRS = ("/usr/src", "/lib/modules", paths.CACHE_DIR)
# In the cache only the record of a driver-source fetch the APT/dpkg doors deferred (act/source_fetch.defer)
# matters: the daemon runs it once apt has exited (service/daemon.py).
PENDING_NAME = os.path.basename(paths.SOURCES_PENDING)
# In /usr/src only these matter (driver sources, kernel headers); our own DKMS tree there is ignored so a
# build we run does not trigger a reconcile of itself.
SRC_PREFIXES = ("nvidia", "linux-headers")
SETTLE_S = 5


def take_sample(host: Host, reason: str) -> dict:
    """One sample: cheap reads only (sysfs counters, /proc/meminfo); safe on the main loop."""
    uvm = observe.observe_uvm(host)
    mem = observe.observe_memory(host, uvm)
    p = uvm.get("packing") or {}
    return {
        "time": round(time.time(), 3),
        "reason": reason,
        "mem_total": mem["total"],
        "mem_available": mem["available"],
        "uvm_loaded": uvm["loaded"],
        "uvm_patched": is_ours(uvm),
        "packing_active": packing_active(uvm),
        "tier": p.get("tier") if "error" not in p else None,
        "backing_bytes": mem["pagetable_backing"],
        "stock_bytes": mem["pagetable_stock_equivalent"],
        "saved_bytes": mem["saved"],
        "counters_error": p.get("error"),
        "_uvm": uvm,   # dropped from the history; the daemon merges it into the status document
        "_memory": memory_model(host, uvm),     # dropped from the history too: metrics, GetMemory, status
    }


def memory_model(host: Host, uvm: dict) -> dict | None:
    """The ``memory`` document (decide/memory.py) from /proc files only: no NVML (no ctypes in the daemon), no
    walk of the sysfs memory blocks. None when it cannot be read (the sample goes on without it)."""
    from spark_memsaver.decide import memory as decide
    from spark_memsaver.observe import memory as observe
    try:
        doc = decide.model(observe.read(host, gpu=False, blocks=False, uvm=uvm, pagetypes=False))
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("memory sample failed: %s", e)
        return None
    doc["gpu"] = {"state": "unknown", "reason": "spark-memsaverd does not load NVML (its footprint): "
                                                "'spark-memsaver memory' shows GPU allocations by process"}
    return doc if doc["total_bytes"] else None


def memory_json(host: Host) -> str:
    """D-Bus GetMemory: the ``memory --json`` document now, as the daemon can make it (memory_model)."""
    import json
    from spark_memsaver.errors import InspectionError
    doc = memory_model(host, observe.observe_uvm(host))
    if doc is None:
        raise InspectionError("/proc/meminfo is not readable", remedy="Nothing to do from here: see the daemon's log.")
    return json.dumps(doc)


# The history keeps each sample as a tuple in this field order (a dict per sample would cost ~2.5x the
# memory: 1440 samples = 24 h at the default interval).
FIELDS = ("time", "reason", "mem_total", "mem_available", "uvm_loaded", "uvm_patched", "packing_active", "tier",
          "backing_bytes", "stock_bytes", "saved_bytes", "counters_error", "error")


def pack(sample: dict) -> tuple:
    return tuple(sample.get(k) for k in FIELDS)


def unpack(row: tuple) -> dict:
    d = dict(zip(FIELDS, row))
    if d["error"] is None:
        del d["error"]
    return d


def write_atomic(path: str, text: str) -> None:
    """Write beside the target, then rename over it: node_exporter never reads a half-written file.
    Not fsynced: the file is rewritten every interval."""
    from spark_memsaver.host.fsutil import atomic_write

    atomic_write(path, text, 0o644, durable=False)


DEFAULT_TEXTFILE = "/var/lib/prometheus/node-exporter/spark-memsaver.prom"


class Monitor:
    """Owns the sampling timer, the history ring and the event watches. Main loop only."""

    def __init__(self, host: Host, config, *, on_sample: Callable[[dict], None],
                 on_module_event: Callable[[str, str], None], on_paths_changed: Callable[[list[str]], None],
                 state_of: Callable[[], str] = lambda: "unknown", version: str = "",
                 document_of: Callable[[], dict | None] = lambda: None):
        self.host = host
        self.config = config
        self.history: collections.deque = collections.deque(maxlen=config.history_size)
        self._events_key, self._events_rows = False, []     # the event log as last read (_events)
        self._memory = None                                  # the last sample's memory document (metrics)
        from spark_memsaver.service.history import History
        self.persisted = History(host, config.interval)   # STATE_DIR/history/: `spark-memsaver history` reads it
        self._on_sample = on_sample
        self._on_module_event = on_module_event
        self._on_paths_changed = on_paths_changed
        self._state_of = state_of
        self._document_of = document_of
        self._version = version
        self._timer = None
        self._settle = None
        self._changed_paths: list[str] = []
        self._udev = None
        self._udev_watch = None
        self._file_monitors = []
        self._prom_warned = False
        self.events_seen = 0

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._arm_timer()
        self._start_udev()
        self._start_file_monitors()

    def stop(self) -> None:
        from gi.repository import GLib

        for sid in (self._timer, self._settle, self._udev_watch):
            if sid:
                GLib.source_remove(sid)
        self._timer = self._settle = self._udev_watch = None
        for m in self._file_monitors:
            m.cancel()
        self._file_monitors = []
        self._udev = None

    def reconfigure(self, config) -> None:
        old = self.config
        self.config = config
        self.persisted.interval = config.interval
        if config.history_size != old.history_size:
            self.history = collections.deque(self.history, maxlen=config.history_size)
        if config.interval != old.interval:
            from gi.repository import GLib
            if self._timer:
                GLib.source_remove(self._timer)
            self._arm_timer()

    def _arm_timer(self) -> None:
        from gi.repository import GLib

        self._timer = GLib.timeout_add_seconds(self.config.interval, self._on_timer)

    def _on_timer(self) -> bool:
        self.sample("interval")
        return True

    # --- sampling ----------------------------------------------------------------------------------
    def sample(self, reason: str) -> dict:
        try:
            s = take_sample(self.host, reason)
        except Exception as e:  # never let a sampling bug stop the loop
            log.exception("sampling failed")
            s = {"time": round(time.time(), 3), "reason": reason, "error": f"{type(e).__name__}: {e}"}
        uvm = s.pop("_uvm", None)
        self._memory = s.pop("_memory", None)      # the memory document: metrics, the daemon's status
        self.history.append(pack(s))
        try:    # a failure here must not escape: GLib removes a timer whose callback raises (sampling stops)
            self.persisted.append(s)
            if self.textfile_path():
                self._write_prometheus(s)
            self._on_sample(dict(s, _uvm=uvm, _memory=self._memory))
        except Exception:
            log.exception("after sampling")
        return s

    def textfile_path(self) -> str | None:
        """Where the exposition goes: the configured file, 'off' for nowhere, and by default node_exporter's
        textfile directory when it exists (Debian's and Ubuntu's prometheus-node-exporter read it)."""
        configured = self.config.prometheus_textfile
        if configured == "off":
            return None
        if configured:
            return configured
        return DEFAULT_TEXTFILE if os.path.isdir(self.host.fspath(os.path.dirname(DEFAULT_TEXTFILE))) else None

    def _write_prometheus(self, s: dict | None = None) -> None:
        """Write the exposition (report/metrics.py) of the latest status document with this sample's time.
        Nothing is written before the first document: every write carries the full set of series."""
        path = self.textfile_path()
        doc = self._document_of()
        if path is None or doc is None:
            return
        from spark_memsaver.report.metrics import exposition

        s = s if s is not None else (unpack(self.history[-1]) if self.history else {})
        text = exposition(doc, sample_time=s.get("time"), sample=s, events=self._events(),
                          memory_doc=self._memory)
        path = self.host.fspath(path)
        try:
            write_atomic(path, text)
            self._prom_warned = False
        except OSError as e:
            if not self._prom_warned:   # once per failure streak, not once a minute
                log.warning("cannot write Prometheus textfile %s: %s", path, e.strerror or e)
                self._prom_warned = True

    def _events(self) -> list:
        """The lifecycle event log (host/events.read), read again only when it changed (size, mtime)."""
        from spark_memsaver.host import events
        try:
            st = os.stat(self.host.fspath(events.EVENTS))
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = None
        if key != self._events_key:
            self._events_key, self._events_rows = key, (events.read(self.host) if key is not None else [])
        return self._events_rows

    def document_changed(self) -> None:
        """Called by the daemon when a new status document is in: the textfile follows at once."""
        self._write_prometheus()

    def samples(self) -> list[dict]:
        return [unpack(r) for r in self.history]

    # --- module uevents (kernel netlink) -----------------------------------------------------------
    def _start_udev(self) -> None:
        from gi.repository import GLib

        try:
            import pyudev

            mon = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
            mon.filter_by("module")
            mon.start()
        except Exception as e:  # no netlink (sandbox), no libudev: run on, say so once
            log.warning("module events unavailable (%s: %s); module loads are seen at the next sample",
                        type(e).__name__, e)
            return
        self._udev = mon
        self._udev_watch = GLib.io_add_watch(mon.fileno(), GLib.PRIORITY_DEFAULT, GLib.IO_IN, self._on_udev_ready)
        log.debug("listening for module uevents on kernel netlink")

    def _on_udev_ready(self, _fd, _cond) -> bool:
        mon = self._udev
        if mon is None:
            return False
        while True:
            try:
                dev = mon.poll(timeout=0)
            except Exception as e:
                log.warning("reading a uevent failed: %s", e)
                break
            if dev is None:
                break
            self.events_seen += 1
            name, action = dev.sys_name, dev.action
            if name in WATCHED_MODULES and action in ("add", "remove"):
                log.info("uevent: module %s %s", name, action)
                try:
                    self._on_module_event(action, name)
                except Exception:
                    log.exception("handling the %s uevent of %s failed", action, name)
            else:
                log.debug("uevent: %s module %s (not watched)", action, name)
        return True

    # --- driver sources and kernels (inotify) ------------------------------------------------------
    def _start_file_monitors(self) -> None:
        from gi.repository import Gio

        for d in WATCHED_DIRS:
            path = self.host.fspath(d)
            if not os.path.isdir(path):
                log.debug("not watching %s: no such directory", path)
                continue
            try:
                m = Gio.File.new_for_path(path).monitor_directory(Gio.FileMonitorFlags.WATCH_MOVES, None)
            except Exception as e:
                log.warning("cannot watch %s: %s", path, e)
                continue
            m.connect("changed", self._on_file_changed)
            self._file_monitors.append(m)
            log.debug("watching %s", path)

    def _on_file_changed(self, _monitor, file, _other, event) -> None:
        from gi.repository import Gio, GLib

        relevant = (Gio.FileMonitorEvent.CREATED, Gio.FileMonitorEvent.DELETED, Gio.FileMonitorEvent.MOVED_IN,
                    Gio.FileMonitorEvent.MOVED_OUT, Gio.FileMonitorEvent.RENAMED)
        if event not in relevant:
            return
        p = file.get_path()
        if os.path.dirname(p) == self.host.fspath(paths.CACHE_DIR):
            # atomic_write renames a temp file into place: the new name is the event's other file
            name = os.path.basename(_other.get_path()) if _other is not None and _other.get_path() else \
                os.path.basename(p)
            if name != PENDING_NAME or event in (Gio.FileMonitorEvent.DELETED, Gio.FileMonitorEvent.MOVED_OUT):
                return
        if os.path.dirname(p) == self.host.fspath("/usr/src") and \
                not os.path.basename(p).startswith(SRC_PREFIXES):
            log.debug("file event %s: %s (ignored)", event.value_nick, p)
            return
        log.debug("file event %s: %s", event.value_nick, p)
        if p not in self._changed_paths:
            self._changed_paths.append(p)
        if self._settle is None:   # one-shot; further events in the window join this one
            self._settle = GLib.timeout_add_seconds(SETTLE_S, self._on_settled)

    def _on_settled(self) -> bool:
        self._settle = None
        paths, self._changed_paths = self._changed_paths, []
        log.info("driver sources / kernels changed: %s", ", ".join(paths))
        try:
            self._on_paths_changed(paths)
        except Exception:
            log.exception("handling changed paths failed")
        return False

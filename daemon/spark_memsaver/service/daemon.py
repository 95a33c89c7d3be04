"""spark-memsaverd: the system daemon. Owns ``names.BUS_NAME`` on the system bus and keeps the status fresh.

Shape (firewalld/fwupd): a GLib main loop on the main thread; signals through ``GLib.unix_signal_add``
(TERM/INT stop, HUP reloads the config); logs to stderr (the journal under systemd). The bus name is taken
first; the first status, the event watches and the start-up reconcile follow on the loop and in threads.

``Daemon`` is the core: the property cache, the status document, jobs and monitoring. ``dbus_service`` is the
thin adaptor in front of it, ``runtime`` the process (arguments, logging, the bus name, ``main``).

Idle footprint: the status document is computed in a child process (``statusproc``), operations import
their engines inside the job's worker thread (``operations``), uevents come from a plain netlink socket
(``uevents``): the resident daemon carries GLib, the monitor and little else.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time

from spark_memsaver import __version__
from spark_memsaver.errors import Busy, ConfigError, MemsaverError
from spark_memsaver.service import names, redact

log = logging.getLogger("spark_memsaver.service.daemon")

STOP_WAIT_S = 60   # on SIGTERM, how long a running job may take to finish before we exit anyway
# toward stock: run on the last good config when the file is bad (a reconcile then plans safety steps only)
from spark_memsaver.opnames import DAEMON_SAFETY as REMOVAL_OPS  # noqa: E402  (the one table of operations)
FETCH_POLL_S = 2   # while a deferred driver-source fetch waits for apt/dpkg to exit: how often to look


def _findings(doc: dict) -> list:
    return [(str(f.get("code", "")), str(f.get("severity", "")), redact.text(str(f.get("message", ""))),
             str(f.get("remedy", "") or "")) for f in doc.get("findings", [])]


def _u64(v) -> int:
    return max(0, int(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


class Daemon:
    """The core. Every method runs on the main loop unless its name says thread."""

    def __init__(self, root: str = "/", config_path: str | None = None, reconcile: bool = True,
                 monitor_factory=None):
        from spark_memsaver.host import Host
        from spark_memsaver.service.jobs import JobManager

        self.root, self.config_path = root, config_path
        self.host = Host(root)
        self.reconcile_enabled = reconcile
        self.monitor_factory = monitor_factory   # service/runtime.py injects its uevent monitor; else Monitor
        self.service = None            # the dbus_service.Publication
        self.loop = None
        self.doc: dict | None = None
        self.doc_time = 0.0
        self.last_sample: dict | None = None
        self._refresh_thread: threading.Thread | None = None
        self._refresh_again = False
        self._reconcile_pending = False
        self._fetch_timer = None       # polls the dpkg lock while a driver-source fetch waits for apt to exit
        self._stopping = False
        self.config = None             # statusproc.Settings: the file's, once the first status child has read it
        self.props = {
            "Version": __version__, "State": "starting", "Findings": [], "KernelRelease": "",
            "DriverVersion": "", "UvmPatched": False, "PackingActive": False, "BackingBytes": 0, "SavedBytes": 0,
            "SecureBootState": "unknown", "LastError": "", "LastErrorName": "", "Interval": 0,
            "HeldBy": "", "HeldSince": "",
            "JobId": 0, "JobOperation": "", "JobState": "none", "JobFraction": 0.0, "JobMessage": "",
        }
        self.jobs = JobManager(self._on_job)
        self.monitor = None
        self._history_text = None      # histjson.HistoryText, made on the first history reply

    # --- properties --------------------------------------------------------------------------------
    def set_props(self, **values) -> None:
        changed = {k: v for k, v in values.items() if self.props.get(k) != v}
        if not changed:
            return
        self.props.update(changed)
        if self.service is not None:
            self.service.properties_changed(changed)

    def _set_error(self, e: MemsaverError | dict | None) -> None:
        if e is None:
            self.set_props(LastError="", LastErrorName="")
        elif isinstance(e, dict):
            self.set_props(LastError=redact.text(e.get("message", "")),
                           LastErrorName=e.get("dbus_name") or names.error_name(str(e.get("name") or "Failed")))
        else:
            self.set_props(LastError=redact.text(e.message), LastErrorName=names.error_name(e))

    # --- config and status -------------------------------------------------------------------------
    def reload(self) -> bool:
        """SIGHUP: re-read the config (the status child reads it), apply it, refresh the status."""
        log.info("reloading the configuration")
        self.refresh_status("reload")
        return True   # keep the signal source

    def _apply_config(self, ans: dict) -> None:
        from spark_memsaver.service.statusproc import Settings

        if ans.get("config_error"):
            e = ans["config_error"]
            log.error("config: %s (%s)", e.get("message"), "keeping the previous one" if self.config else "using the defaults")
            self._set_error(e)
            if self.config is not None:
                return
        if not ans.get("config"):
            return
        new = Settings(ans["config"])
        if not ans.get("config_error") and self.props["LastErrorName"] == names.error_name("ConfigError"):
            self._set_error(None)   # the file is good again
        if self.config is None or new != self.config or new.source != self.config.source:
            self.config = new
            if self.monitor is not None:
                self.monitor.reconfigure(new)
            self.set_props(Interval=new.interval)

    def _status_answer(self) -> dict:
        """Thread: the status child's answer (config + document)."""
        from spark_memsaver.service import statusproc

        return statusproc.compute(self.root, self.config_path, self.config.to_dict() if self.config else None)

    def refresh_status(self, reason: str) -> None:
        """Recompute the status document in a thread; concurrent requests coalesce into one re-run."""
        if self._refresh_thread is not None:
            self._refresh_again = True
            return
        log.debug("status refresh (%s)", reason)
        self._refresh_thread = threading.Thread(target=self._refresh_thread_main, name="status", daemon=True)
        self._refresh_thread.start()

    def _refresh_thread_main(self) -> None:
        from gi.repository import GLib

        GLib.idle_add(self._refresh_done, self._status_answer())

    def _refresh_done(self, ans: dict) -> bool:
        self._refresh_thread = None
        self.apply_answer(ans)
        if self._refresh_again:
            self._refresh_again = False
            self.refresh_status("coalesced")
        return False

    def apply_answer(self, ans: dict) -> None:
        self._apply_config(ans)
        if ans.get("doc") is not None:
            self.apply_doc(ans["doc"])
        else:
            err = ans.get("error") or {"message": "no status"}
            log.warning("status refresh failed: %s", err.get("message"))
            self._set_error(err)
            if self.doc is None:
                self.set_props(State="needs-attention")
        if self.monitor is None and not self._stopping:
            self._start_monitor()

    def apply_doc(self, doc: dict) -> None:
        from spark_memsaver.decide.ours import is_ours
        from spark_memsaver.decide.packing import packing_active

        first = self.doc is None
        self.doc, self.doc_time = doc, time.time()
        mem, uvm = doc.get("memory") or {}, doc.get("uvm") or {}
        hold = doc.get("hold") if isinstance(doc.get("hold"), dict) else {}
        self.set_props(
            Interval=self.config.interval,
            State=str(doc.get("state") or "unknown"), Findings=_findings(doc),
            KernelRelease=str((doc.get("host") or {}).get("kernel") or ""),
            DriverVersion=str((doc.get("driver") or {}).get("loaded_version") or ""),
            UvmPatched=bool(uvm.get("loaded") and is_ours(uvm)), PackingActive=packing_active(uvm),
            BackingBytes=_u64(mem.get("pagetable_backing")), SavedBytes=_u64(mem.get("saved")),
            SecureBootState=str((doc.get("secure_boot") or {}).get("state") or "unknown"),
            HeldBy=str(hold.get("by") or ""), HeldSince=str(hold.get("since") or ""))
        if self.monitor is not None:
            self.monitor.document_changed()   # the Prometheus textfile follows the new document
        if first:
            log.info("state: %s", self.props["State"])
            if self.reconcile_enabled:
                self.request_reconcile("start")

    def status_json(self, full: bool = True) -> str:
        if self.doc is None:
            raise Busy("spark-memsaverd is starting; the first status is not ready yet",
                       remedy="Retry in a moment, or run 'spark-memsaver status --direct'.")
        doc = copy.deepcopy(self.doc)
        s = self.last_sample
        if s is not None and s.get("time", 0) >= self.doc_time and "error" not in s:
            uvm = s.get("_uvm") or {}
            doc["memory"].update({"total": s["mem_total"], "available": s["mem_available"],
                                  "pagetable_backing": s["backing_bytes"],
                                  "pagetable_stock_equivalent": s["stock_bytes"], "saved": s["saved_bytes"]})
            m = s.get("_memory") or {}                  # status's Memory line: MemFree and the free blocks
            doc["memory"].update({"free": m.get("free_now_bytes"), "free_blocks": m.get("free_blocks")} if m else {})
            if uvm.get("loaded") == doc["uvm"].get("loaded"):
                doc["uvm"]["packing"] = uvm.get("packing")
        doc["source"] = "daemon"
        if time.time() - self.doc_time > self.config.interval:
            self.refresh_status("stale on GetStatus")
        return json.dumps(doc if full else redact.document(doc))

    def history_json(self, since: float | None = None, limit: int | None = None) -> str:
        """The newest ``limit`` samples at or after ``since``, oldest first; each encoded once (histjson)."""
        if self._history_text is None:
            from spark_memsaver.service.histjson import HistoryText
            self._history_text = HistoryText()
        return self._history_text.reply(self.monitor.history if self.monitor else (), since, limit)

    def job_json(self, job_id: int, full: bool = True) -> str:
        from spark_memsaver.service.jobs import KEEP_FINISHED

        job = self.jobs.get(int(job_id))
        if job is None:
            from spark_memsaver.service.dbus_service import NotFound
            raise NotFound(f"no job {job_id} (the daemon keeps the last {KEEP_FINISHED} finished jobs)")
        return json.dumps(job.to_dict() if full else redact.value(job.to_dict()))

    # --- monitoring --------------------------------------------------------------------------------
    def _start_monitor(self) -> None:
        if self.config is None:   # no status child answered: sample on the defaults
            from spark_memsaver.service.statusproc import default_settings
            self.config = default_settings()
            self.set_props(Interval=self.config.interval)
        if self.monitor_factory is None:
            from spark_memsaver.service.monitor import Monitor
            self.monitor_factory = Monitor
        self.monitor = self.monitor_factory(self.host, self.config, on_sample=self.on_sample,
                                       on_module_event=self.on_module_event, on_paths_changed=self.on_paths_changed,
                                       state_of=lambda: self.props["State"], version=__version__,
                                       document_of=lambda: self.doc)
        self.monitor.start()
        self.monitor.sample("start")
        from spark_memsaver.service import floor    # config memory_floor: a PSI trigger, or nothing
        self.floor = floor.attach(self)

    def on_sample(self, s: dict) -> None:
        self.last_sample = s
        if "error" in s:
            return
        self.set_props(UvmPatched=bool(s["uvm_loaded"] and s["uvm_patched"]), PackingActive=s["packing_active"],
                       BackingBytes=_u64(s["backing_bytes"]), SavedBytes=_u64(s["saved_bytes"]))

    def on_module_event(self, action: str, name: str) -> None:
        self.monitor.sample(f"module {name} {action}")
        self.refresh_status(f"module {name} {action}")

    def on_paths_changed(self, paths: list[str]) -> None:
        if self.reconcile_enabled:
            self.request_reconcile("driver sources or kernels changed")
        else:
            self.refresh_status("paths changed")

    # --- jobs --------------------------------------------------------------------------------------
    def _on_job(self, job, event: str) -> None:
        message = redact.text(job.message)
        self.set_props(JobId=job.id, JobOperation=job.operation, JobState=job.state,
                       JobFraction=float(job.progress), JobMessage=message)
        if self.service is None:
            return
        if event in ("progress", "started"):
            self.service.emit("JobProgress", job.id, float(job.progress), message)
        elif event == "finished":
            err = job.error or {}
            payload = redact.value(job.result if job.error is None else job.error)   # a signal reaches everyone
            self.service.emit("JobFinished", job.id, job.operation, job.state == "succeeded",
                              err.get("dbus_name", ""), message, json.dumps(payload))
            self._set_error(job.error)

    def _check_accepting(self) -> None:
        if self._stopping:
            raise Busy("spark-memsaverd is stopping", remedy="Retry after it has restarted.")

    def _job_config(self, op: str):
        """Thread: the config an operation acts on, read from the file now (an edit is never missed)."""
        from spark_memsaver import config as cfg

        try:
            return cfg.load(self.config_path, root=self.root)
        except ConfigError as e:
            if op in REMOVAL_OPS:   # toward stock is always safe: the last good config, marked (no builds)
                from spark_memsaver.record import replace
                good = self.config.to_config() if self.config is not None else cfg.Config()
                return replace(good, invalid=cfg.invalid_dict(e))
            raise

    def start_operation(self, op: str, kwargs: dict, caller) -> int:
        """Start ``op`` (service/operations.py) as a job; returns its id at once."""
        self._check_accepting()
        kwargs.pop("progress", None)
        if op == "rollback":
            kwargs.setdefault("reason", f"requested over D-Bus by uid {caller.uid}")
        host = self.host

        def run(progress):
            from spark_memsaver.service import operations
            return operations.run(op, host, self._job_config(op), progress, **kwargs)

        return self.jobs.start(op, run, uid=caller.uid, then=self._after_job).id

    def start_refresh(self, caller) -> int:
        """Refresh as a job (a real, harmless one): re-read the host and the config, publish the new status."""
        self._check_accepting()
        out = {}

        def run(progress):
            progress(0.05, "reading the host")
            out["ans"] = ans = self._status_answer()
            progress(0.9, "evaluating")
            if ans.get("doc") is None:
                raise MemsaverError.from_dict(ans.get("error") or {})
            return {"state": ans["doc"].get("state"), "findings": [f.get("code") for f in ans["doc"].get("findings", [])]}

        def then(job):
            if "ans" in out:
                self.apply_answer(out["ans"])
                self.monitor and self.monitor.sample("refresh")
            self._after_job(job, refresh=False)

        return self.jobs.start("refresh", run, uid=caller.uid, then=then).id

    def request_reconcile(self, why: str) -> None:
        """Run the executor's reconcile as a job; later if a job runs."""
        if self._stopping:
            return
        if self.jobs.busy:
            self._reconcile_pending = True
            return
        log.info("reconcile: %s", why)
        host = self.host

        def run(progress):
            from spark_memsaver.service import operations
            return operations.run("reconcile", host, self._job_config("reconcile"), progress)

        self.jobs.start("reconcile", run, uid=0, then=self._after_job)

    def _after_job(self, job, refresh: bool = True) -> None:
        if job.state == "succeeded":
            self._set_error(None)
        if self._stopping:
            self.loop.quit()
            return
        if refresh:
            self.refresh_status(f"after {job.operation}")
        if self._reconcile_pending:
            self._reconcile_pending = False
            self.request_reconcile("deferred")
        self.arm_deferred_fetch()

    # --- a driver-source fetch the APT/dpkg doors deferred (act/source_fetch.defer) -------------------------
    def arm_deferred_fetch(self) -> None:
        """Inside the doors apt holds its locks, so the fetch was recorded instead (a file in the cache, which the
        monitor watches; its appearance runs a reconcile, which defers again while dpkg runs, then lands here).
        Poll, without taking it, whether apt/dpkg still hold the dpkg lock; once they exit, reconcile (it
        fetches and builds). Armed only while such a record exists: no timer otherwise."""
        if not self.reconcile_enabled or self._stopping or self._fetch_timer is not None:
            return
        from spark_memsaver.observe.sources import pending
        if pending(self.host) is None:
            return
        from gi.repository import GLib
        self._fetch_timer = GLib.timeout_add_seconds(FETCH_POLL_S, self.poll_deferred_fetch)

    def poll_deferred_fetch(self) -> bool:
        from spark_memsaver.host.locks import dpkg_running
        from spark_memsaver.observe.sources import pending
        if self._stopping or pending(self.host) is None:
            self._fetch_timer = None
            return False
        if dpkg_running(self.host):
            return True                  # apt/dpkg still run: ask again in FETCH_POLL_S
        self._fetch_timer = None
        self.request_reconcile("apt/dpkg exited: fetching the driver source the APT/dpkg doors deferred")
        return False

    # --- run ---------------------------------------------------------------------------------------
    def stop(self) -> bool:
        if self._stopping:
            log.info("second stop request: exiting now")
            self.loop.quit()
            return True
        self._stopping = True
        job = self.jobs.current
        if job is None:
            self.loop.quit()
        else:
            from gi.repository import GLib
            log.warning("stopping: waiting up to %d s for job %d '%s' to finish", STOP_WAIT_S, job.id, job.operation)
            GLib.timeout_add_seconds(STOP_WAIT_S, self.loop.quit)
        return True

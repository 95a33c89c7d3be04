"""spark-memsaverd: the system daemon. Owns ``names.BUS_NAME`` on the system bus and keeps the status fresh.

Shape (firewalld/fwupd): a GLib main loop on the main thread; signals through ``GLib.unix_signal_add``
(TERM/INT stop, HUP reloads the config); logs to stderr (the journal under systemd). The bus name is taken
first, within a second; the first status snapshot, the event watches and the start-up reconcile follow on
the loop and in threads, so a slow host never delays activation.

``Daemon`` is the core: the property cache, the status document, jobs and monitoring. ``dbus_service`` is
the thin adaptor in front of it.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import inspect
import json
import logging
import os
import sys
import threading
import time

from spark_memsaver import __version__
from spark_memsaver.service import names
from spark_memsaver.errors import ConfigError, MemsaverError, Unsupported

log = logging.getLogger("spark_memsaver.service.daemon")

# D-Bus operation -> (module, function) provided by the other parts of the package, looked up when called.
OPERATIONS = {
    "build": ("act.dkms", "build"),
    "install": ("act.dkms", "install"),
    "remove": ("act.dkms", "remove"),
    "activate": ("act.lifecycle", "activate"),
    "rollback": ("act.lifecycle", "rollback"),
    "request-enrollment": ("act.mok", "request_enrollment"),
    "reconcile": ("act.lifecycle", "reconcile"),
}

STOP_WAIT_S = 60   # on SIGTERM, how long a running job may take to finish before we exit anyway


def resolve_operation(op: str):
    """The callable behind an operation, or Unsupported (named) when its module or function is absent."""
    modname, fname = OPERATIONS[op]
    full = f"spark_memsaver.{modname}"
    try:
        mod = importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name == full:
            raise Unsupported(f"'{op}' is not available: this build of spark-memsaver has no {modname} module",
                              remedy="Install the complete spark-memsaver package.")
        raise
    fn = getattr(mod, fname, None)
    if not callable(fn):
        raise Unsupported(f"'{op}' is not available: {modname}.{fname} is missing",
                          remedy="Install the complete spark-memsaver package.")
    return fn


def operation_available(op: str):
    """Cheap check on the main loop: the callable when its module is already imported, None when the module
    exists but is not imported yet (the worker imports it, so a slow import never blocks the loop), and
    Unsupported when the module is absent."""
    full = f"spark_memsaver.{OPERATIONS[op][0]}"
    if full in sys.modules:
        return resolve_operation(op)
    if importlib.util.find_spec(full) is None:
        raise Unsupported(f"'{op}' is not available: this build of spark-memsaver has no {OPERATIONS[op][0]} "
                          "module", remedy="Install the complete spark-memsaver package.")
    return None


def call_operation(op: str, fn, host, config, progress, **kwargs):
    """Worker side: import if needed, pass ``progress`` when the function takes it."""
    fn = fn or resolve_operation(op)
    extra = {"progress": progress} if _accepts(fn, "progress") else {}
    return fn(host, config, **kwargs, **extra)


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _findings(doc: dict) -> list:
    return [(str(f.get("code", "")), str(f.get("severity", "")), str(f.get("message", "")),
             str(f.get("remedy", "") or "")) for f in doc.get("findings", [])]


def _u64(v) -> int:
    return max(0, int(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


class Daemon:
    """The core. Every method runs on the main loop unless its name says thread."""

    def __init__(self, root: str = "/", config_path: str | None = None, reconcile: bool = True):
        from spark_memsaver.host import Host

        self.root = root
        self.config_path = config_path
        self.host = Host(root)
        self.reconcile_enabled = reconcile
        self.service = None            # the published dbus_service.Manager
        self.loop = None
        self.doc: dict | None = None
        self.doc_time = 0.0
        self.last_sample: dict | None = None
        self._refresh_thread: threading.Thread | None = None
        self._refresh_again = False
        self._reconcile_pending = False
        self._stopping = False
        self.props = {
            "Version": __version__, "State": "starting", "Findings": [], "KernelRelease": "",
            "DriverVersion": "", "UvmPatched": False, "PackingActive": False, "BackingBytes": 0, "SavedBytes": 0,
            "SecureBootState": "unknown", "LastError": "", "LastErrorName": "", "Interval": 60,
            "JobId": 0, "JobOperation": "", "JobState": "none", "JobFraction": 0.0, "JobMessage": "",
        }
        self._config_stamp = self._config_file_stamp()
        self.config = self._load_config(initial=True)
        self.props["Interval"] = self.config.interval
        from spark_memsaver.service.jobs import JobManager
        self.jobs = JobManager(self._on_job)
        self.monitor = None

    # --- config ------------------------------------------------------------------------------------
    def _load_config(self, initial: bool = False):
        from spark_memsaver import config as cfg

        try:
            return cfg.load(self.config_path, root=self.root)
        except ConfigError as e:
            log.error("config: %s (%s)", e.message, "using the defaults" if initial else "keeping the previous one")
            self._set_error(e)
            return cfg.Config() if initial else self.config

    def _config_file_stamp(self):
        """Identity of the config file as it is now (None when absent): one stat, no read."""
        from spark_memsaver import config as cfg

        path = self.config_path or os.environ.get(cfg.ENV_VAR) or cfg.DEFAULT_PATH
        if not (self.config_path or os.environ.get(cfg.ENV_VAR)) and self.root != "/":
            path = os.path.join(self.root, path.lstrip("/"))
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _current_config(self):
        """The config an operation must act on: re-read first if the file changed since it was loaded,
        so an edit followed by an operation never acts on the old policy (no SIGHUP needed)."""
        stamp = self._config_file_stamp()
        if stamp != self._config_stamp:
            self._config_stamp = stamp
            self.reload()
        return self.config

    def reload(self) -> bool:
        """SIGHUP: re-read the config, apply it, refresh the status."""
        self._config_stamp = self._config_file_stamp()
        log.info("reloading the configuration")
        new = self._load_config()
        if new is not self.config and self.props["LastErrorName"] == names.error_name("ConfigError"):
            self._set_error(None)   # the file is good again
        if new is not self.config:
            self.config = new
            if self.monitor is not None:
                self.monitor.reconfigure(new)
            self.set_props(Interval=new.interval)
        self.refresh_status("reload")
        return True   # keep the signal source

    # --- properties --------------------------------------------------------------------------------
    def set_props(self, **values) -> None:
        changed = {k: v for k, v in values.items() if self.props.get(k) != v}
        if not changed:
            return
        self.props.update(changed)
        if self.service is not None:
            self.service.PropertiesChanged(names.INTERFACE, changed, [])

    def _set_error(self, e: MemsaverError | dict | None) -> None:
        if e is None:
            self.set_props(LastError="", LastErrorName="")
        elif isinstance(e, dict):
            self.set_props(LastError=e.get("message", ""), LastErrorName=e.get("dbus_name", names.ERROR_FAILED))
        else:
            self.set_props(LastError=e.message, LastErrorName=names.error_name(e))

    # --- status ------------------------------------------------------------------------------------
    def refresh_status(self, reason: str) -> None:
        """Recompute the status document in a thread; concurrent requests coalesce into one re-run."""
        if self._refresh_thread is not None:
            self._refresh_again = True
            return
        log.debug("status refresh (%s)", reason)
        self._refresh_thread = threading.Thread(target=self._refresh_thread_main, name="status", daemon=True)
        self._refresh_thread.start()

    def _compute_status(self):
        from spark_memsaver.report.document import status

        return status(self.host, self.config)

    def _refresh_thread_main(self) -> None:
        from gi.repository import GLib

        try:
            doc, _ = self._compute_status()
            GLib.idle_add(self._refresh_done, doc, None)
        except MemsaverError as e:
            GLib.idle_add(self._refresh_done, None, e)
        except Exception as e:
            log.exception("status refresh failed")
            GLib.idle_add(self._refresh_done, None, MemsaverError(f"internal error: {type(e).__name__}: {e}"))

    def _refresh_done(self, doc, err) -> bool:
        self._refresh_thread = None
        if doc is not None:
            self.apply_doc(doc)
        else:
            log.warning("status refresh failed: %s", err.message)
            self._set_error(err)
            if self.doc is None:
                self.set_props(State="needs-attention")
        if self._refresh_again:
            self._refresh_again = False
            self.refresh_status("coalesced")
        return False

    def apply_doc(self, doc: dict) -> None:
        first = self.doc is None
        self.doc, self.doc_time = doc, time.time()
        mem, uvm = doc.get("memory") or {}, doc.get("uvm") or {}
        from spark_memsaver.service.monitor import packing_active
        self.set_props(
            State=str(doc.get("state") or "unknown"), Findings=_findings(doc),
            KernelRelease=str((doc.get("host") or {}).get("kernel") or ""),
            DriverVersion=str((doc.get("driver") or {}).get("loaded_version") or ""),
            UvmPatched=bool(uvm.get("loaded") and uvm.get("patched")), PackingActive=packing_active(uvm),
            BackingBytes=_u64(mem.get("pagetable_backing")), SavedBytes=_u64(mem.get("saved")),
            SecureBootState=str((doc.get("secure_boot") or {}).get("state") or "unknown"))
        if first:
            log.info("state: %s", self.props["State"])
            if self.reconcile_enabled:
                self.request_reconcile("start")

    def status_json(self) -> str:
        if self.doc is None:
            from spark_memsaver.errors import Busy
            raise Busy("spark-memsaverd is starting; the first status is not ready yet",
                       remedy="Retry in a moment, or run 'spark-memsaver status --direct'.")
        doc = copy.deepcopy(self.doc)
        s = self.last_sample
        if s is not None and s.get("time", 0) >= self.doc_time and "error" not in s:
            uvm = s.get("_uvm") or {}
            doc["memory"].update({"total": s["mem_total"], "available": s["mem_available"],
                                  "pagetable_backing": s["backing_bytes"],
                                  "pagetable_stock_equivalent": s["stock_bytes"], "saved": s["saved_bytes"]})
            if uvm.get("loaded") == doc["uvm"].get("loaded"):
                doc["uvm"]["packing"] = uvm.get("packing")
        doc["source"] = "daemon"
        if time.time() - self.doc_time > self.config.interval:
            self.refresh_status("stale on GetStatus")
        return json.dumps(doc)

    def history_json(self) -> str:
        return json.dumps(self.monitor.samples() if self.monitor else [])

    def job_json(self, job_id: int) -> str:
        job = self.jobs.get(int(job_id))
        if job is None:
            from spark_memsaver.service.dbus_service import NotFound
            from spark_memsaver.service.jobs import KEEP_FINISHED
            raise NotFound(f"no job {job_id} (the daemon keeps the last {KEEP_FINISHED} finished jobs)")
        return json.dumps(job.to_dict())

    # --- monitoring --------------------------------------------------------------------------------
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
        self.set_props(JobId=job.id, JobOperation=job.operation, JobState=job.state,
                       JobFraction=float(job.progress), JobMessage=job.message)
        if self.service is None:
            return
        if event == "progress" or event == "started":
            self.service.JobProgress(job.id, float(job.progress), job.message)
        elif event == "finished":
            err = job.error or {}
            self.service.JobFinished(job.id, job.operation, job.state == "succeeded", err.get("dbus_name", ""),
                                     job.message, json.dumps(job.result if job.error is None else job.error))
            self._set_error(job.error)

    def _check_accepting(self) -> None:
        if self._stopping:
            from spark_memsaver.errors import Busy
            raise Busy("spark-memsaverd is stopping", remedy="Retry after it has restarted.")

    def start_operation(self, op: str, kwargs: dict, caller) -> int:
        """Start one of OPERATIONS as a job; returns its id at once."""
        self._check_accepting()
        fn = operation_available(op)
        kwargs.pop("progress", None)
        if op == "rollback":
            kwargs.setdefault("reason", f"requested over D-Bus by uid {caller.uid}")
        host, config = self.host, self._current_config()
        job = self.jobs.start(op, lambda progress: call_operation(op, fn, host, config, progress, **kwargs),
                              uid=caller.uid, then=self._after_job)
        return job.id

    def start_refresh(self, caller) -> int:
        """Refresh as a job (a real, harmless one): re-read the host and publish the new status."""
        self._check_accepting()
        self._current_config()   # a refresh re-reads everything, the config file included
        out = {}

        def run(progress):
            progress(0.05, "reading the host")
            doc, verdict = self._compute_status()
            progress(0.9, "evaluating")
            out["doc"] = doc
            return {"state": verdict.state, "findings": [f.code for f in verdict.findings]}

        def then(job):
            if "doc" in out:
                self.apply_doc(out["doc"])
                self.monitor and self.monitor.sample("refresh")
            self._after_job(job, refresh=False)

        return self.jobs.start("refresh", run, uid=caller.uid, then=then).id

    def request_reconcile(self, why: str) -> None:
        """Run lifecycle.reconcile as a job when it exists; later if a job runs; a refresh otherwise."""
        if self._stopping:
            return
        try:
            fn = operation_available("reconcile")
        except Unsupported:
            self.refresh_status(why)
            return
        except Exception as e:   # a broken lifecycle module: say so, keep observing
            log.exception("reconcile unavailable")
            self._set_error(MemsaverError(f"reconcile unavailable: {type(e).__name__}: {e}"))
            self.refresh_status(why)
            return
        if self.jobs.busy:
            self._reconcile_pending = True
            return
        log.info("reconcile: %s", why)
        host, config = self.host, self._current_config()
        self.jobs.start("reconcile", lambda progress: call_operation("reconcile", fn, host, config, progress),
                        uid=0, then=self._after_job)

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

    def _start_background(self) -> bool:
        from spark_memsaver.service.monitor import Monitor

        self.monitor = Monitor(self.host, self.config, on_sample=self.on_sample,
                               on_module_event=self.on_module_event, on_paths_changed=self.on_paths_changed,
                               state_of=lambda: self.props["State"], version=__version__)
        self.monitor.start()
        self.monitor.sample("start")
        self.refresh_status("start")
        return False

    def run(self) -> int:
        from gi.repository import GLib
        import pydbus
        import signal

        from spark_memsaver.service import dbus_service

        logging.getLogger("pydbus.registration").setLevel(logging.CRITICAL)  # we log errors ourselves
        try:
            bus = pydbus.SystemBus()
        except GLib.Error as e:
            log.error("cannot connect to the system bus: %s", e.message)
            return 1
        self.loop = GLib.MainLoop()
        self.service = dbus_service.make_manager_class()(self)
        registration = bus.register_object(names.OBJECT_PATH, self.service, None)
        try:
            request_name(bus.con)
        except (RuntimeError, GLib.Error) as e:
            log.error("cannot own %s on the system bus: %s", names.BUS_NAME, getattr(e, "message", e))
            registration.unregister()
            return 1
        log.info("spark-memsaverd %s owns %s (object %s)", __version__, names.BUS_NAME, names.OBJECT_PATH)
        for sig in (signal.SIGTERM, signal.SIGINT):
            GLib.unix_signal_add(GLib.PRIORITY_HIGH, sig, self.stop)
        GLib.unix_signal_add(GLib.PRIORITY_HIGH, signal.SIGHUP, self.reload)
        GLib.idle_add(self._start_background)
        try:
            self.loop.run()
        finally:
            if self.monitor is not None:
                self.monitor.stop()
            registration.unregister()
        log.info("stopped")
        return 0


def request_name(con) -> None:
    """Own BUS_NAME, refusing replacement and queueing (a second daemon fails instead of waiting).

    Called directly rather than through pydbus's request_name, which builds an introspected proxy of the
    bus driver (a megabyte of Python objects kept for the life of the process)."""
    from gi.repository import Gio, GLib

    DO_NOT_QUEUE = 4
    reply = con.call_sync("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "RequestName",
                          GLib.Variant("(su)", (names.BUS_NAME, DO_NOT_QUEUE)), GLib.VariantType.new("(u)"),
                          Gio.DBusCallFlags.NONE, 10000, None).unpack()[0]
    if reply != 1:   # 1 = primary owner; 3 = exists; 4 = already ours
        raise RuntimeError({3: "the name is already owned by another process",
                            4: "this connection already owns it"}.get(reply, f"RequestName answered {reply}"))


def trim_footprint() -> None:
    """Keep the resident daemon small (it exists to save memory).

    - No OpenSSL: hashlib falls back to Python's built-in sha2/sha3/blake2/md5 when ``_hashlib`` cannot be
      imported; nothing in the daemon needs an OpenSSL-only digest (signing runs in subprocesses). Saves the
      ~3 MiB libcrypto mapping that importing hashlib would otherwise pull in.
    - One malloc arena per process instead of one per thread (the job, status and GDBus threads would each
      get a 64 MiB arena whose touched pages stay resident).
    """
    sys.modules.setdefault("_hashlib", None)
    try:
        import ctypes

        M_ARENA_MAX = -8
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        pass


class _JournalFormatter(logging.Formatter):
    """``<N>`` syslog priority prefixes, which the journal reads from a service's stderr."""

    LEVELS = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record):
        return f"<{self.LEVELS.get(record.levelno, 6)}>{super().format(record)}"


def setup_logging(debug: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="spark-memsaverd",
                                description=f"spark-memsaver daemon: owns {names.BUS_NAME} on the system bus.")
    p.add_argument("--debug", action="store_true", help="log debug messages (every command, every uevent)")
    p.add_argument("--root", default="/", help="inspect the system under this root prefix (tests, images)")
    p.add_argument("--config", default=None, help="config file [default: /etc/spark-memsaver/config.yaml]")
    p.add_argument("--no-reconcile", action="store_true",
                   help="do not run lifecycle reconcile at start or on driver/kernel changes (observe only)")
    p.add_argument("--version", action="version", version=f"spark-memsaverd {__version__}")
    args = p.parse_args(argv)
    trim_footprint()
    setup_logging(args.debug)
    d = Daemon(root=args.root, config_path=args.config, reconcile=not args.no_reconcile)
    sys.exit(d.run())


if __name__ == "__main__":
    main()

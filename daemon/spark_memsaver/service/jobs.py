"""Long operations off the main loop: one job at a time, in a worker thread, reported back on the loop.

pydbus cannot defer a method reply, so a method that starts a build returns a job id at once and the
outcome follows as signals and properties (udisks' Job pattern, flattened onto the one object).

Threading rule: only the main (GLib) thread touches D-Bus objects. The worker writes the job's progress
under a lock and asks the loop, through ``GLib.idle_add``, to publish it; updates that arrive faster than
the loop publishes them coalesce into the latest one.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from spark_memsaver.service import names
from spark_memsaver.errors import Busy, MemsaverError

log = logging.getLogger("spark_memsaver.service.jobs")

RUNNING, SUCCEEDED, FAILED = "running", "succeeded", "failed"
KEEP_FINISHED = 32   # finished jobs kept for GetJob()


class Job:
    """One operation's record. A plain class (not a dataclass: dataclasses would cost the idle daemon ~1 MiB)."""

    __slots__ = ("id", "operation", "uid", "started", "finished", "state", "progress", "message", "result", "error")

    def __init__(self, id: int, operation: str, uid: int | None):
        self.id, self.operation, self.uid = id, operation, uid
        self.started: float = time.time()
        self.finished: float | None = None
        self.state = RUNNING
        self.progress = 0.0
        self.message = ""
        self.result = None
        self.error: dict | None = None

    def to_dict(self) -> dict:
        return {"id": self.id, "operation": self.operation, "uid": self.uid, "state": self.state,
                "progress": round(self.progress, 4), "message": self.message,
                "started": round(self.started, 3),
                "finished": round(self.finished, 3) if self.finished else None,
                "result": self.result, "error": self.error}


def error_dict(e: BaseException) -> dict:
    """What a failed job reports: the D-Bus error name plus the named error's code, message and remedy."""
    if isinstance(e, MemsaverError):
        d = e.to_dict()
        d["dbus_name"] = names.error_name(e)
        d["exit_code"] = e.exit_code
        return d
    return {"code": "internal-error", "name": "Failed", "dbus_name": names.ERROR_FAILED, "exit_code": 3,
            "message": f"internal error: {type(e).__name__}: {e}",
            "remedy": "See 'journalctl -u spark-memsaverd.service' and report it as a bug."}


class JobManager:
    """Runs at most one job. ``on_update(job, event)`` is called on the main loop, event in
    ``started``, ``progress``, ``finished``."""

    def __init__(self, on_update: Callable[[Job, str], None], idle_add: Callable | None = None):
        if idle_add is None:
            from gi.repository import GLib
            idle_add = GLib.idle_add
        self._idle_add = idle_add
        self._on_update = on_update
        self._lock = threading.Lock()
        self._next_id = 1
        self.current: Job | None = None
        self._finished: collections.OrderedDict[int, Job] = collections.OrderedDict()
        self._progress_pending = False

    @property
    def busy(self) -> bool:
        return self.current is not None

    def get(self, job_id: int) -> Job | None:
        if self.current is not None and self.current.id == job_id:
            return self.current
        return self._finished.get(job_id)

    def last(self) -> Job | None:
        if self.current is not None:
            return self.current
        return next(reversed(self._finished.values()), None) if self._finished else None

    def start(self, operation: str, fn: Callable[[Callable[[float, str], None]], Any],
              uid: int | None = None, then: Callable[[Job], None] | None = None) -> Job:
        """Start ``fn(progress)`` in a worker thread; raises Busy when a job runs. Main loop only."""
        if self.current is not None:
            cur = self.current
            raise Busy(f"another operation is running: job {cur.id} '{cur.operation}' "
                       f"({cur.progress * 100:.0f} %: {cur.message or 'started'})")
        job = Job(self._next_id, operation, uid)
        self._next_id += 1
        self.current = job
        log.info("job %d: %s started (uid %s)", job.id, operation, uid)
        self._on_update(job, "started")
        t = threading.Thread(target=self._run, args=(job, fn, then), name=f"job-{job.id}-{operation}",
                             daemon=True)
        t.start()
        return job

    # --- worker side -------------------------------------------------------------------------------
    def _progress(self, job: Job) -> Callable[[float, str], None]:
        def progress(*args, fraction=None, message=None) -> None:
            # progress(fraction, message) is the contract; progress(message) and progress(fraction) are
            # accepted too, so an operation's way of reporting never fails it.
            for a in args:
                if isinstance(a, str):
                    message = a
                elif isinstance(a, (int, float)) and not isinstance(a, bool):
                    fraction = a
            with self._lock:
                if fraction is not None:
                    try:
                        job.progress = min(1.0, max(0.0, float(fraction)))
                    except (TypeError, ValueError):
                        pass
                if message is not None:
                    job.message = str(message)[:500]
                if self._progress_pending:
                    return
                self._progress_pending = True
            self._idle_add(self._publish_progress, job)
        return progress

    def _publish_progress(self, job: Job) -> bool:
        with self._lock:
            self._progress_pending = False
        if job.state == RUNNING:
            self._on_update(job, "progress")
        return False

    def _run(self, job: Job, fn, then) -> None:
        try:
            result = fn(self._progress(job))
            outcome = (SUCCEEDED, _jsonable(result), None)
        except MemsaverError as e:
            log.warning("job %d: %s failed: [%s] %s", job.id, job.operation, e.code, e.message)
            outcome = (FAILED, None, error_dict(e))
        except Exception as e:  # a bug in an operation must not take the daemon down
            log.exception("job %d: %s failed with an internal error", job.id, job.operation)
            outcome = (FAILED, None, error_dict(e))
        self._idle_add(self._finish, job, outcome, then)

    def _finish(self, job: Job, outcome, then) -> bool:
        job.state, job.result, job.error = outcome
        job.finished = time.time()
        if job.state == SUCCEEDED:
            job.progress = 1.0
            job.message = "done"
        else:
            job.message = job.error["message"]
        self.current = None
        self._finished[job.id] = job
        while len(self._finished) > KEEP_FINISHED:
            self._finished.popitem(last=False)
        log.info("job %d: %s %s in %.1f s", job.id, job.operation, job.state, job.finished - job.started)
        self._on_update(job, "finished")
        if then is not None:
            try:
                then(job)
            except Exception:
                log.exception("job %d: follow-up failed", job.id)
        return False


def _jsonable(value):
    """Results travel as JSON; anything exotic becomes its string form."""
    import json

    if value is None:
        return None
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return str(value)

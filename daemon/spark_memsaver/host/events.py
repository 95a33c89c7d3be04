"""The lifecycle event log: one JSON object a line in STATE_DIR/events.jsonl, append-only and bounded.

Written through :func:`record` only (act/executor.py calls it once per finished operation; MOK enrollment
requests should call it too). A line is written with one ``write()`` on an O_APPEND descriptor, so a reader
sees whole lines; a line torn by a crash is skipped when read. When the file passes :data:`MAX_BYTES` it is
rewritten atomically (fsutil.atomic_write) keeping its newest half. Recording never fails the operation: an
unwritable log is logged and reported as False.

Read back, a line is used only when it is an event as :func:`event_of` writes it (a JSON object, ``time`` a UTC
time between the epoch and 2100, ``op`` a string, ``error`` an object, ``steps`` a list of objects, strings or
numbers elsewhere); anything else is skipped and counted (:func:`read_counted`), never shown half-read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

from spark_memsaver.host import paths
from spark_memsaver.host.fsutil import atomic_write, loads_strict

log = logging.getLogger(__name__)

EVENTS = paths.EVENTS
MAX_BYTES = 1 << 20          # ~5000 events; the newest half is kept when it is passed
KINDS = ("build", "install", "remove", "activate", "rollback", "reconcile", "apt-pre-install", "enroll",
         "enroll-delete")
_ARGS = ("kernel", "driver_version", "driver", "all_kernels", "force", "reason", "code")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _short(v, n=500):
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= n else s[:n] + "..."


def event_of(op: str, args: dict | None = None, result: dict | None = None, error: BaseException | None = None) \
        -> dict:
    """The event for one finished operation (pure)."""
    ev: dict = {"time": _now(), "op": op}
    for k in _ARGS:
        v = (args or {}).get(k)
        if v not in (None, False, ""):
            ev[k] = v if isinstance(v, (str, int, float, bool)) else _short(v)
    if error is not None:
        ev["ok"] = False
        ev["error"] = {"code": getattr(error, "code", type(error).__name__), "message": _short(str(error))}
        return ev
    result = result or {}
    ev["ok"] = bool(result.get("ok", True))
    steps = result.get("steps") or []
    if steps:
        ev["steps"] = [{k: s.get(k) for k in ("action", "kernel", "ok") if s.get(k) is not None}
                       for s in steps if isinstance(s, dict)][:50]
    for k in ("changes", "recovered"):
        if result.get(k):
            ev[k] = _short(result[k])
    for k in ("kernel", "driver_version", "srcversion", "path"):
        if isinstance(result.get(k), (str, int)) and k not in ev:
            ev[k] = result[k]
    return ev


def record(host, op: str, args: dict | None = None, result: dict | None = None,
           error: BaseException | None = None) -> bool:
    """Append the event of one finished operation. Never raises for I/O; returns whether it was written."""
    if op not in KINDS:
        raise ValueError(f"unknown event kind {op!r}")
    line = (json.dumps(event_of(op, args, result, error), sort_keys=True, default=str) + "\n").encode()
    p = str(host.path(EVENTS, follow=False))   # the log itself is never followed: O_NOFOLLOW below
    try:
        os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, line)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size > MAX_BYTES:
            _trim(p)
        return True
    except OSError as e:
        log.warning("cannot record the %s event in %s: %s", op, p, e.strerror or e)
        return False


def _trim(p: str) -> None:
    with open(p, "rb") as f:
        data = f.read()
    keep = data[len(data) - MAX_BYTES // 2:]
    nl = keep.find(b"\n")
    atomic_write(p, keep[nl + 1:] if nl >= 0 else b"", 0o644)


def read(host, since: float | None = None) -> list[dict]:
    """Every whole, parsable event, oldest first (``since``: epoch seconds)."""
    return read_counted(host, since)[0]


def read_counted(host, since: float | None = None) -> tuple[list[dict], int]:
    """``read``, and how many lines were skipped as unreadable (not an event; a torn last line is not counted)."""
    out, skipped = [], 0
    with contextlib.suppress(FileNotFoundError):
        with open(host.path(EVENTS), "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # a line torn by a crash
                if not raw.strip():
                    continue
                try:
                    ev = loads_strict(raw.decode())
                except (ValueError, UnicodeDecodeError, RecursionError):
                    ev = None
                t = _epoch(ev.get("time")) if _well_formed(ev) else None
                if t is None:
                    skipped += 1
                elif since is None or t >= since:
                    out.append(ev)
    return out, skipped


def _well_formed(ev) -> bool:
    if not isinstance(ev, dict) or not isinstance(ev.get("op"), str):
        return False
    if "error" in ev and not isinstance(ev["error"], dict):
        return False
    if "steps" in ev and not (isinstance(ev["steps"], list) and all(isinstance(s, dict) for s in ev["steps"])):
        return False
    return all(isinstance(v, (str, int, float, bool)) or v is None
               for k, v in ev.items() if k not in ("error", "steps"))


def _epoch(t) -> float | None:
    """Epoch seconds of an event's UTC time; None unless it is one, between the epoch and 2100."""
    import calendar
    try:
        v = float(calendar.timegm(time.strptime(t, "%Y-%m-%dT%H:%M:%SZ")))
    except (TypeError, ValueError, OverflowError):
        return None
    return v if 0 <= v < 4102444800 else None

"""The one lifecycle event log: one JSON object a line in STATE_DIR/events.jsonl, append-only and bounded.

Every lifecycle line goes through :func:`_append`, the one writer: an operation's event (:func:`record`:
act/executor.py calls it once per finished operation), and what happens inside one or around it
(:func:`note`: a plan step that acted, a hook run, a rollback record written or cleared). A line is written
with one ``write()`` on an O_APPEND descriptor and fsynced, under an advisory lock on the log that only the
rotation needs (a writer that finds the log renamed under it reopens it), so lines written by two processes at
once -- the lifecycle lock's holder and a hook outside it -- are both kept, and a reader sees whole lines; a line
torn by a crash is skipped when read. When the file passes :data:`MAX_BYTES` it is rewritten atomically
(fsutil.atomic_write) keeping its newest half. Recording never fails the operation: an unwritable log is
logged and reported as False.

Older installs kept the lines of :func:`note` in a second file, STATE_DIR/history.jsonl (``"event"`` instead of
``"op"``; a step's action as its event). Until a writer folds it into the log (in time order, then removes it:
:func:`_migrate`), readers read it as the log's older segment, so nothing an older version recorded is lost,
also on an image that is only inspected (``--root``; readers never write).

Read back, a line is used only when it is an event as this module writes it (a JSON object, ``time`` a UTC
time between the epoch and 2100, ``op`` a string, ``error`` an object, ``steps`` a list of objects, the
:data:`LISTS` fields lists of strings, strings or numbers elsewhere); anything else is skipped and counted
(:func:`read_counted`), never shown half-read.
"""

from __future__ import annotations

import json
import logging
import os
import time

from spark_memsaver.errors import MemsaverError
from spark_memsaver.host import paths
from spark_memsaver.opnames import EVENT_KINDS
from spark_memsaver.host.fsutil import atomic_write, loads_strict

log = logging.getLogger(__name__)

EVENTS = paths.EVENTS
LEGACY = paths.LEGACY_HISTORY   # an older install's second log, read and folded in (above)
MAX_BYTES = 1 << 20          # ~5000 events; the newest half is kept when it is passed
KINDS = EVENT_KINDS         # opnames.py: the executor's operations and the enrollment's (enroll, enroll-cancel)
# what :func:`note` records: a plan step that acted (``action``), a dpkg/kernel/APT hook's run (``source``), a
# rollback record written (its fields) or cleared
NOTES = ("step", "hook", "rolled-back", "rollback-cleared")
LISTS = ("packages", "sources_seen", "removed", "kept")    # the APT door's lists of names
_ARGS = ("kernel", "driver_version", "driver", "all_kernels", "force", "reason", "code", "cert")
LOCK_WAIT = 5.0              # seconds a writer waits for a rotation; then it appends without the lock
REOPENS = 20                 # a log replaced under the writer more often than this is not a rotation
OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class EventLogUnstable(MemsaverError):
    """The log's path named another file after each of :data:`REOPENS` opens: something keeps replacing it."""

    code = "event-log-unstable"
    remedy = ("Check what replaces /var/lib/spark-memsaver/events.jsonl (ls -l it: it must be a regular file "
              "owned by root); the operation itself was not affected.")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _short(v, n=500):
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= n else s[:n] + "..."


def _field(k, v):
    if k in LISTS and isinstance(v, (list, tuple)):
        return [_short(x, 200) for x in v][:200]
    return v if isinstance(v, (int, float, bool)) or v is None else _short(v)


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
    for k in ("kernel", "driver_version", "srcversion", "path", "sha256", "state_before", "state_now"):
        if isinstance(result.get(k), (str, int)) and k not in ev:
            ev[k] = result[k]
    for k in LISTS:
        if isinstance(result.get(k), (list, tuple)):
            ev[k] = _field(k, result[k])
    return ev


def record(host, op: str, args: dict | None = None, result: dict | None = None,
           error: BaseException | None = None) -> bool:
    """Append the event of one finished operation. Never raises for I/O; returns whether it was written."""
    if op not in KINDS:
        raise ValueError(f"unknown event kind {op!r}")
    return _append(host, event_of(op, args, result, error))


def note(host, kind: str, **fields) -> bool:
    """Append one line of what happened inside or around an operation (:data:`NOTES`). Never raises for I/O."""
    if kind not in NOTES:
        raise ValueError(f"unknown event kind {kind!r}")
    ev = {"time": _now(), "op": kind}
    ev.update({k: _field(k, v) for k, v in fields.items() if v is not None and not k.startswith("_")
               and k not in ("op", "time", "event")})
    return _append(host, ev)


def _open_locked(p: str, flags: int = OPEN_FLAGS) -> int:
    """An O_APPEND descriptor of the log, flocked when the lock comes within LOCK_WAIT; reopened when a rotation
    renamed a new file over the one it opened, at most :data:`REOPENS` times (then :class:`EventLogUnstable`)."""
    import fcntl
    deadline = time.monotonic() + LOCK_WAIT
    for _ in range(REOPENS):
        fd = os.open(p, flags, 0o644)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return fd           # a stuck holder never stops recording: append unlocked
                time.sleep(0.01)
        try:
            same = os.stat(p, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
    raise EventLogUnstable(f"{p} named another file after each of {REOPENS} opens", path=p)


def _append(host, ev: dict) -> bool:
    from spark_memsaver.host.boots import current
    boot = current(host)                    # events --boot N and history --boot N number boots alike (host/boots)
    if boot is not None:
        ev = {**ev, "boot": boot}
    line = (json.dumps(ev, sort_keys=True, default=str) + "\n").encode()
    p = host.fspath(EVENTS, follow=False)   # the log itself is never followed: O_NOFOLLOW above
    try:
        os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
        fd = _open_locked(p)
        legacy = host.fspath(LEGACY, follow=False)
        if os.path.lexists(legacy):
            try:
                _migrate(p, legacy)       # a new file is renamed over the log: append to that one
            except OSError as e:          # the line is still written; the older file is still read
                log.warning("cannot fold %s into %s: %s", legacy, p, e.strerror or e)
            else:
                os.close(fd)
                fd = _open_locked(p)
        try:
            os.write(fd, line)
            os.fsync(fd)
            if os.fstat(fd).st_size > MAX_BYTES:
                _trim(p)
        finally:
            os.close(fd)          # the lock goes with it, after a rotation's rename
        return True
    except OSError as e:
        log.warning("cannot record the %s event in %s: %s", ev.get("op"), p, e.strerror or e)
        return False
    except EventLogUnstable as e:
        log.warning("cannot record the %s event: error[%s]: %s", ev.get("op"), e.code, e)
        return False


def _trim(p: str) -> None:
    with open(p, "rb") as f:
        data = f.read()
    keep = data[len(data) - MAX_BYTES // 2:]
    nl = keep.find(b"\n")
    atomic_write(p, keep[nl + 1:] if nl >= 0 else b"", 0o644)


def _migrate(p: str, legacy: str) -> None:
    """Fold an older install's history.jsonl into the log, in time order, then remove it (the caller holds the
    log's lock). A line that cannot be read is kept as it was (readers skip and count it, as before)."""
    fd = os.open(legacy, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)   # a link is never copied into the log
    with os.fdopen(fd, "rb") as f:
        cut = max(0, os.fstat(f.fileno()).st_size - MAX_BYTES)    # an older install kept 500 lines; more is not ours
        f.seek(max(0, cut - 1))                    # from the byte before the cut: does the cut split a line?
        data = f.read()
        if cut:                                    # drop the line the cut went through; one it starts is whole
            data = data[data.find(b"\n") + 1:] if b"\n" in data else b""
        old = [_converted(raw) for raw in data.splitlines() if raw.strip()]
    with open(p, "rb") as f:
        cur = [raw for raw in f.read().splitlines() if raw.strip()]
    lines = sorted(old + cur, key=_line_time)      # stable: the older file's line first at the same second
    atomic_write(p, b"".join(ln + b"\n" for ln in lines), 0o644)
    os.unlink(legacy)


def _converted(raw: bytes) -> bytes:
    """An older history.jsonl line as a line of the log: ``event`` becomes ``op``; a step's action is kept."""
    try:
        ev = loads_strict(raw.decode())
    except (ValueError, UnicodeDecodeError, RecursionError):
        return raw
    ev = _legacy_event(ev)
    return raw if ev is None else json.dumps(ev, sort_keys=True).encode()


def _legacy_event(ev):
    if not isinstance(ev, dict) or not isinstance(ev.get("event"), str) or "op" in ev:
        return None
    ev = dict(ev)
    name = ev.pop("event")
    if name in NOTES or name in KINDS:
        ev["op"] = name
    else:
        ev["op"], ev["action"] = "step", name
    return ev


def _line_time(raw: bytes) -> float:
    try:
        t = epoch(loads_strict(raw.decode()).get("time"))
    except (ValueError, UnicodeDecodeError, RecursionError, AttributeError):
        t = None
    return -1.0 if t is None else t


def as_json(host, since: float | None = None, limit: int = 100) -> str:
    """The newest ``limit`` events at or after ``since``, oldest first, as JSON (D-Bus GetEvents)."""
    return json.dumps(read(host, since)[-limit:] if limit > 0 else [])


def read(host, since: float | None = None) -> list[dict]:
    """Every whole, parsable event, oldest first (``since``: epoch seconds)."""
    return read_counted(host, since)[0]


def read_counted(host, since: float | None = None) -> tuple[list[dict], int]:
    """``read``, and how many lines were skipped as unreadable (not an event; a torn last line is not counted).
    An older install's history.jsonl still there is read first, as the log's older segment."""
    out, skipped = [], 0
    older = _read_file(host, LEGACY, since, legacy=True)
    if older[0] or older[1]:
        out, skipped = older
    rows, bad = _read_file(host, EVENTS, since)
    if out:
        out = sorted(out + rows, key=lambda e: epoch(e["time"]))    # stable: older first at the same second
    else:
        out = rows
    return out, skipped + bad


def _read_file(host, rel: str, since: float | None, legacy: bool = False) -> tuple[list[dict], int]:
    out, skipped = [], 0
    try:   # the older file is never followed (a link there is not ours: neither shown nor folded in)
        f = open(host.fspath(rel), "rb") if not legacy else os.fdopen(
            os.open(host.fspath(rel, follow=False), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")
    except FileNotFoundError:
        return out, skipped
    except OSError:
        if not legacy:
            raise
        return out, skipped
    with f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break  # a line torn by a crash
            ev, t = _line(raw, legacy)
            if t is None:
                skipped += raw.strip() != b""
            elif since is None or t >= since:
                out.append(ev)
    return out, skipped


def _line(raw: bytes, legacy: bool = False) -> tuple[dict | None, float | None]:
    """One line of the log: (the event, its epoch), or (None, None) for an empty or unreadable line."""
    if not raw.strip():
        return None, None
    try:
        ev = loads_strict(raw.decode())
    except (ValueError, UnicodeDecodeError, RecursionError):
        ev = None
    if legacy:
        ev = _legacy_event(ev)
    t = epoch(ev.get("time")) if _well_formed(ev) else None
    return (ev, t) if t is not None else (None, None)


class Index:
    """The log for a long-lived reader (the daemon's GetEvents): each event parsed once and kept as its epoch and
    its JSON text, brought up to date at each call from the file itself -- lines appended since are the only bytes
    read; a file replaced (a rotation or a migration renames a new one over it) or shorter is read again whole.
    Never a re-parse of the whole log per call (issue 35 item 5: ~70 ms a call on a 1 MiB log). While an older
    install's history.jsonl is there it is read whole, as :func:`read` does (the next write folds it in).
    Holds what the log holds (MAX_BYTES and a line)."""

    def __init__(self, host):
        self.host = host
        self._key = None            # (st_dev, st_ino) of the file read
        self._off = 0               # bytes of it read: whole lines only
        self._rows: list[tuple[float, str]] = []
        self.skipped = 0
        self.whole_reads = 0        # how often the whole file was read (tests and benchmarks say so)

    def refresh(self) -> None:
        if os.path.lexists(self.host.fspath(LEGACY, follow=False)):
            rows, self.skipped = read_counted(self.host)
            self._rows, self._key, self._off = [(epoch(e["time"]), json.dumps(e)) for e in rows], None, 0
            self.whole_reads += 1
            return
        try:
            f = open(self.host.fspath(EVENTS), "rb")
        except FileNotFoundError:
            self._rows, self._key, self._off, self.skipped = [], None, 0, 0
            return
        with f:
            st = os.fstat(f.fileno())
            if (st.st_dev, st.st_ino) != self._key or st.st_size < self._off:
                self._rows, self._key, self._off, self.skipped = [], (st.st_dev, st.st_ino), 0, 0
                self.whole_reads += 1
            if st.st_size == self._off:
                return
            if self._off:                         # rewritten in place? the line read last must still end there
                f.seek(self._off - 1)
                if f.read(1) != b"\n":
                    self._rows, self._off, self.skipped = [], 0, 0
                    self.whole_reads += 1
            f.seek(self._off)
            data = f.read(min(st.st_size - self._off, 4 * MAX_BYTES))
            end = data.rfind(b"\n") + 1          # a torn last line is read again when it is whole
            for raw in data[:end].splitlines(keepends=True):
                ev, t = _line(raw)
                if t is not None:
                    self._rows.append((t, json.dumps(ev)))
                else:
                    self.skipped += raw.strip() != b""
            self._off += end
            if len(self._rows) > 4 * MAX_BYTES // 64:   # more lines than the log can hold: keep the newest
                del self._rows[:len(self._rows) - 4 * MAX_BYTES // 64]

    def as_json(self, since: float | None = None, limit: int = 100) -> str:
        """What :func:`as_json` answers, from the index: the newest ``limit`` events at or after ``since``."""
        self.refresh()
        out: list[str] = []
        for t, text in reversed(self._rows):
            if len(out) >= limit:
                break
            if since is None or t >= since:
                out.append(text)
        return "[" + ", ".join(reversed(out)) + "]"


def _well_formed(ev) -> bool:
    if not isinstance(ev, dict) or not isinstance(ev.get("op"), str):
        return False
    if "error" in ev and not isinstance(ev["error"], dict):
        return False
    if "steps" in ev and not (isinstance(ev["steps"], list) and all(isinstance(s, dict) for s in ev["steps"])):
        return False
    if any(k in ev and not (isinstance(ev[k], list) and all(isinstance(x, str) for x in ev[k])) for k in LISTS):
        return False
    return all(isinstance(v, (str, int, float, bool)) or v is None
               for k, v in ev.items() if k not in ("error", "steps") + LISTS)


def epoch(t) -> float | None:
    """Epoch seconds of an event's UTC time ('2026-12-02T12:00:05Z', as _now writes it); None unless it is one,
    between the epoch and 2100. timefmt, not time.strptime: the daemon reads the log for its textfile and GetEvents,
    and strptime would load _strptime, calendar, datetime and locale into it."""
    from spark_memsaver.timefmt import utc_epoch
    v = utc_epoch(t) if isinstance(t, str) and t.endswith("Z") else None
    return v if v is not None and 0 <= v < 4102444800 else None

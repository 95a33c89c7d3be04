"""Intent and rollback records: what a multi-step operation is doing, written before it does it.

Every multi-step operation (register, build, install, remove, rollback) writes an *intent* record under
``/var/lib/spark-memsaver/intents/`` before its first side effect and deletes it after its last one. A
record still present at the next start means the operation was interrupted (power cut, kill -9, OOM); the
reconciler (reconcile.py) then finishes or undoes it. *Rollback* records
(``/var/lib/spark-memsaver/rollbacks/<kernel>.json``) say why our module was taken away from a kernel;
they are what ``status`` reports as ``rolled-back`` until the patch is back.

Writes are atomic: a temporary file in the same directory, fsync, rename over the target, fsync of the
directory. A reader therefore sees the old record or the new one, never a torn one; a record that is
still unreadable (disk corruption, a hand edit) is reported and replaced, never trusted.

Record fields (schema 1), kept compatible with observe.observe_records / decide.evaluate:
  intent:   schema, id, op, kernel, started, pid, phase, driver_version, reason, details
  rollback: schema, kernel, time, reason, remedy, from_driver, to_driver, code
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re

from spark_memsaver.host import Host
from spark_memsaver.host.locks import start_time as _start_time
from spark_memsaver.host.fsutil import atomic_write, fsync_dir  # noqa: F401  (atomic_write is used by lifecycle)
from spark_memsaver.host import paths

STATE_DIR = paths.STATE_DIR   # host/paths.py is the one list
INTENTS = paths.INTENTS   # host/paths.py is the one list
ROLLBACKS = paths.ROLLBACKS   # host/paths.py is the one list
SCHEMA = 1
from spark_memsaver.opnames import INTENT_KINDS as OPS  # noqa: E402  (the one list)
_SAFE = re.compile(r"[^A-Za-z0-9._+-]")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _name(s: str | None) -> str:
    return _SAFE.sub("_", s or "all")


def _unlink(path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(os.path.dirname(os.fspath(path)))
    return True


def _load_dir(host: Host, kind: str) -> tuple[list[dict], list[str]]:
    """(valid records, paths of bad ones): host/records.py's typed reader, the one for every record kind."""
    from spark_memsaver.host import records
    bad: list = []
    good = records.read_dir(host, kind, bad)
    for rec in good:
        rec.setdefault("id", os.path.basename(rec["_path"])[:-5])
    return good, [b["path"] for b in bad]


# --- intents -------------------------------------------------------------------------------------

def intent_id(op: str, kernel: str | None) -> str:
    return f"{op}-{_name(kernel)}"


def write_intent(host: Host, op: str, kernel: str | None = None, phase: str = "started", **details) -> dict:
    if op not in OPS:
        raise ValueError(f"unknown operation {op!r}")
    iid = intent_id(op, kernel)
    rec = {"schema": SCHEMA, "id": iid, "op": op, "kernel": kernel, "started": now(), "pid": os.getpid(),
           "start_time": _start_time(os.getpid()), "phase": phase}
    rec.update({k: v for k, v in details.items() if v is not None})
    atomic_write(host.path(f"{INTENTS}/{iid}.json"), json.dumps(rec, indent=1, sort_keys=True) + "\n")
    return rec


def update_intent(host: Host, rec: dict, **changes) -> dict:
    rec = {k: v for k, v in rec.items() if not k.startswith("_")}
    rec.update(changes)
    atomic_write(host.path(f"{INTENTS}/{rec['id']}.json"), json.dumps(rec, indent=1, sort_keys=True) + "\n")
    return rec


def clear_intent(host: Host, rec_or_id) -> bool:
    iid = rec_or_id["id"] if isinstance(rec_or_id, dict) else rec_or_id
    return _unlink(host.path(f"{INTENTS}/{iid}.json"))


def list_intents(host: Host) -> tuple[list[dict], list[str]]:
    """(readable intents, paths of unreadable ones)."""
    return _load_dir(host, "intent")


@contextlib.contextmanager
def intent(host: Host, op: str, kernel: str | None = None, **details):
    """Write an intent before the body runs; delete it when the body completes.

    If the body raises, the record stays (with the error) so the next reconcile finishes or undoes it.
    """
    rec = write_intent(host, op, kernel, **details)
    try:
        yield rec
    except BaseException as e:
        with contextlib.suppress(Exception):
            update_intent(host, rec, phase="failed", error=f"{type(e).__name__}: {e}"[:500])
        raise
    clear_intent(host, rec)


# --- rollbacks -----------------------------------------------------------------------------------

def write_rollback(host: Host, kernel: str, reason: str, remedy: str = "", code: str = "rolled-back",
                   **details) -> dict:
    rec = {"schema": SCHEMA, "kernel": kernel, "time": now(), "reason": reason, "remedy": remedy, "code": code}
    rec.update({k: v for k, v in details.items() if v is not None})
    atomic_write(host.path(f"{ROLLBACKS}/{_name(kernel)}.json"), json.dumps(rec, indent=1, sort_keys=True) + "\n")
    from spark_memsaver.host import events
    events.note(host, "rolled-back", **rec)
    return rec


def clear_rollback(host: Host, kernel: str) -> bool:
    if _unlink(host.path(f"{ROLLBACKS}/{_name(kernel)}.json")):
        from spark_memsaver.host import events
        events.note(host, "rollback-cleared", kernel=kernel)
        return True
    return False


def list_rollbacks(host: Host) -> tuple[list[dict], list[str]]:
    return _load_dir(host, "rollback")

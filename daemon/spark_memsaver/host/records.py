"""Typed reading of every on-disk record the product reads (issue 12 defect 3), and its one quarantine.

A record that is not valid JSON, not a JSON object, or whose fields have the wrong type is never trusted
and never crashes a reader. Reading only reports it (``observe_records()['quarantined']``, the status finding
``record-quarantined``; ``moved_to`` None): an inspection -- ``status``, also ``status --root IMAGE`` -- never
renames or writes. The planner then plans a ``drop-record`` step, and the executor (the daemon's reconcile,
any root operation through act/executor.perform) sets it aside with :func:`quarantine`: renamed to
``<name>.bad-<UTC time>`` (kept for a human, never deleted). Fields a record may lack stay optional, so
records written by 0.1.0 read unchanged (tests/test_records_compat.py). Writers go through fsutil.atomic_write.
"""

from __future__ import annotations

import json
import os

from spark_memsaver.host import paths

_S, _I, _N = str, int, type(None)
_STRS = (_S, _N)
_ANY = object

# kind -> (required {field: types}, optional {field: types})
SPECS: dict[str, tuple[dict, dict]] = {
    "intent": ({"op": (_S,)}, {"id": _STRS, "kernel": _STRS, "pid": (_I, _N), "start_time": (_S, _I, _N),
                               "phase": _STRS, "started": _STRS, "schema": (_I, _N), "driver_version": _STRS,
                               "reason": _STRS, "error": _STRS}),
    "rollback": ({"kernel": (_S,)}, {"reason": _STRS, "remedy": _STRS, "code": _STRS, "time": _STRS,
                                     "schema": (_I, _N), "from_driver": _STRS, "to_driver": _STRS,
                                     "driver_from": _STRS, "driver_to": _STRS}),
    "stock": ({"kernel": (_S,)}, {"stock_path": _STRS, "stock_sha256": _STRS, "stock_version": _STRS,
                                  "stock_owner_dkms": (_S, dict, list, _N), "recorded": _STRS}),
    "build": ({"kernel": (_S,)}, {"driver": _STRS, "time": _STRS, "schema": (_I, _N)}),
    "signing": ({"key": (_S,), "cert": (_S,)}, {"format": (_I, _N), "subject": _STRS, "serial": _STRS,
                                               "sha256": _STRS, "source": _STRS, "updated": _STRS,
                                               "created_by_spark_memsaver": (bool, _N),
                                               "changes_global_signing": (bool, _N)}),
    "signed-log": ({"signed": (list,)}, {"format": (_I, _N)}),
    "validate": ({"outcome": (_S,)}, {"outcome": _STRS, "reason": _STRS, "finished_at": _STRS, "started_at": _STRS}),
    "mok-request": ({"cert_sha256": (_S,)}, {"boot_id": _STRS, "requested_at": _STRS}),
    "hold": ({"by": (_S,)}, {"kernel": _STRS, "since": _STRS, "reason": _STRS, "schema": (_I, _N),
                             "released": (list, _N)}),
    # a fetched source tree's .spark-memsaver-source.json (act/source_fetch.py publishes it with the tree)
    "source-tree": ({}, {"format": (_I, _N), "driver": _STRS, "package": _STRS, "deb_version": _STRS,
                         "sha256": _STRS, "deb_bytes": (_I, _N), "bytes": (_I, _N), "fetched": _STRS}),
    # a driver-source fetch the APT/dpkg doors deferred until apt exits (act/source_fetch.defer writes it, the
    # daemon's timer and status read it; a bad one is ignored: the next defer replaces it, the planner fetches)
    "sources-pending": ({"drivers": (list,)}, {"format": (_I, _N), "kernel": _STRS, "reason": _STRS,
                                               "time": _STRS}),
    # the rendered DKMS tree's spark-memsaver.json (act/render.py writes it; a build of 0.1.0's has no build record)
    "dkms-tree": ({"driver_version": (_S,)}, {"format": (_I, _N), "package": _STRS, "dkms_version": _STRS,
                                              "our_version": _STRS, "tier": _STRS, "tier_default": (_I, _S, _N),
                                              "kernels_policy": _STRS, "nvidia_source": _STRS, "patch_id": _STRS,
                                              "signing_record": _STRS, "content_sha256": _STRS}),
}

# fields that are lists of one type: every item is checked too
ITEMS = {("sources-pending", "drivers"): _S}

# directories of records of one kind (every *.json in them), and single record files
DIRS = {"intent": paths.INTENTS, "rollback": paths.ROLLBACKS, "stock": paths.DKMS_STATE,
        "build": paths.BUILDS, "hold": paths.HOLDS}
FILES = {"signing": paths.SIGNING_RECORD, "signed-log": paths.SIGNED_LOG, "validate": paths.VALIDATE_REPORT,
         "mok-request": paths.MOK_REQUEST}


class BadRecord(ValueError):
    """Why a record cannot be trusted (the reason shown in the finding)."""


def _type_names(types) -> str:
    return " or ".join("null" if t is _N else {"str": "string", "int": "integer", "list": "array",
                                               "dict": "object", "bool": "boolean"}.get(t.__name__, t.__name__)
                       for t in types)


def check(kind: str, rec) -> dict:
    """``rec`` if it is a valid ``kind`` record, else :class:`BadRecord` naming the first problem."""
    required, optional = SPECS[kind]
    if not isinstance(rec, dict):
        raise BadRecord(f"a JSON {type(rec).__name__.replace('str', 'string').replace('list', 'array')}, "
                        "not an object")
    for field, types in required.items():
        if field not in rec:
            raise BadRecord(f"field '{field}' is missing")
    for field, types in {**optional, **required}.items():
        if field in rec and not (isinstance(rec[field], types)
                                 and not (isinstance(rec[field], bool) and bool not in types)):
            raise BadRecord(f"field '{field}' is {json.dumps(rec[field])[:40]}, not {_type_names(types)}")
        item = ITEMS.get((kind, field))
        if item is not None and field in rec and not all(isinstance(x, item) for x in rec[field]):
            raise BadRecord(f"field '{field}' is {json.dumps(rec[field])[:40]}, not an array of "
                            f"{_type_names((item,))}s")
    return rec


def parse(kind: str, text: str) -> dict:
    try:
        rec = json.loads(text)
    except ValueError as e:
        raise BadRecord(f"not valid JSON ({e})") from None
    except RecursionError:                  # "[[[[..." deeper than Python's parser goes
        raise BadRecord("JSON nested too deeply") from None
    return check(kind, rec)


def _stamp() -> str:
    import datetime as _dt

    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")


def quarantine(host, path: str, kind: str, reason: str) -> dict:
    """Rename ``path`` aside (never delete it); returns the finding's facts. A root we may not write to
    (an image, a non-root reader of the live system) keeps the file; the record is still not trusted."""
    src = host.path(path, follow=False)
    dest = f"{path}.bad-{_stamp()}"
    moved = None
    try:
        os.rename(src, host.path(dest, follow=False))
        moved = dest
        from spark_memsaver.host.fsutil import fsync_dir
        fsync_dir(os.path.dirname(os.fspath(src)))
    except OSError as e:
        reason = f"{reason}; could not set it aside: {e.strerror or e}"
    return {"path": path, "kind": kind, "reason": reason, "moved_to": moved}


def read(host, kind: str, path: str, quarantined: list) -> dict | None:
    """The record at ``path``, or None when it is absent or bad (bad: reported in ``quarantined`` with
    ``moved_to`` None; never renamed here: see :func:`quarantine`)."""
    text = host.read_text(path)
    if text is None:
        return None
    try:
        return parse(kind, text)
    except BadRecord as e:
        quarantined.append({"path": path, "kind": kind, "reason": str(e), "moved_to": None})
        return None


def one(host, kind: str, path: str | None = None) -> dict | None:
    """The ``kind`` record at ``path`` (default: the kind's one file), or None when absent or bad -- for a writer
    that only needs what it may trust (a bad record is reported by :func:`read_all` and set aside by the
    executor, never here)."""
    return read(host, kind, path or FILES[kind], [])


def read_dir(host, kind: str, quarantined: list, directory: str | None = None) -> list[dict]:
    """Every valid ``*.json`` record of ``kind`` in its directory (each with ``_path``; intents get ``id``
    from the name when they lack one); bad ones are quarantined."""
    d = directory or DIRS[kind]
    out = []
    for name in sorted(host.listdir(d)):
        if not name.endswith(".json") or name.startswith("."):
            continue
        rec = read(host, kind, f"{d}/{name}", quarantined)
        if rec is not None:
            if kind == "intent":
                rec.setdefault("id", name[:-5])
            rec["_path"] = f"{d}/{name}"
            out.append(rec)
    return out


def read_all(host) -> dict:
    """Every record kind, validated: {kind: [records] or record or None, 'quarantined': [...]}."""
    q: list = []
    out: dict = {kind: read_dir(host, kind, q) for kind in DIRS}
    out.update({kind: read(host, kind, p, q) for kind, p in FILES.items()})
    out["quarantined"] = q
    return out

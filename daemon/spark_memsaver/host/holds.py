"""The administrator's hold: after ``rollback`` or ``remove`` automation never brings our module back.

A hold is a record under ``/var/lib/spark-memsaver/holds/`` (host/paths.py): ``<kernel>.json`` for one
kernel, ``all.json`` for every kernel, also those installed later. It is written by the executor before
``rollback``/``remove`` acts, read through host/records.py (kind "hold") and decided on by decide/hold.py:
reconcile (the daemon at start and on events, the APT/dpkg/kernel hooks) plans no build or install for a
held kernel -- safety steps (removing a mismatched override) still run. Only ``install`` clears it: for one
kernel it drops that kernel's hold and releases the kernel from an ``all`` hold; ``install --all`` drops
every hold.

Record (schema 1): by ("rollback" | "remove"), kernel (null: all), since, reason, released (all only).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os

from spark_memsaver.host import Host, paths
from spark_memsaver.host.fsutil import atomic_write, fsync_dir

SCHEMA = 1
BY = ("rollback", "remove")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write(host: Host, rec: dict) -> None:
    atomic_write(host.path(paths.hold(rec.get("kernel"))), json.dumps(rec, indent=1, sort_keys=True) + "\n")


def _read(host: Host, kernel: str | None) -> dict | None:
    from spark_memsaver.host import records     # the typed reader of every record
    return records.one(host, "hold", paths.hold(kernel))


def hold(host: Host, by: str, kernel: str | None, reason: str = "") -> dict:
    """Record the administrator's ``by`` (rollback/remove) for ``kernel`` (None: every kernel). OSError
    when it cannot be written (the caller goes on toward stock and reports it)."""
    if by not in BY:
        raise ValueError(f"unknown hold origin {by!r}")
    rec = {"schema": SCHEMA, "by": by, "kernel": kernel, "since": _now(), "reason": reason}
    if kernel is None:
        rec["released"] = []
    _write(host, rec)
    return rec


def releasable(host: Host, kernel: str | None) -> list[str]:
    """What :func:`release` would end for ``kernel``, read only (install's dry run says it)."""
    if kernel is None:
        return [n[:-5] for n in sorted(host.listdir(paths.HOLDS)) if n.endswith(".json") and not n.startswith(".")]
    every = _read(host, None)
    return ([kernel] if host.exists(paths.hold(kernel)) else []) + \
        ([f"all (for {kernel})"] if every is not None and kernel not in (every.get("released") or []) else [])


def release(host: Host, kernel: str | None) -> list[str]:
    """``install`` for ``kernel`` (None: every kernel) ends the hold on it; returns what was released."""
    done = []
    if kernel is None:
        for name in host.listdir(paths.HOLDS):
            if name.endswith(".json") and not name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(host.path(f"{paths.HOLDS}/{name}"))
                    done.append(name[:-5])
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(host.path(paths.hold(kernel)))
            done.append(kernel)
        every = _read(host, None)
        if every is not None and kernel not in (every.get("released") or []):
            every["released"] = sorted(set(every.get("released") or []) | {kernel})
            _write(host, every)
            done.append(f"all (for {kernel})")
    if done:
        fsync_dir(os.fspath(host.path(paths.HOLDS)))
    return done

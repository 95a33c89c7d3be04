"""The executor's records: intents written "safely" (a removal goes on without one), build records.

Until host/records.py (E1) lands, intents and rollbacks go through host/intents.py; this module adds
what the executor needs on top of it:

- :func:`safe_intent`: an intent around a step. For a step that only moves toward stock (``removal``
  True), an OSError while writing the record (full disk, read-only state directory) does not stop the
  step: it proceeds without a record and the failure is reported in ``problems`` (the result's
  ``record_problems`` and a ``record-write-failed`` finding). Any other step refuses without a record
  (:class:`RecordWriteFailed`), since nothing could recover it after a kill. A removal that stops on a named
  error keeps its record (phase "failed"): the next operation finishes it; a build or install clears it.
- build records (``/var/lib/spark-memsaver/builds/<kernel>.json``): the settings (tier, kernels policy)
  the installed build of a kernel was made with; reconcile compares them with the current config.
"""

from __future__ import annotations

import contextlib
import json
import os

from spark_memsaver.errors import EXIT_FAILED, MemsaverError
from spark_memsaver.host import Host, intents, paths
from spark_memsaver.observe.builds import dkms_meta, read_builds  # noqa: F401  (the readers: observe/builds.py)

BUILDS = paths.BUILDS
BUILD_SCHEMA = 1


class RecordWriteFailed(MemsaverError):
    code = "record-write-failed"
    exit_code = EXIT_FAILED
    remedy = ("Free space in /var/lib/spark-memsaver (df -h /var/lib/spark-memsaver) or make it writable, "
              "then run the command again. Removing the override toward stock still works without records.")


def record_problem(problems: list | None, what: str, err: OSError) -> dict:
    p = {"code": "record-write-failed", "severity": "warning",
         "message": f"could not write {what}: {err.strerror or err}",
         "remedy": RecordWriteFailed.remedy}
    if problems is not None:
        problems.append(p)
    return p


@contextlib.contextmanager
def safe_intent(host: Host, op: str, kernel: str | None, *, removal: bool, problems: list | None = None,
                **details):
    """An intent around the body; see the module docstring for what happens when it cannot be written."""
    try:
        rec = intents.write_intent(host, op, kernel, **details)
    except OSError as e:
        if not removal:
            raise RecordWriteFailed(f"cannot write the recovery record for '{op}' "
                                    f"({kernel or 'all kernels'}): {e.strerror or e}; nothing was changed")
        record_problem(problems, f"the recovery record for '{op}' ({kernel or 'all kernels'})", e)
        yield None
        return
    try:
        yield rec
    except MemsaverError as e:
        if removal:
            # a removal that stopped midway (depmod missing or failing, the stock module not verified): our files
            # may be gone while the selection is not refreshed. The record stays, so status names the interruption
            # and the next operation finishes the removal (exit 3 means just that)
            with contextlib.suppress(Exception):
                intents.update_intent(host, rec, phase="failed", error=f"{e.code}: {e.message}"[:500])
            raise
        # a named refusal or failure of a build or install: the engine has put back what it changed (stock stays
        # selected); the caller reports it, and there is nothing left to recover
        with contextlib.suppress(OSError):
            intents.clear_intent(host, rec)
        raise
    except BaseException as e:
        # anything else (a bug, an interrupt): keep the record so the next perform finishes or undoes it
        with contextlib.suppress(Exception):
            intents.update_intent(host, rec, phase="failed", error=f"{type(e).__name__}: {e}"[:500])
        raise
    try:
        intents.clear_intent(host, rec)
    except OSError as e:
        record_problem(problems, f"the removal of the recovery record {rec['id']}", e)


def clear_intent(host: Host, iid: str, problems: list | None = None) -> bool:
    try:
        return intents.clear_intent(host, iid)
    except OSError as e:
        record_problem(problems, f"the removal of the recovery record {iid}", e)
        return False


def write_rollback(host: Host, kernel: str, reason: str, problems: list | None = None, **kw) -> dict | None:
    """A rollback record; an OSError is reported, never raised (the removal it explains has happened)."""
    try:
        return intents.write_rollback(host, kernel, reason, **kw)
    except OSError as e:
        record_problem(problems, f"the rollback record for {kernel}", e)
        return None


# --- build records ---------------------------------------------------------------------------------

def _build_path(kernel: str) -> str:
    return f"{BUILDS}/{intents._name(kernel)}.json"


def write_build(host: Host, kernel: str, settings: dict, *, driver: str | None, problems: list | None = None,
                **facts) -> dict | None:
    rec = {"schema": BUILD_SCHEMA, "kernel": kernel, "time": intents.now(), "driver": driver, **settings}
    rec.update({k: v for k, v in facts.items() if v is not None})
    try:
        intents.atomic_write(host.path(_build_path(kernel)), json.dumps(rec, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        record_problem(problems, f"the build record for {kernel}", e)
        return None
    return rec


def clear_build(host: Host, kernel: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(host.path(_build_path(kernel)))

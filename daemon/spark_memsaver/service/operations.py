"""What a D-Bus operation runs, in the job's worker thread. Plain imports, done here (lazily, in the
worker) so the idle daemon never imports the engines.

Every module mutation goes through the one executor, ``act.executor.perform`` (plan -> lifecycle lock ->
intent -> act -> verify -> record). RequestEnrollment is the MOK step of act/enroll.py; its certificate file
is read here, without blocking, and handed on as a private copy (issue 12 defect 11).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from spark_memsaver.errors import Unsupported

from spark_memsaver.opnames import DBUS_JOBS as OPERATIONS, EXECUTOR, PREPARE_LAUNCH, REQUEST_ENROLLMENT  # noqa: E402

MUTATIONS = tuple(op for op in OPERATIONS if op in EXECUTOR)    # executor operations with a D-Bus door


def _missing(op: str, e: ImportError) -> Unsupported:
    return Unsupported(f"'{op}' is not available: this build of spark-memsaver lacks {e.name or 'a module'}",
                       remedy="Install the complete spark-memsaver package.")


def run(op: str, host, config, progress, **kwargs):
    """Worker side of a job: do ``op`` and return its JSON-able result (named errors on refusal)."""
    if op in MUTATIONS:
        try:
            from spark_memsaver.act import executor
        except ImportError as e:
            if not (e.name or "").startswith("spark_memsaver"):
                raise
            raise _missing(op, e) from None
        return executor.perform(op, host, config, progress=progress, **kwargs)
    if op == REQUEST_ENROLLMENT:
        return request_enrollment(host, config, progress, **kwargs)
    if op == PREPARE_LAUNCH:            # not a module mutation: act/reclaim.py, its own lock
        from spark_memsaver.act import reclaim
        return reclaim.reclaim(host, kwargs["need_bytes"], progress=progress)
    raise Unsupported(f"unknown operation {op!r} (one of: {', '.join(OPERATIONS)})")


def request_enrollment(host, config, progress, password: str, cert: str | None = None,
                       wait_at_console: bool = False):
    from spark_memsaver.service.checks import read_cert

    try:
        from spark_memsaver.act import enroll
    except ImportError as e:
        if not (e.name or "").startswith("spark_memsaver"):
            raise
        raise _missing("request-enrollment", e) from None
    if cert is None:
        return enroll.request_enrollment(host, config, password, wait_at_console=wait_at_console)
    data = read_cert(cert)          # never blocks: a FIFO or a device is refused here
    work = tempfile.mkdtemp(prefix="spark-memsaver-dbus-cert.")
    try:
        copy = os.path.join(work, os.path.basename(cert) or "cert")
        fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        result = enroll.request_enrollment(host, config, password, cert=copy, wait_at_console=wait_at_console)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _renamed(result, copy, cert)


def _renamed(v, old: str, new: str):
    """The private copy's path in a result -> the path the caller gave."""
    if isinstance(v, str):
        return v.replace(old, new)
    if isinstance(v, list):
        return [_renamed(x, old, new) for x in v]
    if isinstance(v, dict):
        return {k: _renamed(x, old, new) for k, x in v.items()}
    return v

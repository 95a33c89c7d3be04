"""Arguments, sizing and headroom of ``spark-memsaver validate`` (constants and pure functions)."""

from __future__ import annotations

import math
import os

from spark_memsaver.errors import EXIT_NOT_APPLICABLE, EXIT_OK, EXIT_PROBLEM, MemsaverError, UsageError
from spark_memsaver.host import paths

KIB, MIB, GIB = 1024, 1024 ** 2, 1024 ** 3

DEFAULT_MAX_GIB = 2.0
MAX_GIB_RANGE = (0.25, 1024.0)
DEFAULT_DURATION = 20.0
DURATION_RANGE = (1.0, 3600.0)
DEFAULT_THREADS = 4
THREADS_RANGE = (1, 64)

HEADROOM_FRACTION = 0.25            # never ask for more than this share of what is free
MIN_BUDGET = 256 * MIB              # below this the run refuses rather than run a meaningless test
SPAN_BYTES = 4 * GIB + 64 * MIB     # longer than 4 GiB: always contains a 4 GiB-aligned address
SPAN_WINDOW = 2 * MIB               # bytes touched around each span boundary
SPAN_RESIDENT = 16 * MIB            # budget charged for the span's touched windows
MAX_BLOCK = 256 * MIB
VERIFY_CHUNK = 8 * MIB              # data is read back and compared this much at a time
HOST_FRACTION = 0.5                 # managed pages live in host memory between GPU visits: keep half free
WORKER_GRACE_S = 240.0              # worker limit beyond --duration (start, pool fill, peak, teardown)
PEAK_WAIT_S = 120.0                 # how long the worker waits at its peak for the parent's reading
RETURN_WAIT_S = 15.0                # how long the parent waits for counters to return after teardown

STATE_DIR = paths.STATE_DIR   # host/paths.py is the one list
REPORT_PATH = f"{STATE_DIR}/validate-last.json"   # observe.observe_records() reads it; status shows it
REPORT_PATH_ENV = "SPARK_MEMSAVER_VALIDATE_REPORT"  # another path for root's copy (tests, images)
SCHEMA = 1

PASSED, FAILED, REFUSED, NOT_APPLICABLE = "passed", "failed", "refused", "not-applicable"
EXIT_FOR_OUTCOME = {PASSED: EXIT_OK, FAILED: EXIT_PROBLEM, REFUSED: EXIT_PROBLEM, NOT_APPLICABLE: EXIT_NOT_APPLICABLE}

PASS, FAIL, SKIP, NA = "pass", "fail", "skip", "not-applicable"
STOCK_REASON = "stock module: counters absent"

# Sizes the workload draws from: page-aligned, page-odd, just under/over 64 KiB and 2 MiB, large.
SIZES = (4 * KIB, 12 * KIB + 4, 60 * KIB, 64 * KIB, 64 * KIB + 4 * KIB, 100 * KIB + 20, 1 * MIB,
         2 * MIB - 4 * KIB, 2 * MIB, 2 * MIB + 64 * KIB, 3 * MIB + 12, 16 * MIB, 33 * MIB, 64 * MIB,
         128 * MIB + 64 * KIB, MAX_BLOCK)


class ValidateUsage(UsageError):
    code = "validate-usage"
    remedy = "See 'spark-memsaver validate --help' for the allowed ranges."


class HeadroomRefused(MemsaverError):
    code = "validate-headroom"
    exit_code = EXIT_PROBLEM        # a refusal, as in the CLI's exit table (exitcodes.py)
    remedy = "Stop other GPU work or lower --max-gib, then run it again."


# --- arguments and sizing (pure) --------------------------------------------------------------------

def check_args(max_gib, duration, threads) -> dict:
    """Validated parameters, or ValidateUsage naming the option and its range."""
    def num(name, v, lo, hi, kind=float):
        try:
            x = kind(v)
        except (TypeError, ValueError):
            raise ValidateUsage(f"{name} must be a number, got {v!r}") from None
        if isinstance(x, float) and not math.isfinite(x) or not lo <= x <= hi:
            raise ValidateUsage(f"{name} must be between {lo:g} and {hi:g}, got {v!r}")
        return x
    if isinstance(threads, float) and not threads.is_integer():
        raise ValidateUsage(f"--threads must be a whole number, got {threads!r}")
    max_gib = num("--max-gib", max_gib, *MAX_GIB_RANGE)
    return {"max_gib": max_gib, "max_bytes": int(max_gib * GIB),
            "duration": num("--duration", duration, *DURATION_RANGE),
            "threads": int(num("--threads", threads, *THREADS_RANGE, kind=int))}


def checked(host, max_gib, duration, threads) -> dict:
    """What a run and its dry run both refuse: the options (check_args) and a --root prefix."""
    params = check_args(max_gib, duration, threads)
    if not host.is_live:
        raise ValidateUsage("validate drives the GPU of the running system: it cannot use --root",
                            remedy="Run it without --root on the node to qualify.")
    return params


def report_targets(report_path: str | None) -> list[str]:
    """Where a run's report goes: root's state file (status reads it), then --report."""
    state_path = os.environ.get(REPORT_PATH_ENV) or REPORT_PATH
    return ([state_path] if os.geteuid() == 0 else []) + ([report_path] if report_path else [])


def plan_budget(max_bytes: int, gpu_free: int, gpu_total: int, *, integrated: bool = False,
                host_available: int | None = None, concurrent_managed: bool = True,
                fraction: float = HEADROOM_FRACTION, min_budget: int | None = None) -> dict:
    """How much the run may allocate, from what is free now. ``refused`` holds the reason when it must not run.

    On an integrated GPU, device memory is host memory: the smaller of the GPU's free and the host's
    MemAvailable counts. On a discrete GPU the budget is also held to half the host's MemAvailable, since
    managed pages live in host memory whenever they are not on the GPU. The >4 GiB span is planned only when the headroom fraction of that covers its whole
    size (the ask, not only what is touched), and, where managed memory is not demand-paged
    (concurrent_managed false), only when --max-gib covers it too.
    """
    min_budget = MIN_BUDGET if min_budget is None else min_budget
    free = gpu_free
    basis = "GPU free memory (cuMemGetInfo)"
    if integrated and host_available is not None and host_available < free:
        free, basis = host_available, "host MemAvailable (integrated GPU)"
    cap = int(free * fraction)
    # discrete GPU: managed pages sit in host memory between GPU visits, so the host must hold them too
    host_cap = int(host_available * HOST_FRACTION) if not integrated and host_available is not None else None
    budget = min(max_bytes, cap, cap if host_cap is None else host_cap)
    limited_by = ("--max-gib" if budget == max_bytes else
                  "host memory" if host_cap is not None and host_cap < cap else "headroom")
    plan = {"gpu_free": gpu_free, "gpu_total": gpu_total, "host_available": host_available,
            "integrated": integrated, "basis": basis, "fraction": fraction, "cap": cap, "host_cap": host_cap,
            "max_bytes": max_bytes, "budget": budget, "limited_by": limited_by,
            "refused": None, "span": None, "span_skipped": None}
    if budget < min_budget:
        why = f"{fraction:.0%} of {free / MIB:.0f} MiB free by {basis}"
        if limited_by == "host memory":
            why = f"{HOST_FRACTION:.0%} of {host_available / MIB:.0f} MiB host MemAvailable"
        plan["refused"] = (f"only {budget / MIB:.0f} MiB may be used ({why}, --max-gib {max_bytes / GIB:g}); "
                           f"at least {min_budget / MIB:.0f} MiB is needed to run while leaving the rest free")
        plan["budget"] = 0
        return plan
    span_charge = SPAN_RESIDENT if concurrent_managed else SPAN_BYTES
    if SPAN_BYTES > cap:
        plan["span_skipped"] = (f"a {SPAN_BYTES / GIB:.2f} GiB managed span needs {SPAN_BYTES / fraction / GIB:.1f}"
                                f" GiB free, {free / GIB:.1f} GiB is")
    elif span_charge + min_budget > budget:
        plan["span_skipped"] = ("managed memory is not demand-paged on this GPU: the span would need "
                                f"--max-gib {(SPAN_BYTES + min_budget) / GIB:.2f} or more")
    else:
        plan["span"] = {"bytes": SPAN_BYTES, "charged": span_charge}
    return plan


def crossings(ptr: int, size: int, unit: int = 4 * GIB) -> list[int]:
    """The ``unit``-aligned addresses strictly inside [ptr, ptr + size)."""
    first = (ptr // unit + 1) * unit
    return list(range(first, ptr + size, unit))

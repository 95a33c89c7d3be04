"""``spark-memsaver validate --dry-run``: what a run would do on this node. Nothing is run or written.

It refuses what the run refuses: bad arguments and ``--root`` (exit 2). It says "not applicable" (exit 4)
where the run would: libcuda.so.1 cannot be loaded, or is not a CUDA driver library. The library is loaded
the way the run's worker loads it, but CUDA is never initialised and no GPU memory is asked for. Otherwise
it prints the plan and exits 0.

The run's budget is decided from the GPU's free memory when the run starts (cuMemGetInfo), so the plan gives
the rule and the host figures it can read now, not the final number.
"""

from __future__ import annotations

import os

from spark_memsaver.errors import EXIT_NOT_APPLICABLE, EXIT_OK
from spark_memsaver.decide.ours import is_ours
from spark_memsaver.validate.params import (GIB, HEADROOM_FRACTION, HOST_FRACTION, MIB, MIN_BUDGET, SPAN_BYTES,
                                            checked, report_targets)

# The checks a run reports, in its order: the worker's data checks, the packing counters, the #1269 device
# allocation in its own process, the kernel-log scan (tests/test_validate_dryrun.py pins them to the code).
CHECKS = ("device-memory", "managed-memory", "managed-prefetch", "holes-reuse", "cross-4gib", "threads",
          "teardown", "packing-counters-consistent", "packing-counters-move", "packing-counters-return",
          "device-alloc-4gib", "kernel-log")


def plan(host, max_gib, duration, threads, report_path: str | None = None) -> dict:
    """The plan of ``validate`` with these options (raises ValidateUsage as the run does)."""
    params = checked(host, max_gib, duration, threads)
    from spark_memsaver.validate.node import identity, uvm as _uvm
    from spark_memsaver.validate.cuda import Cuda, CudaUnavailable
    from spark_memsaver.observe.snapshot import observe_memory, uvm_holders
    ident = identity(host)
    uvm = _uvm(host)
    others = [h for h in uvm_holders(host) if h["pid"] != os.getpid()]
    try:
        lib = Cuda().path
        not_applicable = None
    except CudaUnavailable as e:
        lib, not_applicable = None, f"no CUDA driver library: {e}"
    packing = uvm.get("packing") if uvm.get("loaded") else None
    return {
        "dry_run": True,
        "outcome": "not-applicable" if not_applicable else "would-run",
        "reason": not_applicable,
        "exit_code": EXIT_NOT_APPLICABLE if not_applicable else EXIT_OK,
        "parameters": {k: params[k] for k in ("max_gib", "duration", "threads")},
        "identity": dict(ident, uvm={k: uvm.get(k) for k in ("loaded", "version", "patched", "parameters")}),
        "counters": ("readable" if packing and "error" not in packing else
                     "absent (stock module)" if uvm.get("loaded") and not is_ours(uvm) else
                     "nvidia-uvm not loaded" if not uvm.get("loaded") else
                     f"unreadable ({(packing or {}).get('error', 'missing')})"),
        "other_uvm_users": [f"{h['comm']}[{h['pid']}]" for h in others],
        "libcuda": lib,
        "budget_rule": {"max_bytes": params["max_bytes"], "fraction": HEADROOM_FRACTION,
                        "host_fraction": HOST_FRACTION, "min_budget": MIN_BUDGET, "span_bytes": SPAN_BYTES,
                        "host_available_now": observe_memory(host, {})["available"]},
        "checks": [] if not_applicable else list(CHECKS),
        "report_to": report_targets(report_path),
    }


def render(p: dict) -> str:
    idt, b = p["identity"], p["budget_rule"]
    u = idt["uvm"]
    page = f"{idt['page_size'] // 1024} KiB pages" if idt.get("page_size") else "page size unknown"
    out = ["plan (dry run): spark-memsaver validate",
           f"  node:     {idt['kernel']} ({idt['arch']}, {page}), nvidia {idt['nvidia_driver'] or 'not loaded'}, "
           f"nvidia-uvm {('ours' if is_ours(u) else 'stock') + ' ' + str(u['version']) if u['loaded'] else 'not loaded'}"
           f"; counters {p['counters']}"]
    if p["outcome"] == "not-applicable":
        out.append(f"  outcome:  not applicable: {p['reason']} (exit 4, as the run)")
        return "\n".join(out + ["  nothing was run or written"])
    have = b["host_available_now"]
    out += [f"  cuda:     {p['libcuda']} (loaded, not initialised)",
            f"  memory:   at most {b['max_bytes'] / GIB:.2f} GiB (--max-gib), never more than {b['fraction']:.0%} of "
            "the GPU's free memory when the run starts (an integrated GPU counts the smaller of that and the "
            "host's MemAvailable" + (f", {have / GIB:.1f} GiB now" if have is not None else "") + "); refused "
            f"below {b['min_budget'] // MIB} MiB; the {b['span_bytes'] / GIB:.2f} GiB span across a 4 GiB line "
            "only when that covers it",
            f"  work:     {p['parameters']['threads']} threads, {p['parameters']['duration']:g} s of allocation rounds "
            "in a worker process, the counters read at its peak and after it exits; then a 4.06 GiB cuMemAlloc "
            "in a process of its own (#1269)",
            "  checks:   " + ", ".join(p["checks"])]
    if p["other_uvm_users"]:
        out.append("  note:     other processes hold /dev/nvidia-uvm (" + ", ".join(p["other_uvm_users"][:5])
                   + "): they move the counters too; stop them for a clean baseline")
    out.append("  report:   " + (", ".join(p["report_to"]) or "printed only (not root, no --report)"))
    return "\n".join(out + ["  nothing was run or written"])

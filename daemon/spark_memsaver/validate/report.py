"""The report of ``spark-memsaver validate``: outcome, document, readable summary, saving."""

from __future__ import annotations

import datetime as _dt
import json
from spark_memsaver.decide.ours import is_ours

from spark_memsaver import __version__
from spark_memsaver.validate.params import (
    EXIT_FOR_OUTCOME, FAIL, FAILED, GIB, NA, NOT_APPLICABLE, PASS, PASSED, REFUSED, SCHEMA, SKIP, STOCK_REASON)

# --- the report --------------------------------------------------------------------------------------

def outcome_of(checks: list[dict], terminal: dict | None = None) -> tuple[str, str]:
    """(outcome, reason) from the checks, or from a terminal worker event (not-applicable, refused)."""
    if terminal and terminal.get("event") == "not-applicable":
        return NOT_APPLICABLE, terminal["reason"]
    if terminal and terminal.get("event") == "refused":
        return REFUSED, terminal["reason"]
    failed = [c for c in checks if c["status"] == FAIL]
    if failed:
        return FAILED, "; ".join(f"{c['name']}: {c['detail']}" for c in failed[:3])
    if not checks:
        return FAILED, "no check ran"
    na = [c for c in checks if c["status"] in (NA, SKIP)]
    note = "; ".join(f"{c['name']}: {c['detail']}" for c in na)
    packing = [c for c in checks if c["name"].startswith("packing-counters-")]
    if packing and all(c["status"] == NA and c["detail"] == STOCK_REASON for c in packing):
        return PASSED, f"data checks passed; {STOCK_REASON}"
    return PASSED, "all checks passed" + (f" ({note})" if note else "")


def build_report(*, params: dict, identity: dict, device: dict | None, budget: dict | None, checks: list[dict],
                 counters: dict, kernel_log: dict, workload: dict | None, timings: dict,
                 terminal: dict | None, started: float, finished: float) -> dict:
    outcome, reason = outcome_of(checks, terminal)
    rep = {
        "schema": SCHEMA,
        "tool": "spark-memsaver validate",
        "version": __version__,
        "outcome": outcome,
        "reason": reason,
        "exit_code": EXIT_FOR_OUTCOME[outcome],
        "started_at": _iso(started),
        "finished_at": _iso(finished),
        "parameters": params,
        "identity": dict(identity, device=device),
        "budget": budget,
        "checks": checks,
        "counts": {s: sum(1 for c in checks if c["status"] == s) for s in (PASS, FAIL, SKIP, NA)},
        "counters": counters,
        "kernel_log": kernel_log,
        "workload": workload,
        "timings": timings,
    }
    rep["summary"] = render_summary(rep)
    return rep


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _gib(n) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def render_summary(rep: dict) -> str:
    ident = rep.get("identity") or {}
    dev = ident.get("device") or {}
    uvm = ident.get("uvm") or {}
    lines = [f"spark-memsaver validate: {rep['outcome'].upper()}: {rep['reason']}"]
    if dev:
        lines.append(f"  device:  {dev.get('name')} {dev.get('uuid') or ''} ({dev.get('pci_bus_id') or '?'}), "
                     f"{'integrated' if dev.get('integrated') else 'discrete'}, CUDA {dev.get('cuda_driver_version')}"
                     f", prefetch via {dev.get('prefetch_api')}")
    lines.append(f"  driver:  {ident.get('nvidia_driver') or 'nvidia.ko not seen in /sys/module'}; nvidia-uvm "
                 f"{'ours' if is_ours(uvm) else 'stock'} {uvm.get('version') or ''} "
                 f"srcversion {uvm.get('srcversion') or '?'}")
    lines.append(f"  kernel:  {ident.get('kernel')} ({ident.get('arch')}, "
                 f"{(ident.get('page_size') or 0) // 1024 or '?'} KiB pages) on {ident.get('node')}")
    b = rep.get("budget")
    if b:
        lines.append(f"  budget:  {_gib(b.get('budget'))} (limited by {b.get('limited_by')}; "
                     f"{_gib(b.get('gpu_free'))} of {_gib(b.get('gpu_total'))} free, at most "
                     f"{b.get('fraction', 0):.0%} of it)")
    for c in rep["checks"]:
        lines.append(f"  {c['status']:<15}{c['name']:<29}{c['detail']}")
    kl = rep.get("kernel_log") or {}
    w = rep.get("workload") or {}
    if w:
        lines.append(f"  work:    {w.get('threads')} threads, {w.get('rounds')} rounds, "
                     f"{w.get('device_allocs', 0) + w.get('managed_allocs', 0)} allocations, "
                     f"{w.get('verified_bytes', 0) / GIB:.2f} GiB verified; at peak "
                     f"{_gib((w.get('peak_live_bytes') or 0) - (w.get('peak_span_bytes') or 0))} allocated"
                     f" + the {_gib(w.get('peak_span_bytes'))} span (VA), GPU free fell by "
                     f"{_gib(w.get('gpu_used_at_peak'))}")
    t = rep.get("timings") or {}
    if t:
        lines.append("  time:    " + ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in t.items() if k.endswith("_s")))
    if kl.get("source"):
        lines.append(f"  log:     {kl['source']}, {len(kl.get('events') or [])} event(s)")
    if rep.get("saved_to"):
        lines.append(f"  report:  {', '.join(rep['saved_to'])}")
    return "\n".join(lines)


def save_report(rep: dict, path: str) -> None:
    """Write atomically: a temporary file beside it, fsync, rename, fsync the directory."""
    from spark_memsaver.host.fsutil import atomic_write

    atomic_write(path, json.dumps(rep, indent=2) + "\n", 0o644)

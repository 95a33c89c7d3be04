"""``spark-memsaver validate``: qualify a node's nvidia-uvm with real GPU work and keep the evidence.

What it does, in order:

1. reads the packing counters (``/sys/module/nvidia_uvm/parameters/uvm_pt_pack_stats``), the driver and
   kernel identity, and marks the kernel log (``/dev/kmsg``, else ``dmesg``);
2. starts a worker process (``python3 -m spark_memsaver.validate.command --worker``) that drives the CUDA driver API
   through ctypes (``cuda.py``): primary context, managed (``cuMemAllocManaged``) and device (``cuMemAlloc``)
   allocations of varied sizes from several threads, page-unique patterns written with ``cuMemcpyHtoD`` or from
   the host, ``cuMemsetD8``/``cuMemsetD32``, managed memory prefetched to the GPU and back, holes freed and
   refilled, and one managed span longer than 4 GiB (touched sparsely) so a 4 GiB boundary is crossed;
3. reads the counters again while the worker holds its peak allocation, and after the worker has exited
   (the process's UVM address space is gone only then), and requires, on a packed node, that they moved and
   came back to the baseline; on a stock module they are absent and the packing checks say so;
4. scans the kernel-log lines that appeared meanwhile for NVRM Xid, UVM assertions, UVM errors, allocation
   failures, OOM kills, kernel warnings in NVIDIA code and oopses;
5. writes a JSON report (also to ``/var/lib/spark-memsaver/validate-last.json`` when run as root, which
   ``spark-memsaver status`` shows) and a readable summary.

Safety: the worker sizes everything from ``cuMemGetInfo``: it never asks for more than
``min(--max-gib, 25 % of the free GPU memory)`` (on an integrated GPU, 25 % of min(GPU free, host
MemAvailable)), and it refuses to start below 256 MiB of such budget. The >4 GiB span is a managed
allocation touched in a few 2 MiB windows only; it is made only when 25 % of free memory covers its whole size.

Exit codes (also in docs/validate.md):
  0  passed: every check passed (packing checks may be "not-applicable" on a stock module)
  1  failed: a data check, a packing check or the kernel-log scan failed, or the worker broke or hung; or
     refused: not enough free memory to keep the headroom (a refusal is 1 in every command: exitcodes.py)
  2  bad usage (out-of-range option, --root)
  4  not applicable: no libcuda.so.1, no CUDA device, or managed memory unsupported

Runs with the standard library alone (psutil is used when present); click is imported only by ``register``.
``python3 -m spark_memsaver.validate.command [--max-gib N] [--duration S] [--threads T] [--json] [--report PATH]``
is the same command for a node without click.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

from spark_memsaver.errors import EXIT_NOT_APPLICABLE, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, MemsaverError, UsageError
from spark_memsaver import __version__
# The sections live in these modules; every name stays importable (and patchable) here.
from spark_memsaver.validate.params import (  # noqa: F401
    KIB, MIB, GIB, DEFAULT_MAX_GIB, MAX_GIB_RANGE, DEFAULT_DURATION, DURATION_RANGE, DEFAULT_THREADS,
    THREADS_RANGE, HEADROOM_FRACTION, MIN_BUDGET, SPAN_BYTES, SPAN_WINDOW, SPAN_RESIDENT, MAX_BLOCK,
    VERIFY_CHUNK, HOST_FRACTION, WORKER_GRACE_S, PEAK_WAIT_S, RETURN_WAIT_S, STATE_DIR, REPORT_PATH,
    REPORT_PATH_ENV, SCHEMA, PASSED, FAILED, REFUSED, NOT_APPLICABLE, EXIT_FOR_OUTCOME, PASS, FAIL, SKIP, NA,
    STOCK_REASON, SIZES, ValidateUsage, HeadroomRefused, check_args, checked, plan_budget, crossings,
    report_targets)
from spark_memsaver.validate.node import identity, uvm as _uvm  # noqa: F401  (patchable here)
from spark_memsaver.validate.workload import (  # noqa: F401
    _Mismatch, _first_diff, _Block, _Stats, _Thread)
from spark_memsaver.validate.checks import (  # noqa: F401
    check, _tables, _zero_stats, _signature, packing_checks, LOG_PATTERNS, _KMSG_RE, _DMESG_RE, parse_kmsg_record,
    parse_dmesg_line, scan_messages, KernelLog, log_check)
from spark_memsaver.validate.worker import (  # noqa: F401
    _Worker, _Span, worker_checks, _try, _cuda_version, host_mem_available, worker_main)
from spark_memsaver.validate.report import (  # noqa: F401
    outcome_of, build_report, _iso, _gib, render_summary, save_report)


# --- orchestration --------------------------------------------------------------------------------------

def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_argv(params: dict) -> list[str]:
    return [sys.executable, "-m", "spark_memsaver.validate.command", "--worker", json.dumps(params)]


def run_worker(argv: list[str], timeout: float, on_peak) -> dict:
    """Run the worker; call on_peak() when it holds its peak, then let it go on. Returns its events and status."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _package_root() + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    lines: queue.Queue = queue.Queue()
    err: list[str] = []

    def pump(stream, sink, eof):
        for line in stream:
            sink(line)
        if eof:
            lines.put(None)

    threading.Thread(target=pump, args=(p.stdout, lines.put, True), daemon=True).start()
    errt = threading.Thread(target=pump, args=(p.stderr, err.append, False), daemon=True)
    errt.start()
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    timed_out = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            timed_out = True
            break
        if line is None:
            break
        try:
            ev = json.loads(line)
        except ValueError:
            err.append(line)
            continue
        events.append(ev)
        if ev.get("event") == "peak":
            try:
                on_peak(ev)
            finally:
                try:
                    p.stdin.write("go\n")
                    p.stdin.flush()
                except OSError:
                    pass
    if timed_out:
        p.kill()
    try:
        rc = p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
    errt.join(timeout=5)
    return {"events": events, "returncode": rc, "timed_out": timed_out, "stderr": "".join(err)[-4000:]}


def run_validation(host, params: dict, *, argv: list[str] | None = None, timeout: float | None = None) -> dict:
    """The whole qualification; returns the report (nothing is printed or saved here)."""
    started = time.time()
    t0 = time.monotonic()
    ident = identity(host)
    from spark_memsaver.observe.snapshot import uvm_holders
    others = [h for h in uvm_holders(host) if h["pid"] != os.getpid()]
    readings = {"before": _uvm(host), "peak": None, "after": None}
    klog = KernelLog(host)
    klog.start()
    wparams = {"max_bytes": params["max_bytes"], "duration": params["duration"], "threads": params["threads"],
               "device": params.get("device", 0), "seed": params.get("seed")}

    def on_peak(ev):
        readings["peak"] = _uvm(host)

    res = run_worker(argv or worker_argv(wparams), timeout or params["duration"] + WORKER_GRACE_S, on_peak)
    t_worker = time.monotonic()
    events = res["events"]
    by = {e.get("event"): e for e in events}
    terminal = by.get("not-applicable") or by.get("refused")
    checks: list[dict] = []
    device = (by.get("identity") or {}).get("device")
    budget = (by.get("budget") or {}).get("budget")
    workload, wtimings = None, {}
    if terminal is not None:
        checks.append(check("cuda" if terminal["event"] == "not-applicable" else "headroom",
                            NA if terminal["event"] == "not-applicable" else FAIL, terminal["reason"]))
    if "done" in by:
        checks.extend(by["done"]["checks"])
        workload = by["done"]["workload"]
        workload["peak_live_bytes"] = (by.get("peak") or {}).get("live_bytes")
        workload["peak_span_bytes"] = (by.get("peak") or {}).get("span_bytes")
        wtimings = by["done"].get("timings", {})
    elif terminal is None:
        why = (by.get("error") or {}).get("reason")
        if res["timed_out"]:
            why = f"the worker did not finish within {timeout or params['duration'] + WORKER_GRACE_S:.0f} s: killed"
        elif not why:
            tail = res["stderr"].strip().splitlines()[-3:]
            why = f"the worker exited with status {res['returncode']}" + (f": {' | '.join(tail)}" if tail else "")
        checks.append(check((by.get("error") or {}).get("check") or "worker", FAIL, why))
    if res["timed_out"] and "done" in by:
        checks.append(check("worker", FAIL, "the worker hung after its report and was killed"))
    # after teardown: the process is gone, its UVM address space with it; wait for counters to settle
    after = _uvm(host)
    t_wait = time.monotonic()
    if terminal is None:
        while time.monotonic() - t_wait < RETURN_WAIT_S:
            pc = packing_checks(readings["before"], readings["peak"] or after, after)
            if all(c["status"] != FAIL for c in pc if c["name"] == "packing-counters-return"):
                break
            time.sleep(0.25)
            after = _uvm(host)
    readings["after"] = after
    if terminal is None and readings["peak"] is None:
        # the worker stopped before its peak: only the stock/packed distinction can be told
        checks.extend(c if c["status"] == NA or c["name"] == "packing-counters-consistent" else
                      check(c["name"], SKIP, "no peak reading: the worker stopped before its peak")
                      for c in packing_checks(readings["before"], after, after))
    elif terminal is None:
        pc = packing_checks(readings["before"], readings["peak"], readings["after"])
        if others:  # the counters are global: another UVM user moves them too
            note = (" (other processes held /dev/nvidia-uvm during the run: "
                    + ", ".join(f"{h['comm']}[{h['pid']}]" for h in others[:5])
                    + "; stop them for a clean baseline)")
            pc = [dict(c, detail=c["detail"] + note) if c["status"] == FAIL else c for c in pc]
        checks.extend(pc)
    dev_check = None
    if terminal is None and "done" in by and argv is None and not params.get("no_devalloc"):
        from spark_memsaver.validate import devalloc  # its own process: a lost context stays there
        dev_check = devalloc.run_check({"max_bytes": params["max_bytes"], "device": params.get("device", 0)})
    messages = klog.collect()
    events_log = scan_messages(messages)
    if dev_check is not None:
        checks.append(devalloc.xid31_check(dev_check, events_log))
    if terminal is None or events_log:
        checks.append(log_check(klog.source, klog.reason, events_log))
    ident["uvm"] = {k: after.get(k) for k in ("loaded", "version", "srcversion", "patched", "parameters")}
    ident["other_uvm_users"] = others
    counters = {k: (v or {}).get("packing") for k, v in readings.items()}
    counters["source"] = "/sys/module/nvidia_uvm/parameters/uvm_pt_pack_stats"
    counters["after_settle_s"] = round(time.monotonic() - t_wait, 2)
    timings = dict(wtimings, total_s=round(time.monotonic() - t0, 3),
                   worker_process_s=round(t_worker - t0, 3))
    return build_report(params={k: params[k] for k in ("max_gib", "duration", "threads")}, identity=ident,
                        device=device, budget=budget, checks=checks, counters=counters,
                        kernel_log={"source": klog.source, "unreadable_reason": klog.reason,
                                    "messages_seen": len(messages), "events": events_log},
                        workload=workload, timings=timings, terminal=terminal, started=started,
                        finished=time.time())


class ValidateBusy(MemsaverError):
    code = "validate-busy"
    remedy = "Wait for the other validation run to finish: two runs would read each other's counters."


class _single_run:
    """host/locks.hold(host, "validate"): RUN_DIR/validate.lock (root-only, O_NOFOLLOW, 0600), no wait."""

    PATH = None      # None: paths.lock("validate"); tests point it elsewhere (validate cannot use --root)

    def __enter__(self):
        from spark_memsaver.errors import LockTimeout
        from spark_memsaver.host import Host, locks
        self.cm = locks.hold(Host("/"), "validate", timeout=0, purpose="spark-memsaver validate", path=self.PATH)
        try:
            self.cm.__enter__()
        except LockTimeout as e:
            self.cm = None
            raise ValidateBusy(f"another 'spark-memsaver validate' is running on this node ({e})") from None
        except OSError:
            self.cm = None   # not root: RUN_DIR is root-only, and nothing that shares this lock runs as us
        return self

    def __exit__(self, *exc):
        if self.cm is not None:
            self.cm.__exit__(*exc)
        return False


def validate(host, max_gib, duration, threads, report_path: str | None = None) -> dict:
    """Check arguments, run, save (root: the state file; --report: that path). Returns the report."""
    params = checked(host, max_gib, duration, threads)
    with _single_run():
        rep = run_validation(host, params)
    saved, save_errors = [], []
    targets = report_targets(report_path)
    for path in targets:
        try:
            save_report(rep, path)
            saved.append(path)
        except OSError as e:
            save_errors.append(f"{path}: {e.strerror or e}")
    rep["saved_to"] = saved
    if save_errors:
        rep["save_errors"] = save_errors
    rep["summary"] = render_summary(rep)
    if saved:  # the saved copies carry saved_to too
        for path in saved:
            try:
                save_report(rep, path)
            except OSError:
                pass
    return rep


def _print(rep: dict, as_json: bool, echo) -> int:
    if as_json:
        echo(json.dumps(rep, indent=2))
    else:
        echo(rep["summary"])
        for e in rep.get("save_errors", []):
            echo(f"warning: report not saved: {e}")
    return rep["exit_code"]


def main(argv: list[str] | None = None) -> int:
    """``python3 -m spark_memsaver.validate.command``: the same command with argparse, for nodes without click."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(json.loads(argv[1]))
    ap = argparse.ArgumentParser(prog="spark-memsaver validate",
                                 description="Qualify this node's nvidia-uvm with real GPU work.")
    ap.add_argument("--max-gib", type=float, default=DEFAULT_MAX_GIB)
    ap.add_argument("--duration", type=float, default=DEFAULT_DURATION)
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--report", default=None)
    ap.add_argument("--dry-run", action="store_true")
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code else 0
    from spark_memsaver.host import Host
    try:
        if a.dry_run:
            from spark_memsaver.validate import dryrun
            p = dryrun.plan(Host("/"), a.max_gib, a.duration, a.threads, a.report)
            print(json.dumps(p, indent=2) if a.json else dryrun.render(p))
            return p["exit_code"]
        rep = validate(Host("/"), a.max_gib, a.duration, a.threads, a.report)
    except MemsaverError as e:
        if a.json:
            print(json.dumps({"error": e.to_dict()}, indent=2))
        else:
            print(f"error[{e.code}]: {e.message}", file=sys.stderr)
            if e.remedy:
                print(f"remedy: {e.remedy}", file=sys.stderr)
        return e.exit_code
    return _print(rep, a.json, print)


if __name__ == "__main__":
    sys.exit(main())

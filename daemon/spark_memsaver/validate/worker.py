"""The worker process of ``spark-memsaver validate``: CUDA work, its checks, and ``worker_main``."""

from __future__ import annotations

import ctypes
import json
import os
import random
import select
import struct
import sys
import threading
import time

from spark_memsaver.validate.params import (
    FAIL, GIB, KIB, MAX_BLOCK, MIB, PASS, PEAK_WAIT_S, SKIP, SPAN_WINDOW, crossings, plan_budget)
from spark_memsaver.validate.workload import _Mismatch, _Stats, _Thread, _first_diff
from spark_memsaver.validate.checks import check

class _Worker:
    def __init__(self, params: dict, emit, wait_go, cuda_factory=None):
        self.p = params
        self.cuda_factory = cuda_factory
        self.emit = emit
        self.wait_go = wait_go
        self.seed = params.get("seed") or random.randrange(1, 1 << 30)
        self.failed = threading.Event()
        self.go = threading.Event()

    def run(self) -> None:
        from spark_memsaver.validate.cuda import CUDA_ERROR_NO_DEVICE, CUDA_ERROR_OUT_OF_MEMORY, ATTR_CONCURRENT_MANAGED_ACCESS, ATTR_INTEGRATED, \
            ATTR_MANAGED_MEMORY, ATTR_PAGEABLE_MEMORY_ACCESS, Cuda, CudaError, CudaUnavailable
        t0 = time.monotonic()
        timings = {}
        try:
            cu = self.cu = (self.cuda_factory or Cuda)()
        except CudaUnavailable as e:
            self.emit({"event": "not-applicable", "reason": f"no CUDA driver library: {e}"})
            return
        try:
            cu.init()
        except CudaError as e:
            if e.code == CUDA_ERROR_NO_DEVICE:
                self.emit({"event": "not-applicable", "reason": f"no CUDA device: cuInit returned {e.name}"})
            else:
                self.emit({"event": "error", "check": "cuda-init", "reason": str(e)})
            return
        if cu.device_count() == 0:
            self.emit({"event": "not-applicable", "reason": "no CUDA device (cuDeviceGetCount = 0)"})
            return
        ordinal = self.p.get("device", 0)
        dev = self.dev = cu.device(ordinal)
        ident = {"libcuda": cu.path, "cuda_driver_version": _cuda_version(cu.driver_version()),
                 "device_ordinal": ordinal, "name": cu.device_name(dev), "uuid": _try(cu.uuid, dev),
                 "pci_bus_id": _try(cu.pci_bus_id, dev), "total_memory": cu.total_mem(dev),
                 "integrated": bool(cu.attribute(dev, ATTR_INTEGRATED)),
                 "managed_memory": bool(cu.attribute(dev, ATTR_MANAGED_MEMORY)),
                 "concurrent_managed_access": bool(cu.attribute(dev, ATTR_CONCURRENT_MANAGED_ACCESS)),
                 "pageable_memory_access": bool(cu.attribute(dev, ATTR_PAGEABLE_MEMORY_ACCESS)),
                 "prefetch_api": cu.prefetch_api}
        self.emit({"event": "identity", "device": ident})
        if not ident["managed_memory"]:
            self.emit({"event": "not-applicable", "reason": f"{ident['name']} does not support managed memory"})
            return
        try:
            self.ctx = cu.primary_ctx_retain(dev)
        except CudaError as e:
            if e.code == CUDA_ERROR_OUT_OF_MEMORY:
                self.emit({"event": "refused", "reason": f"the GPU has no memory left for a CUDA context ({e.name})"})
                return
            raise
        cu.set_current(self.ctx)
        timings["init_s"] = round(time.monotonic() - t0, 3)
        free, total = cu.mem_info()
        plan = plan_budget(self.p["max_bytes"], free, total, integrated=ident["integrated"],
                           host_available=host_mem_available(),
                           concurrent_managed=ident["concurrent_managed_access"],
                           min_budget=self.p.get("min_budget"))
        self.emit({"event": "budget", "budget": plan})
        if plan["refused"]:
            cu.primary_ctx_release(dev)
            self.emit({"event": "refused", "reason": plan["refused"]})
            return
        self.prefetch_ok = ident["concurrent_managed_access"] and cu.prefetch_api is not None
        threads_n = self.p["threads"]
        span_charge = plan["span"]["charged"] if plan["span"] else 0
        share = (plan["budget"] - span_charge) // threads_n
        if share < 4 * MIB:
            threads_n = max(1, (plan["budget"] - span_charge) // (4 * MIB))
            share = (plan["budget"] - span_charge) // threads_n
        self.max_block = max(4 * KIB, min(self.p.get("max_block") or MAX_BLOCK, share // 2) // (4 * KIB) * (4 * KIB))
        self.pool_slack = 4 * MIB
        t = time.monotonic()
        self.pool = ctypes.create_string_buffer(os.urandom(max(self.max_block, SPAN_WINDOW) + self.pool_slack))
        self.pool_addr = ctypes.addressof(self.pool)
        timings["pattern_pool_s"] = round(time.monotonic() - t, 3)
        self.deadline = time.monotonic() + self.p["duration"]
        self.barrier = threading.Barrier(threads_n + 1)
        workers = [_Thread(self, i, share) for i in range(threads_n)]
        t = time.monotonic()
        for th in workers:
            th.start()
        span = _Span(self, plan)
        span.run()
        try:
            self.barrier.wait(timeout=self.p["duration"] + PEAK_WAIT_S + 120)
        except threading.BrokenBarrierError:
            pass
        timings["workload_s"] = round(time.monotonic() - t, 3)
        live = sum(th.live for th in workers) + span.live
        free_peak, _ = cu.mem_info()
        self.emit({"event": "peak", "live_bytes": live, "span_bytes": span.live, "gpu_free": free_peak,
                   "blocks": sum(len(th.blocks) for th in workers) + (1 if span.ptr else 0)})
        t = time.monotonic()
        got_go = self.wait_go(PEAK_WAIT_S)
        timings["peak_hold_s"] = round(time.monotonic() - t, 3)
        self.go.set()
        t = time.monotonic()
        span.teardown()
        for th in workers:
            th.join(timeout=PEAK_WAIT_S + 120)
        stats = _Stats()
        for th in workers:
            stats.merge(th.stats)
            if th.is_alive():
                stats.errors["threads"].append(f"thread {th.index} did not finish")
        stats.merge(span.stats)
        try:
            cu.synchronize()
            cu.set_current(None)
            cu.primary_ctx_release(dev)
        except CudaError as e:
            stats.errors["teardown"].append(f"context release: {e}")
        timings["teardown_s"] = round(time.monotonic() - t, 3)
        timings["worker_s"] = round(time.monotonic() - t0, 3)
        self.emit({"event": "done", "checks": worker_checks(stats, plan, span.result, self.prefetch_ok,
                                                             threads_n, got_go),
                   "workload": dict(stats.counts, threads=threads_n, share_per_thread=share,
                                    max_block=self.max_block, seed=self.seed, span=span.result,
                                    crossings=stats.crossed[:8], gpu_free_at_start=free,
                                    gpu_free_at_peak=free_peak, gpu_used_at_peak=max(0, free - free_peak)),
                   "timings": timings})


class _Span:
    """One managed allocation longer than 4 GiB, touched in windows at its ends and around each 4 GiB line."""

    def __init__(self, w: _Worker, plan: dict):
        self.w, self.plan = w, plan
        self.ptr = None
        self.live = 0
        self.stats = _Stats()
        self.result = {"status": SKIP, "reason": plan["span_skipped"]} if not plan["span"] else None
        self.windows = []
        self.stream = None

    def run(self) -> None:
        if not self.plan["span"]:
            return
        cu, w = self.w.cu, self.w
        rng = random.Random(w.seed)
        size = self.plan["span"]["bytes"]
        try:
            self.stream = cu.stream_create()
            self.ptr = cu.alloc_managed(size)
            self.live = size
            self.stats.counts["managed_allocs"] += 1
            self.stats.counts["managed_bytes"] += size
            lines = crossings(self.ptr, size)
            starts = [self.ptr] + [b - SPAN_WINDOW // 2 for b in lines] + [self.ptr + size - SPAN_WINDOW]
            scratch = ctypes.create_string_buffer(SPAN_WINDOW)
            for s in starts:
                off = rng.randrange(0, w.pool_slack // 8) * 8
                src = w.pool_addr + off
                ctypes.memmove(s, src, SPAN_WINDOW)
                if w.prefetch_ok:
                    cu.prefetch(s, SPAN_WINDOW, w.dev, self.stream)
                    cu.stream_sync(self.stream)
                cu.dtoh(ctypes.addressof(scratch), s, SPAN_WINDOW)
                got, want = ctypes.string_at(scratch, SPAN_WINDOW), ctypes.string_at(src, SPAN_WINDOW)
                self.stats.counts["verifications"] += 1
                self.stats.counts["verified_bytes"] += SPAN_WINDOW
                if got != want:
                    raise _Mismatch(f"span window at {s:#x}: byte {_first_diff(got, want)} differs after "
                                    "host write and prefetch to GPU")
                v = rng.randrange(1, 1 << 32)
                cu.memset_d32(s, v, SPAN_WINDOW // 4)
                if w.prefetch_ok:
                    cu.prefetch(s, SPAN_WINDOW, None, self.stream)
                    cu.stream_sync(self.stream)
                got = ctypes.string_at(s, SPAN_WINDOW)
                self.stats.counts["verifications"] += 1
                self.stats.counts["verified_bytes"] += SPAN_WINDOW
                if got != struct.pack("<I", v) * (SPAN_WINDOW // 4):
                    raise _Mismatch(f"span window at {s:#x}: GPU memset not seen by the host after prefetch")
                if w.prefetch_ok:  # back on the GPU for the peak reading
                    cu.prefetch(s, SPAN_WINDOW, w.dev, self.stream)
                    cu.stream_sync(self.stream)
                self.windows.append(s)
            self.stats.crossed.append(f"span {size} B at {self.ptr:#x}")
            self.result = {"status": PASS, "bytes": size, "address": f"{self.ptr:#x}",
                           "boundaries": [f"{b:#x}" for b in lines], "windows": len(starts),
                           "touched_bytes": len(starts) * SPAN_WINDOW}
        except Exception as e:
            self.result = {"status": FAIL, "reason": f"{type(e).__name__}: {e}" if not isinstance(e, _Mismatch)
                           else str(e), "address": f"{self.ptr:#x}" if self.ptr else None}
            self.w.failed.set()

    def teardown(self) -> None:
        cu = self.w.cu
        try:
            if self.ptr:
                cu.free(self.ptr)
                self.stats.counts["frees"] += 1
                self.live = 0
            if self.stream:
                cu.stream_destroy(self.stream)
        except Exception as e:
            self.stats.errors["teardown"].append(f"span: {e}")


def worker_checks(stats: _Stats, plan: dict, span: dict | None, prefetch_ok: bool, threads: int,
                  got_go: bool) -> list[dict]:
    """The data checks, from what the worker counted and the errors it recorded."""
    c = stats.counts
    e = stats.errors

    def chk(name, errs, ok_detail, data=None, skip=None):
        if errs:
            return check(name, FAIL, "; ".join(errs[:3]) + (f" (+{len(errs) - 3} more)" if len(errs) > 3 else ""),
                         data)
        if skip:
            return check(name, SKIP, skip, data)
        return check(name, PASS, ok_detail, data)

    out = [
        chk("device-memory", e["device"] + ([] if c["device_allocs"] else ["no cuMemAlloc allocation was made"]),
            f"{c['device_allocs']} cuMemAlloc allocations, {c['device_bytes'] / MIB:.0f} MiB, written by "
            "HtoD/memsetD8/memsetD32 and read back", {"allocations": c["device_allocs"], "bytes": c["device_bytes"]}),
        chk("managed-memory", e["managed"] + ([] if c["managed_allocs"] else ["no cuMemAllocManaged allocation"]),
            f"{c['managed_allocs']} cuMemAllocManaged allocations, {c['managed_bytes'] / MIB:.0f} MiB, written by "
            "the host and the GPU and read back by both", {"allocations": c["managed_allocs"],
                                                            "bytes": c["managed_bytes"]}),
        chk("managed-prefetch", e["prefetch"], f"{c['prefetches']} prefetches, GPU and back, data intact",
            {"prefetches": c["prefetches"]},
            skip=None if prefetch_ok else "this GPU has no concurrent managed access: prefetch not exercised"),
        chk("holes-reuse", e["holes"] + ([] if c["holes_freed"] else ["no hole was punched"]),
            f"{c['holes_freed']} blocks freed between live ones, {c['hole_refills']} refilled "
            f"({c['hole_reused_addresses']} at the same address), neighbours intact",
            {"freed": c["holes_freed"], "refilled": c["hole_refills"], "reused": c["hole_reused_addresses"]}),
    ]
    if span and span.get("status") == PASS:
        out.append(check("cross-4gib", PASS, f"{span['bytes'] / GIB:.2f} GiB managed span at {span['address']} "
                         f"crosses {', '.join(span['boundaries'])}; {span['windows']} windows verified", span))
    elif span and span.get("status") == FAIL:
        out.append(check("cross-4gib", FAIL, span["reason"], span))
    elif stats.crossed:
        out.append(check("cross-4gib", PASS, f"crossed by {stats.crossed[0]}", {"crossings": stats.crossed[:8]}))
    else:
        out.append(check("cross-4gib", SKIP, (span or {}).get("reason") or "no allocation crossed 4 GiB", span))
    out.append(chk("threads", e["threads"], f"{threads} threads, {c['rounds']} rounds in all",
                   {"threads": threads, "rounds": c["rounds"]}))
    out.append(chk("teardown", e["teardown"] + ([] if got_go else ["the parent never read the peak counters"]),
                   f"{c['frees']} frees, primary context released", {"frees": c["frees"]}))
    return out


def _try(fn, *a):
    try:
        return fn(*a)
    except Exception:
        return None


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def host_mem_available() -> int | None:
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except Exception:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def worker_main(params: dict) -> int:
    """Entry of the child process: JSON events on stdout, 'go' read from stdin at the peak."""
    lock = threading.Lock()

    def emit(ev: dict) -> None:
        with lock:
            sys.stdout.write(json.dumps(ev) + "\n")
            sys.stdout.flush()

    def wait_go(timeout: float) -> bool:
        r, _, _ = select.select([sys.stdin], [], [], timeout)
        return bool(r) and sys.stdin.readline().strip() == "go"

    try:
        _Worker(params, emit, wait_go).run()
    except Exception as e:  # reported, never a traceback on the user's terminal
        emit({"event": "error", "check": "worker", "reason": f"{type(e).__name__}: {e}"})
        return 1
    return 0

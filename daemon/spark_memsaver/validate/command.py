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
  1  failed: a data check, a packing check or the kernel-log scan failed, or the worker broke or hung
  2  bad usage (out-of-range option), or refused: not enough free memory to keep the headroom
  4  not applicable: no libcuda.so.1, no CUDA device, or managed memory unsupported

Runs with the standard library alone (psutil is used when present); click is imported only by ``register``.
``python3 -m spark_memsaver.validate.command [--max-gib N] [--duration S] [--threads T] [--json] [--report PATH]``
is the same command for a node without click.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import json
import math
import os
import queue
import random
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time

from spark_memsaver import __version__
from spark_memsaver.errors import EXIT_NOT_APPLICABLE, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, MemsaverError, UsageError

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

STATE_DIR = "/var/lib/spark-memsaver"
REPORT_PATH = f"{STATE_DIR}/validate-last.json"   # observe.observe_records() reads it; status shows it
REPORT_PATH_ENV = "SPARK_MEMSAVER_VALIDATE_REPORT"  # another path for root's copy (tests, images)
SCHEMA = 1

PASSED, FAILED, REFUSED, NOT_APPLICABLE = "passed", "failed", "refused", "not-applicable"
EXIT_FOR_OUTCOME = {PASSED: EXIT_OK, FAILED: EXIT_PROBLEM, REFUSED: EXIT_USAGE, NOT_APPLICABLE: EXIT_NOT_APPLICABLE}

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
    exit_code = EXIT_USAGE
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


# --- the worker (child process): CUDA work --------------------------------------------------------------

class _Mismatch(Exception):
    pass


def _first_diff(a: bytes, b: bytes) -> int:
    step = 1 << 16
    for off in range(0, min(len(a), len(b)), step):
        if a[off:off + step] != b[off:off + step]:
            for i in range(off, min(off + step, len(a), len(b))):
                if a[i] != b[i]:
                    return i
    return min(len(a), len(b))


class _Block:
    __slots__ = ("ptr", "size", "kind", "expect")

    def __init__(self, ptr, size, kind):
        self.ptr, self.size, self.kind, self.expect = ptr, size, kind, None


class _Stats:
    def __init__(self):
        self.counts = {"device_allocs": 0, "managed_allocs": 0, "device_bytes": 0, "managed_bytes": 0,
                       "verified_bytes": 0, "verifications": 0, "prefetches": 0, "frees": 0,
                       "holes_freed": 0, "hole_refills": 0, "hole_reused_addresses": 0, "rounds": 0,
                       "max_thread_live_bytes": 0}
        self.errors: dict[str, list[str]] = {"device": [], "managed": [], "prefetch": [], "holes": [],
                                             "teardown": [], "threads": []}
        self.crossed: list[str] = []

    def merge(self, other: "_Stats") -> None:
        for k, v in other.counts.items():
            self.counts[k] = max(self.counts[k], v) if k == "max_thread_live_bytes" else self.counts[k] + v
        for k, v in other.errors.items():
            self.errors[k].extend(v)
        self.crossed.extend(other.crossed)


class _Thread(threading.Thread):
    """One worker thread: rounds of allocate / fill / verify / punch holes / refill / free, then the peak."""

    def __init__(self, w: "_Worker", index: int, share: int):
        super().__init__(name=f"validate-{index}", daemon=True)
        self.w, self.index, self.share = w, index, share
        self.rng = random.Random(w.seed * 1000 + index)
        self.stats = _Stats()
        self.blocks: list[_Block] = []
        self.live = 0
        self.stream = None
        self.scratch = None

    # one block -----------------------------------------------------------------------------------
    def _pool_slice(self, size: int) -> int:
        """Offset of a random-pattern source in the pool: same size, different content for each block."""
        return self.rng.randrange(0, self.w.pool_slack // 8) * 8

    def _expect(self, b: _Block, pos: int, n: int) -> bytes:
        """Bytes [pos, pos + n) of what the block should hold."""
        kind, v = b.expect
        if kind == "rand":
            return ctypes.string_at(self.w.pool_addr + v + pos, n)
        if kind == "d8":
            return bytes((v,)) * n
        return struct.pack("<I", v) * (n // 4)  # d32: only on 4-byte multiples; pos, n are multiples of 4

    def _verify(self, b: _Block, where: str, via_gpu: bool) -> None:
        """Compare the block with its expected content, VERIFY_CHUNK bytes at a time (bounded host memory).

        via_gpu: read through the copy engine (cuMemcpyDtoH into a scratch chunk); else read by the CPU
        directly (managed memory: faults the pages to the host if they are on the GPU).
        """
        scratch = ctypes.addressof(self.scratch)
        for pos in range(0, b.size, VERIFY_CHUNK):
            n = min(VERIFY_CHUNK, b.size - pos)
            if via_gpu:
                self.w.cu.dtoh(scratch, b.ptr + pos, n)
                got = ctypes.string_at(scratch, n)
            else:
                got = ctypes.string_at(b.ptr + pos, n)
            want = self._expect(b, pos, n)
            if got != want:
                at = pos + _first_diff(got, want)
                raise _Mismatch(f"{where}: {b.kind} block of {b.size} B at {b.ptr:#x}: byte {at} "
                                f"(address {b.ptr + at:#x}) differs from the {b.expect[0]} pattern")
        self.stats.counts["verifications"] += 1
        self.stats.counts["verified_bytes"] += b.size

    def _alloc(self, size: int, kind: str) -> _Block:
        cu = self.w.cu
        ptr = cu.alloc_managed(size) if kind == "managed" else cu.alloc(size)
        self.stats.counts[f"{kind}_allocs"] += 1
        self.stats.counts[f"{kind}_bytes"] += size
        b = _Block(ptr, size, kind)
        self.live += size
        self.stats.counts["max_thread_live_bytes"] = max(self.stats.counts["max_thread_live_bytes"], self.live)
        if crossings(ptr, size):
            self.stats.crossed.append(f"{kind} {size} B at {ptr:#x}")
        return b

    def _free(self, b: _Block) -> None:
        self.w.cu.free(b.ptr)
        self.live -= b.size
        self.stats.counts["frees"] += 1

    def _exercise(self, b: _Block) -> None:
        """Write and read back every way that applies to the block's kind; leaves a random pattern in it."""
        cu = self.w.cu
        if b.kind == "device":
            off = self._pool_slice(b.size)
            cu.htod(b.ptr, self.w.pool_addr + off, b.size)
            b.expect = ("rand", off)
            self._verify(b, "HtoD then DtoH", True)
            v8 = self.rng.randrange(1, 256)
            cu.memset_d8(b.ptr, v8, b.size)
            b.expect = ("d8", v8)
            self._verify(b, "cuMemsetD8 then DtoH", True)
            if b.size % 4 == 0:
                v32 = self.rng.randrange(1, 1 << 32)
                cu.memset_d32(b.ptr, v32, b.size // 4)
                b.expect = ("d32", v32)
                self._verify(b, "cuMemsetD32 then DtoH", True)
            off = self._pool_slice(b.size)
            cu.htod(b.ptr, self.w.pool_addr + off, b.size)
            b.expect = ("rand", off)
            return
        # managed: written by the host, migrated to the GPU, read by the copy engine, written by the GPU,
        # migrated back and read by the host
        off = self._pool_slice(b.size)
        ctypes.memmove(b.ptr, self.w.pool_addr + off, b.size)
        b.expect = ("rand", off)
        if self.w.prefetch_ok:
            try:
                cu.prefetch(b.ptr, b.size, self.w.dev, self.stream)
                cu.stream_sync(self.stream)
                self.stats.counts["prefetches"] += 1
            except Exception as e:
                self.stats.errors["prefetch"].append(f"to GPU: {e}")
                raise
        self._verify(b, "host write, prefetch to GPU, DtoH", True)
        if b.size % 4 == 0:
            v = self.rng.randrange(1, 1 << 32)
            cu.memset_d32(b.ptr, v, b.size // 4)
            b.expect = ("d32", v)
        else:
            v = self.rng.randrange(1, 256)
            cu.memset_d8(b.ptr, v, b.size)
            b.expect = ("d8", v)
        if self.w.prefetch_ok:
            try:
                cu.prefetch(b.ptr, b.size, None, self.stream)
                cu.stream_sync(self.stream)
                self.stats.counts["prefetches"] += 1
            except Exception as e:
                self.stats.errors["prefetch"].append(f"to host: {e}")
                raise
        self._verify(b, "GPU memset, prefetch to host, host read", False)
        off = self._pool_slice(b.size)
        ctypes.memmove(b.ptr, self.w.pool_addr + off, b.size)
        b.expect = ("rand", off)

    def _check(self, b: _Block, where: str) -> None:
        self._verify(b, where, via_gpu=b.kind == "device")

    # rounds --------------------------------------------------------------------------------------
    def _fill(self, limit: int, max_blocks: int, timed: bool = True, to_gpu: bool = False) -> None:
        while len(self.blocks) < max_blocks:
            if timed and len(self.blocks) >= 4 and time.monotonic() > self.w.deadline:
                break
            room = limit - self.live
            if room < 4 * KIB:
                break
            size = self.rng.choice(SIZES)
            if size > min(room, self.w.max_block):
                size = max(4 * KIB, (min(room, self.w.max_block) // 2) // (4 * KIB) * (4 * KIB))
                if size > room:
                    break
            kind = "managed" if self.rng.random() < 0.5 else "device"
            b = self._alloc(size, kind)
            self.blocks.append(b)
            self._exercise(b)
            if to_gpu and kind == "managed" and self.w.prefetch_ok:
                # held on the GPU across the peak reading, so its GPU page tables exist then
                self.w.cu.prefetch(b.ptr, b.size, self.w.dev, self.stream)
                self.w.cu.stream_sync(self.stream)
                self.stats.counts["prefetches"] += 1

    def _holes(self) -> None:
        freed = []
        keep = []
        for i, b in enumerate(self.blocks):
            if i % 2:
                freed.append((b.ptr, b.size, b.kind))
                self._free(b)
                self.stats.counts["holes_freed"] += 1
            else:
                keep.append(b)
        self.blocks = keep
        for b in self.blocks:
            self._check(b, "survivor after neighbours were freed")
        holes = {p for p, _, _ in freed}
        for _, size, kind in freed:
            b = self._alloc(size, kind)
            self.blocks.append(b)
            self.stats.counts["hole_refills"] += 1
            if b.ptr in holes:
                self.stats.counts["hole_reused_addresses"] += 1
            self._exercise(b)
        for b in self.blocks:
            self._check(b, "after holes were refilled")

    def _free_all(self) -> None:
        while self.blocks:
            self._free(self.blocks.pop())

    def run(self) -> None:
        cu = self.w.cu
        try:
            cu.set_current(self.w.ctx)
            self.stream = cu.stream_create()
            self.scratch = ctypes.create_string_buffer(VERIFY_CHUNK)
            rounds = 0
            while rounds == 0 or time.monotonic() < self.w.deadline:
                self._phase = "fill"
                self._fill(int(self.share * self.rng.uniform(0.5, 1.0)), 24)
                self._phase = "holes"
                self._holes()
                self._phase = "free"
                self._free_all()
                rounds += 1
                if self.w.failed.is_set():
                    break
            self.stats.counts["rounds"] = rounds
            self._phase = "peak"
            self._fill(self.share, 64, timed=False, to_gpu=True)
        except (_Mismatch, Exception) as e:
            self._record(e)
        finally:
            try:
                self.w.barrier.wait(timeout=PEAK_WAIT_S + 60)
            except threading.BrokenBarrierError:
                pass
        self.w.go.wait(timeout=PEAK_WAIT_S + 60)
        try:
            for b in self.blocks:
                self._check(b, "held across the peak reading")
        except Exception as e:
            self._record(e)
        try:
            self._free_all()
            cu.stream_sync(self.stream)
            cu.stream_destroy(self.stream)
        except Exception as e:
            self.stats.errors["teardown"].append(f"thread {self.index}: {e}")

    def _record(self, e: Exception) -> None:
        phase = getattr(self, "_phase", "?")
        msg = f"thread {self.index}, {phase}: {e}"
        if isinstance(e, _Mismatch):
            area = "holes" if phase == "holes" else ("managed" if "managed" in str(e) else "device")
        else:
            from spark_memsaver.validate.cuda import CudaError
            if isinstance(e, CudaError) and "Prefetch" in e.call:
                area = "prefetch"
            elif isinstance(e, CudaError):
                area = "holes" if phase == "holes" else ("managed" if e.call == "cuMemAllocManaged" else "device")
            else:
                area = "threads"
                msg += f" ({type(e).__name__})"
        self.stats.errors[area].append(msg)
        self.w.failed.set()
        # blocks stay listed: teardown frees them


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
                           concurrent_managed=ident["concurrent_managed_access"])
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
        self.max_block = max(4 * KIB, min(MAX_BLOCK, share // 2) // (4 * KIB) * (4 * KIB))
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


# --- checks and counters (pure) ------------------------------------------------------------------------

def check(name: str, status: str, detail: str, data=None) -> dict:
    d = {"name": name, "status": status, "detail": detail}
    if data is not None:
        d["data"] = data
    return d


def _tables(s: dict) -> int:
    return sum(c.get("tables", 0) for c in s.get("classes", {}).values())


def _zero_stats() -> dict:
    return {"format": 1, "tier": None, "trees_packed": 0, "trees_unpacked": 0, "backing_bytes": 0,
            "stock_bytes": 0, "saved_bytes": 0,
            "classes": {c: {"tables": 0, "pages": 0, "backing_bytes": 0, "stock_bytes": 0, "saved_bytes": 0}
                        for c in ("256", "4096")}}


def _signature(s: dict) -> dict:
    sig = {"trees_packed": s.get("trees_packed", 0), "backing_bytes": s.get("backing_bytes", 0)}
    for cls, v in s.get("classes", {}).items():
        sig[f"c{cls}_tables"] = v.get("tables", 0)
        sig[f"c{cls}_pages"] = v.get("pages", 0)
    return sig


def packing_checks(before: dict | None, peak: dict | None, after: dict | None) -> list[dict]:
    """Checks on the packing counters from three observe_uvm() readings: before, at peak, after teardown.

    Stock module (no counters at all): both checks not-applicable, "stock module: counters absent".
    Packed module: at peak the live tables and backing bytes must have grown; after teardown every live count
    (trees, tables and pages per class, backing bytes) must equal the baseline. Tier off, or a GPU whose trees
    the module declines to pack (unpacked_reason), make them skip / not-applicable with the reason.
    """
    names = ("packing-counters-move", "packing-counters-return")
    stats = [(x or {}).get("packing") for x in (before, peak, after)]
    if all(s is None for s in stats):
        loaded = any((x or {}).get("loaded") for x in (before, peak, after))
        reason = STOCK_REASON if loaded else "nvidia-uvm not loaded: counters absent"
        return [check(n, NA, reason) for n in names]
    errs = [s["error"] for s in stats if s and "error" in s]
    if errs:
        return [check(n, FAIL, f"counters unreadable: {errs[0]}") for n in names]
    b, p, a = stats
    if b is None:
        if (before or {}).get("loaded"):
            return [check(n, FAIL, "counters appeared during the run: the module changed under it") for n in names]
        b = _zero_stats()  # nvidia-uvm was loaded by this run: its baseline is empty
    if p is None or a is None:
        return [check(n, FAIL, "counters vanished during the run: nvidia-uvm unloaded or replaced")
                for n in names]
    out = []
    bad = [f"{label}: saved_bytes {s['saved_bytes']} != stock_bytes {s['stock_bytes']} - backing_bytes "
           f"{s['backing_bytes']}" for label, s in (("before", b), ("peak", p), ("after", a))
           if s.get("tier") is not None and s["saved_bytes"] != s["stock_bytes"] - s["backing_bytes"]]
    out.append(check("packing-counters-consistent", FAIL if bad else PASS,
                     "; ".join(bad) if bad else "saved = stock - backing in every reading"))
    if str(p.get("tier")).lower() in ("off", "0"):
        return out + [check(n, SKIP, "packing tier is off (uvm_pt_pack=0): nothing is packed") for n in names]
    d_tables = _tables(p) - _tables(b)
    d_backing = p["backing_bytes"] - b["backing_bytes"]
    d_trees = p.get("trees_packed", 0) - b.get("trees_packed", 0)
    moved = {"tables": d_tables, "backing_bytes": d_backing, "trees_packed": d_trees}
    if d_trees <= 0 and d_tables <= 0 and p.get("trees_unpacked", 0) > b.get("trees_unpacked", 0):
        reason = f"this GPU's page trees are not packed: unpacked_reason {p.get('unpacked_reason')}"
        return out + [check(n, NA, reason, moved) for n in names]
    if d_tables > 0 and d_backing > 0:
        out.append(check(names[0], PASS, f"+{d_tables} packed tables, +{d_backing / MIB:.2f} MiB backing at peak",
                         moved))
    else:
        out.append(check(names[0], FAIL, f"counters did not grow at peak (tables {d_tables:+d}, backing "
                                         f"{d_backing:+d} B, trees {d_trees:+d})", moved))
    sb, sa = _signature(b), _signature(a)
    diff = {k: sa.get(k, 0) - sb.get(k, 0) for k in set(sb) | set(sa) if sa.get(k, 0) != sb.get(k, 0)}
    if diff:
        out.append(check(names[1], FAIL, "after teardown the counters differ from the baseline: "
                         + ", ".join(f"{k} {v:+d}" for k, v in sorted(diff.items())), diff))
    else:
        out.append(check(names[1], PASS, "trees, tables, pages and backing bytes back to the baseline"))
    return out


# --- kernel log -------------------------------------------------------------------------------------

LOG_PATTERNS = (
    ("xid", re.compile(r"NVRM: Xid \((?P<dev>[^)]*)\): (?P<xid>\d+)")),
    ("uvm-assert", re.compile(r"nvidia-uvm: .*Assert failed")),
    ("uvm-fatal", re.compile(r"nvidia-uvm: .*global fatal error")),
    ("uvm-error", re.compile(r"nvidia-uvm: .*(?:\bERROR: |\bfailed\b)")),
    ("alloc-failure", re.compile(r"page allocation failure|NV_ERR_NO_MEMORY|NVRM: .*(?:failed to allocate|"
                                 r"out of memory)", re.I)),
    ("oom-kill", re.compile(r"Out of memory: Killed process|oom-kill:|invoked oom-killer")),
    ("kernel-warning", re.compile(r"WARNING: CPU: \d+ PID: \d+ at .*(?:nvidia|uvm)")),
    ("kernel-bug", re.compile(r"\bBUG: |\bOops\b|general protection fault|Kernel panic")),
)

_KMSG_RE = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<ts>\d+),[^;]*;(?P<msg>.*)$", re.S)
_DMESG_RE = re.compile(r"^\[\s*(?P<ts>\d+\.\d+)\]\s?(?P<msg>.*)$")


def parse_kmsg_record(rec: str) -> dict | None:
    """One /dev/kmsg record: 'prio,seq,usec,flags;message' + optional ' KEY=value' continuation lines."""
    first = rec.split("\n", 1)[0]
    m = _KMSG_RE.match(first)
    if not m:
        return None
    return {"level": int(m["prio"]) & 7, "seq": int(m["seq"]), "ts": int(m["ts"]) / 1e6, "msg": m["msg"]}


def parse_dmesg_line(line: str) -> dict | None:
    m = _DMESG_RE.match(line)
    if not m:
        return None
    return {"ts": float(m["ts"]), "msg": m["msg"]}


def scan_messages(messages: list[str]) -> list[dict]:
    """Kernel-log messages that mean trouble for a UVM qualification, each with its kind."""
    events = []
    for msg in messages:
        for kind, rx in LOG_PATTERNS:
            m = rx.search(msg)
            if m:
                ev = {"kind": kind, "line": msg.strip()[:400]}
                if kind == "xid":
                    ev["xid"] = int(m["xid"])
                    ev["device"] = m["dev"]
                events.append(ev)
                break
    return events


class KernelLog:
    """Marks the kernel log at start and returns the messages that appeared since, from /dev/kmsg or dmesg."""

    def __init__(self, host):
        self.host = host
        self.fd = None
        self.source = None
        self.reason = None
        self.mark = None

    def start(self) -> None:
        errors = []
        if self.host.is_live:
            try:
                fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
                try:
                    os.lseek(fd, 0, os.SEEK_END)
                except OSError:
                    pass
                self.fd, self.source = fd, "/dev/kmsg"
                return
            except OSError as e:
                errors.append(f"/dev/kmsg: {e.strerror or e}")
        try:
            r = self.host.run(["dmesg"], timeout=15)
            if r.ok:
                lines = [x for x in (parse_dmesg_line(ln) for ln in r.stdout.splitlines()) if x]
                self.mark = (lines[-1]["ts"], lines[-1]["msg"]) if lines else (-1.0, "")
                self.source = "dmesg"
                return
            errors.append(f"dmesg: {(r.stderr or r.stdout).strip()[:200]}")
        except MemsaverError as e:
            errors.append(f"dmesg: {e.message}")
        self.reason = "; ".join(errors) or "no kernel log"

    def collect(self) -> list[str]:
        if self.source == "/dev/kmsg":
            msgs = []
            while True:
                try:
                    data = os.read(self.fd, 16384)
                except BlockingIOError:
                    break
                except BrokenPipeError:   # records overwritten while we read: go on with the next one
                    continue
                except OSError as e:
                    self.reason = f"/dev/kmsg read: {e}"
                    break
                if not data:
                    break
                rec = parse_kmsg_record(data.decode(errors="replace"))
                if rec:
                    msgs.append(rec["msg"])
            os.close(self.fd)
            self.fd = None
            return msgs
        if self.source == "dmesg":
            try:
                r = self.host.run(["dmesg"], timeout=15)
            except MemsaverError as e:
                self.reason = f"dmesg: {e.message}"
                return []
            lines = [x for x in (parse_dmesg_line(ln) for ln in r.stdout.splitlines()) if x]
            return [x["msg"] for x in lines if (x["ts"], x["msg"]) > self.mark]
        return []


def log_check(log_source: str | None, reason: str | None, events: list[dict]) -> dict:
    if log_source is None:
        return check("kernel-log", SKIP, f"kernel log not readable ({reason}); run as root to scan it")
    if events:
        kinds = sorted({e["kind"] for e in events})
        return check("kernel-log", FAIL, f"{len(events)} kernel-log event(s) during the run: {', '.join(kinds)}; "
                     f"first: {events[0]['line']}", {"events": events[:50]})
    return check("kernel-log", PASS, f"no Xid, UVM assertion or allocation failure in {log_source}")


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
                 f"{'ours' if uvm.get('patched') else 'stock'} {uvm.get('version') or ''} "
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


def identity(host) -> dict:
    from spark_memsaver.observe.snapshot import observe_driver, observe_host
    h = observe_host(host)
    drv = observe_driver(host)
    u = os.uname()
    return {"node": socket.gethostname(), "kernel": h["kernel"], "kernel_version": u.version, "arch": h["arch"],
            "page_size": h["page_size"], "nvidia_driver": drv["loaded_version"],
            "nvidia_srcversion": (host.read_text("/sys/module/nvidia/srcversion") or "").strip() or None}


def _uvm(host) -> dict:
    from spark_memsaver.observe.snapshot import observe_uvm
    return observe_uvm(host)


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
    remedy = "Wait for the other 'spark-memsaver validate' to finish: two runs would read each other's counters."


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
    params = check_args(max_gib, duration, threads)
    if not host.is_live:
        raise ValidateUsage("validate drives the GPU of the running system: it cannot use --root",
                            remedy="Run it without --root on the node to qualify.")
    with _single_run():
        rep = run_validation(host, params)
    saved, save_errors = [], []
    state_path = os.environ.get(REPORT_PATH_ENV) or REPORT_PATH
    targets = ([state_path] if os.geteuid() == 0 else []) + ([report_path] if report_path else [])
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
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code else 0
    from spark_memsaver.host import Host
    try:
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

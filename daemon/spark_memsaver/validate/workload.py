"""The worker's allocation threads: blocks, statistics and one thread's workload (runs in the worker)."""

from __future__ import annotations

import ctypes
import random
import struct
import threading
import time

from spark_memsaver.validate.params import KIB, PEAK_WAIT_S, SIZES, VERIFY_CHUNK, crossings

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

"""The device-allocation check (issue 18 item 3) without a GPU: window plan, budget, the child's verdicts."""
import json
import sys

from spark_memsaver.validate import devalloc as d
from spark_memsaver.validate.cuda import CudaError

GIB, KIB = d.GIB, d.KIB


def test_windows_at_each_4gib_line():
    assert d.window_offsets(d.DEVALLOC_BYTES) == [4 * GIB - 128 * KIB, 4 * GIB - 64 * KIB, 4 * GIB]
    assert len(d.window_offsets(12 * GIB + 64 * KIB)) == 9
    assert d.window_offsets(4 * GIB) == []


def test_budget_skips_with_reason():
    p = d.plan(2 * GIB, 100 * GIB)
    assert p["skipped"] and "below the 4.06 GiB" in p["skipped"]
    assert d.plan(8 * GIB, 100 * GIB)["skipped"] is None
    assert d.plan(8 * GIB, 10 * GIB)["skipped"]


class FakeCuda:
    """Stands in for libcuda (no GPU here): device memory is a dict of windows; fault_at makes a copy fail."""

    def __init__(self, free=100 * GIB, fault_at=None, corrupt_at=None):
        self.mem, self.free_b, self.fault_at, self.corrupt_at = {}, free, fault_at, corrupt_at

    def init(self): pass
    def device(self, o): return 0
    def primary_ctx_retain(self, dev): return 1
    def set_current(self, c): pass
    def synchronize(self): pass
    def mem_info(self): return self.free_b, 140 * GIB
    def alloc(self, size): return 1 << 40
    def free(self, p): pass

    def htod(self, dst, src, n):
        import ctypes
        if self.fault_at is not None and dst - (1 << 40) == self.fault_at:
            raise CudaError("cuMemcpyHtoD", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access")
        self.mem[dst] = ctypes.string_at(src, n)

    def dtoh(self, dst, src, n):
        import ctypes
        data = self.mem[src]
        if self.corrupt_at is not None and src - (1 << 40) == self.corrupt_at:
            data = b"\0" * n
        ctypes.memmove(dst, data, n)


def test_child_passes_and_counts_bytes():
    r = d.child({"max_bytes": 8 * GIB}, cuda_factory=FakeCuda)
    assert r["status"] == "pass" and r["windows"] == 3 and r["checked_bytes"] == 3 * 64 * KIB


def test_child_skips_when_budget_small():
    r = d.child({"max_bytes": 2 * GIB}, cuda_factory=FakeCuda)
    assert r["status"] == "skip" and "headroom budget" in r["reason"]


def test_child_fault_names_issue():
    r = d.child({"max_bytes": 8 * GIB}, cuda_factory=lambda: FakeCuda(fault_at=4 * GIB - 64 * KIB))
    assert r["status"] == "fail" and r["fault"] and d.ISSUE in r["reason"] and "0xffff0000" in r["reason"]


def test_child_mismatch_fails():
    r = d.child({"max_bytes": 8 * GIB}, cuda_factory=lambda: FakeCuda(corrupt_at=4 * GIB))
    assert r["status"] == "fail" and d.ISSUE in r["reason"]


def test_dead_child_is_contained():
    c = d.run_check({}, argv=[sys.executable, "-c", "import os; os.abort()"])
    assert c["name"] == d.NAME and c["status"] == "fail" and d.ISSUE in c["detail"]


def test_child_result_passed_through():
    line = json.dumps({"status": "pass", "bytes": d.DEVALLOC_BYTES, "windows": 3, "checked_bytes": 196608})
    c = d.run_check({}, argv=[sys.executable, "-c", f"print({line!r})"])
    assert c["status"] == "pass" and "196608 B" in c["detail"]


def test_xid31_turns_pass_into_fail():
    ok = {"name": d.NAME, "status": "pass", "detail": "", "data": None}
    assert d.xid31_check(ok, [{"kind": "xid", "xid": 31}])["status"] == "fail"
    assert d.xid31_check(ok, [{"kind": "xid", "xid": 79}])["status"] == "pass"

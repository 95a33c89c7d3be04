"""`spark-memsaver memory` on a machine with an NVIDIA GPU (`pytest -m gpu`): observe/gpuprocs.py's NVML binding
(ctypes over libnvidia-ml.so.1) finds this process's CUDA allocation under its pid, with its cgroup/unit.

Not applicable (skipped with the reason) where no CUDA driver or GPU is (CI, the build machine). On GB10 the
device is unified (NVML's memory totals "Not Supported") and the allocation is a row of MemTotal; on a discrete
GPU it is listed but not carved out of MemTotal."""

from __future__ import annotations

import json
import os

import pytest

from spark_memsaver.decide import memory as decide
from spark_memsaver.host import Host
from spark_memsaver.observe import gpuprocs
from spark_memsaver.observe import memory as observe
from tests.test_gpu import gpu  # noqa: F401  (the module fixture: a CUDA context on device 0)

pytestmark = [pytest.mark.gpu]
GIB = 1 << 30


def test_a_cuda_allocation_appears_under_its_pid(gpu):  # noqa: F811
    c, _dev = gpu
    ptr = c.alloc(4 * GIB)
    try:
        c.memset_d8(ptr, 0x5A, 4 * GIB)
        c.synchronize()
        got = gpuprocs.read(Host("/"))
        assert got["state"] == "known", got
        mine = [p for p in got["processes"] if p["pid"] == os.getpid()]
        assert mine and mine[0]["bytes"] >= 4 * GIB, got
        assert mine[0]["comm"] and (mine[0]["cgroup"] or mine[0]["unit"] is None)
        doc = decide.model(observe.read(Host("/")), 4 * GIB)
        assert abs(doc["rows_sum_bytes"] - doc["total_bytes"]) <= decide.TOLERANCE * doc["total_bytes"]
        rows = {r["kind"]: r["bytes"] for r in doc["rows"]}
        if mine[0]["unified"]:
            assert rows.get("gpu-allocations", 0) >= 4 * GIB
        else:
            assert "gpu-allocations" not in rows
        print(json.dumps({"process": mine[0], "rows": rows, "verdict": doc["verdict"]}))
    finally:
        c.free(ptr)

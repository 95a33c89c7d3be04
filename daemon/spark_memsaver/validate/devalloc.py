"""The device-allocation check: one ``cuMemAlloc`` of a little over 4 GiB, read back around each 4 GiB line.

NVIDIA/open-gpu-kernel-modules#1269: on 64 KiB-page arm64 kernels, drivers from 590.44.01 map GPU
allocations of 4 GiB or more with an unusable 64 KiB page just below each 4 GiB boundary; the first
access faults (Xid 31, FAULT_PTE). This check writes a pattern into the 64 KiB windows at
4 GiB - 128 KiB, 4 GiB - 64 KiB and 4 GiB (and at each further 4 GiB boundary inside the allocation)
and reads it back. It runs in its own child process (``python3 -m spark_memsaver.validate.devalloc``)
so that a lost CUDA context stays there: the parent turns whatever the child says, or its death,
into one check. Standard library only.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
WINDOW = 64 * KIB
DEVALLOC_BYTES = 4 * GIB + 64 * MIB      # a little over 4 GiB: holds the window at 4 GiB and its neighbours
HEADROOM_FRACTION = 0.25                 # as the main run: never more than this share of what is free
TIMEOUT_S = 120.0
ISSUE = "NVIDIA/open-gpu-kernel-modules#1269"
NAME = "device-alloc-4gib"
FAULT_ERRORS = {"CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_CONTEXT_IS_DESTROYED",
                "CUDA_ERROR_ECC_UNCORRECTABLE", "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_UNKNOWN",
                "CUDA_ERROR_INVALID_CONTEXT", "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS"}


def window_offsets(size: int, unit: int = 4 * GIB, window: int = WINDOW) -> list[int]:
    """Offsets (from the allocation's start) of the windows checked: B - 128 KiB, B - 64 KiB, B per line B."""
    out = []
    b = unit
    while b + window <= size:
        out.extend((b - 2 * window, b - window, b))
        b += unit
    return out


def plan(max_bytes: int, gpu_free: int, size: int = DEVALLOC_BYTES,
         fraction: float = HEADROOM_FRACTION) -> dict:
    """Whether the check may allocate ``size`` now; ``skipped`` holds the reason when not."""
    budget = min(max_bytes, int(gpu_free * fraction))
    if budget < size:
        return {"bytes": size, "budget": budget,
                "skipped": f"headroom budget {budget / GIB:.2f} GiB (min of --max-gib and {fraction:.0%} of "
                           f"{gpu_free / GIB:.2f} GiB free) is below the {size / GIB:.2f} GiB allocation"}
    return {"bytes": size, "budget": budget, "skipped": None}


def pattern(off: int, n: int = WINDOW) -> bytes:
    """A pattern that differs per window and per 4-byte word (a stale or shifted page shows)."""
    import struct
    base = (off // WINDOW) * 0x9E3779B1
    return b"".join(struct.pack("<I", (base + i * 0x01000193) & 0xFFFFFFFF) for i in range(n // 4))


def fault_message(what: str) -> str:
    return (f"GPU fault in the device-allocation check ({what}): a cuMemAlloc mapping >= 4 GiB is unusable "
            f"near a 4 GiB boundary, as in {ISSUE} (drivers 590.44.01 and newer on 64 KiB-page kernels); "
            "use a driver without the defect (580.x) or keep single allocations below 4 GiB")


def child(params: dict, cuda_factory=None) -> dict:
    """In the child: the result dict (status pass/fail/skip/not-applicable)."""
    from spark_memsaver.validate.cuda import Cuda, CudaError, CudaUnavailable
    try:
        cu = (cuda_factory or Cuda)()
        cu.init()
        dev = cu.device(params.get("device", 0))
        ctx = cu.primary_ctx_retain(dev)
        cu.set_current(ctx)
    except CudaUnavailable as e:
        return {"status": "not-applicable", "reason": f"no CUDA driver library: {e}"}
    except CudaError as e:
        return {"status": "not-applicable", "reason": f"no CUDA context: {e}"}
    free, total = cu.mem_info()
    p = plan(params["max_bytes"], free, params.get("bytes", DEVALLOC_BYTES))
    if p["skipped"]:
        return {"status": "skip", "reason": p["skipped"], "plan": p}
    size, ptr, step = p["bytes"], None, "cuMemAlloc"
    checked = 0
    try:
        ptr = cu.alloc(size)
        offs = window_offsets(size)
        buf = ctypes.create_string_buffer(WINDOW)
        for off in offs:
            want = pattern(off)
            step = f"write at offset {off:#x}"
            ctypes.memmove(buf, want, WINDOW)
            cu.htod(ptr + off, ctypes.addressof(buf), WINDOW)
            cu.synchronize()
        for off in offs:
            step = f"read at offset {off:#x}"
            ctypes.memset(buf, 0, WINDOW)
            cu.dtoh(ctypes.addressof(buf), ptr + off, WINDOW)
            cu.synchronize()
            if buf.raw != pattern(off):
                return {"status": "fail", "fault": False, "bytes": size, "address": f"{ptr:#x}",
                        "reason": f"the pattern read back at offset {off:#x} differs ({ISSUE}: the 64 KiB "
                                  "page below a 4 GiB boundary of a cuMemAlloc mapping)"}
            checked += WINDOW
        step = "cuMemFree"
        cu.free(ptr)
        ptr = None
    except CudaError as e:
        fault = e.name in FAULT_ERRORS
        return {"status": "fail", "fault": fault, "bytes": size, "checked_bytes": checked,
                "reason": fault_message(f"{step}: {e}") if fault else f"{step}: {e}"}
    return {"status": "pass", "bytes": size, "windows": len(offs),
            "checked_bytes": checked, "offsets": [f"{o:#x}" for o in offs]}


def run_check(params: dict, argv: list[str] | None = None, timeout: float = TIMEOUT_S) -> dict:
    """In the parent: run the child, return one check dict {name, status, detail, data}."""
    argv = argv or [sys.executable, "-m", "spark_memsaver.validate.devalloc", json.dumps(params)]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return _check("fail", fault_message(f"the check's process hung for {timeout:.0f} s and was killed"))
    res = None
    for line in r.stdout.splitlines():
        try:
            res = json.loads(line)
        except ValueError:
            continue
    if not isinstance(res, dict) or "status" not in res:
        tail = " | ".join(r.stderr.strip().splitlines()[-3:])
        return _check("fail", fault_message(f"the check's process died with status {r.returncode}"
                                            + (f": {tail}" if tail else "")))
    detail = res.get("reason") or (f"{res['bytes'] / GIB:.2f} GiB cuMemAlloc: {res['windows']} windows of 64 KiB "
                                   f"around each 4 GiB boundary read back intact ({res['checked_bytes']} B)")
    return _check(res["status"], detail, res)


def xid31_check(chk: dict, events: list[dict]) -> dict:
    """A passing check with Xid 31 in the kernel log during the run fails, naming the issue."""
    if chk["status"] == "pass" and any(e.get("xid") == 31 for e in events):
        return _check("fail", fault_message("Xid 31 in the kernel log during the run"), chk.get("data"))
    return chk


def _check(status: str, detail: str, data=None) -> dict:
    return {"name": NAME, "status": status, "detail": detail, "data": data}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        res = child(json.loads(argv[0]))
    except Exception as e:  # reported as a result line, never a traceback
        res = {"status": "fail", "reason": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Observe: GPU allocations per process, through NVML (libnvidia-ml.so.1) by ctypes, and pid -> systemd unit.

On GB10 NVML's memory totals say "Not Supported", but ``nvmlDeviceGetComputeRunningProcesses`` works: each
compute process with the bytes it holds. Where the library is absent (no NVIDIA driver, a --root fixture) or a
call fails, the answer is ``{"state": "unknown", "reason": ...}``: never a guessed zero.
"""

from __future__ import annotations

from spark_memsaver.host import Host

NVML_LIBRARY = "libnvidia-ml.so.1"
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_VALUE_NOT_AVAILABLE = (1 << 64) - 1     # usedGpuMemory when the driver does not know it
MAX_PROCESSES = 256


def unit_of(cgroup_text: str | None) -> dict:
    """/proc/PID/cgroup -> {cgroup, unit}: the v2 (``0::``) path, or the v1 ``name=systemd`` one on a hybrid
    host; the unit is the path's last ``.service``/``.scope`` component (None when there is none)."""
    path = None
    for line in (cgroup_text or "").splitlines():
        hid, _, rest = line.partition(":")
        ctrl, _, p = rest.partition(":")
        if hid == "0" and ctrl == "" and p and p != "/":
            path = p
            break
        if ctrl == "name=systemd" and p:
            path = path or p
    unit = None
    for part in reversed((path or "").split("/")):
        if part.endswith((".service", ".scope")):
            unit = part
            break
    return {"cgroup": path, "unit": unit}


def describe_pid(host: Host, pid: int) -> dict:
    comm = (host.read_text(f"/proc/{pid}/comm") or "").strip() or None
    return {"pid": pid, "comm": comm, **unit_of(host.read_text(f"/proc/{pid}/cgroup"))}


def _nvml_processes() -> list[tuple[int, int | None, bool]]:
    """[(pid, used bytes or None, unified)] over every device; raises OSError/RuntimeError when NVML cannot
    answer. ``unified``: the device has no memory of its own (GB10: nvmlDeviceGetMemoryInfo is "Not Supported"),
    so what its processes hold is the node's memory; a discrete GPU's memory is not in MemTotal."""
    import ctypes

    class ProcessInfo(ctypes.Structure):          # nvmlProcessInfo_t (v2/v3 layout)
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                    ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]

    class Memory(ctypes.Structure):               # nvmlMemory_t
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    lib = ctypes.CDLL(NVML_LIBRARY)

    def call(name, *args):
        rc = getattr(lib, name)(*args)
        if rc != NVML_SUCCESS:
            raise RuntimeError(f"{name} returned NVML error {rc}")

    call("nvmlInit_v2")
    try:
        count = ctypes.c_uint(0)
        call("nvmlDeviceGetCount_v2", ctypes.byref(count))
        out = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            call("nvmlDeviceGetHandleByIndex_v2", i, ctypes.byref(handle))
            unified = lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(Memory())) == NVML_ERROR_NOT_SUPPORTED
            fn = next((f for f in ("nvmlDeviceGetComputeRunningProcesses_v3",
                                   "nvmlDeviceGetComputeRunningProcesses_v2") if hasattr(lib, f)), None)
            if fn is None:
                raise RuntimeError("this NVML has no nvmlDeviceGetComputeRunningProcesses_v2/_v3")
            n = ctypes.c_uint(MAX_PROCESSES)
            buf = (ProcessInfo * MAX_PROCESSES)()
            rc = getattr(lib, fn)(handle, ctypes.byref(n), buf)
            if rc not in (NVML_SUCCESS, NVML_ERROR_INSUFFICIENT_SIZE):
                raise RuntimeError(f"{fn} returned NVML error {rc}")
            for p in buf[:min(n.value, MAX_PROCESSES)]:
                used = None if p.usedGpuMemory == NVML_VALUE_NOT_AVAILABLE else int(p.usedGpuMemory)
                out.append((int(p.pid), used, unified))
        return out
    finally:
        try:
            lib.nvmlShutdown()
        except (AttributeError, OSError):
            pass


def read(host: Host) -> dict:
    """{"state": "known", "processes": [{pid, comm, cgroup, unit, bytes, unified}]} or {"state": "unknown",
    "reason"}."""
    if not host.is_live:
        return {"state": "unknown", "reason": "NVML answers for the running system only, not under --root"}
    try:
        procs = _nvml_processes()
    except OSError:
        return {"state": "unknown", "reason": f"{NVML_LIBRARY} is not installed (no NVIDIA driver here)"}
    except (RuntimeError, AttributeError) as e:
        return {"state": "unknown", "reason": f"NVML did not answer: {e}"}
    merged: dict[tuple[int, bool], int | None] = {}
    for pid, used, unified in procs:
        k = (pid, unified)
        merged[k] = None if used is None or merged.get(k, 0) is None else merged.get(k, 0) + used
    return {"state": "known",
            "processes": [dict(describe_pid(host, pid), bytes=b, unified=u) for (pid, u), b in sorted(merged.items())]}

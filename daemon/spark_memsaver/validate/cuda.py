"""A thin ctypes binding of the CUDA driver API (``libcuda.so.1``), just what ``validate`` needs.

No compiler, no CUDA toolkit, no PyTorch: the driver's own library is enough. Standard library only, so the
validation worker runs on a bare node's ``/usr/bin/python3``.

Every entry point is looked up by its exported symbol name. Where the CUDA headers map a name to a versioned
symbol (``cuMemAlloc`` -> ``cuMemAlloc_v2``) the versioned one is bound, as a program compiled against the
headers would. ``cuMemPrefetchAsync`` changed its signature in CUDA 12.2 (``_v2`` takes a ``CUmemLocation``
and flags) and CUDA 13 headers only offer the new form; the driver keeps exporting both. We bind
``cuMemPrefetchAsync_v2`` when the library exports it, else the original, and say which (``prefetch_api``).

Set ``SPARK_MEMSAVER_LIBCUDA`` to load another file than ``libcuda.so.1`` (tests, unusual installs).
"""

from __future__ import annotations

import ctypes
import os

# CUresult values this module names (cuda.h).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_NOT_SUPPORTED = 801

# CUdevice_attribute values.
ATTR_INTEGRATED = 18
ATTR_MANAGED_MEMORY = 83
ATTR_PAGEABLE_MEMORY_ACCESS = 88
ATTR_CONCURRENT_MANAGED_ACCESS = 89

CU_MEM_ATTACH_GLOBAL = 0x1
CU_STREAM_NON_BLOCKING = 0x1
CU_DEVICE_CPU = -1            # the legacy prefetch API's "host" device
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2

CUdeviceptr = ctypes.c_uint64
CUdevice = ctypes.c_int
CUcontext = ctypes.c_void_p
CUstream = ctypes.c_void_p

_NAMES = {0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
          3: "CUDA_ERROR_NOT_INITIALIZED", 100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE",
          801: "CUDA_ERROR_NOT_SUPPORTED"}


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CudaUnavailable(Exception):
    """libcuda.so.1 cannot be loaded, or lacks an entry point validate needs."""


class CudaError(Exception):
    def __init__(self, call: str, code: int, name: str, text: str):
        super().__init__(f"{call} failed: {name} ({code}): {text}")
        self.call, self.code, self.name, self.text = call, code, name, text


# name -> (symbol candidates, argtypes)
_P = ctypes.POINTER
_SIGS = {
    "cuInit": (("cuInit",), [ctypes.c_uint]),
    "cuDriverGetVersion": (("cuDriverGetVersion",), [_P(ctypes.c_int)]),
    "cuDeviceGetCount": (("cuDeviceGetCount",), [_P(ctypes.c_int)]),
    "cuDeviceGet": (("cuDeviceGet",), [_P(CUdevice), ctypes.c_int]),
    "cuDeviceGetName": (("cuDeviceGetName",), [ctypes.c_char_p, ctypes.c_int, CUdevice]),
    "cuDeviceGetAttribute": (("cuDeviceGetAttribute",), [_P(ctypes.c_int), ctypes.c_int, CUdevice]),
    "cuDeviceTotalMem": (("cuDeviceTotalMem_v2",), [_P(ctypes.c_size_t), CUdevice]),
    "cuDeviceGetPCIBusId": (("cuDeviceGetPCIBusId",), [ctypes.c_char_p, ctypes.c_int, CUdevice]),
    "cuDeviceGetUuid": (("cuDeviceGetUuid_v2", "cuDeviceGetUuid"), [ctypes.c_char_p, CUdevice]),
    "cuDevicePrimaryCtxRetain": (("cuDevicePrimaryCtxRetain",), [_P(CUcontext), CUdevice]),
    "cuDevicePrimaryCtxRelease": (("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"), [CUdevice]),
    "cuCtxSetCurrent": (("cuCtxSetCurrent",), [CUcontext]),
    "cuCtxSynchronize": (("cuCtxSynchronize",), []),
    "cuMemGetInfo": (("cuMemGetInfo_v2",), [_P(ctypes.c_size_t), _P(ctypes.c_size_t)]),
    "cuMemAlloc": (("cuMemAlloc_v2",), [_P(CUdeviceptr), ctypes.c_size_t]),
    "cuMemAllocManaged": (("cuMemAllocManaged",), [_P(CUdeviceptr), ctypes.c_size_t, ctypes.c_uint]),
    "cuMemFree": (("cuMemFree_v2",), [CUdeviceptr]),
    "cuMemsetD8": (("cuMemsetD8_v2",), [CUdeviceptr, ctypes.c_ubyte, ctypes.c_size_t]),
    "cuMemsetD32": (("cuMemsetD32_v2",), [CUdeviceptr, ctypes.c_uint, ctypes.c_size_t]),
    "cuMemcpyHtoD": (("cuMemcpyHtoD_v2",), [CUdeviceptr, ctypes.c_void_p, ctypes.c_size_t]),
    "cuMemcpyDtoH": (("cuMemcpyDtoH_v2",), [ctypes.c_void_p, CUdeviceptr, ctypes.c_size_t]),
    "cuStreamCreate": (("cuStreamCreate",), [_P(CUstream), ctypes.c_uint]),
    "cuStreamDestroy": (("cuStreamDestroy_v2", "cuStreamDestroy"), [CUstream]),
    "cuStreamSynchronize": (("cuStreamSynchronize",), [CUstream]),
}


class Cuda:
    """The loaded driver library. Methods raise CudaError on a non-zero CUresult."""

    def __init__(self, path: str | None = None):
        path = path or os.environ.get("SPARK_MEMSAVER_LIBCUDA") or "libcuda.so.1"
        self.path = path
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as e:
            raise CudaUnavailable(f"cannot load {path}: {e}") from None
        self._fn = {}
        for name, (symbols, argtypes) in _SIGS.items():
            fn = None
            for sym in symbols:
                fn = getattr(self.lib, sym, None)
                if fn is not None:
                    break
            if fn is None:
                raise CudaUnavailable(f"{path} does not export {symbols[0]}: not an NVIDIA CUDA driver library")
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
            self._fn[name] = fn
        self._name = getattr(self.lib, "cuGetErrorName", None)
        self._text = getattr(self.lib, "cuGetErrorString", None)
        for f in (self._name, self._text):
            if f is not None:
                f.restype = ctypes.c_int
                f.argtypes = [ctypes.c_int, _P(ctypes.c_char_p)]
        v2 = getattr(self.lib, "cuMemPrefetchAsync_v2", None)
        if v2 is not None:
            v2.restype = ctypes.c_int
            v2.argtypes = [CUdeviceptr, ctypes.c_size_t, CUmemLocation, ctypes.c_uint, CUstream]
            self._prefetch, self.prefetch_api = v2, "cuMemPrefetchAsync_v2"
        else:
            v1 = getattr(self.lib, "cuMemPrefetchAsync", None)
            if v1 is not None:
                v1.restype = ctypes.c_int
                v1.argtypes = [CUdeviceptr, ctypes.c_size_t, CUdevice, CUstream]
            self._prefetch, self.prefetch_api = v1, ("cuMemPrefetchAsync" if v1 is not None else None)

    # --- plumbing -------------------------------------------------------------------------------
    def error_name(self, code: int) -> tuple[str, str]:
        name, text = _NAMES.get(code, f"CUresult {code}"), ""
        s = ctypes.c_char_p()
        if self._name is not None and self._name(code, ctypes.byref(s)) == 0 and s.value:
            name = s.value.decode(errors="replace")
        s = ctypes.c_char_p()
        if self._text is not None and self._text(code, ctypes.byref(s)) == 0 and s.value:
            text = s.value.decode(errors="replace")
        return name, text

    def call(self, name: str, *args) -> None:
        rc = self._fn[name](*args)
        if rc != CUDA_SUCCESS:
            raise CudaError(name, rc, *self.error_name(rc))

    # --- what validate uses ---------------------------------------------------------------------
    def init(self) -> None:
        self.call("cuInit", 0)

    def driver_version(self) -> int:
        v = ctypes.c_int()
        self.call("cuDriverGetVersion", ctypes.byref(v))
        return v.value

    def device_count(self) -> int:
        n = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(n))
        return n.value

    def device(self, ordinal: int) -> int:
        d = CUdevice()
        self.call("cuDeviceGet", ctypes.byref(d), ordinal)
        return d.value

    def device_name(self, dev: int) -> str:
        buf = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", buf, 256, dev)
        return buf.value.decode(errors="replace")

    def attribute(self, dev: int, attr: int) -> int:
        v = ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(v), attr, dev)
        return v.value

    def total_mem(self, dev: int) -> int:
        v = ctypes.c_size_t()
        self.call("cuDeviceTotalMem", ctypes.byref(v), dev)
        return v.value

    def pci_bus_id(self, dev: int) -> str:
        buf = ctypes.create_string_buffer(64)
        self.call("cuDeviceGetPCIBusId", buf, 64, dev)
        return buf.value.decode(errors="replace")

    def uuid(self, dev: int) -> str:
        buf = ctypes.create_string_buffer(16)
        self.call("cuDeviceGetUuid", buf, dev)
        h = buf.raw.hex()
        return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def primary_ctx_retain(self, dev: int) -> int:
        c = CUcontext()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(c), dev)
        return c.value

    def primary_ctx_release(self, dev: int) -> None:
        self.call("cuDevicePrimaryCtxRelease", dev)

    def set_current(self, ctx: int | None) -> None:
        self.call("cuCtxSetCurrent", CUcontext(ctx))

    def synchronize(self) -> None:
        self.call("cuCtxSynchronize")

    def mem_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.call("cuMemGetInfo", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def alloc(self, size: int) -> int:
        p = CUdeviceptr()
        self.call("cuMemAlloc", ctypes.byref(p), size)
        return p.value

    def alloc_managed(self, size: int) -> int:
        p = CUdeviceptr()
        self.call("cuMemAllocManaged", ctypes.byref(p), size, CU_MEM_ATTACH_GLOBAL)
        return p.value

    def free(self, ptr: int) -> None:
        self.call("cuMemFree", CUdeviceptr(ptr))

    def memset_d8(self, ptr: int, value: int, count: int) -> None:
        self.call("cuMemsetD8", CUdeviceptr(ptr), value, count)

    def memset_d32(self, ptr: int, value: int, count: int) -> None:
        self.call("cuMemsetD32", CUdeviceptr(ptr), value, count)

    def htod(self, dst: int, src_addr: int, nbytes: int) -> None:
        self.call("cuMemcpyHtoD", CUdeviceptr(dst), ctypes.c_void_p(src_addr), nbytes)

    def dtoh(self, dst_addr: int, src: int, nbytes: int) -> None:
        self.call("cuMemcpyDtoH", ctypes.c_void_p(dst_addr), CUdeviceptr(src), nbytes)

    def stream_create(self) -> int:
        s = CUstream()
        self.call("cuStreamCreate", ctypes.byref(s), CU_STREAM_NON_BLOCKING)
        return s.value

    def stream_destroy(self, stream: int) -> None:
        self.call("cuStreamDestroy", CUstream(stream))

    def stream_sync(self, stream: int | None) -> None:
        self.call("cuStreamSynchronize", CUstream(stream))

    def prefetch(self, ptr: int, nbytes: int, dev: int | None, stream: int | None) -> None:
        """Migrate managed memory to GPU ``dev``, or to the host when ``dev`` is None."""
        if self._prefetch is None:
            raise CudaError("cuMemPrefetchAsync", CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED",
                            "the driver library exports no cuMemPrefetchAsync")
        if self.prefetch_api == "cuMemPrefetchAsync_v2":
            loc = CUmemLocation(CU_MEM_LOCATION_TYPE_HOST if dev is None else CU_MEM_LOCATION_TYPE_DEVICE,
                                0 if dev is None else dev)
            rc = self._prefetch(CUdeviceptr(ptr), nbytes, loc, 0, CUstream(stream))
        else:
            rc = self._prefetch(CUdeviceptr(ptr), nbytes, CU_DEVICE_CPU if dev is None else dev, CUstream(stream))
        if rc != CUDA_SUCCESS:
            raise CudaError(self.prefetch_api, rc, *self.error_name(rc))

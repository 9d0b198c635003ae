"""The few CUDA driver calls that CUDA IPC needs, through ctypes (libcuda ships with the driver).

torch's own IPC (`UntypedStorage._share_cuda_`) counts one release per export, made by
the consumer that maps it; an object exported once and read by any number of fetches
needs handles without that count. Nothing here runs before a transport asks for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
HANDLE_BYTES = 64


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed: `code` is its CUresult."""

    def __init__(self, call: str, code: int, message: str) -> None:
        super().__init__(f"{call} failed: CUDA error {code} ({message})")
        self.code = code


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    u64, p_u64 = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)
    lib.cuMemGetAddressRange_v2.argtypes = [p_u64, ctypes.POINTER(ctypes.c_size_t), u64]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), u64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [p_u64, _Handle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [u64]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(call: str, code: int) -> None:
    if code != 0:
        msg = ctypes.c_char_p()
        _lib().cuGetErrorString(code, ctypes.byref(msg))
        raise CudaDriverError(call, code, (msg.value or b"unknown").decode())


_contexts: dict[int, int] = {}  # device ordinal -> its primary context (kept by torch)
_lock = threading.Lock()


def _primary(ordinal: int) -> int:
    """Device `ordinal`'s primary context (torch's), retained once per process."""
    with _lock:
        ctx = _contexts.get(ordinal)
        if ctx is None:
            lib = _lib()
            dev, c = ctypes.c_int(), ctypes.c_void_p()
            _check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), ordinal))
            _check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev))
            ctx = _contexts[ordinal] = c.value or 0  # torch holds it too
    return ctx


@contextlib.contextmanager
def on_device(ordinal: int) -> Iterator[None]:
    """Make device `ordinal`'s primary context current on this thread for the block, then
    the one that was current before again.

    Setting a context current is what cudaSetDevice does: left so, the caller's thread
    (a producer's own, which exports inline) would allocate on `ordinal` from then on.
    """
    lib = _lib()
    ctx = _primary(ordinal)
    current = ctypes.c_void_p()
    _check("cuCtxGetCurrent", lib.cuCtxGetCurrent(ctypes.byref(current)))
    before = current.value or 0
    if before != ctx:
        _check("cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))
    try:
        yield
    finally:
        if before != ctx:
            _check("cuCtxSetCurrent", lib.cuCtxSetCurrent(before or None))


def export(ptr: int, ordinal: int) -> tuple[bytes, int, int]:
    """Return the IPC handle of the allocation holding `ptr`, its base address and size."""
    lib = _lib()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    handle = _Handle()
    with on_device(ordinal):
        _check("cuMemGetAddressRange", lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr))
        _check("cuIpcGetMemHandle", lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value))
    return ctypes.string_at(ctypes.addressof(handle), HANDLE_BYTES), base.value, size.value  # NULs and all


def open_handle(handle: bytes, ordinal: int) -> int:
    """Map another process's allocation on device `ordinal` here; return its address."""
    h = _Handle()
    ctypes.memmove(ctypes.addressof(h), handle, HANDLE_BYTES)
    ptr = ctypes.c_uint64()
    with on_device(ordinal):
        _check("cuIpcOpenMemHandle", _lib().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
    return ptr.value


def bytes_from(ptr: int, ordinal: int) -> int:
    """How many bytes of its allocation (ours, or one mapped here) lie from `ptr` on."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with on_device(ordinal):
        _check("cuMemGetAddressRange", _lib().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr))
    return int(base.value + size.value - ptr)


def close_handle(ptr: int, ordinal: int) -> None:
    """Unmap what `open_handle` mapped."""
    with on_device(ordinal):
        _check("cuIpcCloseMemHandle", _lib().cuIpcCloseMemHandle(ptr))

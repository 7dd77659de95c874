"""The CUDA driver calls the expert cache makes for every missed expert, through ctypes.

torch's way to queue a host->device copy on a side stream (switch the current stream, `copy_`,
record an event, switch back) builds Python objects and resolves the device at every step. The
same work is three driver calls here. In one call on the GPU machine (docs/bench/2026-12-05-first)
the host's step per copied expert fell from about 16 to 10 us, at Qwen3-30B-A3B's 12 GiB
(about 100 misses a token). The driver library is the one torch itself runs on (libcuda on
Linux, nvcuda.dll on Windows); streams and events are torch's, passed by handle. Each call
needs the device's context current on the calling thread, which any earlier torch CUDA call on
that thread makes so (the cache's callers sync on the routing first).
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache

import torch

from moeferry.engine.errors import UserError

LIBRARY = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"


class DriverError(RuntimeError):
    pass


@cache
def library():
    """The driver library with the argument types of the calls below (loaded once; one sentence
    when it cannot be)."""
    try:
        lib = ctypes.WinDLL(LIBRARY) if sys.platform == "win32" else ctypes.CDLL(LIBRARY)
        lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuEventQuery.argtypes = [ctypes.c_void_p]
        lib.cuEventSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    except (OSError, AttributeError):
        raise UserError(f"PyTorch sees a CUDA GPU, but the NVIDIA driver's {LIBRARY} cannot be loaded; "
                        f"reinstall the NVIDIA driver, or run with --device cpu.") from None
    return lib


def _check(code: int, call: str) -> None:
    if code:
        raise DriverError(f"The CUDA driver refused {call} (error {code}).")


def copy_to_device(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Queue a copy of nbytes from host address src to device address dst on stream."""
    _check(library().cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream), "a host-to-device copy")


def copy_to_host(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Queue a copy of nbytes from device address src to (page-locked) host address dst on stream."""
    _check(library().cuMemcpyDtoHAsync_v2(dst, src, nbytes, stream), "a device-to-host copy")


def device_pointer(host: int) -> int:
    """The address through which kernels read page-locked host memory at `host` (the host's own
    wherever the driver maps registered memory so; it need not be)."""
    out = ctypes.c_uint64()
    _check(library().cuMemHostGetDevicePointer_v2(ctypes.byref(out), host, 0), "the device address of pinned memory")
    return out.value


NOT_READY = 600  # CUDA_ERROR_NOT_READY


def done(event: int) -> bool:
    """Whether the work before event's last record has run."""
    code = library().cuEventQuery(event)
    if code != NOT_READY:
        _check(code, "an event query")
    return code == 0


def synchronize(event: int) -> None:
    """Wait on the host until event's last record has run."""
    _check(library().cuEventSynchronize(event), "an event synchronize")


def record(event: int, stream: int) -> None:
    """Record event on stream (handles: torch.cuda.Event.cuda_event, torch.cuda.Stream.cuda_stream)."""
    _check(library().cuEventRecord(event, stream), "an event record")


def wait(stream: int, event: int) -> None:
    """Make stream wait for event's last record."""
    _check(library().cuStreamWaitEvent(stream, event, 0), "a stream wait")


def new_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A torch event whose handle exists (torch creates it lazily, at its first record)."""
    event = torch.cuda.Event()
    event.record(stream)
    return event

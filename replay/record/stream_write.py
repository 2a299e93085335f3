"""A 64-bit word written by a CUDA stream into host memory, with the driver's stream memory
operation (``cuStreamWriteValue64``): what commits a job of the record ring.

The commit word must land after the job's other device copies; a stream runs its work in order,
and the driver fences the write (its default flag), so the word written this way lands after
everything queued before it on that stream. Against the alternative, a device counter bumped
by a kernel and copied to the host, it is one driver call instead of a kernel launch, a view of
the ring and a copy: tens of µs of the program's host time a step on an eager CUDA step.

A setting of ``Staging`` (``DRIVER_COMMIT``, off by default: side by side it measured no faster).
Used only where a self-test on the device passed (the write landed, with the value written);
anywhere else (no driver library, an older driver, a platform that refuses it) the caller keeps
the counter and the copy.
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["StreamWriter", "open_stream_writer"]


class StreamWriter:
    """The driver's ``cuStreamWriteValue64`` and ``cuMemHostGetDevicePointer``."""

    def __init__(self, lib: Any) -> None:
        write = getattr(lib, "cuStreamWriteValue64_v2", None) or lib.cuStreamWriteValue64
        write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        write.restype = ctypes.c_int
        pointer = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or lib.cuMemHostGetDevicePointer
        pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        pointer.restype = ctypes.c_int
        self._write = write
        self._pointer = pointer

    def device_pointer(self, host_ptr: int) -> int | None:
        """The device address of registered (or pinned) host memory; None: the driver refused."""
        out = ctypes.c_uint64(0)
        if self._pointer(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0) != 0:
            return None
        return int(out.value)

    def write(self, stream: int, address: int, value: int) -> bool:
        """Queue the write of ``value`` at device ``address`` on ``stream`` (a ``cudaStream_t``,
        ``torch.cuda.Stream.cuda_stream``); False: the driver refused it (nothing was queued)."""
        return self._write(stream, address, value, 0) == 0


def open_stream_writer(device: Any) -> StreamWriter | None:
    """A writer that was seen to work on ``device`` (a write into pinned memory, checked), or None."""
    import torch

    try:
        writer = StreamWriter(ctypes.CDLL("libcuda.so.1"))
        probe = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        address = writer.device_pointer(probe.data_ptr())
        stream = torch.cuda.Stream(device)  # its own: the check waits for nothing of the program's
        value = 0x5EED_0000_0000_0001
        if address is None or not writer.write(stream.cuda_stream, address, value):
            return None
        stream.synchronize()
        return writer if int(probe[0]) == value else None
    except Exception:  # noqa: BLE001 - no driver library or symbol: the caller's copy path
        return None

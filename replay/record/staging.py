"""Getting a step's tensors off the device with as few operations as possible.

Small CUDA tensors are packed into one buffer and copied to pinned host memory in one transfer;
large ones are digested on the device and copied only when their bytes are kept; CPU tensors are
cloned. Everything is queued on the current stream, and a job's event tells the writer thread
when its copies have landed.
"""

from __future__ import annotations

import torch

from replay.digest import local_tensor
from replay.format.schema import TensorKind, dtype_to_str
from replay.record.writer import Entry, Job, PinnedPool, host_entry

__all__ = ["Staging", "SMALL_BYTES"]

# CUDA tensors up to this size are packed and copied to the host in one transfer per call.
SMALL_BYTES = 64 << 10


class Staging:
    def __init__(self) -> None:
        self.pool = PinnedPool()
        self._device_digests: torch.Tensor | None = None

    def entries(self, device: list[torch.Tensor] | None, items: list[tuple[str, TensorKind, torch.Tensor, bool]]) -> list[Entry]:
        """Capture several tensors now, with as few device operations as possible.

        CPU tensors are cloned. Small CUDA tensors (inputs, tokens, counts) are packed into one
        device buffer and copied to pinned memory in one transfer; the writer digests them on
        the CPU. Large CUDA tensors (logits) are digested on the device, and copied only when
        their bytes are kept.
        """
        out: list[Entry] = []
        small: list[tuple[Entry, torch.Tensor]] = []
        for name, kind, t, store in items:
            t = local_tensor(t).detach()  # a DTensor: this rank's shard
            if t.device.type != "cuda":
                out.append(host_entry(name, kind, t, store=store))
                continue
            e = Entry(name=name, kind=kind, dtype=dtype_to_str(t.dtype), shape=tuple(t.shape), store=store)
            out.append(e)
            nbytes = t.numel() * t.element_size()
            if nbytes <= SMALL_BYTES:
                small.append((e, t))
                continue
            if device is not None:
                e.digest_slot = len(device)
                device.append(t)
            if store or device is None:
                host, buf = self.pool.get(t.dtype, tuple(t.shape))
                host.copy_(t, non_blocking=True)
                e.host, e.release = host, buf
        if small:
            flat = [t.reshape(-1).view(torch.uint8) for _, t in small]
            packed = flat[0] if len(flat) == 1 else torch.cat(flat)
            host, buf = self.pool.get(torch.uint8, (packed.numel(),))
            host.copy_(packed, non_blocking=True)
            off = 0
            for (e, _), f in zip(small, flat):
                e.packed = (host, off, f.numel())
                off += f.numel()
            small[0][0].release = buf
        return out

    def stage(self, job: Job, device: list[torch.Tensor] | None, margin: torch.Tensor | None) -> None:
        """Queue the device work of a job: digests, scalars, and the event the writer waits on."""
        for entries in job.groups.values():
            job.releases.extend(e.release for e in entries if e.release is not None)
        cuda_work = bool(job.releases)
        if device:
            from replay.digest import digest_into

            n = len(device)
            dev = device[0].device
            buf = self._device_digests
            if buf is None or buf.numel() < n or buf.device != dev:
                buf = self._device_digests = torch.zeros(max(n, 64), dtype=torch.int64, device=dev)
            for i, t in enumerate(device):
                digest_into(t, buf, i)
            job.digests_host = self.pinned_copy(job, buf[:n])
            cuda_work = True
        if margin is not None:
            job.margin_host = self.pinned_copy(job, margin)
            cuda_work = True
        if cuda_work:
            job.event = torch.cuda.Event()
            job.event.record()

    def pinned_copy(self, job: Job, t: torch.Tensor) -> torch.Tensor:
        host, buf = self.pool.get(t.dtype, tuple(t.shape))
        host.copy_(t, non_blocking=True)
        job.releases.append(buf)
        return host

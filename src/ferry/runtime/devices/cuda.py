"""CUDA: the allocator. (Streams, events and graphs: runtime/devices/streams.py, which CUDA shares
with the simulated device the tests run on.)

Allocation goes through PyTorch's CUDA caching allocator (torch.empty on the device), not raw
cudaMalloc: ferry's kernels and delegates run through PyTorch, so one allocator means one pool
(no memory stranded between two allocators), stream-aware reuse, allocations that are legal
inside CUDA-graph capture, and PyTorch's OOM errors with the CUDA text. ferry still allocates
everything at load, so the caching allocator's run-time behaviour never matters.
"""

from __future__ import annotations

import functools

import torch

from ferry.alignment import default_alignment
from ferry.runtime.devices.allocator import DeviceAllocator, get_allocator, register_allocator
from ferry.runtime.devices.streams import CUDA_API

MIN_ALIGNMENT = default_alignment("cuda")  # what cudaMalloc guarantees


class CudaAllocator(DeviceAllocator):
    device_type = "cuda"
    default_alignment = MIN_ALIGNMENT
    caching = True

    def _normalize_index(self, index: int) -> int:
        if index == -1:
            return torch.cuda.current_device()
        if index < -1:
            raise ValueError(f"CUDA device index must be >= 0, or -1 for the current device; got {index}")
        count = torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"CUDA device index {index} is out of range: this machine has {count} GPU(s)")
        return index

    def _allocate(self, nbytes: int, index: int, alignment: int) -> torch.Tensor:
        # the caching allocator hands out 512-byte aligned blocks; ask for slack only when
        # a larger alignment is requested
        alignment = max(alignment, MIN_ALIGNMENT)
        slack = 0 if alignment <= 512 else alignment
        base = torch.empty(nbytes + slack, dtype=torch.uint8, device=torch.device("cuda", index))
        if not slack:
            return base
        start = (-base.data_ptr()) % alignment
        return base[start:start + nbytes]

    def _deallocate(self, memory: torch.Tensor, index: int) -> None:
        # the tensor's storage returns to the caching allocator when the last reference goes
        return None

    # Asynchronous only with page-locked host memory: PyTorch stages a non-blocking copy to or
    # from pageable memory through its own pinned buffer, which ferry's events cannot see.
    def _copy_h2d(self, dst, src, nbytes, index):
        dst.copy_(src, non_blocking=src.is_pinned())

    def _copy_d2h(self, dst, src, nbytes, index):
        dst.copy_(src, non_blocking=dst.is_pinned())

    def _copy_d2d(self, dst, src, nbytes, dst_index, src_index):
        dst.copy_(src, non_blocking=True)

    def streams_api(self):
        return CUDA_API

    def _bind_copy(self, direction, dst, src, nbytes, *indices):
        # page-locked or not is fixed for planned memory: ask once, not on every copy
        host = {"h2d": src, "d2h": dst}.get(direction)
        return functools.partial(dst.copy_, src, non_blocking=True if host is None else host.is_pinned())


def register_if_available() -> None:
    if torch.cuda.is_available() and get_allocator("cuda") is None:
        register_allocator(CudaAllocator())

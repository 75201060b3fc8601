"""Tensor helpers that know about ferry devices (ExecuTorch's TensorPtr device helpers).

- ``device_of(t)``: the ferry Device a torch tensor's memory lives on;
- ``make_tensor(memory, shape, dtype, device, offset)``: a tensor view over existing memory;
- ``clone_to(t, device)``: a copy on another device, made through the registered allocators.
"""

from __future__ import annotations

import math

import torch

from ferry.device import CPU, Device
from ferry.layout import contiguous_strides, is_dense
from ferry.runtime.devices.allocator import (
    DeviceMemoryBuffer,
    as_bytes,
    registered_allocators,
    require_allocator,
)

__all__ = ["buffer_of", "clone_to", "device_of", "make_tensor", "pad_rows"]

_BUFFER_ATTR = "_ferry_buffer"
_DEVICE_ATTR = "_ferry_device"


def device_of(tensor: torch.Tensor) -> Device:
    """Where ``tensor``'s memory lives.

    CUDA tensors -> ``cuda:<index>``; CPU tensors -> the registered device whose allocator
    claims the memory (host-backed devices such as the emulated one), else ``cpu``.
    A zero-byte tensor has no memory to ask about; one made by ``make_tensor`` (or
    ``clone_to``) remembers the device it was made for.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"device_of expects a torch.Tensor, got {type(tensor).__name__}")
    kind = tensor.device.type
    if kind == "cuda":
        index = tensor.device.index
        return Device("cuda", torch.cuda.current_device() if index is None else index)
    if kind == "cpu":
        if tensor.numel() == 0:
            # no memory to ask about: use the label make_tensor left, if any
            label = getattr(tensor, _DEVICE_ATTR, None)
            if label is not None:
                return label
        for allocator in registered_allocators():
            found = allocator.device_index_of(tensor)
            if found is not None:
                return Device(allocator.device_type, found)
        return CPU
    raise ValueError(
        f"a tensor on torch device {tensor.device} has no ferry device; ferry places tensors on "
        "cpu, cuda and host-backed registered devices"
    )


def _check_shape(shape) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"shape must hold ints >= 0, got {dims}")
    return dims


def make_tensor(
    memory: torch.Tensor,
    shape,
    dtype: torch.dtype,
    device: Device | str,
    offset: int = 0,
    strides=None,
) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` over ``memory`` starting at byte ``offset``; no copy.

    ``memory`` is a 1-D uint8 tensor (an allocation); the result shares its data:
    ``result.data_ptr() == memory.data_ptr() + offset``.  ``device`` must be where the
    memory lives (checked with ``device_of``). ``strides`` (elements) lay it out as a
    permutation of the dense layout (the layout eager gave the value); default contiguous.
    """
    device = Device.parse(device)
    if not isinstance(memory, torch.Tensor):
        raise TypeError(f"memory must be a torch.Tensor, got {type(memory).__name__}")
    if memory.dtype != torch.uint8 or memory.dim() != 1 or not memory.is_contiguous():
        raise ValueError(
            f"memory must be a contiguous 1-D torch.uint8 tensor, got {memory.dtype} of shape "
            f"{tuple(memory.shape)}"
        )
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    dims = _check_shape(shape)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an int >= 0, got {offset!r}")
    itemsize = dtype.itemsize
    nbytes = math.prod(dims) * itemsize
    if offset % itemsize:
        raise ValueError(
            f"offset {offset} is not a multiple of the {dtype} element size ({itemsize} bytes)"
        )
    if offset + nbytes > memory.numel():
        raise ValueError(
            f"a {dtype} tensor of shape {dims} needs {nbytes} bytes at offset {offset} "
            f"(through byte {offset + nbytes}), but the memory has only {memory.numel()} bytes"
        )
    if (memory.storage_offset() + offset) % itemsize:
        raise ValueError(
            f"memory starts {memory.storage_offset()} bytes into its storage, so offset {offset} is not "
            f"aligned to the {dtype} element size ({itemsize} bytes)"
        )
    if memory.numel():
        actual = device_of(memory)
        if actual != device:
            raise ValueError(f"the memory lives on {actual}, not on {device}")
    layout = contiguous_strides(dims) if not strides else _check_dense_strides(dims, strides)
    # A fresh tensor over the storage (not a view of ``memory``): views of the result then
    # have the result as their ``_base``, which keeps attributes set on it (clone_to's buffer) alive.
    result = torch.empty(0, dtype=dtype, device=memory.device)
    start = (memory.storage_offset() + offset) // itemsize
    result.set_(memory.untyped_storage(), start, dims, layout)
    if nbytes == 0:
        setattr(result, _DEVICE_ATTR, device)
    return result


def _check_dense_strides(dims, strides) -> tuple[int, ...]:
    strides = tuple(strides)
    if not is_dense(dims, strides):
        raise ValueError(f"strides {strides} do not lay out shape {tuple(dims)} densely (a permutation of contiguous)")
    return strides


def buffer_of(tensor: torch.Tensor) -> DeviceMemoryBuffer | None:
    """The DeviceMemoryBuffer that owns a tensor made by ``clone_to`` (None for others)."""
    return getattr(tensor, _BUFFER_ATTR, None)


def _contiguous_on(tensor: torch.Tensor, device: Device) -> tuple[torch.Tensor, DeviceMemoryBuffer | None]:
    """A contiguous, conj/neg-resolved equal of ``tensor`` on the same device (plus a staging buffer to close)."""
    if tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg():
        return tensor, None
    if device.is_cpu or tensor.device.type != "cpu":
        # torch-native memory (host or CUDA): torch makes the contiguous copy where the tensor is
        return tensor.resolve_conj().resolve_neg().contiguous(), None
    # host-backed device memory: stage on the same device, through its allocator, so the
    # contiguous copy is still that device's memory
    nbytes = tensor.numel() * tensor.element_size()
    staging = DeviceMemoryBuffer.create(nbytes, device)
    try:
        view = make_tensor(staging.memory, tensor.shape, tensor.dtype, device)
        view.copy_(tensor)
    except BaseException:
        staging.close()
        raise
    return view, staging


def _copy(dst: torch.Tensor, src: torch.Tensor, nbytes: int, dst_device: Device, src_device: Device) -> None:
    d, s = as_bytes(dst, "dst"), as_bytes(src, "src")
    if src_device.is_cpu:
        require_allocator(dst_device).copy_host_to_device(d, s, nbytes, dst_device.index)
    elif dst_device.is_cpu:
        require_allocator(src_device).copy_device_to_host(d, s, nbytes, src_device.index)
    else:
        src_alloc = require_allocator(src_device)
        dst_alloc = require_allocator(dst_device)
        if src_alloc is dst_alloc and src_alloc.supports_device_to_device:
            src_alloc.copy_device_to_device(d, s, nbytes, dst_device.index, src_device.index)
            return
        # different device types, or no direct path: go through page-locked host memory
        with DeviceMemoryBuffer.create(nbytes, CPU, pin_memory=True) as host:
            src_alloc.copy_device_to_host(host.memory, s, nbytes, src_device.index)
            dst_alloc.copy_host_to_device(d, host.memory, nbytes, dst_device.index)


def clone_to(tensor: torch.Tensor, device: Device | str) -> torch.Tensor:
    """A contiguous copy of ``tensor`` on ``device``, made through the registered allocators.

    One allocation (a DeviceMemoryBuffer) and one allocator copy of exactly the tensor's
    bytes: host-to-device, device-to-host, or device-to-device (different device types,
    or an allocator without device-to-device copies, go through host memory).  The result
    owns its memory (see ``buffer_of``), which is freed once the result and every view of
    it are gone (views taken with torch view ops keep the result's buffer alive).  A same-device clone
    is a ValueError: use ``tensor.clone()``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"clone_to expects a torch.Tensor, got {type(tensor).__name__}")
    device = Device.parse(device)
    src_device = device_of(tensor)
    if src_device == device:
        raise ValueError(
            f"the tensor is already on {device}; use tensor.clone() for a copy on the same device"
        )
    src, staging = _contiguous_on(tensor, src_device)
    try:
        nbytes = src.numel() * src.element_size()
        buffer = DeviceMemoryBuffer.create(nbytes, device)
        try:
            result = make_tensor(buffer.memory, src.shape, src.dtype, device)
            if nbytes:
                _copy(result, src, nbytes, device, src_device)
        except BaseException:
            buffer.close()
            raise
    finally:
        if staging is not None:
            staging.close()
    setattr(result, _BUFFER_ATTR, buffer)
    return result


def pad_rows(t: torch.Tensor, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """`t` with its own rows repeated after it up to `size` rows, in `out` when given. Real
    values: a padded row of zeros could be a masked-out sequence, whose softmax is NaN, and NaN
    is best not made. Whole blocks of rows are plain memcpys; filling from one broadcast row
    cost 3x as much on the H200 host."""
    rows = t.shape[0]
    if out is None:
        out = torch.empty((size, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[:rows].copy_(t)
    filled = rows
    while filled < size:
        n = min(rows, size - filled)
        out[filled:filled + n].copy_(t[:n])
        filled += n
    return out

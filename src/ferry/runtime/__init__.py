"""ferry's runtime: device allocators, the emulated device, and tensor helpers."""

from ferry.runtime.devices.allocator import (
    DeviceAllocator,
    DeviceMemoryBuffer,
    get_allocator,
    register_allocator,
    registered_allocators,
    registered_device_types,
    unregister_allocator,
)
from ferry.runtime.devices.emulated import CopyRecord, EmulatedAllocator, emulated_device
from ferry.runtime.devices.tensor import buffer_of, clone_to, device_of, make_tensor

__all__ = [
    "CopyRecord",
    "DeviceAllocator",
    "DeviceMemoryBuffer",
    "EmulatedAllocator",
    "buffer_of",
    "clone_to",
    "device_of",
    "emulated_device",
    "get_allocator",
    "make_tensor",
    "register_allocator",
    "registered_allocators",
    "registered_device_types",
    "unregister_allocator",
]

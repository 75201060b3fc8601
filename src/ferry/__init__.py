"""ferry: device placement, explicit copies and per-device memory planning for torch.export programs."""

from ferry import ops  # noqa: F401  (registers the et_copy ops and ferry's own)
from ferry.device import Device
from ferry.errors import (
    AllocationError, BackendError, CompileError, ConfigError, DeviceError, FerryError, InputError, InternalError,
    PeerError, ProgramError, UnknownMethodError,
)
from ferry.aot.partition import OpSupportPartitioner, Partition, target_device
from ferry.aot.device_map import DeviceMapPartitioner
from ferry.aot.lower import LoweredBackendModule, LoweredProgram, to_backend
from ferry.aot.config import CompileConfig, PropagateDeviceConfig
from ferry.aot.compile import compile, place
from ferry.aot.place import PropagateDevicePass
from ferry.program import MethodMeta, Program, load_program, save_program
from ferry.program.report import CopyReport, copy_report
from ferry.runtime.stages.module import Module
from ferry.runtime.generate import Generation, generate
from ferry import backends  # noqa: F401  (registers the built-in backends)
from ferry.runtime.devices.cuda import register_if_available as _register_cuda

_register_cuda()  # the CUDA allocator registers itself when a GPU is present


__all__ = [
    "AllocationError", "BackendError", "CompileConfig", "CompileError", "ConfigError", "CopyReport", "Device",
    "DeviceError", "DeviceMapPartitioner", "FerryError", "Generation", "InputError", "InternalError",
    "LoweredBackendModule", "LoweredProgram", "MethodMeta", "Module", "OpSupportPartitioner", "Partition", "PeerError",
    "Program", "ProgramError", "PropagateDeviceConfig", "PropagateDevicePass", "UnknownMethodError", "compile",
    "copy_report", "generate", "load_program", "place", "save_program", "target_device", "to_backend",
]

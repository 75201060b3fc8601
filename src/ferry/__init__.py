"""ferry: device placement, explicit copies and per-device memory planning for torch.export programs."""

from ferry import ops  # noqa: F401  (registers the et_copy ops)
from ferry.device import Device
from ferry.errors import (
    AllocationError, BackendError, CompileError, DeviceError, FerryError, InputError, InternalError, ProgramError,
)
from ferry.aot.partition import OpSupportPartitioner, Partition, target_device
from ferry.aot.lower import LoweredBackendModule, LoweredProgram, to_backend
from ferry.aot.config import CompileConfig, PropagateDeviceConfig
from ferry.aot.compile import compile, place
from ferry.program.schema import MethodMeta, Program
from ferry.report import CopyReport, copy_report
from ferry.runtime.module import Module
from ferry import passes  # noqa: F401
from ferry.runtime.cuda import register_if_available as _register_cuda

_register_cuda()  # the CUDA allocator registers itself when a GPU is present


def load_program(path_or_bytes) -> Program:
    """Load a saved program: no code runs, constants are mapped without a copy."""
    from ferry.program.serialize import load_program as _load

    return _load(path_or_bytes)


__all__ = [
    "AllocationError", "BackendError", "CompileConfig", "CompileError", "CopyReport", "Device", "DeviceError",
    "FerryError", "InputError", "InternalError", "LoweredBackendModule", "LoweredProgram", "MethodMeta", "Module",
    "OpSupportPartitioner", "Partition", "Program", "ProgramError", "PropagateDeviceConfig", "compile",
    "copy_report", "load_program", "passes", "place", "target_device", "to_backend",
]

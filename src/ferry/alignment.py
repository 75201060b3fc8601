"""Memory alignment: ferry's defaults per device type, and the one check of a setting.

Defaults:
  * cpu: 64 bytes, one cache line on x86/ARM and one AVX-512 vector, so no planned tensor
    shares a line with its neighbour (no false sharing) and vector loads are aligned.
  * everything else: 256 bytes, the alignment cudaMalloc guarantees; cuBLAS/cuDNN and
    vectorized (128-bit per thread) kernels assume at least that, so a tensor at a planned
    offset behaves like one that was allocated on its own.

A planned buffer records its alignment and the runtime allocates it at that alignment, so
offsets aligned within the buffer are aligned in real addresses too.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Union

__all__ = [
    "DEFAULT_ALIGNMENT", "AlignmentSpec", "alignment_for", "check_alignment", "default_alignment", "resolve_alignment",
]

DEFAULT_ALIGNMENT: Mapping[str, int] = MappingProxyType({"cpu": 64, "default": 256})

AlignmentSpec = Union[int, Mapping[str, int], None]


def check_alignment(value: object, what: str = "alignment") -> int:
    """`value` if it is a power of two >= 1; ValueError naming `what` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{what} must be a power of two >= 1 (bytes), got {value!r}")
    return value


def default_alignment(device_type: str) -> int:
    return DEFAULT_ALIGNMENT.get(device_type, DEFAULT_ALIGNMENT["default"])


def resolve_alignment(spec: AlignmentSpec) -> dict[str, int]:
    """An alignment setting (None, one int for every device, or {device type or 'default': int})
    as a full table {device type or 'default': bytes}; ValueError for a bad entry."""
    if spec is None:
        return dict(DEFAULT_ALIGNMENT)
    if isinstance(spec, Mapping):
        table = dict(DEFAULT_ALIGNMENT)
        if "default" in spec:  # the caller's default applies to every type not named
            table = {"default": table["default"]}
        for key, value in spec.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"alignment keys must be device types or 'default', got {key!r}")
            table[key] = check_alignment(value, f"alignment for {key!r}")
        return table
    return {"default": check_alignment(spec)}


def alignment_for(table: Mapping[str, int], device_type: str) -> int:
    """The alignment a resolved table gives `device_type`."""
    return table.get(device_type, table["default"])

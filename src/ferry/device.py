"""The Device value type: where a tensor lives, independent of torch.device."""

from __future__ import annotations

from dataclasses import dataclass

BUILTIN_DEVICE_TYPES = ("cpu", "cuda")


def known_device_types() -> tuple[str, ...]:
    """cpu and cuda, plus every type with a registered allocator."""
    from ferry.runtime.allocator import registered_device_types

    extra = tuple(t for t in registered_device_types() if t not in BUILTIN_DEVICE_TYPES)
    return BUILTIN_DEVICE_TYPES + tuple(sorted(extra))


@dataclass(frozen=True, order=True)
class Device:
    type: str
    index: int = 0

    def __post_init__(self):
        if not isinstance(self.type, str) or not self.type:
            raise ValueError(f"device type must be a non-empty string, got {self.type!r}")
        if isinstance(self.index, bool) or not isinstance(self.index, int):
            raise ValueError(f"device index must be an integer, got {self.index!r}")
        if self.index < 0:
            raise ValueError(f"device index must be >= 0, got {self.index} in {self.type}:{self.index}")

    @classmethod
    def parse(cls, text: "str | Device") -> "Device":
        """Parse 'cuda:1', 'CUDA:1', ' cuda ', 'cpu' (index 0 when absent)."""
        if isinstance(text, Device):
            return text
        if not isinstance(text, str):
            raise ValueError(f"expected a device string like 'cuda:0', got {type(text).__name__}")
        s = text.strip().lower()
        kind, sep, idx = s.partition(":")
        kind = kind.strip()
        known = known_device_types()
        if kind not in known:
            raise ValueError(
                f"unknown device type {kind!r} in {text!r}; known types: {', '.join(known)} "
                "(register an allocator with ferry.runtime.register_allocator to add one)"
            )
        if not sep:
            return cls(kind, 0)
        idx = idx.strip()
        if not idx.isdigit():
            raise ValueError(f"device index in {text!r} must be a non-negative integer, got {idx!r}")
        return cls(kind, int(idx))

    @property
    def is_cpu(self) -> bool:
        return self.type == "cpu"

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"

    def to_torch(self):
        """The torch.device holding this device's memory (emulated devices live in host memory)."""
        import torch

        if self.type == "cuda":
            return torch.device("cuda", self.index)
        return torch.device("cpu")


CPU = Device("cpu", 0)

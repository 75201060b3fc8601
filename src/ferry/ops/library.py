"""Where ferry's own operators are defined: one FRAGMENT library of the `ferry` namespace per
module that defines some, made once per process; and whether Triton, which builds the CUDA
kernels of some of them, imports here."""

from __future__ import annotations

import functools

import torch

__all__ = ["NAMESPACE", "new_fragment", "triton_imports"]

NAMESPACE = "ferry"


def new_fragment(probe: str) -> torch.library.Library | None:
    """A library to define a module's ops in, or None where `probe` (one of them, by name) is
    defined already: the module was imported a second time, or reloaded."""
    try:
        torch._C._get_schema(f"{NAMESPACE}::{probe}", "")
        return None
    except RuntimeError:
        return torch.library.Library(NAMESPACE, "FRAGMENT")


@functools.cache
def triton_imports() -> bool:
    """Triton imports (asked once per process: an op's call asks each time it runs uncaptured)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True

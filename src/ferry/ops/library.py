"""Where ferry's own operators are defined: one FRAGMENT library of the `ferry` namespace per
module that defines some, made once per process."""

from __future__ import annotations

import torch

__all__ = ["NAMESPACE", "new_fragment"]

NAMESPACE = "ferry"


def new_fragment(probe: str) -> torch.library.Library | None:
    """A library to define a module's ops in, or None where `probe` (one of them, by name) is
    defined already: the module was imported a second time, or reloaded."""
    try:
        torch._C._get_schema(f"{NAMESPACE}::{probe}", "")
        return None
    except RuntimeError:
        return torch.library.Library(NAMESPACE, "FRAGMENT")

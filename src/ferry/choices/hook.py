"""The one place the binder asks which form runs an op: each op family (gemm.py, conv.py,
attention.py, norms.py) declares the ops it has forms for and a `form(op, args, kwargs, site)` that
returns a callable of the op's own signature, or None where eager's kernel stays."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from ferry.choices import attention, conv, gemm, norms
from ferry.choices.decisions import Site

__all__ = ["FAMILIES", "choose", "wants"]

# op -> its family's form hook; a table built once from what the families declare
FAMILIES: Mapping[object, Callable] = MappingProxyType(
    {op: family.form for family in (gemm, conv, attention, norms) for op in family.OPS})


def wants(op) -> bool:
    """Some family has forms for `op` (the binder then builds the arguments to ask with)."""
    return op in FAMILIES


def choose(op, args: list, kwargs: dict, site: Site) -> Callable | None:
    """The form `op` runs as for arguments like these (real tensors where fixed, meta tensors of
    the same shape, strides and dtype for values of the call; one value is one object), or None
    for the kernel named. Under deterministic algorithms eager's kernels always run."""
    form = FAMILIES.get(op)
    if form is None or torch.are_deterministic_algorithms_enabled():
        return None
    return form(op, args, kwargs, site)

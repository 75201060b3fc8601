"""Weights held as tensor subclasses (torchao's quantized weights), described for the file.

torch.export keeps such a weight as its subclass; turning the program into functional ATen
(aot/lower.py) replaces it by its inner tensors (int8 data, scales, packed int4 tiles) as plain
weights and the subclass's methods by the ATen ops they call (`mm` of a dequantized weight,
`_weight_int4pack_mm`). ferry stores those inner tensors as ordinary constants, checked like
every constant on load, never as pickled Python objects. This module records what each weight
was, so `ferry inspect` can say which weights are quantized, how, and what they cost.
"""

from __future__ import annotations

import enum

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ferry.program.schema import QuantizedWeight

__all__ = ["quantized_weights"]


def quantized_weights(ep: torch.export.ExportedProgram, stored: dict | None = None) -> list[QuantizedWeight]:
    """One record per parameter, buffer or constant of `ep` that is a tensor subclass. `stored`:
    {name: tensor} the lowered program holds, where an inner tensor may be stored otherwise
    (int4 values two to a byte: aot/gathered_rows.py)."""
    tensors = {**ep.state_dict, **ep.constants}
    out = []
    for spec in ep.graph_signature.input_specs:
        t = tensors.get(spec.target) if spec.target else None
        if t is not None and is_traceable_wrapper_subclass(t):
            try:
                out.append(_record(spec.target, t, stored or {}))
            except Exception:  # noqa: BLE001 - a fact for people: a subclass that describes itself oddly is left out
                continue
    return out


def _record(name: str, t, stored: dict) -> QuantizedWeight:
    """`t`: a traceable wrapper subclass (it has `__tensor_flatten__`)."""
    attrs, ctx = t.__tensor_flatten__()
    inner = {a: stored.get(inner_name(name, i), getattr(t, a)) for i, a in enumerate(attrs)}
    kind = type(t)
    return QuantizedWeight(
        name=name, scheme=f"{kind.__module__.split('.')[0]} {kind.__qualname__}",
        dtype=str(t.dtype).removeprefix("torch."), shape=tuple(int(s) for s in t.shape),
        parts={a: _part(v, getattr(t, a)) for a, v in inner.items()},
        nbytes=sum(v.numel() * v.element_size() for v in inner.values()), details=_details(ctx))


def inner_name(name: str, i: int) -> str:
    """The name torch gives inner tensor `i` of weight `name` when it unwraps the subclass."""
    parent, _, leaf = name.rpartition(".")
    return f"{parent}.parametrizations.{leaf}.original{i}" if parent else f"parametrizations.{leaf}.original{i}"


def _part(v: torch.Tensor, was: torch.Tensor) -> str:
    text = f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    return text + " (int4, two per byte)" if v.dtype == torch.uint8 and was.dtype == torch.int8 else text


def _details(ctx) -> str:
    """A subclass's settings (its flatten context: a dict, or a list or tuple of values) as text."""
    items = ctx.items() if isinstance(ctx, dict) else enumerate(ctx if isinstance(ctx, (list, tuple)) else [ctx])
    return ", ".join(f"{k}={_setting(v)}" for k, v in items if v is not None and not isinstance(v, torch.Tensor))[:400]


def _setting(v) -> str:
    """A subclass setting as short text: a dtype or an enum by its name."""
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    return v.name if isinstance(v, enum.Enum) else str(v)

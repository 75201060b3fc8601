"""Inputs a method writes in place, as eager's in-place ops write them (`x.add_(y)`, `x[0] = v`).

torch.export records such a write as an output holding the input's new value; the program
computes it as any other output, on the input's device, and the call copies it into the
caller's tensor at the end, while its set of memory is still held. Whatever the placement, the
caller's tensor then holds what eager would have left in it, and the call returns the other
outputs (a returned written input is a copy of it, not the caller's tensor itself)."""

from __future__ import annotations

import torch

from ferry.errors import InputError, ProgramError
from ferry.ops.aliasing import extent
from ferry.program.schema import Method

__all__ = ["check_writable", "written_back"]


def check_writable(method: Method, inputs: list) -> None:
    """Refuse, before anything runs, an input the call could not write as eager would: one whose
    elements share memory (an expanded tensor), an inference tensor outside inference mode, or
    one whose memory another input shares (the program reads every input as it was passed; eager
    would read the write through the other). An input that requires grad is refused by the input
    check, as for every method."""
    for w in method.input_writes:
        t = inputs[w.input] if w.input < len(inputs) else None
        if not isinstance(t, torch.Tensor):
            continue  # the input check names it
        what = f"method {method.name!r} writes input {w.input} in place, and"
        if torch._debug_has_internal_overlap(t) == 1:  # (MemOverlap::Yes)
            raise InputError(f"{what} several of its elements share one memory location (an expanded tensor); "
                             "pass a tensor of its own (x.clone()), as eager needs for an in-place op")
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise InputError(f"{what} it is an inference tensor, which can be written only inside "
                             "torch.inference_mode(); call there, or pass x.clone()")
        for j, other in enumerate(inputs):
            if j != w.input and isinstance(other, torch.Tensor) and _overlap(t, other):
                raise InputError(f"{what} input {j} shares its memory; pass tensors of their own (x.clone())")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do the bytes `a` and `b` may touch intersect (one storage, overlapping ranges)?"""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a0 < b1 and b0 < a1


def written_back(method: Method, inputs: list, outputs: list) -> list:
    """Copy each written input's new value into the caller's tensor; return the other outputs."""
    if not method.input_writes:
        return outputs
    for w in method.input_writes:
        new, given = outputs[w.output], inputs[w.input]
        if tuple(new.shape) != tuple(given.shape):  # (a file's dynamic dims are not held to each other)
            raise ProgramError(f"method {method.name!r}: output {w.output}, {tuple(new.shape)}, cannot be written into "
                               f"input {w.input}, {tuple(given.shape)}: the file's input writes are wrong")
    with torch.no_grad():
        for w in method.input_writes:
            inputs[w.input].copy_(outputs[w.output])
    return [outputs[i] for i in method.returned_outputs]

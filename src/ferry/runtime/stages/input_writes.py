"""Inputs a method writes in place, as eager's in-place ops write them (`x.add_(y)`, `x[0] = 1`).

torch.export records such a write as an output holding the input's new value; the program
computes it as any other output, on the input's device, and the call copies it into the
caller's tensor at the end. Whatever the placement, the caller's tensor then holds what eager
would have left in it, and the call returns the other outputs."""

from __future__ import annotations

import torch

from ferry.errors import InputError
from ferry.program.schema import Method

__all__ = ["check_writable", "written_back"]


def check_writable(method: Method, inputs: list) -> None:
    """Refuse, before anything runs, an input the call could not write as eager would: one whose
    elements share memory (an expanded tensor). (An input that requires grad is refused by the
    input check, as for every method.)"""
    for w in method.input_writes:
        t = inputs[w.input] if w.input < len(inputs) else None
        if not isinstance(t, torch.Tensor):
            continue  # the input check names it
        if torch._debug_has_internal_overlap(t) == 1:  # (MemOverlap::Yes)
            raise InputError(f"method {method.name!r} writes input {w.input} in place, and several of its elements "
                             "share one memory location (an expanded tensor); pass a tensor of its own "
                             "(x.clone()), as eager needs for an in-place op")


def written_back(method: Method, inputs: list, outputs: list) -> list:
    """Copy each written input's new value into the caller's tensor; return the other outputs."""
    if not method.input_writes:
        return outputs
    for w in method.input_writes:
        with torch.no_grad():
            inputs[w.input].copy_(outputs[w.output])
    return [outputs[i] for i in method.returned_outputs]

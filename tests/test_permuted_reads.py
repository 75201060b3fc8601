"""A pointwise op reads a permuted value where it read a contiguous copy of it reshaped
(aot/permuted_reads.py): Swin's window reverse before its residual add runs no copy, and the
results are eager's bit for bit."""

from __future__ import annotations

import pytest
import torch

import ferry
from ferry.aot import permuted_reads
from test_layout_chains import Windows, compiled, equal_to_eager

CLONE = "aten::clone.default"


def test_an_unshifted_window_reverse_is_read_by_the_residual_add_directly(emu):
    torch.manual_seed(0)
    model, shape = Windows(shift=0), (2, 8, 8, 16)
    program, ran, notes = compiled(model, torch.randn(shape))
    assert ran[CLONE] == 1, ran  # the partition's copy, before the linear, stays
    assert "elementwise ops reshaped" in notes
    equal_to_eager(program, model, shape)  # rtol=0, atol=0
    permuted_reads.ON = False
    try:
        _, traced, _ = compiled(model, torch.randn(shape))
    finally:
        permuted_reads.ON = True
    assert traced[CLONE] == 2


class Reverse(torch.nn.Module):
    """Windows put back, then read by `kind`."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.register_buffer("bias", torch.randn(16))

    def forward(self, x, r):
        b, h, w, c = x.shape
        y = r.view(b, 2, 2, 4, 4, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        if self.kind == "two pointwise readers":
            return x + y, x * y
        if self.kind == "reduction":
            return y.sum(-1)
        if self.kind == "broadcast operand":
            return y + self.bias
        if self.kind == "copy first":
            return y - x
        if self.kind == "returned":
            return y
        if self.kind == "atan2":
            return torch.atan2(x, y)
        if self.kind == "add with alpha":
            return torch.add(x, y, alpha=0.3)
        raise AssertionError(self.kind)


SHAPES = ((2, 8, 8, 16), (8, 16, 16))


def test_two_pointwise_readers_both_read_the_permuted_value(emu):
    model = Reverse("two pointwise readers")
    program, ran, _ = compiled(model, *(torch.randn(s) for s in SHAPES))
    assert ran[CLONE] == 0, ran
    equal_to_eager_two(program, model)


@pytest.mark.parametrize("kind", ["reduction", "broadcast operand", "copy first", "returned", "atan2",
                                  "add with alpha"])
def test_what_cannot_read_through_keeps_its_copy_and_eagers_bits(kind, emu):
    """A reduction sums in its input's order; a broadcast operand has another shape; `y - x` (as
    `sigmoid(y)`) would lay its result out as the permuted operand is; a returned value owns its
    memory; atan2 (and pow, logaddexp, ...) and an add with alpha (in bf16: a fused multiply-add)
    give other last bits from a CPU kernel's scalar path, which a strided operand takes."""
    model = Reverse(kind)
    program, ran, _ = compiled(model, *(torch.randn(s) for s in SHAPES))
    assert ran[CLONE] == 1, ran
    equal_to_eager_two(program, model)


def equal_to_eager_two(program, model):
    module = ferry.Module(ferry.load_program(program.to_bytes()))
    for _ in range(3):
        args = tuple(torch.randn(s) for s in SHAPES)
        with torch.no_grad():
            torch.testing.assert_close(module(*args), model(*args), rtol=0, atol=0)


def test_merges_accepts_only_runs_of_adjacent_dims():
    assert permuted_reads._merges((1, 2, 4, 2, 4, 16), (1, 8, 8, 16))
    assert permuted_reads._merges((2, 4, 2, 4, 16), (8, 128))
    assert not permuted_reads._merges((2, 4, 2, 4, 16), (4, 2, 128))
    assert not permuted_reads._merges((2, 4, 2, 4, 16), (8, 8, 8, 2))

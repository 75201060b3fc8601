"""Outputs nobody reads are not planned: a kernel may write them larger than the trace said.

Batch norm's saved statistics trace as (0,) on the CPU but are (C,) on CUDA; planned at 0 bytes
they shared an offset with live values, and the GPU kernel wrote over them. A custom op whose
kernel does the same on the CPU reproduces that here."""

from __future__ import annotations

import pytest
import torch

import ferry
import ferry.examples

_lib = torch.library.Library("ferry_test_stats", "DEF")
_lib.define("stats(Tensor x) -> (Tensor, Tensor)")
_lib.define("stats.out(Tensor x, *, Tensor(a!) out0, Tensor(b!) out1) -> (Tensor(a!), Tensor(b!))")


def _stats(x):
    return x * 2, torch.full((256,), 7.0)


def _stats_out(x, *, out0, out1):
    out0.copy_(x * 2)
    out1.resize_(256).fill_(7.0)  # larger than the traced (0,): what a device kernel may do
    return out0, out1


_lib.impl("stats", _stats, "CPU")
_lib.impl("stats.out", _stats_out, "CPU")


@torch.library.register_fake("ferry_test_stats::stats", lib=_lib)
def _stats_fake(x):
    return torch.empty_like(x), x.new_empty(0)


class UsesStats(torch.nn.Module):
    def forward(self, x):
        y = x + 1  # alive across the op, planned where the unread output would have gone
        a, _ = torch.ops.ferry_test_stats.stats(x)
        return a + y


def test_unread_output_is_not_planned_and_cannot_clobber_neighbours():
    program = ferry.compile(torch.export.export(UsesStats(), (torch.randn(64),)))
    m = program.method("forward")
    (call,) = [i for i in m.instructions if i.kernel.startswith("ferry_test_stats::stats")]
    used, unread = call.outputs
    assert m.values[used].plan is not None and m.values[unread].plan is None
    module = ferry.Module(program)
    for _ in range(3):
        x = torch.randn(64)
        torch.testing.assert_close(module(x), UsesStats()(x))


def test_batch_norm_statistics_are_not_planned():
    """Batch norm's .out computes into a temporary and copies, so it runs its functional kernel:
    none of its outputs is planned, the statistics (which CUDA writes larger than the CPU
    trace says) least of all."""
    model, example = ferry.examples.small_cnn()
    program = ferry.compile(torch.export.export(model, example))
    m = program.method("forward")
    bn = [i for i in m.instructions if "batch_norm" in getattr(i, "kernel", "")]
    assert bn
    for ins in bn:
        out, mean, invstd = ins.outputs
        assert ins.kernel in m.kernel_choices and "(measured)" in m.kernel_choices[ins.kernel]
        assert all(m.values[v].plan is None for v in (out, mean, invstd))
    x = torch.randn_like(example[0])
    with torch.no_grad():
        torch.testing.assert_close(ferry.Module(program)(x), model(x), atol=1e-5, rtol=1e-5)


_lib.define("grow(Tensor x) -> Tensor")
_lib.define("grow.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)")
_lib.impl("grow", lambda x: torch.full((256,), 3.0), "CPU")


def _grow_out(x, *, out):
    out.resize_(256).fill_(3.0)  # a kernel that disagrees with its traced shape, for an output that is read
    return out


_lib.impl("grow.out", _grow_out, "CPU")


@torch.library.register_fake("ferry_test_stats::grow", lib=_lib)
def _grow_fake(x):
    return torch.empty_like(x)


class UsesGrow(torch.nn.Module):
    def forward(self, x):
        return torch.ops.ferry_test_stats.grow(x) * 2


def test_a_read_output_larger_than_planned_is_an_error_not_a_wrong_result():
    module = ferry.Module(ferry.compile(torch.export.export(UsesGrow(), (torch.randn(8),))))
    with pytest.raises(ferry.ProgramError, match=r"ferry_test_stats::grow\.(out|default) wrote a \(256,\) output where the program planned \(8,\)"):
        module(torch.randn(8))

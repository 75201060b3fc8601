"""ops/writes.py: ferry's out kernels of `copy` and the `*_scatter` ops against ATen's functional
ones, and slice writes, scatters and `as_strided` end to end in planned memory against eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ferry
from ferry.device import CPU
from ferry.ops import writes
from ferry.program.schema import KernelCall
from ferry.runtime import clone_to, device_of
from ferry.runtime.devices.allocator import allocate_aligned
from models import fresh_inputs

aten = torch.ops.aten

# (functional op, self shape, src shape, other arguments)
CASES = [
    (aten.copy.default, (4, 6), (4, 6), (False,)),
    (aten.copy.default, (4, 6), (6,), ()),  # broadcast
    (aten.slice_scatter.default, (4, 6), (4, 2), (1, 2, 4, 1)),
    (aten.slice_scatter.default, (5, 3), (2, 3), (0, 1, 5, 2)),
    (aten.slice_scatter.default, (4, 6), (4, 6), (1, None, None, 1)),
    (aten.select_scatter.default, (4, 6), (4,), (1, -1)),
    (aten.diagonal_scatter.default, (4, 6), (4,), (2, 0, 1)),
    (aten.diagonal_scatter.default, (3, 4, 5), (4, 3), (-1, 2, 0)),
    (aten.as_strided_scatter.default, (4, 6), (2, 2), ((2, 2), (1, 6), 3)),
    (aten.as_strided_scatter.default, (4, 6), (3, 3), ((3, 3), (7, 1), None)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c[0]) if isinstance(c, torch._ops.OpOverload) else None)
@pytest.mark.parametrize("layout", ["contiguous", "transposed self", "out is self"])
def test_ferry_kernels_equal_aten(case, layout):
    op, self_shape, src_shape, rest = case
    g = torch.Generator().manual_seed(0)
    self_ = torch.randn(self_shape, generator=g)
    if layout == "transposed self" and len(self_shape) == 2:
        self_ = torch.randn(self_shape[::-1], generator=g).t()
    src = torch.randn(src_shape, generator=g)
    want = op(self_, src, *rest)
    out = self_ if layout == "out is self" else torch.empty(self_shape)
    got = writes.OUT_KERNELS[op](self_.clone() if layout != "out is self" else self_, src, *rest, out=out)
    assert got is out
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_src_of_another_shape_is_refused_as_eager_refuses_it():
    with pytest.raises(RuntimeError, match="shape"):
        writes.OUT_KERNELS[aten.slice_scatter.default](torch.zeros(4, 6), torch.zeros(4, 3), 1, 0, 2, out=torch.empty(4, 6))


@pytest.mark.parametrize("alignment", [1, 64, 256, 4096])
@pytest.mark.parametrize("nbytes", [0, 1, 200, 319, 4096])
def test_host_memory_is_a_storage_of_exactly_its_bytes(alignment, nbytes):
    m = allocate_aligned(nbytes, alignment)
    assert m.untyped_storage().nbytes() == nbytes and m.numel() == nbytes
    assert nbytes == 0 or m.data_ptr() % alignment == 0
    m.fill_(7)  # writable
    assert int(m.sum()) == 7 * nbytes


class SliceWrites(nn.Module):
    """Every way a model writes part of a tensor: functionalized into the scatter ops."""

    def forward(self, x, s, d):
        y = x * 2
        y[:, :2] = 0
        y[:, 3] += s
        y[1:3, 4:6].copy_(d)
        z = torch.diagonal_scatter(y, torch.ones(4), 0)
        w = torch.as_strided_scatter(z, d * 7, (2, 2), (1, 3), 5)
        v = torch.as_strided(w + 1, (3, 3), (2, 1), 4)
        return y + 1, z, w, v, torch.select_scatter(w, s, 1, -1)


EXAMPLE = (torch.randn(4, 16), torch.randn(4), torch.randn(2, 2))


def on(t, device):
    return t if device_of(t) == device else clone_to(t, device)


@pytest.mark.parametrize("place", ["cpu", "emu", "emu-io"])
def test_slice_writes_and_as_strided_equal_eager_in_every_placement(emu, place, tmp_path):
    config = None
    if place == "emu-io":
        config = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(
            skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True))
    partitioner = None if place == "cpu" else ferry.OpSupportPartitioner("emu:0")
    program = ferry.compile(torch.export.export(SliceWrites(), EXAMPLE), partitioner, config)
    program.save(tmp_path / "m.ferry")
    module = ferry.Module(tmp_path / "m.ferry")
    meta = module.method_meta("forward")
    for seed in (1, 2, 3):
        inputs = fresh_inputs(EXAMPLE, seed)
        args = [on(t, meta.input_meta(i).device) for i, t in enumerate(inputs)]
        for g, w in zip(module(*args), SliceWrites()(*inputs)):
            torch.testing.assert_close(on(g, CPU), w, rtol=0, atol=0)


def test_a_scatter_over_a_dying_self_writes_only_its_slice_in_place():
    """`cache[:, pos] = x` of a value nobody reads after: the plan writes the result over `self`."""

    class M(nn.Module):
        def forward(self, x, u):
            y = x * 2
            y[:, 1] = u
            return y + 1

    program = ferry.compile(torch.export.export(M(), (torch.randn(8, 4), torch.randn(8))))
    m = program.method("forward")
    (ins,) = [i for i in m.instructions if isinstance(i, KernelCall) and i.kernel == "ferry::select_scatter.out"]
    self_, out = m.tensor(ins.args[0]), m.tensor(ins.outputs[0])
    assert self_.plan == out.plan  # in place: one buffer, one offset
    module = ferry.Module(program)
    for seed in (1, 2):
        x, u = fresh_inputs((torch.randn(8, 4), torch.randn(8)), seed)
        torch.testing.assert_close(module(x, u), M()(x, u), rtol=0, atol=0)


def test_slice_writes_at_dynamic_sizes_in_any_order_equal_eager():
    class M(nn.Module):
        def forward(self, x):
            y = x * 2
            y[:, :2] = 0
            y[1:] += 1
            return y

    ep = torch.export.export(M(), (torch.randn(6, 4),), dynamic_shapes=({0: torch.export.Dim("b", min=3, max=16)},))
    module = ferry.Module(ferry.compile(ep))
    for n in (6, 3, 6, 16, 4, 16):
        x = torch.randn(n, 4)
        got = module(x)
        assert got.shape == (n, 4)
        torch.testing.assert_close(got, M()(x), rtol=0, atol=0)


def test_an_out_kernel_the_device_lacks_runs_as_its_functional_twin(emu, monkeypatch):
    """`narrow_copy.out` has no CUDA kernel: the binder runs `narrow_copy` and copies into `out`
    (faked here: the emulated device is told it lacks every out kernel)."""
    from ferry.ops import variants
    from ferry.runtime.stages import kernel_steps

    asked = []

    def lacks(op, device_type):
        asked.append((str(op), device_type))
        return device_type != "emu"

    monkeypatch.setattr(kernel_steps, "has_device_kernel", lacks)

    class M(nn.Module):
        def forward(self, x):
            return torch.narrow_copy(x * 2, 1, 1, 2) + 1

    program = ferry.compile(torch.export.export(M(), (torch.randn(4, 4),)), ferry.OpSupportPartitioner("emu:0"))
    module = ferry.Module(program)
    for seed in (1, 2):
        (x,) = fresh_inputs((torch.randn(4, 4),), seed)
        torch.testing.assert_close(module(x), M()(x), rtol=0, atol=0)
    assert ("aten.narrow_copy.out", "emu") in asked
    assert variants.functional_variant(torch.ops.aten.narrow_copy.out) is torch.ops.aten.narrow_copy.default

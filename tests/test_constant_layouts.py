"""Constants and state keep the layout eager gives them: a transposed weight, a folded value that
kept its operand's memory order, a buffer updated in place. Ops that read memory rather than
values (`as_strided`, `view`) then see what eager sees; before, the bytes were stored row-major
under the traced strides, and `as_strided` read other elements (or `view` was refused)."""

from __future__ import annotations

import pytest
import torch

import ferry
from test_constant_fold import folded_note

PLACEMENTS = ("cpu", "emu:0")
ON_CUDA = pytest.param("cuda:0", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs a CUDA GPU")])


def run_saved(model, inputs, placement, tmp_path, calls=2):
    """Export, compile for `placement`, save, load; each call's results against eager's (on the
    same device), bit for bit off CUDA, with fresh inputs each call (the model may update its
    buffers: eager runs a twin)."""
    import copy

    twin = copy.deepcopy(model)
    ep = torch.export.export(model, inputs)
    program = ferry.compile(ep) if placement == "cpu" else ferry.compile(ep, ferry.OpSupportPartitioner(placement))
    path = tmp_path / "m.ferry"
    program.save(path)
    module = ferry.Module(path)
    on_cuda = placement.startswith("cuda")
    twin = twin.cuda() if on_cuda else twin
    for _ in range(calls):
        fresh = [torch.randn_like(t) for t in inputs]
        got, want = module(*fresh).cpu(), twin(*[t.cuda() for t in fresh] if on_cuda else fresh).cpu()
        if on_cuda:  # (a product may take another kernel than eager's: its rounding, not the layout)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want), (got, want)
    return program


class TransposedWeight(torch.nn.Module):
    """A buffer held transposed, read by value (matmul), through its memory (as_strided) and
    through a view that only its layout allows (`.t().view(-1)`)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(4, 8).t())  # (8, 4), strides (1, 8)

    def forward(self, x):
        return x @ self.w + self.w.as_strided((4,), (2,), 3) + self.w.t().reshape(-1)[5:9]


@pytest.mark.parametrize("placement", [*PLACEMENTS, ON_CUDA])
def test_a_transposed_constant_is_read_through_its_memory_as_eager_reads_it(placement, emu, tmp_path):
    run_saved(TransposedWeight().eval(), (torch.randn(2, 8),), placement, tmp_path)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_folded_value_keeps_the_memory_order_of_what_it_was_computed_from(placement, emu, tmp_path):
    class Folded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randn(4, 8))

        def forward(self, x):
            y = self.w.t() * 2  # (8, 4) in w's memory order: strides (1, 8)
            return x + y.as_strided((8,), (1,), 3) + y.t().view(-1)[3:11]

    program = run_saved(Folded().eval(), (torch.randn(8),), placement, tmp_path)
    if placement != "cpu":  # (a program without a partitioner is not rewritten)
        assert folded_note(program), "the product was expected to be folded"


@pytest.mark.parametrize("placement", [*PLACEMENTS, ON_CUDA])
def test_state_held_transposed_is_updated_in_place_and_read_as_it_lies_in_memory(placement, emu, tmp_path):
    class Transposed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("s", torch.randn(3, 5).t())

        def forward(self, x):
            self.s.add_(x)
            return self.s.t().reshape(-1)[2:9] * 1  # (in eager a view of s's memory, row-major)

    run_saved(Transposed().eval(), (torch.randn(5, 3),), placement, tmp_path, calls=3)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_float8_constants_of_either_layout_compile_and_run(placement, emu, tmp_path):
    class Float8(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("a", torch.randn(4, 8).to(torch.float8_e4m3fn))
            self.register_buffer("b", torch.randn(8, 4).to(torch.float8_e5m2).t())

        def forward(self, x):
            return x + self.a.float()[1] + self.b.float()[2]

    run_saved(Float8().eval(), (torch.randn(8),), placement, tmp_path)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_as_strided_over_a_view_of_a_result_of_the_call(placement, emu, tmp_path):
    """The storage offset counts from the start of the result's memory, read when the call runs:
    the result must still be held then, though only a view of it is the op's argument."""
    class Unfolded(torch.nn.Module):
        def forward(self, x, w):
            return x + (w.t() * 1).unfold(0, 2, 2).as_strided((8,), (2,), 1)

    run_saved(Unfolded(), (torch.randn(8), torch.randn(4, 8)), placement, tmp_path)


class WrittenThenRead(torch.nn.Module):
    """A buffer written in place through a view, then read through its memory."""

    def __init__(self, written: str, read_memory: bool):
        super().__init__()
        self.written, self.read_memory = written, read_memory
        self.register_buffer("b", torch.randn(4, 5) if written != "transposed buffer" else torch.randn(5, 4).t())

    def forward(self, x, mask):
        v = {"transposed view": self.b.transpose(0, 1), "row slice": self.b[1:3]}.get(self.written, self.b)
        v.masked_fill_(mask[: v.shape[0], : v.shape[1]], 10.0)
        read = v.as_strided(v.size(), v.stride(), v.storage_offset()) if self.read_memory else v
        return read * 1 + x[: read.shape[0], : read.shape[1]] * 0


def written_inputs():
    return torch.randn(5, 5), torch.rand(5, 5) > 0.5


@pytest.mark.parametrize("written", ["transposed view", "transposed buffer"])
def test_as_strided_over_memory_written_in_a_transposed_layout_is_refused_naming_both_ops(written, emu):
    """torch's functional form computes the write into a tensor of another layout, where
    `as_strided` reads other elements than eager's (torch's own decomposed program does so)."""
    ep = torch.export.export(WrittenThenRead(written, read_memory=True), written_inputs())
    with pytest.raises(ferry.CompileError, match=r"as_strided.*masked_fill_.*not laid out row-major"):
        ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"))


class OutInto(torch.nn.Module):
    """`torch.mul(x, 2, out=self.s)` into a transposed buffer: its functional twin lays `x * 2` out
    as x is laid out, so a read of s's memory would see other elements."""

    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.randn(4, 6).t())

    def forward(self, x):
        torch.mul(x, 2, out=self.s)
        return self.s.as_strided((5,), (3,), 2) * 1


def test_as_strided_over_an_out_argument_laid_out_otherwise_is_refused(emu):
    ep = torch.export.export(OutInto(), (torch.randn(6, 4),))
    with pytest.raises(ferry.CompileError, match=r"as_strided.*mul.out.*not laid out row-major"):
        ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"))


class LayoutKeepingWrite(torch.nn.Module):
    """Pointwise writes, copies and fills keep the layout they write into: a column slice
    scaled in place, a transposed view copied into, a transposed buffer clamped."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.randn(5, 4))
        self.register_buffer("c", torch.randn(4, 5).t())

    def forward(self, x):
        cols = self.b[:, 1:3]
        cols.mul_(2)
        self.b.t().copy_(x.t())
        self.c.clamp_(-0.5, 0.5)
        memory = [t.as_strided(t.size(), t.stride(), t.storage_offset()) for t in (cols, self.b, self.c)]
        return torch.cat([m.reshape(-1) for m in memory]) * 1


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_pointwise_write_a_copy_or_a_fill_through_any_view_is_read_through_its_memory(placement, emu, tmp_path):
    run_saved(LayoutKeepingWrite().eval(), (torch.randn(5, 4),), placement, tmp_path, calls=3)


@pytest.mark.parametrize("written, read_memory", [("row slice", True), ("transposed view", False)])
def test_a_write_through_a_view_runs_where_nothing_reads_memory_it_laid_out_otherwise(
        written, read_memory, emu, tmp_path):
    """A row-major slice written then read through its memory, or a transposed view written then
    read by value: the program compiles and each call equals eager's."""
    model = WrittenThenRead(written, read_memory)
    x, mask = written_inputs()
    import copy

    twin = copy.deepcopy(model)
    module = ferry.Module(ferry.compile(torch.export.export(model, (x, mask)), ferry.OpSupportPartitioner("emu:0")))
    for _ in range(3):
        x, mask = written_inputs()
        assert torch.equal(module(x, mask).cpu(), twin(x, mask))


@pytest.mark.parametrize("transposed", [False, True])
def test_the_inductor_backend_reads_a_constant_through_its_memory_as_eager(transposed, emu):
    """Inductor's code reads a constant uploaded into a slab, which starts inside it: `as_strided`'s
    storage offset counts from the constant's own start (before, from the slab's)."""
    class Strided(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randn(4, 6).t() if transposed else torch.randn(6, 4))

        def forward(self, x):
            return x + self.w.as_strided((6,), (4,), 1)

    model = Strided().eval()
    ep = torch.export.export(model, (torch.randn(6),))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0", backend_id="inductor")))
    for _ in range(2):
        x = torch.randn(6)
        torch.testing.assert_close(module(x).cpu(), model(x), rtol=0, atol=0)

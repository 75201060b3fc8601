"""Chains of data movement run as one gather or none, and q/k/v slices copied once
(aot/layout_chains.py): fewer kernels, and every result equal to eager's bit for bit, since only
copies change."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ferry
from ferry.aot import layout_chains

GATHER = "aten::index_select.out"
aten = torch.ops.aten
_MOVES = {aten.clone.default, aten.roll.default, aten.flip.default, aten.constant_pad_nd.default,
          aten.index_select.out, aten.index_select.default}


class _Moves(TorchDispatchMode):
    """Counts the data-movement kernels a call runs, matmul's own copies of its operands included."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in _MOVES
        return func(*args, **(kwargs or {}))


def moves_per_call(module, x) -> int:
    with _Moves() as moves:
        module(x)
    return moves.count


def compiled(model, *args, device="emu:0", dynamic_shapes=None):
    ep = torch.export.export(model.eval(), args, dynamic_shapes=dynamic_shapes)
    program = ferry.compile(ep, ferry.OpSupportPartitioner(device))
    methods = [ferry.load_program(program.segments[d.payload], segments=program.segments).method("forward")
               for d in program.delegates]
    ran = collections.Counter(i.kernel for m in methods for i in m.instructions if hasattr(i, "kernel"))
    notes = " ".join(v for m in methods for v in m.kernel_choices.values())
    return program, ran, notes


def equal_to_eager(program, model, shape, calls=3):
    module = ferry.Module(ferry.load_program(program.to_bytes()))  # saved and loaded
    for _ in range(calls):
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=0, atol=0)


class Windows(torch.nn.Module):
    """Swin's window partition and its reverse around a linear: roll, view, permute, copy."""

    def __init__(self, c=16, ws=4, shift=2):
        super().__init__()
        self.ws, self.shift = ws, shift
        self.proj = torch.nn.Linear(c, c)

    def forward(self, x):
        b, h, w, c = x.shape
        ws, s = self.ws, self.shift
        y = torch.roll(x, shifts=(-s, -s), dims=(1, 2)) if s else x
        y = y.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        y = self.proj(y)
        y = y.view(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        y = torch.roll(y, shifts=(s, s), dims=(1, 2)) if s else y
        return x + y


def test_shifted_window_partition_and_reverse_are_one_gather_each(emu):
    torch.manual_seed(0)
    model, shape = Windows(), (2, 8, 8, 16)
    program, ran, notes = compiled(model, torch.randn(shape))
    assert ran[GATHER] == 2 and "aten::roll.default" not in ran and "aten::clone.default" not in ran, ran
    assert "2 chain(s) of rolls" in notes
    equal_to_eager(program, model, shape)
    layout_chains.ON = False
    try:
        before, traced, _ = compiled(model, torch.randn(shape))
    finally:
        layout_chains.ON = True
    assert traced["aten::roll.default"] == 2 and traced["aten::clone.default"] == 2 and GATHER not in traced
    x = torch.randn(shape)
    # each roll of two dims, each copy: per call, four data-movement kernels fewer at the least
    assert moves_per_call(ferry.Module(program), x) <= moves_per_call(ferry.Module(before), x) - 4


def test_one_copy_stays_a_copy(emu):
    """Unshifted windows: the partition is one copy; a gather would be no fewer kernels. (The
    reverse's copy is gone: the residual add reads the permuted windows, aot/permuted_reads.py.)"""
    torch.manual_seed(0)
    model, shape = Windows(shift=0), (1, 8, 8, 16)
    program, ran, _ = compiled(model, torch.randn(shape))
    assert GATHER not in ran and ran["aten::clone.default"] == 1, ran
    equal_to_eager(program, model, shape)


class PadPermuteBack(torch.nn.Module):
    """A pad of nothing (Swin's, when the size already divides); a copy in another layout copied
    back into the first; and one read back through a permute by a layer norm, whose result is
    contiguous either way (Swin's patch embedding): each result is the input itself."""

    def forward(self, x):
        y = torch.nn.functional.pad(x * 2, (0, 0, 0, 0, 0, 0))
        z = y.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1).contiguous()
        w = (x * 3).permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)
        return torch.nn.functional.layer_norm(z, (x.shape[-1],)) + torch.nn.functional.layer_norm(w, (x.shape[-1],))


def test_a_copy_that_gives_the_input_back_is_a_view(emu):
    torch.manual_seed(0)
    model, shape = PadPermuteBack(), (1, 4, 6, 8)
    program, ran, notes = compiled(model, torch.randn(shape))
    assert "aten::pad.default" not in ran and "aten::clone.default" not in ran and GATHER not in ran, ran
    assert "read as a view" in notes
    equal_to_eager(program, model, shape)


class Shuffles(torch.nn.Module):
    """Moves that break rows apart (a transpose of the last dim) or keep only some (a strided
    slice), a chain the method returns, and copies read back by an op whose result keeps their
    layout or whose sum follows it."""

    def forward(self, x):
        inner = torch.roll(x, 1, 1).transpose(-1, -2).contiguous().sin()  # elements leave their rows
        strided = torch.roll(x[:, ::2], 1, 2).flip(1).contiguous().cos()  # rows dropped and reordered
        returned = torch.roll(x * 3, (1, 1), (1, 2)).permute(0, 2, 1, 3).contiguous()
        laid_out = (x * 4).permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1) + 1  # the add keeps the copy's layout
        summed = (x * 5).permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1).sum(-1)  # summed in the copy's order
        return inner, strided, returned, laid_out, summed


def test_moves_that_split_rows_stay_and_dropped_rows_are_gathered(emu):
    torch.manual_seed(0)
    model, shape = Shuffles(), (2, 6, 6, 6)
    program, ran, _ = compiled(model, torch.randn(shape))
    # the strided slice, rolled and flipped: one gather of what stays; the roll over two dims before the returned
    # copy: one gather; the roll before the transpose (a roll of one dim, one kernel) as traced
    assert ran[GATHER] == 2 and ran["aten::roll.default"] == 1 and ran["aten::clone.default"] == 4, ran
    module = ferry.Module(program)
    for _ in range(3):
        x = torch.randn(shape)
        for got, want in zip(module(x), model(x), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dynamic_sizes_keep_the_chain(emu):
    torch.manual_seed(0)
    model = Windows()
    batch = torch.export.Dim("batch", min=1, max=8)
    program, ran, _ = compiled(model, torch.randn(2, 8, 8, 16), dynamic_shapes=({0: batch},))
    assert GATHER not in ran and ran["aten::roll.default"] == 2, ran
    module = ferry.Module(program)
    for b in (1, 3):
        x = torch.randn(b, 8, 8, 16)
        torch.testing.assert_close(module(x), model(x), rtol=0, atol=0)


class QKV(torch.nn.Module):
    """q, k and v from one projection through a permute, as Swin's window attention takes them."""

    def __init__(self, c=32, heads=2, read_q=False):
        super().__init__()
        self.heads, self.read_q = heads, read_q
        self.qkv = torch.nn.Linear(c, 3 * c)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.softmax((q * 0.25) @ k.transpose(-2, -1), dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(b, n, c)
        return out + q.sum() if self.read_q else out


def test_q_k_and_v_of_one_projection_are_copied_once(emu):
    torch.manual_seed(0)
    model, shape = QKV(), (4, 16, 32)
    program, ran, notes = compiled(model, torch.randn(shape))
    assert "1 permuted value(s)" in notes
    layout_chains.ON = False
    try:
        before, _, _ = compiled(model, torch.randn(shape))
    finally:
        layout_chains.ON = True
    x = torch.randn(shape)
    # q's copy, and matmul's of k and v, become one copy of all three
    assert moves_per_call(ferry.Module(program), x) <= moves_per_call(ferry.Module(before), x) - 2
    equal_to_eager(program, model, shape)


def test_a_slice_read_as_it_lies_keeps_the_traced_copies(emu):
    torch.manual_seed(0)
    model, shape = QKV(read_q=True), (4, 16, 32)
    program, _, notes = compiled(model, torch.randn(shape))
    assert "permuted value" not in notes
    equal_to_eager(program, model, shape)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_windows_and_qkv_on_cuda_with_graphs_equal_eager(full_fp32):
    torch.manual_seed(0)
    for model, shape, note in ((Windows(), (1, 56, 56, 16), "2 chain(s) of rolls"),
                               (QKV(), (64, 49, 32), "1 permuted value(s)")):
        model = model.eval()
        program, _, notes = compiled(model, torch.randn(shape), device="cuda:0")
        assert note in notes, notes
        module = ferry.Module(program, cuda_graphs=True)
        cuda_model = model.cuda()
        for _ in range(3):
            x = torch.randn(shape)
            with torch.no_grad():
                want = cuda_model(x.cuda()).cpu()
            torch.testing.assert_close(module(x), want, rtol=0, atol=0)


class LeftAlone(torch.nn.Module):
    """What slices_copied_once must not take (each would add a copy or change a clone's layout):
    slices whose clones keep the layout they are given (after one copy of the whole they would
    come out contiguous, not in the order they had), and a tensor only some of whose slices are read."""

    def forward(self, x):
        q, k, v = (x * 2).permute(1, 0, 3, 2).unbind(0)
        some = (x * 3).permute(1, 0, 2, 3)
        return q.clone() * k.clone() + v.clone(), some[0] @ some[1].transpose(-1, -2)


def test_copies_that_would_stay_or_change_layout_leave_the_slices_alone(emu):
    torch.manual_seed(0)
    model, shape = LeftAlone(), (4, 3, 6, 5)
    program, _, notes = compiled(model, torch.randn(shape))
    assert "permuted value" not in notes
    module = ferry.Module(program)
    for _ in range(2):
        x = torch.randn(shape)
        for got, want in zip(module(x), model(x), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


class Interleaved(torch.nn.Module):
    """Two chains of one row order, the later-starting one ending first (their order is stored
    once, before either reads it), and a chain whose slice starts at a size read at run time."""

    def forward(self, x):
        a = torch.roll(x * 2, (1, 1), (0, 1))
        b = torch.roll(x * 3, (1, 1), (0, 1))
        y = x[0] * 2
        c = torch.roll(y.narrow(0, x.shape[0] % 2, 2), 1, 0).flip(0)
        return b.sin() + a.cos(), c.sin()


def test_chains_sharing_an_order_and_chains_reading_sizes(emu):
    torch.manual_seed(0)
    model, shape = Interleaved(), (4, 6, 8)
    batch = torch.export.Dim("batch", min=2, max=8)
    program, ran, _ = compiled(model, torch.randn(shape), dynamic_shapes=({0: batch},))
    module = ferry.Module(program)
    for b in (2, 3, 5):
        x = torch.randn(b, 6, 8)
        for got, want in zip(module(x), model(x), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    static, ran, _ = compiled(model, torch.randn(shape))
    assert ran[GATHER] == 3 and "aten::roll.default" not in ran, ran
    equal_to_eager(static, model, shape)

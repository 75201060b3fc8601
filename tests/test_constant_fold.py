"""Values computed from constants alone, folded at compile time (aot/constant_fold.py): the ops
that only they needed no longer run, results keep eager's bits, and what may not be folded is
left to run time (a reduction, a transcendental function, a returned value, state, a dynamic size)."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

import ferry
from ferry.aot import constant_fold

FOLDED = "values computed from constants"


def delegate_methods(program) -> list:
    return [ferry.load_program(program.segments[d.payload], segments=program.segments).method("forward")
            for d in program.delegates]


def kernels(program) -> collections.Counter:
    return collections.Counter(i.kernel for m in delegate_methods(program) for i in m.instructions
                               if hasattr(i, "kernel"))


def folded_note(program) -> str:
    return " ".join(m.kernel_choices.get(FOLDED, "") for m in delegate_methods(program)).strip()


def compile_on(model, inputs, device="emu:0", dynamic_shapes=None):
    ep = torch.export.export(model.eval(), inputs, dynamic_shapes=dynamic_shapes)
    return ferry.compile(ep, ferry.OpSupportPartitioner(device))


class WindowAttention(torch.nn.Module):
    """torchvision Swin's shifted-window attention, trimmed: the relative position bias gathered
    from its table and the shift mask built from zeros and slice fills, on every call."""

    def __init__(self, dim=32, heads=2, ws=4, shift=2):
        super().__init__()
        self.ws, self.heads, self.shift = ws, heads, shift
        self.table = torch.nn.Parameter(torch.randn((2 * ws - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous() + (ws - 1)
        self.register_buffer("index", (rel[:, :, 0] * (2 * ws - 1) + rel[:, :, 1]).flatten())
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, h, w, c = x.shape
        ws, shift, n = self.ws, self.shift, self.ws * self.ws
        bias = self.table[self.index].view(n, n, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
        nw = (h // ws) * (w // ws)
        x = x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b * nw, n, c)
        q, k, v = self.qkv(x).reshape(b * nw, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * 0.5) @ k.transpose(-2, -1) + bias
        mask = x.new_zeros((h, w))
        count = 0
        for hs in ((0, -ws), (-ws, -shift), (-shift, None)):
            for vs in ((0, -ws), (-ws, -shift), (-shift, None)):
                mask[hs[0]:hs[1], vs[0]:vs[1]] = count
                count += 1
        mask = mask.view(h // ws, ws, w // ws, ws).permute(0, 2, 1, 3).reshape(nw, n)
        mask = mask.unsqueeze(1) - mask.unsqueeze(2)
        mask = mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
        attn = attn.view(b, nw, self.heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
        attn = F.softmax(attn.view(-1, self.heads, n, n), dim=-1)
        return (attn @ v).transpose(1, 2).reshape(b, h, w, c)


class TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = WindowAttention(), WindowAttention()

    def forward(self, x):
        return self.b(self.a(x))


def test_swins_masks_and_position_biases_are_folded_and_results_keep_eagers_bits(emu):
    torch.manual_seed(0)
    model, x = TwoBlocks().eval(), torch.randn(2, 8, 8, 32)
    program = compile_on(model, (x,))
    ran = kernels(program)
    # (the bias's gather from its table is gone; the window partition's rows are one index_select, layout_chains.py)
    assert not {k for k in ran if "slice_scatter" in k or "fill" in k or "aten::index." in k or "new_zeros" in k}, ran
    assert "4 value(s)" in folded_note(program)  # two biases, two masks
    module = ferry.Module(ferry.load_program(program.to_bytes()))  # saved and loaded
    for _ in range(3):
        x = torch.randn(2, 8, 8, 32)
        torch.testing.assert_close(module(x), model(x), rtol=0, atol=0)


def folded_segments(program) -> dict[int, int]:
    """Segment -> bytes, of the constants the fold made (named _folded_* at compile time)."""
    return {v.constant: len(program.segments[v.constant]) for m in delegate_methods(program) for v in m.values
            if getattr(v, "constant", None) is not None and "_folded_" in v.name}


def test_equal_folded_values_are_stored_once(emu):
    """Both blocks build the same mask: one constant; their biases differ: one each."""
    torch.manual_seed(0)
    program = compile_on(TwoBlocks(), (torch.randn(2, 8, 8, 32),))
    mask_bytes, bias_bytes = 4 * 16 * 16 * 4, 2 * 16 * 16 * 4
    assert sorted(folded_segments(program).values()) == [bias_bytes, bias_bytes, mask_bytes]


class Inexact(torch.nn.Module):
    """Values of constants whose bits may differ by device: each stays an op run per call."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        w = self.w
        return (x + w.exp(), x + w.sum(), x + w / 3, x + torch.add(w, w, alpha=2), x + (w * 100).long(),
                x + torch.arange(0.0, 0.8, 0.1))


def test_a_reduction_a_transcendental_or_a_rounding_that_may_differ_by_device_is_not_folded(emu):
    torch.manual_seed(0)
    model, x = Inexact().eval(), torch.randn(4, 8)
    program = compile_on(model, (x,))
    assert folded_note(program).startswith("1 value(s)")  # w * 100 alone: a product of two numbers
    ran = kernels(program)
    assert sum(n for k, n in ran.items() if "add" in k) == 7  # six x + ..., and w + 2 * w
    for op in ("exp", "sum", "div", "_to_copy", "arange"):
        assert any(op in k for k in ran), (op, ran)
    x = torch.randn(4, 8)
    for got, want in zip(ferry.Module(program)(x), model(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class ReturnsAConstantValue(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return x * 2, self.w.t().contiguous()


def test_a_value_the_method_returns_is_computed_per_call_so_the_caller_may_write_into_it(emu):
    torch.manual_seed(0)
    model, x = ReturnsAConstantValue().eval(), torch.randn(4, 8)
    program = compile_on(model, (x,))
    assert not folded_note(program)
    module = ferry.Module(program)
    first = module(x)[1]
    first.fill_(7.0)  # the caller's tensor
    torch.testing.assert_close(module(x)[1], model(x)[1], rtol=0, atol=0)


class Broadcast(torch.nn.Module):
    def forward(self, x):
        return x + torch.arange(8).to(torch.float32).view(1, 8).expand(64, 8)


def test_a_broadcast_folded_value_is_stored_at_its_own_size_and_read_as_a_view(emu):
    program = compile_on(Broadcast(), (torch.randn(64, 8),))
    assert list(folded_segments(program).values()) == [8 * 4]  # the eight floats, not the 64 x 8 expanded
    x = torch.randn(64, 8)
    torch.testing.assert_close(ferry.Module(program)(x), Broadcast()(x), rtol=0, atol=0)


def test_a_value_above_the_size_limit_stays_computed_per_call(emu, monkeypatch):
    monkeypatch.setattr(constant_fold, "MAX_TENSOR_BYTES", 16)
    torch.manual_seed(0)
    model, x = TwoBlocks().eval(), torch.randn(2, 8, 8, 32)
    program = compile_on(model, (x,))
    assert not folded_note(program) and any("slice_scatter" in k for k in kernels(program))
    torch.testing.assert_close(ferry.Module(program)(x), model(x), rtol=0, atol=0)


def test_past_the_budget_the_rest_stays_computed(emu, monkeypatch):
    """A budget that holds the first bias and nothing more (the graph's constants / 16 aside)."""
    torch.manual_seed(0)
    model, x = TwoBlocks().eval(), torch.randn(2, 8, 8, 32)
    constants = sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * 8 for b in model.buffers())
    monkeypatch.setattr(constant_fold, "MAX_TOTAL_BYTES", 2 * 16 * 16 * 4 - constants // 16)
    program = compile_on(model, (x,))
    assert "1 value(s)" in folded_note(program)
    torch.testing.assert_close(ferry.Module(program)(x), model(x), rtol=0, atol=0)


class DynamicMask(torch.nn.Module):
    def forward(self, x):
        n = x.shape[0]
        return x + torch.ones(n, n, dtype=torch.bool).tril().to(x.dtype) @ x


def test_a_value_of_a_dynamic_size_stays_computed_at_every_size(emu):
    program = compile_on(DynamicMask(), (torch.randn(6, 3),), dynamic_shapes=({0: torch.export.Dim("n", max=12)},))
    assert not folded_note(program)
    module = ferry.Module(program)
    for n in (6, 2, 12, 6):
        x = torch.randn(n, 3)
        torch.testing.assert_close(module(x), DynamicMask()(x))


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(3))
        self.register_buffer("step", torch.ones(3))

    def forward(self, x):
        self.count.add_(self.step * 2)
        return x + self.count.clone().flip(0)


def test_state_the_method_updates_is_never_folded_but_constants_beside_it_are(emu):
    program = compile_on(Counter(), (torch.randn(3),))
    assert "1 value(s)" in folded_note(program)  # step * 2
    eager, module = Counter(), ferry.Module(program)
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(module(x), eager(x), rtol=0, atol=0)


@pytest.mark.parametrize("graphs", [False, True])
def test_folded_values_on_an_asynchronous_device_with_graphs_equal_eager(emu_async, graphs):
    torch.manual_seed(0)
    model, x = TwoBlocks().eval(), torch.randn(2, 8, 8, 32)
    module = ferry.Module(compile_on(model, (x,)), cuda_graphs=graphs)
    for _ in range(3):
        x = torch.randn(2, 8, 8, 32)
        torch.testing.assert_close(module(x), model(x), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_swins_folded_masks_on_cuda_with_graphs_equal_eager(full_fp32):
    """torchvision's Swin-T where it imports (its masks and biases folded), else the trimmed block."""
    torch.manual_seed(0)
    try:
        import torchvision

        model, x, folded = torchvision.models.swin_t(weights=None).eval(), torch.randn(1, 3, 224, 224), 17
    except Exception:  # noqa: BLE001 - torchvision absent or not loading with this torch
        model, x, folded = TwoBlocks().eval(), torch.randn(2, 8, 8, 32), 4
    program = compile_on(model, (x,), device="cuda:0")
    assert f"{folded} value(s)" in folded_note(program)
    module = ferry.Module(program, cuda_graphs=True)
    model = model.cuda()
    for _ in range(3):
        x = torch.randn_like(x)
        with torch.no_grad():
            want = model(x.cuda()).cpu()
        torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-4)


class Widened(torch.nn.Module):
    """An int8 weight cast to float and scaled on every call (torchao's int8 linear, written out)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("q", torch.randint(-127, 127, (64, 256), dtype=torch.int8))
        self.register_buffer("scale", torch.rand(64) + 0.5)

    def forward(self, x):
        return (x @ self.q.to(torch.float32).t()) * self.scale


def test_a_quantized_weight_cast_wider_is_not_folded(emu):
    """Folded, the cast would store the int8 weight again as floats, four times its size."""
    torch.manual_seed(0)
    model, x = Widened().eval(), torch.randn(2, 256)
    program = compile_on(model, (x,))
    assert not folded_note(program) and any("_to_copy" in k for k in kernels(program))
    torch.testing.assert_close(ferry.Module(program)(x), model(x), rtol=0, atol=0)


class Tiled(torch.nn.Module):
    def __init__(self, times):
        super().__init__()
        self.times = times
        self.row = torch.nn.Parameter(torch.randn(1, 1024))

    def forward(self, x):
        return x + self.row.repeat(self.times, 1)


@pytest.mark.parametrize(("times", "folds"), [(64, True), (512, False)])
def test_a_value_larger_than_what_it_reads_is_folded_only_while_small(emu, times, folds):
    """A 4 KiB row tiled 64 times (256 KiB, under GROWTH_BYTES) is folded; 512 times (2 MiB) it is
    computed per call, as the model wrote it."""
    torch.manual_seed(0)
    model, x = Tiled(times).eval(), torch.randn(times, 1024)
    program = compile_on(model, (x,))
    assert bool(folded_note(program)) == folds
    torch.testing.assert_close(ferry.Module(program)(x), model(x), rtol=0, atol=0)


class HalfArithmetic(torch.nn.Module):
    """Half-precision arithmetic with a number or a 0-dim float: CUDA and the CPU round it
    differently (the number kept as a float by one, cast to half first by the other)."""

    def __init__(self, dtype):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64).to(dtype))
        self.v = torch.nn.Parameter(torch.randn(64, 64).to(dtype))
        self.register_buffer("scale", torch.tensor(0.3))

    def forward(self, x):
        return x * (self.w + 0.1), x * (self.w * self.scale), x * (self.w - 1 / 3), x * (self.w * self.v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_arithmetic_with_a_number_is_left_to_the_device_and_between_tensors_folded(emu, dtype):
    torch.manual_seed(0)
    model, x = HalfArithmetic(dtype).eval(), torch.randn(64, 64).to(dtype)
    program = compile_on(model, (x,))
    assert folded_note(program).startswith("1 value(s)")  # w * v alone
    for got, want in zip(ferry.Module(program)(x), model(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_folded_half_arithmetic_on_cuda_keeps_eagers_bits(dtype):
    torch.manual_seed(0)
    model, x = HalfArithmetic(dtype).eval(), torch.randn(64, 64).to(dtype)
    module = ferry.Module(compile_on(model, (x,), device="cuda:0"))
    model = model.cuda()
    with torch.no_grad():
        want = model(x.cuda())
    for got, w in zip(module(x), want):
        torch.testing.assert_close(got, w.cpu(), rtol=0, atol=0)


class Rounded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8) * 10)

    def forward(self, x):
        return x + torch.round(self.w, decimals=2), x + torch.round(self.w)


def test_rounding_to_decimals_is_left_to_the_device_and_to_integers_folded(emu):
    """round(w, decimals=2) scales, rounds and scales back: CUDA and the CPU differ there (an
    H100 against the CPU: 7,049 of 65,536 fp16 values); round(w) is exact."""
    torch.manual_seed(0)
    model, x = Rounded().eval(), torch.randn(8, 8)
    program = compile_on(model, (x,))
    assert folded_note(program).startswith("1 value(s)") and any("round" in k for k in kernels(program))
    for got, want in zip(ferry.Module(program)(x), model(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

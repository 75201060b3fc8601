"""An RMS norm written out op by op (transformers' Llama, Qwen, Mistral and T5 norms) as one
`ferry::rms_norm` (choices/norms.py `rms_norms` at compile time, `form` at load; ops/layer_norm.py):
equal to eager bit for bit where the op runs as its ATen calls (the CPU, the emulated device), what
stays written out, the choice at load under faked timing, and on a GPU the one-pass Triton kernel
against fp64 and eager."""

from __future__ import annotations

import pytest
import torch

import ferry
from ferry.choices import hook, norms
from ferry.choices.decisions import DECISIONS, Site
from ferry.ops import layer_norm as rows_norm
from test_layout_chains import compiled
from test_norm_choice import assert_as_close_as, needs_gpu_triton, on_gpu_inputs

FUSED = "ferry::rms_norm.default"
WRITTEN_OUT = ("aten::rsqrt.default", "aten::rsqrt.out", "aten::pow.Tensor_Scalar_out", "aten::pow.Tensor_Scalar",
               "aten::mean.out", "aten::mean.dim")
CAPTURED = Site(measure=True, captured=True)


class LlamaNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm (Qwen2/3, Mistral, Phi-3 write it the same way)."""

    def __init__(self, width, eps=1e-6, weight=True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(width) + 0.5) if weight else None
        self.eps = eps

    def forward(self, h):
        dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(dtype) if self.weight is None else self.weight * h.to(dtype)


class T5Norm(torch.nn.Module):
    """transformers' T5LayerNorm: the product reads the input as it came, not its fp32 copy."""

    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.rand(width) + 0.5), eps

    def forward(self, h):
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(self.weight.dtype)
        return self.weight * h


class Block(torch.nn.Module):
    """A decoder block's shape: a norm before a projection, a second norm of the projection's
    heads (Qwen3's q norm), a last norm."""

    def __init__(self, norm=LlamaNorm, width=64, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.first, self.proj = norm(width), torch.nn.Linear(width, width)
        self.head_norm, self.last = norm(width // heads), norm(width)

    def forward(self, x):
        b, t, c = x.shape
        q = self.head_norm(self.proj(self.first(x)).view(b, t, self.heads, c // self.heads))
        return self.last(q.reshape(b, t, c) + x)


def _equal_to_eager(program, model, shape, dtype=torch.float32, calls=3):
    module = ferry.Module(ferry.load_program(program.to_bytes()))  # saved and loaded
    for _ in range(calls):
        x = (torch.randn(shape) * 3).to(dtype)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("norm", [LlamaNorm, T5Norm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_norm_written_out_is_one_op_and_the_program_equals_eager_bit_for_bit(emu, norm, dtype):
    model = Block(norm).eval().to(dtype)
    program, ran, notes = compiled(model, torch.randn(2, 5, 64, dtype=dtype))
    assert ran[FUSED] == 3 and not any(ran[k] for k in WRITTEN_OUT), ran
    assert "RMS norm(s) written out" in notes
    _equal_to_eager(program, model, (2, 5, 64), dtype)


def test_a_norm_without_a_weight_is_one_op_too(emu):
    model = LlamaNorm(32, weight=False).eval()
    program, ran, _ = compiled(model, torch.randn(3, 32))
    assert ran[FUSED] == 1 and not any(ran[k] for k in WRITTEN_OUT), ran
    _equal_to_eager(program, model, (3, 32))


def test_the_switch_and_a_cpu_delegate_keep_it_written_out(emu, monkeypatch):
    model, x = Block().eval(), torch.randn(2, 5, 64)
    _, on_cpu, _ = compiled(model, x, device="cpu")
    assert on_cpu[FUSED] == 0, on_cpu
    monkeypatch.setattr(norms, "RMS", False)
    _, off, _ = compiled(model, x)
    assert off[FUSED] == 0, off


class Apart(torch.nn.Module):
    """Norms the op does not compute as written, or whose parts something else reads."""

    def __init__(self, kind, width=16):
        super().__init__()
        self.kind = kind
        self.weight = torch.nn.Parameter(torch.rand(width) + 0.5)
        self.register_buffer("eps_tensor", torch.tensor(1e-6))

    def forward(self, h):
        kind = self.kind
        f = h.to(torch.float32)
        if kind == "mean over another dim":
            return self.weight * (f * torch.rsqrt(f.pow(2).mean(0, keepdim=True) + 1e-6))
        if kind == "a cube":
            return self.weight * (f * torch.rsqrt(f.pow(3).mean(-1, keepdim=True) + 1e-6))
        if kind == "eps a tensor":
            return self.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps_tensor))
        if kind == "the variance returned too":
            v = f.pow(2).mean(-1, keepdim=True)
            return self.weight * (f * torch.rsqrt(v + 1e-6)), v
        if kind == "computed in half precision":
            h = h.half()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.float16, copy=True).float()
        if kind == "Gemma's 1 + weight":
            return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + self.weight.float())
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["mean over another dim", "a cube", "eps a tensor", "the variance returned too",
                                  "computed in half precision"])
def test_what_stays_written_out(emu, kind):
    model = Apart(kind).eval()
    program, ran, _ = compiled(model, torch.randn(4, 16))
    assert ran[FUSED] == 0, ran
    module = ferry.Module(program)
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(module(x), model(x), rtol=1e-6, atol=1e-6)


def test_gemmas_one_plus_weight_folded_to_a_constant_is_the_ops_weight(emu):
    """Gemma scales by `1 + weight`: computed from constants alone, it is folded at compile time
    (aot/constant_fold.py, the same bits as eager's add) and the op takes it as its weight."""
    model = Apart("Gemma's 1 + weight").eval()
    program, ran, _ = compiled(model, torch.randn(4, 16))
    assert ran[FUSED] == 1 and not any(ran[k] for k in WRITTEN_OUT), ran
    _equal_to_eager(program, model, (4, 16))


def test_a_weight_of_a_wider_dtype_keeps_its_product_apart(emu):
    """Llama in bf16 with fp32 weights: the product promotes to fp32; the op, whose weight is in
    x's dtype, takes the norm without it, and the product runs after."""
    model = LlamaNorm(32).eval()
    program, ran, _ = compiled(model, torch.randn(3, 32, dtype=torch.bfloat16))
    assert ran[FUSED] == 1 and ran["aten::mul.Tensor"] + ran["aten::mul.out"] == 1, ran
    _equal_to_eager(program, model, (3, 32), torch.bfloat16)


def test_a_dynamic_batch_is_one_op_and_equals_eager_at_each_size(emu):
    model = Block().eval()
    batch = torch.export.Dim("batch", max=8)
    program, ran, _ = compiled(model, torch.randn(4, 5, 64), dynamic_shapes={"x": {0: batch}})
    assert ran[FUSED] == 3, ran
    module = ferry.Module(program)
    for rows in (8, 1, 8, 3):
        x = torch.randn(rows, 5, 64)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=0, atol=0)


# ---------------------------------------------------------------- the choice at load (timing faked)


@pytest.fixture
def triton_here(monkeypatch):
    monkeypatch.setattr(rows_norm, "available", lambda: True)


@pytest.mark.parametrize("times, taken", [((4.0, 2.0), True), ((4.0, 3.9), False)])
def test_the_kernel_is_kept_where_it_saves_ten_percent(times, taken, timed, triton_here):
    timed.times = times
    args = [torch.randn(1, 2048, 128), torch.rand(128), 1e-6]
    chosen = hook.choose(rows_norm.RMS_NORM, args, {}, CAPTURED)
    (made,) = DECISIONS.values(timed=True)
    assert made.op == "ferry::rms_norm" and made.taken is taken and made.forms == norms.RMS_FORMS
    assert made.shape == "2048x128 float32"
    assert chosen is (rows_norm.rms_norm if taken else rows_norm.rms_then_scale)
    hook.choose(rows_norm.RMS_NORM, [torch.randn(1, 2048, 128), torch.rand(128), 1e-6], {}, CAPTURED)
    assert timed.calls == 1  # once per key


@pytest.mark.parametrize("case", ["uncaptured", "transposed", "weight of another dtype", "float64"])
def test_what_keeps_the_kernel_untimed(case, timed, triton_here):
    x, w, site = torch.randn(8, 16), torch.rand(16), CAPTURED
    if case == "uncaptured":
        site = Site(measure=True, captured=False)
    elif case == "transposed":
        x = torch.randn(16, 8).t()
    elif case == "weight of another dtype":
        w = w.double()
    elif case == "float64":
        x, w = x.double(), w.double()
    assert norms.rms_decision([x, w, 1e-6], {}, site) is None and timed.calls == 0
    chosen = hook.choose(rows_norm.RMS_NORM, [x, w, 1e-6], {}, site)
    assert chosen is rows_norm.rms_then_scale  # the op's ATen calls, through torch's bindings


def test_the_ops_own_calls_are_eagers(emu):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w = (torch.randn(5, 48) * 4).to(dtype), (torch.rand(48) + 0.5).to(dtype)
        model = LlamaNorm(48).to(dtype)
        model.weight.data = w
        with torch.no_grad():
            want = model(x)
        assert torch.equal(torch.ops.ferry.rms_norm(x, w, 1e-6), want)
        assert torch.equal(rows_norm.rms_then_scale(x, w, 1e-6), want)


# ---------------------------------------------------------------- the kernel, on a GPU


@pytest.mark.cuda
@pytest.mark.parametrize("rows, width", [(1, 2048), (16, 128), (128, 768), (1, 1), (5, 1000), (3, 8192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weighted", [True, False])
def test_the_gpu_kernel_is_as_close_to_fp64_as_eagers(rows, width, dtype, weighted):
    needs_gpu_triton()
    x, w, _ = on_gpu_inputs(rows, width, dtype, weighted)
    want = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).double()
    want = want if w is None else want * w.double()
    assert_as_close_as(rows_norm.rms_norm(x, w, 1e-6), rows_norm.rms_then_scale(x, w, 1e-6), want)


@pytest.mark.cuda
def test_on_the_gpu_a_captured_block_takes_the_kernel_and_equals_eager(fresh, monkeypatch):
    needs_gpu_triton()
    from ferry.choices import timing

    monkeypatch.setattr(timing, "KEEP_IF_ABOVE", 10.0)  # kept at whatever time: the results are what is tested
    model = Block().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(2, 5, 64),)), ferry.OpSupportPartitioner("cuda:0"))
    module = ferry.Module(program, cuda_graphs=True)
    module.load_method()
    made = [d for d in DECISIONS.values(timed=True) if d.op == "ferry::rms_norm"]
    assert made and all(d.taken for d in made), made
    cuda_model = model.cuda()
    for _ in range(3):
        x = torch.randn(2, 5, 64)
        with torch.no_grad():
            torch.testing.assert_close(module(x), cuda_model(x.cuda()).cpu(), rtol=1e-5, atol=1e-5)

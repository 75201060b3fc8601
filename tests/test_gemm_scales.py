"""A batched product scaled by a number, before or after, runs as one GEMM whose alpha is the
number (aot/gemm_scales.py): no kernel for the scale, and results equal eager's within rounding."""

from __future__ import annotations

import math

import pytest
import torch

import ferry
from ferry.aot import gemm_scales
from test_layout_chains import compiled

BADDBMMS = ("aten::baddbmm.default", "aten::baddbmm.out")
SCALES = ("aten::mul.out", "aten::mul.Tensor", "aten::div.out", "aten::div.Tensor")


def scales_run(ran) -> int:
    return sum(ran[k] for k in SCALES)


def gemms_run(ran) -> int:
    return sum(ran[k] for k in BADDBMMS)


def equal_to_eager(program, model, *shapes, dtype=torch.float32, rtol=1e-5, atol=1e-6, calls=3):
    """Fresh random inputs each call, the saved and loaded program against eager; eager's own
    error against fp64 bounds how far apart the two may be."""
    module = ferry.Module(ferry.load_program(program.to_bytes()))
    for _ in range(calls):
        args = [torch.randn(s, dtype=dtype) for s in shapes]
        with torch.no_grad():
            torch.testing.assert_close(module(*args), model(*args), rtol=rtol, atol=atol)


class PreScaled(torch.nn.Module):
    """torchvision's Swin: q scaled, then q @ kᵀ; the scores then read by a softmax and @ v."""

    def __init__(self, head_dim: int, divide: bool = False):
        super().__init__()
        self.head_dim, self.divide = head_dim, divide

    def forward(self, q, k, v):
        q = q / math.sqrt(self.head_dim) if self.divide else q * self.head_dim ** -0.5
        return torch.softmax(q @ k.transpose(-2, -1), -1) @ v


class PostScaled(torch.nn.Module):
    """transformers' eager attention: the scores scaled after the product."""

    def forward(self, q, k, v):
        scores = torch.matmul(q, k.transpose(2, 3)) * 0.125
        return torch.matmul(torch.softmax(scores, -1), v)


SHAPE = (4, 3, 49, 32)


@pytest.mark.parametrize("divide", [False, True])
def test_a_scaled_query_is_taken_into_the_gemm(divide, emu):
    model = PreScaled(32, divide)
    program, ran, notes = compiled(model, *(torch.randn(SHAPE) for _ in range(3)))
    assert scales_run(ran) == 0 and gemms_run(ran) == 1
    assert "scaled before or after" in notes
    equal_to_eager(program, model, SHAPE, SHAPE, SHAPE)


def test_scaled_scores_are_taken_into_the_gemm(emu):
    program, ran, _ = compiled(PostScaled(), *(torch.randn(SHAPE) for _ in range(3)))
    assert scales_run(ran) == 0 and gemms_run(ran) == 1
    equal_to_eager(program, PostScaled(), SHAPE, SHAPE, SHAPE)


def test_both_scales_multiply_into_one_alpha_and_bmm_is_taken_too(emu):
    class Both(torch.nn.Module):
        def forward(self, a, b):
            return torch.bmm(a * 0.5, b) / 3.0 + 1

    program, ran, _ = compiled(Both(), torch.randn(6, 5, 7), torch.randn(6, 7, 4))
    assert scales_run(ran) == 0 and gemms_run(ran) == 1
    equal_to_eager(program, Both(), (6, 5, 7), (6, 7, 4))


def test_a_query_scaled_then_copied_contiguous_reads_its_own_strides(emu):
    """Swin's last stage: q is a slice of the permuted q/k/v, scaled and copied contiguous before
    the product; the GEMM reads the slice's strides, so neither the scale nor the copy runs."""

    class Sliced(torch.nn.Module):
        def forward(self, qkv, k):
            q = qkv.permute(2, 0, 3, 1, 4)[0]  # (1, heads, tokens, dim), rows 3 x heads x dim apart
            return (q * 0.25).contiguous() @ k.transpose(-2, -1) + 1

    qkv, k = torch.randn(1, 49, 3, 24, 32), torch.randn(1, 24, 49, 32)
    program, ran, _ = compiled(Sliced(), qkv, k)
    assert scales_run(ran) == 0 and ran["aten::clone.default"] == 0 and gemms_run(ran) == 1
    equal_to_eager(program, Sliced(), tuple(qkv.shape), tuple(k.shape))


def test_a_bf16_product_is_taken_and_equals_eager_within_bf16_rounding(emu):
    program, ran, _ = compiled(PreScaled(32), *(torch.randn(SHAPE, dtype=torch.bfloat16) for _ in range(3)))
    assert gemms_run(ran) == 1
    equal_to_eager(program, PreScaled(32), SHAPE, SHAPE, SHAPE, dtype=torch.bfloat16, rtol=2e-2, atol=2e-2)


def test_two_products_share_one_zero_constant(emu):
    class Two(torch.nn.Module):
        def forward(self, q, k):
            s = (q * 0.5) @ k.transpose(-2, -1)
            return s @ (k * 2.0) + 1

    program, ran, _ = compiled(Two(), torch.randn(SHAPE), torch.randn(SHAPE))
    assert gemms_run(ran) == 2 and scales_run(ran) == 0
    equal_to_eager(program, Two(), SHAPE, SHAPE)
    gm = torch.export.export(Two(), (torch.randn(SHAPE), torch.randn(SHAPE))).graph_module
    assert len(gemm_scales.scales_as_alpha(gm)) == 2
    zeros = [n for n in gm.graph.nodes if n.op == "get_attr" and "gemm_alpha_zero" in str(n.target)]
    assert len(zeros) == 1 and all(n.op != "placeholder" for n in gm.graph.nodes if n.prev.op == "get_attr")


class ScaledBy(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.register_buffer("s", torch.full((1,), 0.5))

    def forward(self, q, k):
        if self.kind == "tensor scale":
            return (q * self.s) @ k.transpose(-2, -1)
        if self.kind == "scaled value read twice":
            q = q * 0.5
            return q @ k.transpose(-2, -1), q
        if self.kind == "broadcast batch":
            return (q * 0.5) @ k[0].transpose(-2, -1)
        if self.kind == "product returned":
            return torch.matmul(q * 0.5, k.transpose(-2, -1))
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["tensor scale", "scaled value read twice", "broadcast batch", "product returned"])
def test_what_the_gemm_cannot_take_stays_as_traced(kind, emu):
    model = ScaledBy(kind)
    program, ran, _ = compiled(model, torch.randn(SHAPE), torch.randn(SHAPE))
    assert gemms_run(ran) == 0 and scales_run(ran) >= 1
    module = ferry.Module(ferry.load_program(program.to_bytes()))
    q, k = torch.randn(SHAPE), torch.randn(SHAPE)
    with torch.no_grad():
        torch.testing.assert_close(module(q, k), model(q, k), rtol=0, atol=0)


def test_a_scaled_operand_whose_layout_needs_a_copy_keeps_its_scale(emu):
    """Taking the scale would only trade it for the copy matmul makes of a layout it cannot view:
    the kernels stay as traced."""

    class Strided(torch.nn.Module):
        def forward(self, x, k):
            q = x.permute(2, 1, 0, 3) * 0.5  # (4, 3, 49, 32) with tokens outermost: not one batch stride
            return q @ k.transpose(-2, -1) + 0

    x, k = torch.randn(49, 3, 4, 32), torch.randn(SHAPE)
    program, ran, _ = compiled(Strided(), x, k)
    assert gemms_run(ran) == 0 and scales_run(ran) == 1


def test_dynamic_sizes_keep_their_scale(emu):
    dims = {0: torch.export.Dim("batch", max=8)}
    model = PreScaled(32)
    args = tuple(torch.randn(SHAPE) for _ in range(3))
    program, ran, _ = compiled(model, *args, dynamic_shapes=(dims, dims, dims))
    assert gemms_run(ran) == 0
    module = ferry.Module(ferry.load_program(program.to_bytes()))
    q = torch.randn(2, *SHAPE[1:])
    with torch.no_grad():
        torch.testing.assert_close(module(q, q, q), model(q, q, q))


def test_the_program_is_as_close_to_fp64_as_eager(emu):
    """The rewritten program's error against fp64 is of eager's own size: rounding moved, not lost."""
    model = PreScaled(32)
    program, ran, _ = compiled(model, *(torch.randn(SHAPE) for _ in range(3)))
    assert gemms_run(ran) == 1
    module = ferry.Module(ferry.load_program(program.to_bytes()))
    for seed in range(3):
        torch.manual_seed(seed)
        q, k, v = (torch.randn(SHAPE, dtype=torch.float64) * 3 for _ in range(3))
        with torch.no_grad():
            reference = model(q, k, v)
            eager = (model(q.float(), k.float(), v.float()).double() - reference).abs().max().item()
            ours = (module(q.float(), k.float(), v.float()).double() - reference).abs().max().item()
        assert ours <= 2 * eager + 1e-7, (ours, eager)


class Unusual(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, q, k):
        if self.kind == "alpha beyond float32":
            return (q @ k.transpose(-2, -1)) / 1e-39 + 1
        if self.kind == "a strided slice":  # every other element of the last dim: cuBLAS would copy it
            return (q[..., ::2] * 0.3) @ k[..., ::2].transpose(-2, -1) + 1
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["alpha beyond float32", "a strided slice"])
def test_what_cublas_would_refuse_or_copy_keeps_its_scale(kind, emu):
    model = Unusual(kind)
    q, k = torch.randn(SHAPE) * (1e-20 if kind.startswith("alpha") else 1), torch.randn(SHAPE)
    program, ran, _ = compiled(model, q, k)
    assert gemms_run(ran) == 0 and scales_run(ran) >= 1
    module = ferry.Module(ferry.load_program(program.to_bytes()))
    with torch.no_grad():
        torch.testing.assert_close(module(q, k), model(q, k), rtol=0, atol=0)


def test_fp16_keeps_its_scale_where_eager_overflows(emu):
    """In fp16 eager's scaled scores overflow to inf (NaN after a softmax) where one scaled GEMM's
    would not: fp16 products keep their scale, and eager's infinities."""

    class Scores(torch.nn.Module):
        def forward(self, q, k):
            return (q @ k.transpose(-2, -1)) * 0.001 + 1

    q, k = (torch.randn(SHAPE, dtype=torch.float16) * 200 for _ in range(2))
    program, ran, _ = compiled(Scores(), q, k)
    assert gemms_run(ran) == 0
    module = ferry.Module(ferry.load_program(program.to_bytes()))
    with torch.no_grad():
        want = Scores()(q, k)
        assert want.isinf().any()
        torch.testing.assert_close(module(q, k), want, rtol=0, atol=0)


@pytest.mark.cuda
def test_on_cuda_with_graphs_the_scale_is_the_gemms_and_results_equal_eager(full_fp32):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = PreScaled(32)
    args = tuple(torch.randn(SHAPE) for _ in range(3))
    program, ran, _ = compiled(model, *args, device="cuda:0")
    assert scales_run(ran) == 0 and gemms_run(ran) == 1
    module = ferry.Module(ferry.load_program(program.to_bytes()), cuda_graphs=True)
    for _ in range(3):
        q, k, v = (torch.randn(SHAPE) for _ in range(3))
        with torch.no_grad():
            torch.testing.assert_close(module(q, k, v), model(q, k, v), rtol=1e-5, atol=1e-6)


class OneTokenAttention(torch.nn.Module):
    """MobileViT's last attentions: q, k and v, three linears of one input (merged into one
    product, each a slice of its columns), one token a sequence: q viewed as the GEMM's operand
    meets the slice's strides, not the trace's."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, c // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * (c // self.heads) ** -0.5
        return torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2).reshape(b, t, c) + 1


def test_a_scaled_slice_of_merged_projections_is_read_by_its_own_strides(emu, monkeypatch):
    """merge_projections makes q a slice of one product's columns; the views after it are valued
    again (their strides the slice's), so the GEMM's operand is not a view the slice cannot give."""
    model, x = OneTokenAttention().eval(), torch.randn(8, 1, 32)
    program, ran, notes = compiled(model, x)
    assert "linears reading one input" in notes, notes
    equal_to_eager(program, model, tuple(x.shape), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------
# a layer scale, into the weight

MULS = ("aten::mul.out", "aten::mul.Tensor")


class LayerScaled(torch.nn.Module):
    """A block's last linear, its result scaled per channel and added to the input, as the
    families that do it write it: torchvision's ConvNeXt (NHWC linear, permuted back to NCHW, then
    `layer_scale (C, 1, 1) * y`), transformers' ConvNeXt (`gamma (C,) * y` before the permute),
    DINOv2 (`y * gamma`) and CaiT (tokens, no permute)."""

    def __init__(self, style: str, width=24, hidden=48, scale=None, bias=True):
        super().__init__()
        torch.manual_seed(0)
        self.style = style
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width, bias=bias)
        shape = (width, 1, 1) if style == "torchvision" else (width,)
        self.gamma = torch.nn.Parameter(scale if scale is not None else torch.rand(shape) + 0.1)

    def forward(self, x):
        if self.style == "torchvision":  # x: NCHW
            y = self.down(torch.relu(self.up(x.permute(0, 2, 3, 1)))).permute(0, 3, 1, 2)
            return x + self.gamma * y
        if self.style == "transformers":
            y = self.gamma * self.down(torch.relu(self.up(x.permute(0, 2, 3, 1))))
            return x + y.permute(0, 3, 1, 2)
        return x + self.down(torch.relu(self.up(x))) * self.gamma  # tokens: (batch, tokens, width)


def _input(style, dtype=torch.float32):
    return torch.randn((2, 24, 5, 7) if style != "tokens" else (2, 11, 24), dtype=dtype)


@pytest.mark.parametrize("style", ["torchvision", "transformers", "tokens"])
def test_a_layer_scale_is_taken_into_the_weight(style, emu):
    model = LayerScaled(style).eval()
    x = _input(style)
    program, ran, notes = compiled(model, x)
    assert sum(ran[k] for k in MULS) == 0
    assert "a constant scales per column" in notes
    equal_to_eager(program, model, tuple(x.shape))


def test_a_bf16_layer_scale_is_taken_and_equals_eager_within_bf16_rounding(emu):
    model = LayerScaled("torchvision").eval().to(torch.bfloat16)
    x = _input("torchvision", torch.bfloat16)
    program, ran, _ = compiled(model, x)
    assert sum(ran[k] for k in MULS) == 0
    equal_to_eager(program, model, tuple(x.shape), dtype=torch.bfloat16, rtol=2e-2, atol=2e-2)


def test_the_models_own_weights_are_left_as_they_were(emu):
    model = LayerScaled("tokens").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compiled(model, _input("tokens"))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class KeptScale(torch.nn.Module):
    """A scale after a product that stays a kernel of its own, and why."""

    GAMMA = {"a weight two products read": (24,), "a scale per token": (11, 1), "the product read twice": (24,),
             "the columns merged by a view": (11 * 24,), "the scaled product returned": (24,)}

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.lin = torch.nn.Linear(24, 24)
        self.gamma = torch.nn.Parameter(torch.rand(self.GAMMA[kind]) + 1.5)

    def forward(self, x):
        y = self.lin(x)
        if self.kind == "a weight two products read":  # scaling it would need a copy
            return y * self.gamma + self.lin(x.flip(0))
        if self.kind == "the product read twice":  # both readers need the unscaled product
            return y * self.gamma + y.sum()
        if self.kind == "the columns merged by a view":
            return y.reshape(2, 11 * 24) * self.gamma
        return y * self.gamma  # per token; or the delegate's result


@pytest.mark.parametrize("case", ["a zero in the scale", "a non-finite scale", *KeptScale.GAMMA])
def test_what_keeps_the_scale_a_kernel(case, emu):
    if case in KeptScale.GAMMA:
        model = KeptScale(case).eval()
    else:
        bad = float("inf") if case == "a non-finite scale" else 0.0
        model = LayerScaled("tokens", scale=torch.tensor([bad] + [0.5] * 23)).eval()
    program, ran, notes = compiled(model, torch.randn(2, 11, 24))
    assert sum(ran[k] for k in MULS) == 1 and "a constant scales per column" not in notes
    equal_to_eager(program, model, (2, 11, 24))


def test_a_scale_computed_per_call_keeps_its_kernel(emu):
    class Given(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(24, 24)

        def forward(self, x, gamma):
            return self.lin(x) * gamma

    model = Given().eval()
    program, ran, notes = compiled(model, torch.randn(2, 11, 24), torch.rand(24) + 0.1)
    assert sum(ran[k] for k in MULS) == 1 and "a constant scales per column" not in notes
    equal_to_eager(program, model, (2, 11, 24), (24,))


def test_the_switch_turns_it_off(emu, monkeypatch):
    monkeypatch.setattr(gemm_scales, "ON", False)
    program, ran, _ = compiled(LayerScaled("torchvision").eval(), _input("torchvision"))
    assert sum(ran[k] for k in MULS) == 1

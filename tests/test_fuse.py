"""Delegates get eager's inference shortcuts (aot/fuse.py runs the op families' patterns, ferry/choices/):
nn.MultiheadAttention as one fused op, batch norms folded into convolutions; each checked against
eager with fresh inputs."""

import collections
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import ferry
from ferry.aot import fuse
from ferry.aot.fuse import fuse_for_inference

MHA = "aten::_native_multi_head_attention.default"
SDPA = "aten::scaled_dot_product_attention.default"
BN = "aten::_native_batch_norm_legit_no_training.default"


def delegate_kernels(program) -> list[str]:
    return [i.kernel for d in program.delegates
            for i in ferry.load_program(program.segments[d.payload], segments=program.segments).method("forward").instructions
            if hasattr(i, "kernel")]


def compile_on(model, inputs, fuse=True, device="emu:0"):
    ep = torch.export.export(model.eval(), inputs)
    return ferry.compile(ep, ferry.OpSupportPartitioner(device), ferry.CompileConfig(fuse_for_inference=fuse))


def assert_matches_eager(program, model, make_inputs, calls=3):
    module = ferry.Module(program)
    for _ in range(calls):
        inputs = make_inputs()
        got = module(*inputs)
        with torch.no_grad():
            want = model(*inputs)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


class SelfAttention(torch.nn.Module):
    def __init__(self, batch_first=True, mask=False):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(32, 4, batch_first=batch_first)
        self.norm = torch.nn.LayerNorm(32)
        self.mask = mask

    def forward(self, x):
        y = self.norm(x)
        n = x.shape[1] if self.mha.batch_first else x.shape[0]
        mask = torch.triu(torch.full((n, n), float("-inf")), 1) if self.mask else None
        return x + self.mha(y, y, y, need_weights=False, attn_mask=mask)[0]


def test_self_attention_becomes_one_fused_op_and_equals_eager(emu):
    model = SelfAttention().eval()
    program = compile_on(model, (torch.randn(2, 7, 32),))
    kernels = delegate_kernels(program)
    assert kernels.count(MHA) == 1 and SDPA not in kernels, kernels
    assert len(kernels) <= 4  # layer norm, attention, add (the traced attention alone is ~25 ops)
    assert_matches_eager(program, model, lambda: (torch.randn(2, 7, 32),))
    notes = ferry.load_program(program.segments[program.delegates[0].payload], segments=program.segments).method("forward").kernel_choices
    assert "nn.MultiheadAttention" in notes[MHA]


def test_without_fusion_the_traced_ops_stay(emu):
    model = SelfAttention().eval()
    kernels = delegate_kernels(compile_on(model, (torch.randn(2, 7, 32),), fuse=False))
    assert MHA not in kernels and kernels.count(SDPA) == 1


@pytest.mark.parametrize("kind", ["sequence_first", "masked"])
def test_attention_the_fused_kernel_does_not_compute_alike_stays_traced(kind, emu):
    """Sequence-first attention and a masked one are not what the fused op computes: the
    numerical check (or the mask) keeps the traced ops, and results still equal eager."""
    model = SelfAttention(batch_first=kind != "sequence_first", mask=kind == "masked").eval()
    shape = (7, 2, 32) if kind == "sequence_first" else (2, 7, 32)
    program = compile_on(model, (torch.randn(*shape),))
    assert MHA not in delegate_kernels(program)
    assert_matches_eager(program, model, lambda: (torch.randn(*shape),))


def _bn(channels, dims=2):
    bn = {1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d}[dims](channels)
    with torch.no_grad():  # statistics and affine parameters far from the identity
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.2, 3.0)
        bn.weight.normal_()
        bn.bias.normal_()
    return bn


@pytest.mark.parametrize("bias", [True, False])
def test_batch_norm_after_a_convolution_is_folded_and_equals_eager(bias, emu):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, bias=bias), _bn(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, groups=2), _bn(8)).eval()
    program = compile_on(model, (torch.randn(2, 3, 12, 12),))
    kernels = delegate_kernels(program)
    assert BN not in kernels and kernels.count("aten::conv2d.default") == 1, kernels
    assert kernels.count("ferry::conv_relu.default") == 1, kernels  # the first convolution with its ReLU
    assert_matches_eager(program, model, lambda: (torch.randn(2, 3, 12, 12),))
    notes = ferry.load_program(program.segments[program.delegates[0].payload], segments=program.segments).method("forward").kernel_choices
    assert notes[BN].startswith("2 folded")


def test_conv1d_batch_norm_is_folded(emu):
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 6, 3), _bn(6, dims=1)).eval()
    program = compile_on(model, (torch.randn(2, 4, 10),))
    assert BN not in delegate_kernels(program)
    assert_matches_eager(program, model, lambda: (torch.randn(2, 4, 10),))


class ConvReadTwice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 4, 3), _bn(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y  # the convolution's own result is needed too: nothing to fold into


def test_a_convolution_read_elsewhere_keeps_its_batch_norm(emu):
    model = ConvReadTwice().eval()
    program = compile_on(model, (torch.randn(1, 3, 8, 8),))
    assert BN in delegate_kernels(program)
    assert_matches_eager(program, model, lambda: (torch.randn(1, 3, 8, 8),))


def test_folding_leaves_no_unused_constants():
    """The folded weights replace the originals: the delegate carries one weight and one bias
    per convolution, not the batch norm's four tensors as well."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), _bn(8)).eval()
    ep = torch.export.export(model, (torch.randn(1, 3, 8, 8),))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cpu"))
    sub = ferry.load_program(program.segments[program.delegates[0].payload], segments=program.segments).method("forward")
    constants = [v for v in sub.values if getattr(v, "storage", None) == "constant"]
    assert sorted(v.shape for v in constants) == [(8,), (8, 3, 3, 3)]


def test_fusing_twice_changes_nothing_more():
    model = SelfAttention().eval()
    gm = torch.export.export(model, (torch.randn(2, 5, 32),)).run_decompositions({}).module()
    # get_attr constants, as in a delegate's subgraph
    first = fuse_for_inference(gm)
    assert fuse_for_inference(gm) == [] and len(first) == 1
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_attention_and_folded_batch_norm_on_cuda_equal_eager(full_fp32):
    convs = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), _bn(8), torch.nn.ReLU()).eval()
    for model, shape in ((SelfAttention().eval(), (2, 7, 32)), (convs, (2, 3, 12, 12))):
        program = compile_on(model, (torch.randn(*shape),), device="cuda:0")
        kernels = delegate_kernels(program)
        assert BN not in kernels and SDPA not in kernels, kernels
        module = ferry.Module(program)
        cuda_model = model.cuda()
        for _ in range(3):
            x = torch.randn(*shape)
            with torch.no_grad():
                want = cuda_model(x.cuda()).cpu()
            torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-5)
        model.cpu()


class MaskedAttention(torch.nn.Module):
    """Attention whose mask is built from arange, as transformers builds one when a model is
    exported without an attention mask."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, q):
        i = torch.arange(q.shape[2])
        mask = {"all": (i[None, :] >= 0).expand(q.shape[2], q.shape[2]),
                "causal": i[:, None] >= i[None, :],
                "band": (i[:, None] - i[None, :]).abs() <= 1,
                "input": q[..., :1] > 0}[self.kind]
        return torch.nn.functional.scaled_dot_product_attention(q, q * 2, q, attn_mask=mask)


@pytest.mark.parametrize("kind,note", [("all", "1 all true"), ("causal", "1 lower-triangular"),
                                       ("band", None), ("input", None)])
def test_attention_masks_known_at_compile_time_are_dropped_or_made_causal(kind, note, emu):
    model = MaskedAttention(kind)
    program = compile_on(model, (torch.randn(2, 3, 6, 8),))
    notes = ferry.load_program(program.segments[program.delegates[0].payload], segments=program.segments).method("forward").kernel_choices
    if note is None:  # a mask that is neither, or one that depends on the input, stays
        assert "compile time" not in notes.get(SDPA, "")
    else:
        assert note in notes[SDPA]
        assert not any(k.startswith(("aten::arange", "aten::ge")) for k in delegate_kernels(program))  # mask ops gone
    assert_matches_eager(program, model, lambda: (torch.randn(2, 3, 6, 8),))


def test_half_precision_attention_is_fused_too(emu):
    model = SelfAttention().eval().to(torch.bfloat16)
    program = compile_on(model, (torch.randn(2, 7, 32, dtype=torch.bfloat16),))
    assert delegate_kernels(program).count(MHA) == 1
    module = ferry.Module(program)
    x = torch.randn(2, 7, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(module(x), model(x), rtol=2e-2, atol=2e-2)


def test_inspect_shows_what_each_delegate_runs_and_why():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), _bn(8)).eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(1, 3, 8, 8),)), ferry.OpSupportPartitioner("cpu"))
    from ferry.inspect import program_json, program_summary

    text = program_summary(program)
    assert "delegate 0 (torch): 1 instructions" in text and "1 folded into the convolution" in text
    assert BN in program_json(program)["delegates"][0]["kernel_choices"]


# ---- regressions a review found: each was a wrong answer


def test_a_mask_over_a_dynamic_length_keeps_the_length_dynamic(emu):
    """Evaluating a mask must not call int() on an export size: that returns the example size
    and fixes it, so longer calls ran in memory planned for the example (wrong values)."""
    class ArangeCausal(torch.nn.Module):
        def forward(self, q):
            i = torch.arange(q.shape[-2])
            return torch.nn.functional.scaled_dot_product_attention(q, q * 2, q, attn_mask=i[:, None] >= i[None, :])

    model = ArangeCausal()
    ep = torch.export.export(model, (torch.randn(1, 3, 6, 8),),
                             dynamic_shapes=({2: torch.export.Dim("L", min=2, max=60)},))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0")))
    for length in (6, 9, 20, 3):
        q = torch.randn(1, 3, length, 8)
        torch.testing.assert_close(module(q), model(q), rtol=1e-4, atol=1e-5)


def test_a_batch_norm_scale_computed_in_the_graph_is_not_folded_away(emu):
    class Softplus(torch.nn.Module):
        def forward(self, w):
            return torch.nn.functional.softplus(w)

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), _bn(8)).eval()
    torch.nn.utils.parametrize.register_parametrization(model[1], "weight", Softplus())
    program = compile_on(model, (torch.randn(2, 3, 8, 8),))
    assert_matches_eager(program, model, lambda: (torch.randn(2, 3, 8, 8),))


class PaddedMultiheadAttention(torch.nn.MultiheadAttention):
    """A subclass that does more than nn.MultiheadAttention: not the fused kernel's job."""

    def forward(self, x):
        out = super().forward(x, x, x, need_weights=False)[0]
        return out * (x.abs().sum(-1, keepdim=True) != 0)


def test_a_multihead_attention_subclass_is_not_fused(emu):
    model = PaddedMultiheadAttention(32, 4, batch_first=True).eval()

    def padded():
        x = torch.randn(2, 7, 32)
        x[0, 5:] = 0  # rows a random input never zeroes
        return (x,)

    program = compile_on(model, padded())
    assert MHA not in delegate_kernels(program)
    assert_matches_eager(program, model, padded)


class TwiceAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        y = self.mha(x, x, x, need_weights=False)[0]
        return self.mha(y, y, y, need_weights=False)[0]


def test_one_attention_module_called_twice_is_fused_per_call(emu):
    model = TwiceAttention().eval()
    program = compile_on(model, (torch.randn(2, 5, 32),))
    assert delegate_kernels(program).count(MHA) == 2 and SDPA not in delegate_kernels(program)
    assert_matches_eager(program, model, lambda: (torch.randn(2, 5, 32),))


def test_a_constant_mask_that_would_grow_the_result_is_left_to_fail_as_in_eager():
    """Eager raises when a mask has more leading dimensions than the attention weights; dropping
    an all-true one would have returned a result instead."""
    from ferry.choices.attention import _mask_fits  # internal: the rule for dropping a mask, checked on its own

    q = (3, 6, 8)
    assert not _mask_fits(torch.ones(2, 3, 6, 6, dtype=torch.bool), q, q)
    assert _mask_fits(torch.ones(6, 6, dtype=torch.bool), q, q)
    assert not _mask_fits(torch.ones(6, 5, dtype=torch.bool), q, q)  # does not broadcast at all


# ---- linear as eager's one GEMM over rows, into planned memory


class Mlp(torch.nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 48, bias=bias), torch.nn.Linear(48, 16, bias=bias)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def delegate_method(program):
    return ferry.load_program(program.segments[program.delegates[0].payload], segments=program.segments).method("forward")


@pytest.mark.parametrize("bias,shape", [(True, (2, 5, 16)), (False, (2, 5, 16)), (True, (2, 3, 4, 16)), (True, (6, 16))])
def test_linear_runs_as_one_gemm_into_planned_memory_and_equals_eager(bias, shape, emu):
    model = Mlp(bias).eval()
    program = compile_on(model, (torch.randn(shape),))
    kernels = delegate_kernels(program)
    gemm = "aten::addmm.out" if bias else "aten::mm.out"
    assert kernels.count(gemm) == 2 and "aten::linear.default" not in kernels, kernels
    method = delegate_method(program)
    results = [method.values[i.outputs[0]] for i in method.instructions if getattr(i, "kernel", None) == gemm]
    assert [v.storage for v in results] == ["planned", "planned"]  # inside the plan, not allocated per call
    assert "2 run as eager's one GEMM" in method.kernel_choices["aten::linear.default"]
    assert_matches_eager(program, model, lambda: (torch.randn(shape),))


def test_without_fusion_linear_stays_linear(emu):
    kernels = delegate_kernels(compile_on(Mlp().eval(), (torch.randn(2, 5, 16),), fuse=False))
    assert "aten::addmm.out" not in kernels and any(k.startswith("aten::linear") for k in kernels)


def test_linear_over_a_transposed_input_or_a_dynamic_batch_equals_eager(emu):
    class Transposed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(5, 8)

        def forward(self, x):
            return self.fc(x.transpose(1, 2))

    model = Transposed().eval()
    program = compile_on(model, (torch.randn(2, 5, 7),))
    assert_matches_eager(program, model, lambda: (torch.randn(2, 5, 7),))

    model = Mlp().eval()
    ep = torch.export.export(model, (torch.randn(2, 5, 16),), dynamic_shapes=({0: torch.export.Dim("b", max=9)},))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"))
    assert "aten::addmm.out" in delegate_kernels(program)  # the rows are the batch's: a view of any
    module = ferry.Module(program)
    for batch in (2, 7, 1, 9, 3):
        x = torch.randn(batch, 5, 16)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_linear_as_one_gemm_on_cuda_equals_eager(full_fp32):
    for bias in (True, False):
        model = Mlp(bias).eval()
        program = compile_on(model, (torch.randn(4, 9, 16),), device="cuda:0")
        assert ("aten::addmm.out" if bias else "aten::mm.out") in delegate_kernels(program)
        module = ferry.Module(program)
        cuda_model = model.cuda()
        for _ in range(3):
            x = torch.randn(4, 9, 16)
            with torch.no_grad():
                want = cuda_model(x.cuda()).cpu()
            torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-5)


def test_a_linear_whose_bias_is_not_one_row_stays_linear_and_equals_eager(emu):
    """addmm broadcasts a bias over rows only: F.linear with a (4, 8) bias over (3, 4, 16) inputs
    must not become addmm over 12 rows (a review found it failed to run)."""
    class RowBias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(4, 8))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.w, self.b) * 2

    model = RowBias().eval()
    program = compile_on(model, (torch.randn(3, 4, 16),))
    assert "aten::addmm.out" not in delegate_kernels(program)
    assert_matches_eager(program, model, lambda: (torch.randn(3, 4, 16),))


# ---- a convolution with its bias, residual add and ReLU as one kernel

CONV_RELU, CONV_ADD_RELU = "ferry::conv_relu.default", "ferry::conv_add_relu.default"


class Residual(torch.nn.Module):
    """ResNet's basic block: conv-bn-relu, conv-bn, add the input, relu."""

    def __init__(self, channels=8, inplace=True):
        super().__init__()
        self.c1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.c2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.b1, self.b2, self.relu = _bn(channels), _bn(channels), torch.nn.ReLU(inplace=inplace)

    def forward(self, x):
        out = self.relu(self.b1(self.c1(x)))
        out = self.b2(self.c2(out))
        out += x
        return self.relu(out)


@pytest.mark.parametrize("inplace", [True, False])
def test_a_residual_block_runs_as_two_fused_convolutions_and_equals_eager(inplace, emu):
    torch.manual_seed(0)
    model = Residual(inplace=inplace).eval()
    program = compile_on(model, (torch.randn(2, 8, 10, 10),))
    assert delegate_kernels(program) == [CONV_RELU, CONV_ADD_RELU]
    assert_matches_eager(program, model, lambda: (torch.randn(2, 8, 10, 10),))
    notes = ferry.load_program(program.segments[program.delegates[0].payload], segments=program.segments).method("forward").kernel_choices
    assert notes["aten::relu.default"].startswith("2 fused")
    unfused = delegate_kernels(compile_on(model, (torch.randn(2, 8, 10, 10),), fuse=False))
    assert CONV_RELU not in unfused and CONV_ADD_RELU not in unfused


class NotFusable(torch.nn.Module):
    """Convolutions whose ReLU may not be fused: one read again, a 1-D one, a transposed one, and
    an add that broadcasts."""

    def __init__(self):
        super().__init__()
        self.c, self.c1d = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.Conv1d(4, 4, 3, padding=1)
        self.ct = torch.nn.ConvTranspose2d(4, 4, 3, padding=1)
        self.shift = torch.nn.Parameter(torch.randn(4, 1, 1))

    def forward(self, x):
        y = self.c(x)
        a = torch.relu(y) + y  # the convolution's result is read twice
        b = torch.relu(self.c(x) + self.shift)  # broadcast over the result: not the fused add
        c = torch.relu(self.c1d(x.flatten(2)[..., :10]))
        d = torch.relu(self.ct(x))
        return a, b, c, d


def test_a_convolution_read_twice_1d_transposed_or_broadcast_is_not_fused(emu):
    torch.manual_seed(0)
    model = NotFusable().eval()
    program = compile_on(model, (torch.randn(2, 4, 6, 6),))
    kernels = delegate_kernels(program)
    assert CONV_RELU not in kernels and CONV_ADD_RELU not in kernels, kernels
    assert_matches_eager(program, model, lambda: (torch.randn(2, 4, 6, 6),))


@pytest.mark.parametrize("groups, stride, dilation", [(1, 1, 1), (2, 2, 1), (4, 1, 2)])
def test_the_fused_kernels_equal_convolution_add_and_relu(groups, stride, dilation):
    torch.manual_seed(groups)
    x, w, b = torch.randn(2, 4, 9, 9), torch.randn(8, 4 // groups, 3, 3), torch.randn(8)
    conv = torch.nn.functional.conv2d(x, w, b, stride, 1, dilation, groups)
    z = torch.randn_like(conv)
    args = ([stride] * 2, [1, 1], [dilation] * 2, groups)
    torch.testing.assert_close(torch.ops.ferry.conv_relu(x, w, b, *args), torch.relu(conv))
    torch.testing.assert_close(torch.ops.ferry.conv_add_relu(x, w, z, b, *args), torch.relu(conv + z))
    torch.testing.assert_close(torch.ops.ferry.conv_relu(x, w, None, *args),
                               torch.relu(torch.nn.functional.conv2d(x, w, None, stride, 1, dilation, groups)))
    with torch._subclasses.FakeTensorMode():  # shapes for planning, without running anything
        fake = torch.ops.ferry.conv_add_relu(torch.empty(2, 4, 9, 9), torch.empty(w.shape), torch.empty(conv.shape),
                                             torch.empty(8), *args)
    assert tuple(fake.shape) == tuple(conv.shape)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_convolutions_on_cuda_run_cudnn_and_equal_eager(full_fp32):
    """One cuDNN call per fused convolution (seen by the profiler), results equal to eager's."""
    torch.manual_seed(0)
    model = Residual(16).eval()
    program = compile_on(model, (torch.randn(2, 16, 14, 14),), device="cuda:0")
    assert delegate_kernels(program) == [CONV_RELU, CONV_ADD_RELU]
    module = ferry.Module(program)
    cuda_model = Residual(16).eval()
    cuda_model.load_state_dict(model.state_dict())
    cuda_model.cuda()
    for _ in range(3):
        x = torch.randn(2, 16, 14, 14)
        with torch.no_grad():
            want = cuda_model(x.cuda()).cpu()
        torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        module(torch.randn(2, 16, 14, 14))
    names = {e.name for e in prof.events()}
    assert "aten::cudnn_convolution_relu" in names and "aten::cudnn_convolution_add_relu" in names, sorted(names)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_depthwise_convolution_on_cuda_fuses_only_where_eager_runs_cudnn(full_fp32):
    """A depthwise convolution, which eager may run with its own kernel rather than cuDNN: the
    fused op runs cuDNN's fused call exactly when eager would run cuDNN, and equals eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, padding=1, groups=16), _bn(16), torch.nn.ReLU()).eval()
    program = compile_on(model, (torch.randn(2, 16, 14, 14),), device="cuda:0")
    assert delegate_kernels(program) == [CONV_RELU]
    module = ferry.Module(program)
    cuda_model = copy.deepcopy(model).cuda()
    x = torch.randn(2, 16, 14, 14)
    with torch.no_grad():
        torch.testing.assert_close(module(x), cuda_model(x.cuda()).cpu(), rtol=1e-4, atol=1e-5)
    conv = cuda_model[0]
    backend = torch._C._select_conv_backend(x.cuda(), conv.weight, conv.bias, [1, 1], [1, 1], [1, 1], False, [0, 0], 16,
                                            None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        module(x)
    fused = "aten::cudnn_convolution_relu" in {e.name for e in prof.events()}
    assert fused == (backend == torch._C._ConvBackend.Cudnn), backend


# ---- a convolution whose kernel tiles its input as one GEMM over the patches

PATCH_NOTE = "convolutions as patch GEMMs"


class LayerNorm2d(torch.nn.LayerNorm):
    """ConvNeXt's: normalises channels through a permute, so its result is channels-last."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Patchify(torch.nn.Module):
    """ConvNeXt's stem and downsampling, then ViT's patch embedding (no bias) and its tokens."""

    def __init__(self):
        super().__init__()
        self.stem, self.norm = torch.nn.Conv2d(3, 8, 4, 4), LayerNorm2d(8)
        self.down = torch.nn.Conv2d(8, 16, 2, 2)
        self.embed = torch.nn.Conv2d(16, 32, 2, 2, bias=False)

    def forward(self, x):
        y = self.down(self.norm(self.stem(x)))
        z = self.embed(y)
        return z.reshape(z.shape[0], 32, -1).permute(0, 2, 1), y


def test_convolutions_whose_kernel_tiles_the_input_run_as_gemms_and_equal_eager(emu):
    torch.manual_seed(0)
    model = Patchify().eval()
    program = compile_on(model, (torch.randn(2, 3, 32, 32),))
    kernels = delegate_kernels(program)
    assert "aten::conv2d.default" not in kernels, kernels
    assert kernels.count("aten::addmm.out") + kernels.count("aten::mm.out") == 3, kernels
    # one packing copy per convolution; the stem's eager result is contiguous, but the norm reads it
    # back through a permute, so that copy is a view (aot/layout_chains.py); the downsampling's and the
    # embedding's are channels-last (the permute after the norm), a view
    assert kernels.count("aten::clone.default") == 3, kernels
    assert_matches_eager(program, model, lambda: (torch.randn(2, 3, 32, 32),))
    notes = ferry.load_program(program.segments[program.delegates[0].payload], segments=program.segments).method("forward").kernel_choices
    assert notes[PATCH_NOTE].startswith("3 convolution(s)")


class Overlapping(torch.nn.Module):
    """Convolutions that stay convolutions: kernels that do not tile the input, and a pointwise one."""

    def __init__(self):
        super().__init__()
        self.strided = torch.nn.Conv2d(4, 4, 2, 1)  # stride smaller than the kernel
        self.padded = torch.nn.Conv2d(4, 4, 2, 2, padding=1)
        self.dilated = torch.nn.Conv2d(4, 4, 2, 2, dilation=2)
        self.grouped = torch.nn.Conv2d(4, 4, 2, 2, groups=2)
        self.ragged = torch.nn.Conv2d(4, 4, 3, 3)  # 8 rows are not whole tiles of 3
        self.pointwise = torch.nn.Conv2d(4, 4, 1)  # tiles, but cuDNN runs it as a GEMM already

    def forward(self, x):
        return self.strided(x), self.padded(x), self.dilated(x), self.grouped(x), self.ragged(x), self.pointwise(x)


def test_a_convolution_that_does_not_tile_its_input_or_is_pointwise_stays_a_convolution(emu):
    torch.manual_seed(0)
    model = Overlapping().eval()
    program = compile_on(model, (torch.randn(2, 4, 8, 8),))
    kernels = delegate_kernels(program)
    assert kernels.count("aten::conv2d.default") == 6 and "aten::addmm.out" not in kernels, kernels
    assert_matches_eager(program, model, lambda: (torch.randn(2, 4, 8, 8),))
    unfused = delegate_kernels(compile_on(Patchify().eval(), (torch.randn(2, 3, 32, 32),), fuse=False))
    assert unfused.count("aten::conv2d.default") == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_patch_convolutions_as_gemms_on_cuda_equal_eager(full_fp32):
    torch.manual_seed(0)
    model = Patchify().eval()
    program = compile_on(model, (torch.randn(2, 3, 64, 64),), device="cuda:0")
    assert "aten::conv2d.default" not in delegate_kernels(program)
    module = ferry.Module(program)
    cuda_model = copy.deepcopy(model).cuda()
    for _ in range(3):
        x = torch.randn(2, 3, 64, 64)
        with torch.no_grad():
            want = cuda_model(x.cuda())
        for got, w in zip(module(x), want):
            torch.testing.assert_close(got, w.cpu(), rtol=1e-4, atol=1e-5)


def test_the_fused_kernels_refuse_a_residual_or_bias_that_does_not_fit():
    """A program file names the fused ops with arguments of its choosing: a residual of another
    shape is refused (cuDNN would read past it), as is what a convolution refuses."""
    x, w, b = torch.randn(1, 4, 6, 6), torch.randn(4, 4, 3, 3), torch.randn(4)
    args = ([1, 1], [1, 1], [1, 1], 1)
    with pytest.raises(ValueError, match="z has shape"):
        torch.ops.ferry.conv_add_relu(x, w, torch.randn(1, 4, 3, 3), b, *args)
    with pytest.raises(ValueError, match="z has shape"):
        torch.ops.ferry.conv_add_relu(x, w, torch.randn(4, 1, 1), b, *args)  # broadcasting is not the fused add
    from ferry.ops.fused import _check_args  # internal: the fit check on its own, beside the op's errors
    with pytest.raises(ValueError, match="do not fit"):
        _check_args(x, w, torch.randn(3), *args)
    with pytest.raises(ValueError, match="do not fit"):
        _check_args(x, torch.randn(4, 2, 3, 3), b, *args)
    with pytest.raises(ValueError, match="do not fit"):
        _check_args(x, w, b, [1, 1], [1, 1], [1, 1], 3)
    _check_args(x, w, b, *args)  # what fits passes


def test_a_convolution_added_to_itself_then_relu_compiles_and_equals_eager(emu):
    """relu(y + y): the add is the convolution's one reader but reads it twice, so it is no
    residual add (a review found it crashed compilation)."""

    class Doubled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = torch.nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = self.c(x)
            return torch.relu(y + y)

    torch.manual_seed(0)
    model = Doubled().eval()
    program = compile_on(model, (torch.randn(2, 4, 8, 8),))
    assert CONV_ADD_RELU not in delegate_kernels(program)
    assert_matches_eager(program, model, lambda: (torch.randn(2, 4, 8, 8),))


def test_a_weight_shared_by_two_patch_convolutions_is_laid_out_once(emu):
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = torch.nn.Conv2d(4, 4, 2, 2)

        def forward(self, x):
            return self.c(self.c(x))  # one delegate, one weight, two convolutions

    torch.manual_seed(0)
    model = Twice().eval()
    program = compile_on(model, (torch.randn(1, 4, 16, 16),))
    assert len(program.delegates) == 1 and delegate_kernels(program).count("aten::addmm.out") == 2
    assert_matches_eager(program, model, lambda: (torch.randn(1, 4, 16, 16),))
    delegate = ferry.load_program(program.segments[program.delegates[0].payload], segments=program.segments).method("forward")
    constants = [v for v in delegate.values if getattr(v, "storage", None) == "constant"]
    assert len(constants) == 2, [(v.name, v.shape) for v in constants]  # the laid-out weight and the bias


def test_programs_may_not_name_the_unchecked_cudnn_fusions():
    """aten's fused cuDNN convolutions check neither shapes nor devices (cuDNN would read past
    a small residual): a program reaches them only through ferry's checked ops."""
    from ferry.op_names import resolve_kernel

    for name in ("aten::cudnn_convolution_relu.default", "aten::cudnn_convolution_add_relu.default",
                 "aten::miopen_convolution_relu.default", "aten::miopen_convolution_add_relu.default"):
        with pytest.raises(LookupError, match="may not call"):
            resolve_kernel(name)
    assert resolve_kernel("ferry::conv_add_relu.default") is torch.ops.ferry.conv_add_relu.default


def test_the_fused_kernels_refuse_another_device_and_leave_cudnn_under_deterministic_algorithms(monkeypatch):
    # internal: the checks and the cuDNN rule on their own, with devices and settings faked
    from ferry.ops.fused import _check_args, _check_z, cudnn_takes

    x, w, b = torch.randn(1, 4, 6, 6), torch.randn(4, 4, 3, 3), torch.randn(4)
    args = ([1, 1], [1, 1], [1, 1], 1)
    with pytest.raises(ValueError, match="do not fit"):
        _check_args(x, w.to("meta"), b, *args)
    with pytest.raises(ValueError, match="on meta"):
        _check_z((1, 4, 6, 6), torch.empty(1, 4, 6, 6, device="meta"), x.device)
    # as on a GPU where eager would run cuDNN: only the determinism settings decide
    monkeypatch.setattr(torch._C, "_select_conv_backend", lambda *a: torch._C._ConvBackend.Cudnn)
    assert cudnn_takes(x, w, b, *args)
    torch.use_deterministic_algorithms(True)
    try:
        assert not cudnn_takes(x, w, b, *args)  # eager's deterministic convolution, then add and ReLU
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    assert not cudnn_takes(x, w, b, *args)


# ---- copies that change nothing

class DropoutBlock(torch.nn.Module):
    """Dropouts (clones once export makes the graph functional), a `.contiguous()` of a
    transpose (a real copy) and a returned clone (which must own its memory)."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = torch.nn.Linear(8, 8), torch.nn.Dropout(0.1)

    def forward(self, x):
        y = x + self.drop(self.fc(self.drop(x)))
        t = y.transpose(1, 2).contiguous()
        return t * 2, y.clone()


def test_copies_that_keep_the_layout_are_dropped_and_the_result_equals_eager(emu):
    torch.manual_seed(0)
    model = DropoutBlock().eval()
    program = compile_on(model, (torch.randn(2, 3, 8),))
    kernels = delegate_kernels(program)
    assert kernels.count("aten::clone.default") == 2, kernels  # the transpose's copy and the returned clone
    assert_matches_eager(program, model, lambda: (torch.randn(2, 3, 8),))
    notes = ferry.load_program(program.segments[program.delegates[0].payload], segments=program.segments).method("forward").kernel_choices
    assert notes["clones dropped"].startswith("2 copies")
    assert delegate_kernels(compile_on(model, (torch.randn(2, 3, 8),), fuse=False)).count("aten::clone.default") == 4


def test_gpt2_runs_without_its_dropout_copies_and_equals_eager(emu):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).last_hidden_state

    wrapped = Hidden().eval()
    program = compile_on(wrapped, (torch.randint(0, 100, (2, 16)),))
    assert "aten::clone.default" not in delegate_kernels(program)
    assert_matches_eager(program, wrapped, lambda: (torch.randint(0, 100, (2, 16)),))


class Projections(torch.nn.Module):
    """Attention's q/k/v (k, v narrower: grouped heads) and an MLP's gate/up off one input each; a
    linear of another input width and one whose result is returned stay apart."""

    def __init__(self, bias=False):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(32, n, bias=bias) for n in (32, 16, 16))
        self.gate, self.up = (torch.nn.Linear(32, 64, bias=bias) for _ in range(2))
        self.down = torch.nn.Linear(64, 32, bias=bias)
        self.side = torch.nn.Linear(32, 8, bias=bias)

    def forward(self, x):
        h = self.q(x) + torch.cat([self.k(x), self.v(x)], -1)
        y = x + h
        return y + self.down(torch.nn.functional.silu(self.gate(y)) * self.up(y)), self.side(y)


def _linears(program) -> list:
    m = delegate_method(program)
    return [i for i in m.instructions if hasattr(i, "kernel") and i.kernel.split(".")[0] in (
        "aten::mm", "aten::addmm", "aten::linear")]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 32), (3, 5, 32)], ids=["one-row", "batch"])
def test_linears_of_one_input_run_as_one_gemm_and_equal_eager(emu, bias, shape):
    torch.manual_seed(0)
    model = Projections(bias).eval()
    program = compile_on(model, (torch.randn(shape),))
    # q/k/v -> 1, gate/up -> 1, down, side: 4 GEMMs where the traced program had 7
    assert len(_linears(program)) == 4
    assert len(_linears(compile_on(model, (torch.randn(shape),), fuse=False))) == 7
    assert_matches_eager(program, model, lambda: (torch.randn(shape),))


class _FlatAndRows(torch.nn.Module):
    """Two projections of one input: one's rows regrouped (b*t, 24), the other's result flattened
    whole (`reshape(-1)`, which exports as a view of the contiguous result)."""

    def __init__(self, flat: bool):
        super().__init__()
        self.a, self.b, self.flat = torch.nn.Linear(16, 24), torch.nn.Linear(16, 24), flat

    def forward(self, x):
        b, t, _ = x.shape
        other = self.b(x).reshape(-1)[:5] if self.flat else self.b(x).view(b, t, 4, 6)[..., :5].flatten(1)
        return self.a(x).view(b * t, 24).sum(0) + other.sum()


@pytest.mark.parametrize("flat", [True, False], ids=["flattened whole", "rows and columns apart"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_projection_read_by_a_view_a_slice_cannot_take_is_not_merged(emu, flat, dynamic):
    """A merged projection's result is a slice of the wider product's columns: a view that merges
    its rows with its columns does not fit one (the static program failed to load, the dynamic
    one ran without per-shape plans), so those projections stay apart; views that keep rows and
    columns apart still merge."""
    torch.manual_seed(0)
    model = _FlatAndRows(flat).eval()
    dims = ({0: torch.export.Dim("b", max=4), 1: torch.export.Dim("t", max=12)},) if dynamic else None
    program = ferry.compile(torch.export.export(model, (torch.randn(2, 6, 16),), dynamic_shapes=dims),
                            ferry.OpSupportPartitioner("emu:0"))
    assert len(_linears(program)) == (2 if flat else 1)
    module = ferry.Module(program)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for shape in ([(2, 6, 16), (3, 5, 16), (1, 1, 16), (3, 5, 16)] if dynamic else [(2, 6, 16)] * 2):
            x = torch.randn(shape)
            with torch.no_grad():
                torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-4)
    assert not [w for w in caught if "without a plan of their own" in str(w.message)]


class _LatentAttentionInputs(torch.nn.Module):
    """DeepSeek's attention's first projections: the compressed KV split along its columns, one
    piece viewed with a head dim inserted; the query viewed as heads and transposed."""

    def __init__(self):
        super().__init__()
        self.q_a, self.kv_a = torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 40, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        k_pass, k_rot = torch.split(self.kv_a(x), [32, 8], dim=-1)
        q = self.q_a(x).view(b, t, 4, 8).transpose(1, 2)
        return q.sum((1, 3)) + k_pass.sum(-1) + (k_rot.view(b, 1, t, 8) * 2).sum((1, 3))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_projections_whose_column_pieces_are_viewed_apart_from_their_rows_still_merge(emu, dynamic):
    torch.manual_seed(0)
    model = _LatentAttentionInputs().eval()
    dims = ({0: torch.export.Dim("b", max=4), 1: torch.export.Dim("t", max=12)},) if dynamic else None
    program = ferry.compile(torch.export.export(model, (torch.randn(2, 6, 64),), dynamic_shapes=dims),
                            ferry.OpSupportPartitioner("emu:0"))
    assert len(_linears(program)) == 1
    module = ferry.Module(program)
    for shape in [(2, 6, 64), (3, 5, 64), (1, 1, 64)] if dynamic else [(2, 6, 64)]:
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-4)


def test_merged_weights_are_stored_once_for_every_method(emu):
    torch.manual_seed(0)
    model = Projections().eval()
    one = {"forward": torch.export.export(model, (torch.randn(1, 1, 32),))}
    two = dict(one, batch=torch.export.export(model, (torch.randn(3, 5, 32),)))

    def weight_bytes(eps):
        program = ferry.compile(eps, ferry.OpSupportPartitioner("emu:0"))
        payloads = {d.payload for d in program.delegates}
        return sum(len(s) for i, s in enumerate(program.segments) if i not in payloads)

    assert weight_bytes(one) == weight_bytes(two) == sum(p.numel() * 4 for p in model.parameters())
    program = ferry.compile(two, ferry.OpSupportPartitioner("emu:0"))
    module = ferry.Module(program)
    for name, shape in (("batch", (3, 5, 32)), ("forward", (1, 1, 32)), ("batch", (3, 5, 32))):
        x = torch.randn(shape)
        got, want = module.run_method(name, [x]), model(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_merged_projections_on_cuda_equal_eager(full_fp32):
    torch.manual_seed(0)
    model = Projections(bias=True).eval()
    program = compile_on(model, (torch.randn(1, 1, 32),), device="cuda:0")
    assert len(_linears(program)) == 4
    assert_matches_eager(program, model, lambda: (torch.randn(1, 1, 32),))


class GroupedHeads(torch.nn.Module):
    """transformers' repeat_kv before SDPA: 8 query heads over 2 KV heads, with a mask."""

    def forward(self, q, k, v, mask):
        b, h, n, d = k.shape
        k = k[:, :, None].expand(b, h, 4, n, d).reshape(b, h * 4, n, d)
        v = v[:, :, None].expand(b, h, 4, n, d).reshape(b, h * 4, n, d)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)


def _grouped_inputs(rows=1):
    mask = torch.rand(1, 1, rows, 12) > 0.3
    mask[..., 0] = True
    return (torch.randn(1, 8, rows, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16), mask)


@pytest.mark.parametrize("rows", [1, 5])
def test_attention_reads_grouped_kv_heads_without_repeating_them(emu, rows):
    model = GroupedHeads()
    program = compile_on(model, _grouped_inputs(rows))
    kernels = delegate_kernels(program)
    assert "aten::expand.default" not in kernels and "aten::clone.default" not in kernels, kernels
    (sdpa,) = [i for i in delegate_method(program).instructions if getattr(i, "kernel", "") == SDPA]
    assert sdpa and "attention over grouped KV heads" in delegate_method(program).kernel_choices
    assert "aten::expand.default" in delegate_kernels(compile_on(model, _grouped_inputs(rows), fuse=False))
    assert_matches_eager(program, model, lambda: _grouped_inputs(rows))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_grouped_kv_heads_on_cuda_equal_eager(full_fp32):
    model = GroupedHeads()
    program = compile_on(model, _grouped_inputs(), device="cuda:0")
    assert "aten::expand.default" not in delegate_kernels(program)
    assert_matches_eager(program, model, lambda: _grouped_inputs())


class SharedMask(torch.nn.Module):
    """Two attention calls (grouped heads, as a decoder's layers) reading one boolean mask made
    from the step's position, as transformers' causal mask of a static cache is."""

    def forward(self, q, k, v, pos):
        mask = (torch.arange(k.shape[-2], device=pos.device) <= pos)[None, None, None, :].expand(1, 1, q.shape[-2], -1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return torch.nn.functional.scaled_dot_product_attention(a, k, v, attn_mask=mask, enable_gqa=True)


def _wheres(kernels) -> int:
    return sum(k.startswith("aten::where.") for k in kernels)


def _shared_mask_inputs(dtype=torch.float32, device="cpu"):
    q = torch.randn(1, 8, 1, 16, dtype=dtype, device=device)
    k, v = (torch.randn(1, 2, 12, 16, dtype=dtype, device=device) for _ in range(2))
    return q, k, v, torch.randint(0, 12, (1,), device=device)


def test_a_boolean_mask_shared_by_attention_calls_is_made_additive_once(emu):
    model = SharedMask()
    program = compile_on(model, _shared_mask_inputs())
    kernels = delegate_kernels(program)
    assert _wheres(kernels) == 1 and kernels.count(SDPA) == 2, kernels
    assert "boolean attention masks made additive once" in delegate_method(program).kernel_choices
    assert _wheres(delegate_kernels(compile_on(model, _shared_mask_inputs(), fuse=False))) == 0
    module = ferry.Module(program)
    for _ in range(4):
        inputs = _shared_mask_inputs()
        assert torch.equal(module(*inputs), model(*inputs))  # ATen makes the same bias inside each call


def test_a_mask_read_by_one_attention_stays_boolean(emu):
    model = GroupedHeads()
    program = compile_on(model, _grouped_inputs())
    assert _wheres(delegate_kernels(program)) == 0


def test_a_shared_mask_through_the_inductor_backend_equals_eager():
    model = SharedMask()
    ep = torch.export.export(model.eval(), _shared_mask_inputs())
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    assert _wheres(delegate_kernels(program)) == 1
    module = ferry.Module(program)
    for _ in range(3):
        inputs = _shared_mask_inputs()
        torch.testing.assert_close(module(*inputs), model(*inputs), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["torch", "inductor"])
def test_a_shared_mask_made_additive_on_cuda_equals_eager(backend):
    model = SharedMask()
    inputs = _shared_mask_inputs(torch.bfloat16, "cuda")
    ep = torch.export.export(model.eval(), inputs)
    keep = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(
        skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True))  # inputs and result stay on the GPU
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0", backend_id=backend), keep)
    assert _wheres(delegate_kernels(program)) == 1
    module = ferry.Module(program)
    for _ in range(3):
        inputs = _shared_mask_inputs(torch.bfloat16, "cuda")
        got, want = module(*inputs), model(*inputs)
        if backend == "torch":
            assert torch.equal(got.cpu(), want.cpu())  # cuDNN's kernel given the bias ATen would make
        else:
            torch.testing.assert_close(got.cpu(), want.cpu(), rtol=2e-2, atol=2e-2)


def test_a_shared_mask_over_a_dynamic_length_equals_eager_at_sizes_large_small_large(emu):
    model = SharedMask()
    n = torch.export.Dim("n", min=2, max=12)
    ep = torch.export.export(model.eval(), _shared_mask_inputs(), dynamic_shapes=({}, {2: n}, {2: n}, {}))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"))
    assert _wheres(delegate_kernels(program)) == 1
    module = ferry.Module(program)
    for length in (12, 5, 12):
        q, k, v, _ = _shared_mask_inputs()
        k, v, pos = k[:, :, :length], v[:, :, :length], torch.randint(0, length, (1,))
        assert torch.equal(module(q, k, v, pos), model(q, k, v, pos))


def _dynamic(model, example, dims):
    """`model` exported with the dimensions `dims` ({dim: max}) of its one input dynamic, compiled for emu:0."""
    shapes = ({d: torch.export.Dim(f"d{d}", max=top) for d, top in dims.items()},)
    return ferry.compile(torch.export.export(model, (example,), dynamic_shapes=shapes), ferry.OpSupportPartitioner("emu:0"))


def _equal_at_sizes(program, model, shapes):
    """Called at each shape in turn (smaller and larger than the traced one), equal to eager."""
    module = ferry.Module(program)
    for shape in shapes:
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)


def test_linear_over_two_dynamic_sizes_is_one_gemm_and_equals_eager(emu):
    """Batch and length both dynamic: the results' views take the sizes, each read once."""
    model = Mlp().eval()
    program = _dynamic(model, torch.randn(3, 4, 16), {0: 9, 1: 12})
    kernels = delegate_kernels(program)
    assert kernels.count("aten::addmm.out") == 2, kernels
    assert kernels.count("aten::sym_size.int") == 2, kernels  # each dynamic size read once, for both linears
    _equal_at_sizes(program, model, [(3, 4, 16), (7, 2, 16), (2, 11, 16), (9, 12, 16), (3, 4, 16)])


@pytest.mark.parametrize("dims", [{0: 8}, {0: 8, 1: 16}], ids=["batch", "batch-and-length"])
def test_dynamic_self_attention_becomes_one_fused_op_and_equals_eager_at_every_size(dims, emu):
    model = SelfAttention().eval()
    program = _dynamic(model, torch.randn(2, 7, 32), dims)
    kernels = delegate_kernels(program)
    assert kernels.count(MHA) == 1 and SDPA not in kernels, kernels
    lengths = (7, 3, 16, 1, 7) if 1 in dims else (7, 7, 7, 7, 7)
    _equal_at_sizes(program, model, [(b, t, 32) for b, t in zip((5, 1, 8, 3, 2), lengths)])


def test_dynamic_sequence_first_attention_stays_traced(emu):
    """The numerical check runs at the traced sizes and one larger: what the fused op does not
    compute alike stays traced at dynamic sizes too."""
    model = SelfAttention(batch_first=False).eval()
    program = _dynamic(model, torch.randn(7, 2, 32), {1: 8})
    assert MHA not in delegate_kernels(program)
    _equal_at_sizes(program, model, [(7, 5, 32), (7, 2, 32), (7, 8, 32)])


class SizedMaskAttention(torch.nn.Module):
    """A mask built from arange and the input's dynamic sizes: `causal` is lower-triangular at
    every size; `short` is all true only while the length is at most 4 (a rule of the size
    that one traced value cannot reveal)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, q):
        n, t = q.shape[0], q.shape[2]
        i = torch.arange(t)
        mask = (i[:, None] >= i[None, :]) if self.kind == "causal" else (i[None, :] < 4).expand(t, t)
        return torch.nn.functional.scaled_dot_product_attention(q, q * 2, q, attn_mask=mask.expand(n, 1, t, t))


@pytest.mark.parametrize("kind,note", [("causal", "1 lower-triangular"), ("short", None)])
def test_masks_of_dynamic_sizes_are_simplified_only_where_they_are_so_at_every_size(kind, note, emu):
    model = SizedMaskAttention(kind)
    program = _dynamic(model, torch.randn(2, 3, 4, 8), {0: 5, 2: 9})
    notes = delegate_method(program).kernel_choices
    if note is None:
        assert "compile time" not in notes.get(SDPA, "")
    else:
        assert note in notes[SDPA]
        assert not any(k.startswith(("aten::arange", "aten::ge")) for k in delegate_kernels(program))
    _equal_at_sizes(program, model, [(2, 3, 4, 8), (5, 3, 9, 8), (1, 3, 2, 8), (3, 3, 7, 8)])


def test_a_mask_of_sizes_with_too_many_values_to_check_stays(emu):
    """A causal mask over a length of up to 100 values (more than the compile-time check
    computes) is left to run: no rewrite that was not checked at every size."""
    model = SizedMaskAttention("causal")
    program = _dynamic(model, torch.randn(2, 3, 4, 8), {0: 5, 2: 100})
    assert "compile time" not in delegate_method(program).kernel_choices.get(SDPA, "")
    _equal_at_sizes(program, model, [(2, 3, 4, 8), (5, 3, 37, 8), (1, 3, 2, 8)])


@pytest.mark.parametrize("dims", [{0: 6}, {0: 6, 2: 16, 3: 16}], ids=["batch", "batch-and-image"])
def test_a_residual_block_of_dynamic_sizes_runs_as_two_fused_convolutions(dims, emu):
    """The fused convolutions compute the same at every size: a dynamic batch or image keeps
    them, and the program stays dynamic (no size fixed by the rewrite's checks)."""
    torch.manual_seed(0)
    model = Residual().eval()
    program = _dynamic(model, torch.randn(2, 8, 10, 10), dims)
    assert delegate_kernels(program) == [CONV_RELU, CONV_ADD_RELU]
    sizes = [(5, 8, 10, 10), (1, 8, 10, 10), (6, 8, 10, 10)]
    if 2 in dims:
        sizes += [(3, 8, 16, 7), (2, 8, 4, 12)]
    _equal_at_sizes(program, model, sizes)


class MaskOfAnotherSize(torch.nn.Module):
    """A mask all true while `z` has rows, only key 0 allowed when it has none: a call may pass
    any size from 0 to the bound, so the mask must be checked at 0 too."""

    def forward(self, q, z):
        mask = (torch.arange(8)[None, :] < 8 * z.shape[0] + 1).expand(8, 8)
        return torch.nn.functional.scaled_dot_product_attention(q, q * 2, q, attn_mask=mask) + z.sum()


def test_a_mask_that_differs_at_size_zero_stays(emu):
    model, q = MaskOfAnotherSize(), torch.randn(1, 2, 8, 4)
    ep = torch.export.export(model, (q, torch.randn(3)), dynamic_shapes=(None, {0: torch.export.Dim("n", max=4)}))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"))
    module = ferry.Module(program)
    for rows in (3, 0, 1):
        z = torch.randn(rows)
        torch.testing.assert_close(module(q, z), model(q, z), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape,features", [((3, 0, 16), (16, 8)), ((3, 4, 16), (16, 0)), ((3, 4, 0), (0, 8))],
                         ids=["no-rows", "no-outputs", "no-inputs"])
def test_a_linear_with_an_empty_size_beside_a_dynamic_batch_equals_eager(shape, features, emu):
    """A view that infers a size (-1) is ambiguous over zero elements: such a linear stays."""
    model = torch.nn.Linear(*features).eval()
    program = _dynamic(model, torch.randn(*shape), {0: 8})
    _equal_at_sizes(program, model, [(b, *shape[1:]) for b in (3, 1, 0, 8)])


def test_the_fused_convolution_takes_an_empty_batch_as_eager_does():
    """A dynamic batch may be 0: eager's convolution returns an empty result, and so does the
    fused op (cuDNN's fused call is not asked; its argument check would refuse it)."""
    from ferry.ops.fused import cudnn_takes

    w, b = torch.randn(8, 4, 3, 3), torch.randn(8)
    assert cudnn_takes(torch.randn(0, 4, 6, 5), w, b, [1, 1], [0, 0], [1, 1], 1) is False
    out = torch.ops.ferry.conv_relu(torch.randn(0, 4, 6, 5), w, b, [1, 1], [0, 0], [1, 1], 1)
    assert out.shape == (0, 8, 4, 3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_dynamic_residual_block_on_cuda_equals_eager_at_every_batch_and_an_empty_one():
    torch.manual_seed(0)
    model = Residual().eval()
    ep = torch.export.export(model, (torch.randn(2, 8, 10, 10),), dynamic_shapes=({0: torch.export.Dim("b", max=6)},))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0"))
    assert delegate_kernels(program) == [CONV_RELU, CONV_ADD_RELU]
    module, cuda_model = ferry.Module(program), copy.deepcopy(model).cuda()
    for batch in (5, 0, 1, 6):
        x = torch.randn(batch, 8, 10, 10)
        with torch.no_grad():
            torch.testing.assert_close(module(x), cuda_model(x.cuda()).cpu(), rtol=1e-4, atol=1e-4)


def test_a_llama_with_a_dynamic_batch_and_length_runs_its_fixed_twins_kernels(emu, monkeypatch):
    """transformers' Llama (grouped KV heads, a causal mask built from arange and the sizes,
    linears over two dynamic sizes): the dynamic program runs the kernels the program compiled
    for one shape runs (its positions computed per call: folded into constants only at fixed
    sizes, so the twin folds none here), its views reading the delegate's size inputs (no
    instruction of their own), and equals eager at every size."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = transformers.LlamaForCausalLM(cfg).eval()

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    model, ids = Logits().eval(), torch.randint(0, 128, (2, 8))
    dims = ({0: torch.export.Dim("b", max=4), 1: torch.export.Dim("t", max=16)},)
    dynamic = ferry.compile(torch.export.export(model, (ids,), dynamic_shapes=dims), ferry.OpSupportPartitioner("emu:0"))
    monkeypatch.setattr(fuse, "fold_constants", lambda gm: [])
    fixed = ferry.compile(torch.export.export(model, (ids,)), ferry.OpSupportPartitioner("emu:0"))
    assert collections.Counter(delegate_kernels(dynamic)) == collections.Counter(delegate_kernels(fixed))
    module = ferry.Module(dynamic)
    for b, t in ((2, 8), (1, 3), (4, 16), (3, 1), (2, 8)):
        x = torch.randint(0, 128, (b, t))
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-4)


class _MaskedAttention(torch.nn.Module):
    """Self-attention of width 32 over 4 heads whose boolean mask `mask_of(t, *extra)` makes."""

    def __init__(self, mask_of):
        super().__init__()
        self.qkv, self.mask_of = torch.nn.Linear(32, 96), mask_of

    def forward(self, x, *extra):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 4, 8).transpose(1, 2) for z in self.qkv(x).split(32, -1))
        mask = self.mask_of(t, *extra)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, 32)


def _causal_unless_negative(t, n):
    ar = torch.arange(t)
    return (ar[:, None] >= ar[None, :]) | ((ar[None, :] * 0 + n) < 0)


def test_a_mask_of_an_int_input_stays_where_the_int_may_be_below_its_exported_range(emu):
    """Export records [0, 3] for an int checked to be in [-3, 3] and checks no minimum as low as
    that: causal at 0..3 says nothing of -1, where the mask attends everywhere."""
    model = _MaskedAttention(_causal_unless_negative).eval()

    def forward(x, n: int):
        torch._check(n >= -3)
        torch._check(n <= 3)
        return model(x, n)

    class Wrapped(torch.nn.Module):
        def forward(self, x, n: int):
            return forward(x, n)

    wrapped = Wrapped()
    dims = ({0: torch.export.Dim("b", max=4), 1: torch.export.Dim("t", max=8)}, torch.export.Dim.DYNAMIC)
    ep = torch.export.export(wrapped, (torch.randn(2, 6, 32), 2), dynamic_shapes=dims)
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0")))
    for n in (2, -1, 0, -3, 3):
        x = torch.randn(2, 5, 32)
        with torch.no_grad():
            torch.testing.assert_close(module(x, n), model(x, n), rtol=1e-4, atol=1e-5)


def _causal_at_even_lengths(t):
    ar = torch.arange(t)
    return (ar[:, None] >= ar[None, :]) | ((ar * 0 + t) % 2 == 1)[None, :]


def test_a_length_exported_as_twice_a_size_is_called_at_even_lengths_only(emu):
    """A length exported as 2*s: an odd one is an InputError (a mask causal at every even length
    is all true at the odd ones); the even ones equal eager, in any order."""
    model = _MaskedAttention(_causal_at_even_lengths).eval()
    s = torch.export.Dim("s", min=1, max=8)
    ep = torch.export.export(model, (torch.randn(2, 8, 32),), dynamic_shapes=({0: torch.export.Dim("b", max=4), 1: 2 * s},))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0")))
    for t in (8, 7, 4, 5, 16, 15, 2):
        x = torch.randn(2, t, 32)
        if t % 2:
            with pytest.raises(ferry.InputError, match=rf"dim 1 of 'forward' is {t}; .* 2 \* s \+ 0"):
                module(x)
            continue
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)


class _RowAttention(torch.nn.Module):
    """Causal attention along each row of a (b, t, t, 16) pair tensor: the query's batch is
    (b*t*t)//t, a size divided by a size."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, z):
        b, t = z.shape[:2]
        q, k, v = (a.permute(0, 1, 3, 2, 4).reshape(b * t, 4, t, 4) for a in self.proj(z).view(b, t, t, 3, 4, 4).unbind(3))
        ar = torch.arange(t)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=ar[:, None] >= ar[None, :])
        return y.view(b, t, 4, t, 4).permute(0, 1, 3, 2, 4).reshape(b, t, t, 16)


def test_a_mask_checked_at_a_size_that_divides_by_zero_compiles_and_equals_eager(emu):
    model = _RowAttention().eval()
    t = torch.export.Dim("t", max=10)
    ep = torch.export.export(model, (torch.randn(2, 5, 5, 16),), dynamic_shapes=({0: torch.export.Dim("b", max=3), 1: t, 2: t},))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0")))
    for b, n in ((1, 1), (3, 10), (2, 5), (1, 2)):
        z = torch.randn(b, n, n, 16)
        with torch.no_grad():
            torch.testing.assert_close(module(z), model(z), rtol=1e-4, atol=1e-5)


def test_a_program_from_torch_export_load_has_its_masks_simplified_as_the_one_exported(emu, tmp_path):
    """A loaded ExportedProgram keeps no record of where its sizes came from: what each call
    checks is read from the program's inputs, so its causal mask still becomes is_causal."""
    from ferry.views.text import program_json

    model = _MaskedAttention(lambda t: (lambda ar: ar[:, None] >= ar[None, :])(torch.arange(t))).eval()
    ep = torch.export.export(model, (torch.randn(2, 6, 32),),
                             dynamic_shapes=({0: torch.export.Dim("b", max=4), 1: torch.export.Dim("t", max=8)},))
    torch.export.save(ep, tmp_path / "model.pt2")
    for exported in (ep, torch.export.load(tmp_path / "model.pt2")):
        program = ferry.compile(exported, ferry.OpSupportPartitioner("emu:0"))
        notes = [d["kernel_choices"].get(SDPA, "") for d in program_json(program)["delegates"]]
        assert any("1 lower-triangular (is_causal=True)" in n for n in notes), notes
        module = ferry.Module(program)
        for shape in ((2, 6, 32), (1, 1, 32), (4, 8, 32)):
            x = torch.randn(shape)
            with torch.no_grad():
                torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)


class SqueezeExcite(torch.nn.Module):
    """EfficientNet's and MobileNetV3's squeeze-excitation: a pool to one value per channel."""

    def __init__(self, size=1, three_d=False):
        super().__init__()
        pool, conv = (torch.nn.AdaptiveAvgPool3d, torch.nn.Conv3d) if three_d else (torch.nn.AdaptiveAvgPool2d,
                                                                                    torch.nn.Conv2d)
        self.pool, self.fc = pool(size), conv(8, 8, 1)

    def forward(self, x):
        s = torch.sigmoid(self.fc(self.pool(x)))
        return x * s if s.shape[-1] == 1 else s


@pytest.mark.parametrize(("size", "three_d", "rewritten"), [(1, False, True), (1, True, True), (2, False, False)])
def test_a_pool_to_one_value_per_channel_runs_as_eagers_mean(emu, size, three_d, rewritten):
    torch.manual_seed(0)
    model = SqueezeExcite(size, three_d).eval()
    shape = (1, 8, 6, 12, 12) if three_d else (1, 8, 12, 12)
    program = compile_on(model, (torch.randn(shape),))
    ran = delegate_kernels(program)
    assert any("mean" in k for k in ran) == rewritten and any("adaptive_avg_pool" in k for k in ran) != rewritten
    module = ferry.Module(program)
    for _ in range(2):
        x = torch.randn(shape)
        torch.testing.assert_close(module(x), model(x), rtol=0, atol=0)  # eager runs that very mean


def test_a_pool_to_one_value_at_dynamic_sizes_equals_eager(emu):
    torch.manual_seed(0)
    model, dims = SqueezeExcite().eval(), {0: torch.export.Dim("b", max=4), 2: torch.export.Dim("h", min=2, max=32)}
    ep = torch.export.export(model, (torch.randn(2, 8, 12, 12),), dynamic_shapes=(dims,))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0")))
    for b, h in ((2, 12), (1, 5), (4, 32)):
        x = torch.randn(b, 8, h, 12)
        torch.testing.assert_close(module(x), model(x), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_pool_to_one_value_per_channel_on_cuda_equals_eager(full_fp32):
    torch.manual_seed(0)
    model, x = SqueezeExcite().eval(), torch.randn(1, 8, 112, 112)
    module = ferry.Module(compile_on(model, (x,), device="cuda:0"), cuda_graphs=True)
    model = model.cuda()
    for _ in range(3):
        x = torch.randn(1, 8, 112, 112)
        with torch.no_grad():
            want = model(x.cuda()).cpu()
        torch.testing.assert_close(module(x), want, rtol=1e-6, atol=1e-6)

"""Attention runs as GEMMs and a softmax where the GPU measures that faster than eager's fused
kernel, in plans captured as CUDA graphs only (ferry/choices/attention.py, asked through
ferry/choices/hook.py). On the CPU the timing is faked (conftest's `timed`); the composed forms,
the choice, its limits and the bound steps that use it are real, and results are checked against
eager."""

import math

import pytest
import torch

import ferry
from ferry.choices import attention as attention_choice
from ferry.choices import gemm as gemm_choice
from ferry.choices import hook
from ferry.choices import timing as kernel_timing
from ferry.choices.decisions import DECISIONS, Decisions, Site
from models import loaded_method

MHA = torch.ops.aten._native_multi_head_attention.default
SDPA = torch.ops.aten.scaled_dot_product_attention.default
CAPTURED = Site(measure=True, captured=True)  # a method loading whose plan runs as CUDA graphs


def chosen(op, args, kwargs, site=CAPTURED):
    """What the binder's hook answers for `op(*args, **kwargs)`."""
    return hook.choose(op, list(args), kwargs, site)


def attentions():
    """The attentions this process decided (each alone, and multi-head ones whole)."""
    return [d for d in DECISIONS.values() if d.family in ("attention", "multi-head attention")]


def queries(d):
    """The query length of an attention decision, from its shape ("{b}x{h}x{t}x{s}x{d} float32")."""
    return int(d.shape.split()[0].split("x")[2])


def qkv(b=2, h=3, t=5, s=None, d=4, dtype=torch.float32):
    s = t if s is None else s
    return torch.randn(b, h, t, d, dtype=dtype), torch.randn(b, h, s, d, dtype=dtype), torch.randn(b, h, s, d, dtype=dtype)


def mha_args(b=2, t=5, e=12, heads=3, dtype=torch.float32):
    x = torch.randn(b, t, e, dtype=dtype)
    weights = [torch.randn(3 * e, e, dtype=dtype) * e ** -0.5, torch.randn(3 * e, dtype=dtype),
               torch.randn(e, e, dtype=dtype) * e ** -0.5, torch.randn(e, dtype=dtype)]
    return [x, x, x, e, heads, *weights]


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [1, 2])
def test_composed_attention_equals_eager(scale, dtype, batch):
    q, k, v = qkv(b=batch, t=7, s=9, dtype=dtype)
    k = k.transpose(1, 2).contiguous().transpose(1, 2)  # strided as the heads of one projection are
    got = attention_choice.composed_attention(q, k, v, scale=scale)
    torch.testing.assert_close(got, SDPA(q, k, v, scale=scale))
    if batch == 1:  # laid out as eager's fused kernel lays it out: heads merged back by a view
        assert got.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("batch", [1, 2])
def test_composed_multi_head_attention_equals_eager(timed, batch):
    """Every part composed (the fake timing favours each): in-projection as mm + bias, attention as
    GEMMs and a softmax, out-projection as mm + bias."""
    args = mha_args(b=batch)
    fn = chosen(MHA, args, {"need_weights": False})
    assert fn is not None and fn.parts == (True, True, True)
    want = MHA(*args, need_weights=False)[0]
    got, weights = fn(*args, need_weights=False)
    torch.testing.assert_close(got, want)
    assert weights is None and got.is_contiguous()  # as eager's fused op without its weights


def test_attention_is_composed_only_where_measured_faster_by_a_margin(timed):
    assert chosen(SDPA, qkv(), {}) is attention_choice.composed_attention
    timed.times = (100.0, 95.0)  # under 10% faster: the fused kernel stays
    assert chosen(SDPA, qkv(t=6), {}) is None
    timed.times = (6.5, 5.0)  # 23% faster but 1.5 µs: less than the launches cost
    assert chosen(SDPA, qkv(t=8), {}) is None
    made = {(queries(d), d.taken) for d in attentions()}
    assert made == {(5, True), (6, False), (8, False)}
    assert timed.calls == 3


def test_each_attention_is_measured_once_and_only_while_loading(timed):
    in_a_call = Site(measure=False, captured=True)
    assert chosen(SDPA, qkv(), {}, in_a_call) is None  # bound during a call
    assert timed.calls == 0
    for _ in range(3):
        chosen(SDPA, qkv(), {})
    assert timed.calls == 1
    assert chosen(SDPA, qkv(), {}, in_a_call) is attention_choice.composed_attention
    chosen(SDPA, qkv(), {"scale": 0.5})  # another scale is another kernel's call
    assert timed.calls == 2


@pytest.mark.parametrize("case", ["mask", "dropout", "causal", "gqa", "bf16", "3-D", "large", "deterministic",
                                  "no real tensor", "tf32", "not captured"])
def test_what_attention_is_never_composed(case, timed, monkeypatch):
    """A mask, dropout or causal mask is the fused kernel's (rows all masked differ between the
    two); half precision would round the scores before the softmax, and so would TF32 GEMMs in
    fp32; large scores would be a large tensor; deterministic algorithms get eager's kernel; a plan
    not captured as CUDA graphs would wait on the composed form's launches."""
    if case == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    q, k, v = qkv(dtype=torch.bfloat16 if case == "bf16" else torch.float32,
                  **({"b": 64, "t": 1024} if case == "large" else {}))
    kwargs = {"mask": {"attn_mask": torch.ones(5, 5, dtype=torch.bool)}, "dropout": {"dropout_p": 0.1},
              "causal": {"is_causal": True}, "gqa": {"enable_gqa": True}}.get(case, {})
    if case == "3-D":
        q, k, v = q[0], k[0], v[0]
    if case == "no real tensor":
        q, k, v = (t.to("meta") for t in (q, k, v))
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = case == "tf32"
    try:
        assert chosen(SDPA, [q, k, v], kwargs, Site(measure=True, captured=case != "not captured")) is None
        if case == "tf32":  # fp64 has no TF32 path: still composed
            assert chosen(SDPA, [t.double() for t in (q, k, v)], kwargs) is not None
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert timed.calls == (1 if case == "tf32" else 0)


@pytest.mark.parametrize("case", ["cross-attention", "need weights", "mask", "fp16", "no bias", "deterministic",
                                  "not captured"])
def test_what_multi_head_attention_is_never_composed(case, timed, monkeypatch):
    """Only self-attention (query, key and value one value: the same object), without its
    weights or a mask, in full precision, with both biases; never under deterministic algorithms,
    nor in a plan not captured as CUDA graphs."""
    if case == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    args = mha_args(dtype=torch.float16 if case == "fp16" else torch.float32)
    kwargs = {"need_weights": case == "need weights"}
    if case == "mask":
        kwargs["mask"] = torch.zeros(5, 5, dtype=torch.bool)
    if case == "no bias":
        args[6] = None
    if case == "cross-attention":  # key and value equal to the query, but other values
        args[1], args[2] = args[0].clone(), args[0].clone()
    assert chosen(MHA, args, kwargs, Site(measure=True, captured=case != "not captured")) is None
    assert attentions() == [] and timed.calls == 0


class SelfAttention(torch.nn.Module):
    """nn.MultiheadAttention as ViT uses it: ferry's compiler runs it as the fused op."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.ln, self.attn = torch.nn.LayerNorm(dim), torch.nn.MultiheadAttention(dim, heads, batch_first=True)
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, x):
        y = self.ln(x)
        return x + self.fc(self.attn(y, y, y, need_weights=False)[0])


class Sdpa(torch.nn.Module):
    """Attention over heads as transformers' encoders write it: no mask, not causal."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("model_type", [SelfAttention, Sdpa])
@pytest.mark.parametrize("graphs", [False, True])
def test_bound_steps_compose_attention_only_in_captured_plans(model_type, graphs, timed, emu_async, count_calls):
    """With graphs, the attention runs composed (the fake timing favours it), call after call,
    equal to eager on fresh inputs; without graphs nothing is timed and the fused kernel runs."""
    ran = count_calls(attention_choice, "composed_attention")  # the multi-head form calls it too
    model = model_type().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(2, 6, 32),)), ferry.OpSupportPartitioner("emu:0"))
    module = ferry.Module(program, cuda_graphs=graphs)
    module.load_method()
    measured = attentions()
    assert bool(measured) == graphs
    if graphs:
        # the multi-head form is timed whole, after its attention alone
        want = {"multi-head attention", "attention"} if model_type is SelfAttention else {"attention"}
        assert {d.family for d in measured} == want and all(d.taken for d in measured)
    ran.clear()
    for _ in range(4):
        x = torch.randn(2, 6, 32)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(ran) == (4 if graphs else 0)


def test_a_multi_head_decision_is_keyed_by_its_parts(timed, monkeypatch):
    """The multi-head form is timed with the parts chosen for it: projections measured the other
    way (another process, another GPU) make another decision, not a stale one."""
    args, kwargs = mha_args(), {"need_weights": False}
    assert chosen(MHA, args, kwargs).parts == (True, True, True)
    assert timed.calls == 4  # two GEMMs, the attention, then the whole
    assert chosen(MHA, args, kwargs) is not None and timed.calls == 4
    monkeypatch.setattr(gemm_choice, "DECISIONS", Decisions())  # the GEMMs not decided yet, the rest known
    timed.times = (40.0, 100.0)  # now the fused kernels are the faster
    assert chosen(MHA, args, kwargs) is None
    assert timed.calls == 7  # the GEMMs again, and the whole with eager's projections; the attention is known


def _compiled(model, shape):
    return ferry.compile(torch.export.export(model, (torch.randn(*shape),)), ferry.OpSupportPartitioner("cuda:0"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("model_type", [SelfAttention, Sdpa])
@pytest.mark.parametrize("kernel", ["measured", "composed forced"])
def test_on_cuda_attention_is_measured_and_results_equal_eager(model_type, kernel, fresh, full_fp32, monkeypatch):
    """ViT-B/16's attention shape (197 tokens, 12 heads of 64) with graphs, whichever kernels the
    timing picks and with the composed forms forced (a GPU where they never win would otherwise
    check only eager's)."""
    if kernel == "composed forced":
        monkeypatch.setattr(kernel_timing, "KEEP_IF_ABOVE", math.inf)
        monkeypatch.setattr(kernel_timing, "MIN_SAVING_US", -math.inf)
    model = model_type(768, 12).eval()
    module = ferry.Module(_compiled(model, (1, 197, 768)), cuda_graphs=True)
    cuda_model = model.cuda()
    for _ in range(3):
        x = torch.randn(1, 197, 768)
        with torch.no_grad():
            torch.testing.assert_close(module(x), cuda_model(x.cuda()).cpu(), rtol=1e-4, atol=1e-4)
    made = attentions()
    assert made and all(d.device == "cuda:0" and len(d.times_us) == 2 and min(d.times_us) > 0 for d in made)
    assert kernel == "measured" or all(d.taken for d in made)
    graphs = loaded_method(module).graphs
    assert len(graphs) >= 1 and not any(g.failed for g in graphs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_without_graphs_nothing_is_composed(fresh, full_fp32):
    model = SelfAttention(768, 12).eval()
    module = ferry.Module(_compiled(model, (1, 197, 768)))
    x = torch.randn(1, 197, 768)
    with torch.no_grad():
        torch.testing.assert_close(module(x), model.cuda()(x.cuda()).cpu(), rtol=1e-4, atol=1e-4)
    assert attentions() == []


def test_self_attention_is_one_object_for_query_key_and_value(timed):
    """The binder gives one value of the call as one object (a meta tensor like it) and a fixed
    tensor as itself: multi-head attention is self-attention where query, key and value are that
    one object, not where they are equal ones."""
    args, kwargs = mha_args(), {"need_weights": False}
    x, rest = args[0], args[3:]
    value = x.to("meta")  # one value of the call
    assert chosen(MHA, [value, value, value, *rest], kwargs) is not None
    assert chosen(MHA, [value, x.to("meta"), value, *rest], kwargs) is None  # two values of one shape
    assert chosen(MHA, [x, x, x, *rest], kwargs) is not None  # one fixed tensor
    assert chosen(MHA, [x, value, value, *rest], kwargs) is None  # a fixed tensor and a value of the call
    assert timed.calls == 4  # timed once (two GEMMs, the attention, the whole); the rest known or refused


def test_nothing_is_timed_or_remembered_under_a_capture(timed, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert chosen(SDPA, qkv(), {}) is None
    assert chosen(MHA, mha_args(), {"need_weights": False}) is None
    assert timed.calls == 0 and DECISIONS.values() == []


@pytest.mark.parametrize("graphs", [False, True])
def test_a_captured_plan_is_handed_to_the_delegates_it_binds(graphs, timed, emu_async, monkeypatch):
    """A delegate's own plan is bound inside its caller's (the torch backend's nested method), as
    not captured itself: it runs in the caller's graphs, so the caller hands it CallerPlan(captured,
    the caller's streams), and its attention is asked for as in a captured plan and timed at load."""
    from ferry.backend_registry import CallerPlan

    asked = []

    def form(op, args, kwargs, site):
        asked.append(site)
        return attention_choice.form(op, args, kwargs, site)

    monkeypatch.setattr(hook, "FAMILIES", {**hook.FAMILIES, SDPA: form})  # the table is read-only
    model = Sdpa().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(2, 6, 32),)), ferry.OpSupportPartitioner("emu:0"))
    assert len(program.delegates) == 1
    module = ferry.Module(program, cuda_graphs=graphs)
    module.load_method()
    outer = module._methods["forward"]
    (handle,) = module._instances[0].delegates.values()
    assert outer.streams is not None
    assert handle.method.caller == (CallerPlan(True, outer.streams) if graphs else CallerPlan())
    assert asked and any(site.measure for site in asked)  # asked while loading, then as its plan is bound again
    assert all(site.captured == graphs and site.streams is (outer.streams if graphs else None) for site in asked)
    assert [d.family for d in attentions()] == (["attention"] if graphs else [])  # timed once, at load
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-5)
    assert all(site.captured == graphs for site in asked)

"""ferry::split_kv_attention (ops/split_kv.py) against eager SDPA: the arithmetic on the CPU, the
Triton kernels on CUDA, fresh random inputs, every mask form, grouped and plain heads."""

from __future__ import annotations

import ast
import contextlib
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ferry
from ferry.choices import attention as attention_choice
from ferry.choices import hook
from ferry.choices.decisions import DECISIONS, Site
from ferry.ops import split_kv
from ferry.ops.split_kv import SPLIT_KV_ATTENTION

# (batch, query heads, kv heads, query tokens, cache, head dim)
SHAPES = [(1, 32, 8, 1, 1024, 64), (1, 16, 8, 1, 300, 128), (2, 12, 12, 1, 1500, 64), (3, 8, 2, 4, 77, 80),
          (8, 32, 8, 1, 128, 64), (1, 4, 4, 1, 1, 32)]


def _inputs(b, h, hkv, t, s, d, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g, device=device).to(dtype)
    k, v = (torch.randn(b, hkv, s, d, generator=g, device=device).to(dtype) for _ in range(2))
    return q, k, v


def _mask(kind, b, h, t, s, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed + 1)
    if kind is None:
        return None
    if kind == "prefix":  # a decode step's: the positions written so far, shared by every head
        allowed = torch.arange(s, device=device) < torch.randint(1, s + 1, (b, 1, 1, 1), generator=g, device=device)
    else:  # per head and row, random
        allowed = torch.rand(b, h, t, s, generator=g, device=device) < 0.7
        allowed[..., 0] = True
    return allowed if kind != "additive" else torch.where(allowed, 0.0, -math.inf).to(dtype)


def _eager(q, k, v, mask, scale):
    m = mask if mask is None or mask.dtype == torch.bool else mask.float()
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _check(device, shape, kind, dtype, seed):
    b, h, hkv, t, s, d = shape
    q, k, v = _inputs(b, h, hkv, t, s, d, dtype, device, seed)
    mask = _mask(kind, b, h, t, s, dtype, device, seed)
    scale = d ** -0.5
    assert split_kv.fits(q, k, v, mask)
    out, partials = SPLIT_KV_ATTENTION(q, k, v, mask, scale)
    want = _eager(q, k, v, mask, scale)
    assert out.shape == want.shape and out.dtype == dtype
    assert out.transpose(1, 2).is_contiguous()  # laid out as SDPA's fused kernels lay it out
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    count, _ = split_kv.splits(b, hkv, s)
    assert partials.shape == (b * hkv, count, h // hkv * t, d + 2) and partials.dtype == torch.float32
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", [None, "prefix", "additive", "bool"])
def test_equals_eager_sdpa_on_the_cpu(shape, kind):
    for seed, dtype in enumerate((torch.bfloat16, torch.float16)):
        _check("cpu", shape, kind, dtype, seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strided_layouts_equal_eager_sdpa_on_the_cpu(dtype):
    check_strided_layouts("cpu", dtype, SPLIT_KV_ATTENTION)


def test_the_cache_is_split_into_stretches_that_fill_the_gpu():
    assert split_kv.splits(1, 8, 1024) == (16, 64)  # 128 programs of one block each
    assert split_kv.splits(1, 8, 4096) == (32, 128)
    assert split_kv.splits(8, 8, 1024) == (4, 256)
    assert split_kv.splits(1, 8, 1) == (1, 64)
    assert split_kv.splits(1, 1, 1 << 16) == (64, 1024)  # one KV head: at most MAX_STRETCHES
    for b, hkv, s in [(1, 8, 1000), (3, 5, 77), (64, 32, 4096)]:
        count, length = split_kv.splits(b, hkv, s)
        assert length % split_kv.BLOCK_N == 0 and (count - 1) * length < s <= count * length


def test_a_row_no_key_may_attend_is_zero_as_eager_makes_it():
    q, k, v = _inputs(1, 4, 2, 2, 130, 64, torch.bfloat16, "cpu", 3)
    mask = torch.ones(1, 4, 2, 130, dtype=torch.bool)
    mask[0, 1, 0] = False
    out, _ = SPLIT_KV_ATTENTION(q, k, v, mask, 0.125)
    want = _eager(q, k, v, mask, 0.125)
    assert torch.equal(out[0, 1, 0].float(), torch.zeros(64)) and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want.nan_to_num(0.0), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("args, why", [
    ((torch.float32, (1, 8, 1, 64), (1, 8, 16, 64), None), "fp32"),
    ((torch.bfloat16, (1, 6, 1, 64), (1, 4, 16, 64), None), "heads not grouped"),
    ((torch.bfloat16, (1, 32, 5, 64), (1, 2, 16, 64), None), "too many rows per KV head"),
    ((torch.bfloat16, (1, 8, 1, 64), (1, 8, 16, 32), None), "head dims differ"),
    ((torch.bfloat16, (1, 8, 1, 64), (1, 8, 16, 64), (1, 1, 1, 15)), "a mask of another length"),
    ((torch.bfloat16, (1, 8, 1, 256), (1, 8, 16, 256), None), "a head wider than measured"),
    ((torch.bfloat16, (0, 8, 1, 64), (0, 2, 16, 64), None), "no sequence"),
])
def test_what_it_does_not_compute_is_refused(args, why):
    dtype, qs, ks, ms = args
    q, k = torch.zeros(qs, dtype=dtype), torch.zeros(ks, dtype=dtype)
    mask = None if ms is None else torch.zeros(ms, dtype=torch.bool)
    assert not split_kv.fits(q, k, k, mask), why
    with pytest.raises(ValueError, match="split_kv_attention"):
        split_kv.split_kv_attention(q, k, k, mask, 0.125)


def test_a_slice_of_a_cache_reaching_past_32_bit_offsets_is_not_split():
    """The kernels' offsets are 32-bit: a cache slice of few elements whose last one lies 2**31 or
    more past its first is not offered to the choice (meta tensors: no memory); the same keys laid
    out densely are."""
    cache = torch.empty(128, 8, 32768, 128, dtype=torch.bfloat16, device="meta")
    q = torch.empty(128, 32, 1, 128, dtype=torch.bfloat16, device="meta")
    k = cache[:, :, :1024]
    assert k.numel() < 2 ** 31 and not split_kv.fits(q, k, k, None)
    assert split_kv.fits(q, k.contiguous(), k.contiguous(), None)
    wide = torch.empty(1, 1, 1, 2 ** 32, dtype=torch.bool, device="meta")
    assert not split_kv.fits(q[:1], k[:1].contiguous(), k[:1].contiguous(), wide[..., ::2 ** 22])


def test_the_launch_experiments_refuse_what_would_count_keys_twice_or_overrun_the_counts():
    q, k, v = _inputs(2, 8, 2, 1, 200, 64, torch.float16, "cpu", 6)
    for length in (0, 96):
        with pytest.raises(ValueError, match="multiple of 64"):
            split_kv._on_gpu(q, k, v, None, 0.125, length=length)
    for counts in (torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)):
        with pytest.raises(ValueError, match="4 int32 zeros"):
            split_kv._on_gpu(q, k, v, None, 0.125, counts=counts)


def test_its_fake_results_are_the_real_ones_shapes_and_layouts():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = _inputs(2, 8, 2, 3, 200, 64, torch.bfloat16, "cpu", 5)
    real = SPLIT_KV_ATTENTION(q, k, v, None, 0.125)
    with FakeTensorMode() as mode:
        fake = SPLIT_KV_ATTENTION(*(mode.from_tensor(x) for x in (q, k, v)), None, 0.125)
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


def test_inductor_computes_a_mask_several_calls_share_once():
    """A decode step's layers read one additive mask: Inductor makes it one buffer every call
    reads (under the default layout constraint for library ops it recomputed the mask once per
    call: a kernel per layer on the GPU). The results still equal eager's."""
    from torch._inductor.utils import run_and_get_code

    length, gen = 64, torch.Generator().manual_seed(7)
    q = torch.randn(1, 8, 1, 32, generator=gen, dtype=torch.bfloat16)
    caches = [torch.randn(1, 2, length, 32, generator=gen, dtype=torch.bfloat16) for _ in range(6)]

    def layers(q, pos, *caches):
        allowed = torch.arange(length)[None, None, None] <= (pos + torch.arange(1))[None, None, :, None]
        mask = torch.where(allowed.expand(1, -1, 1, length), 0.0, -math.inf).to(q.dtype)  # as transformers
        out = q
        for k, v in zip(caches[::2], caches[1::2]):
            out = SPLIT_KV_ATTENTION(out, k, v, mask, 32 ** -0.5)[0] * 2
        return out

    pos = torch.tensor([40])
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):  # its key does not hold the op's tags
        got, codes = run_and_get_code(torch.compile(layers, backend="inductor", fullgraph=True), q, pos, *caches)
    calls = [ast.parse(line.split("=", 1)[1].strip()).body[0].value for code in codes for line in code.splitlines()
             if "ferry.split_kv_attention.default(" in line]
    masks = {ast.unparse(call.args[3]) for call in calls}
    assert len(calls) == 3 and len(masks) == 1, masks
    assert torch.equal(got, layers(q, pos, *caches))


def test_inputs_inductor_lays_out_padded_give_eagers_results():
    """With no layout constraint Inductor may pad what it hands the op (as it does on a GPU): a
    mask of 1,100 keys for two query rows arrives with rows of 1,152; q a view of a product."""
    from torch._inductor.utils import run_and_get_code

    length, gen, seen = 1100, torch.Generator().manual_seed(0), []
    weight = torch.randn(64, 8 * 32, generator=gen, dtype=torch.bfloat16) * 0.1
    k, v = (torch.randn(1, 2, length, 32, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(1, 2, 64, generator=gen, dtype=torch.bfloat16)

    def two_layers(x, k, v, pos):
        q = (x @ weight).view(1, 2, 8, 32).transpose(1, 2) * 1.5
        allowed = torch.arange(length)[None, None, None] <= (pos + torch.arange(2))[None, None, :, None]
        mask = torch.where(allowed, 0.0, -math.inf).to(q.dtype)
        out = SPLIT_KV_ATTENTION(q, k, v, mask, 32 ** -0.5)[0]
        return SPLIT_KV_ATTENTION(out * 2, k, v, mask, 32 ** -0.5)[0]

    pos = torch.tensor([700])
    want = two_layers(x, k, v, pos)
    padding = {key: value for key, value in (("disable_padding_cpu", False), ("comprehensive_padding", True))
               if hasattr(torch._inductor.config, key)}
    real = split_kv._reference
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False, **padding), pytest.MonkeyPatch.context() as patch:
        patch.setattr(split_kv, "_reference", lambda *a: seen.append(a[3].stride()) or real(*a))
        got, _ = run_and_get_code(torch.compile(two_layers, backend="inductor", fullgraph=True), x, k, v, pos)
    assert torch.equal(got, want)
    assert seen and all(stride[2] > length for stride in seen)  # (padded: the layout this test is about)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", [None, "prefix", "additive", "bool"])
def test_the_gpu_kernels_equal_eager_sdpa(shape, kind):
    assert split_kv.available(), "Triton does not import beside this CUDA build"
    for seed, dtype in enumerate((torch.bfloat16, torch.float16)):
        out = _check("cuda", shape, kind, dtype, seed)
        q, k, v = _inputs(*shape, dtype, "cuda", seed)
        mask = _mask(kind, *shape[:2], *shape[3:5], dtype, "cuda", seed)
        cpu = SPLIT_KV_ATTENTION(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(), shape[-1] ** -0.5)
        torch.testing.assert_close(out.cpu().float(), cpu[0].float(), rtol=1e-2, atol=1e-2)  # same arithmetic


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gpu_kernels_read_strided_layouts_as_eager_does(dtype):
    check_strided_layouts("cuda", dtype, SPLIT_KV_ATTENTION)


# ---------------------------------------------------------------- the choice at load (choices/attention.py)

SDPA = torch.ops.aten.scaled_dot_product_attention.default
CAPTURED = Site(measure=True, captured=True)


@pytest.fixture
def triton_here(monkeypatch):
    """As if Triton imported: the op's CPU kernel (the same arithmetic) stands in for the GPU's."""
    monkeypatch.setattr(split_kv, "available", lambda: True)


def _decode_args(dtype=torch.bfloat16, heads=8, kv=2):
    q, k, v = _inputs(1, heads, kv, 1, 96, 32, dtype, "cpu", 7)
    return [q, k, v, _mask("prefix", 1, heads, 1, 96, dtype, "cpu", 7)], {"enable_gqa": heads != kv}


@pytest.mark.parametrize("times, taken", [((100.0, 40.0), True), ((100.0, 90.0), True), ((100.0, 91.0), False),
                                          ((5.0, 4.5), True), ((100.0, 120.0), False)])
def test_split_kv_is_chosen_where_it_saves_ten_percent(times, taken, timed, triton_here):
    timed.times = times
    args, kwargs = _decode_args()
    decision = attention_choice.split_kv_decision(args, kwargs, CAPTURED)
    assert decision is not None and decision.taken is taken and decision.forms == attention_choice.SPLIT_KV_FORMS
    assert decision.times_us == times and timed.calls == 1
    assert (hook.choose(SDPA, args, kwargs, CAPTURED) is not None) is taken
    assert timed.calls == 1  # decided once per key


class TwoAttentions(torch.nn.Module):
    """Two decode attentions of one step: one with a positional mask and its own scale, one
    unmasked at SDPA's default scale."""

    def forward(self, q, k, v, mask):
        a = F.scaled_dot_product_attention(q, k, v, mask, scale=0.3, enable_gqa=True)
        return a + F.scaled_dot_product_attention(q * 2, k, v, enable_gqa=True)


def test_the_inductor_rewrite_keeps_each_calls_mask_and_scale(timed, triton_here):
    q, k, v = _inputs(1, 8, 2, 1, 96, 32, torch.bfloat16, "cpu", 9)
    mask = _mask("prefix", 1, 8, 1, 96, torch.bfloat16, "cpu", 9)
    gm = torch.export.export(TwoAttentions(), (q, k, v, mask)).module()
    shapes = {n: torch.empty_strided(n.meta["val"].shape, n.meta["val"].stride(), dtype=n.meta["val"].dtype,
                                     device="meta")
              for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}  # as the dry run makes them
    made = attention_choice.split_kv_rewrites(gm, shapes, Site(torch.device("cpu"), measure=True, captured=True))
    assert len(made) == 2 and all(d.taken for d in made)
    calls = [n for n in gm.graph.nodes if n.target is SPLIT_KV_ATTENTION]
    assert len(calls) == 2 and not any(n.target is SDPA for n in gm.graph.nodes)
    assert [round(n.args[4], 6) for n in calls] == [0.3, round(32 ** -0.5, 6)]  # in the order of the calls
    assert calls[0].args[3] is not None and calls[1].args[3] is None  # the first call's mask, the second none
    for seed in range(3):
        q, k, v = _inputs(1, 8, 2, 1, 96, 32, torch.bfloat16, "cpu", seed)
        mask = _mask("prefix", 1, 8, 1, 96, torch.bfloat16, "cpu", seed)
        torch.testing.assert_close(gm(q, k, v, mask).float(), TwoAttentions()(q, k, v, mask).float(),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", ["uncaptured", "no triton", "dropout", "causal", "fp32", "gqa undeclared",
                                  "deterministic"])
def test_what_is_never_split(case, timed, triton_here, monkeypatch):
    args, kwargs = _decode_args(torch.float32 if case == "fp32" else torch.bfloat16)
    site = CAPTURED
    if case == "uncaptured":
        site = Site(measure=True, captured=False)
    elif case == "no triton":
        monkeypatch.setattr(split_kv, "available", lambda: False)
    elif case == "dropout":
        kwargs["dropout_p"] = 0.1
    elif case == "causal":
        args[3], kwargs["is_causal"] = None, True
    elif case == "gqa undeclared":
        kwargs = {}
    elif case == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert hook.choose(SDPA, args, kwargs, site) is None
    assert timed.calls == 0


class DecodeAttention(torch.nn.Module):
    """One token's query heads against a cache of grouped KV heads, masked to the positions
    written, as a decode step has it (bf16)."""

    def __init__(self, heads=8, kv=2, dim=32, cache=96):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.q = torch.nn.Linear(heads * dim, heads * dim, bias=False)
        self.register_buffer("k_cache", torch.randn(1, kv, cache, dim))
        self.register_buffer("v_cache", torch.randn(1, kv, cache, dim))

    def forward(self, x, mask):
        q = self.q(x).view(1, 1, self.heads, self.dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        return y.transpose(1, 2).reshape(1, 1, self.heads * self.dim)


@pytest.mark.parametrize("backend", ["torch", "inductor"])
def test_a_captured_plan_runs_split_kv_where_timed_faster_and_equals_eager(backend, timed, triton_here, emu,
                                                                            monkeypatch):
    ran = []
    real = split_kv._reference
    monkeypatch.setattr(split_kv, "_reference", lambda *a: ran.append(a[0].shape) or real(*a))
    torch.manual_seed(0)
    model = DecodeAttention().to(torch.bfloat16).eval()
    x, mask = torch.randn(1, 1, 256, dtype=torch.bfloat16), torch.arange(96) < 40
    program = ferry.compile(torch.export.export(model, (x, mask.view(1, 1, 1, 96))),
                            ferry.OpSupportPartitioner("emu:0", backend_id=backend))
    module = ferry.Module(program, cuda_graphs=True)
    module.load_method()
    made = [d for d in DECISIONS.values(timed=True) if d.family == "attention"]
    assert [d.shape for d in made] == ["1x8/2x1x96x32 bfloat16"] and made[0].taken
    ran.clear()
    for written in (1, 50, 96):
        x, mask = torch.randn(1, 1, 256, dtype=torch.bfloat16), (torch.arange(96) < written).view(1, 1, 1, 96)
        with torch.no_grad():
            want = model(x, mask)
        got = module(x, mask)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert len(ran) == 3  # every call ran the split


@pytest.mark.parametrize("device", ["emu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU")])])
@pytest.mark.parametrize("backend", ["torch", "inductor"])
def test_a_bf16_decoder_with_split_kv_attention_follows_eager_step_by_step(device, backend, fresh, monkeypatch):
    """Teacher forcing: ferry's decode step (graphs, every attention split-KV: both forms run, then
    a fake clock favours split-KV) and transformers' static-cache step
    are fed the same tokens; each step's logits agree within bf16 rounding."""
    pytest.importorskip("transformers")
    from ferry.choices import timing
    from ferry.runtime import emulated_device
    from test_generate import KEEP_ON_DEVICE, bf16_decode_step, follows_eager_step_by_step

    if device == "emu":
        monkeypatch.setattr(split_kv, "available", lambda: True)
        monkeypatch.setattr(timing, "gpu_of", lambda operands, device=None: device or timing.real_device(operands))
        monkeypatch.setattr(timing, "on", lambda device: contextlib.nullcontext())
    real_timing = timing.time_both  # both forms run (on the GPU, timed for real); the clock favours split-KV
    monkeypatch.setattr(timing, "time_both", lambda eager, other, stream=None: (
        real_timing(eager, other, stream) if device == "cuda" else (eager(), other())) and (10.0, 1.0))
    model_device = "cpu" if device == "emu" else device
    ep, eager = bf16_decode_step(model_device)
    with emulated_device(num_devices=1) if device == "emu" else contextlib.nullcontext():
        program = ferry.compile(ep, ferry.OpSupportPartitioner(f"{device}:0", backend_id=backend),
                                KEEP_ON_DEVICE if device == "cuda" else None)
        module = ferry.Module(program, cuda_graphs=True)
        module.load_method()
        made = [d for d in DECISIONS.values() if d.family == "attention"]
        assert made and all(d.taken and d.pick == "split-KV" for d in made)
        follows_eager_step_by_step(module, eager, model_device)


def check_strided_layouts(device: str, dtype: torch.dtype, run) -> None:
    """`run(q, k, v, mask, scale)` (the op, or its GPU path) against eager SDPA on layouts a decode
    graph hands over: q a view of a merged projection, k a slice of a longer cache, v laid out
    head-dim-major, masks boolean, additive and broadcast (expanded) over heads."""
    for seed, (b, h, hkv, t, s, d) in enumerate(SHAPES[:4] + SHAPES[5:]):
        for kind in (None, "additive", "bool", "expanded"):
            g = torch.Generator().manual_seed(seed)
            merged = torch.randn(b, t, (h + 1) * d, generator=g).to(device, dtype)
            q = merged[..., :h * d].view(b, t, h, d).transpose(1, 2)
            k, v = (torch.randn(b, hkv, s + 5, d, generator=g).to(device, dtype)[:, :, 5:] for _ in range(2))
            v = v.transpose(2, 3).contiguous().transpose(2, 3)
            allowed = (torch.rand(b, h, t, s, generator=g) < 0.7).to(device)
            allowed[..., 0] = True
            mask = None if kind is None else allowed if kind == "bool" else torch.where(allowed, 0.0, -math.inf).to(dtype)
            if kind == "expanded":
                mask = mask[:, :1].expand(b, h, t, s)
            got = run(q, k, v, mask, d ** -0.5)[0]
            want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=h != hkv,
                                                  attn_mask=None if mask is None else
                                                  mask if mask.dtype == torch.bool else mask.float())
            err = (got.float() - want).abs().max().item()
            assert err < (2e-2 if dtype == torch.bfloat16 else 4e-3), (b, h, hkv, t, s, d, kind, err)
            assert got.transpose(1, 2).is_contiguous()


_INTERPRETED = """
import contextlib, sys
import torch
torch.cuda.device = lambda device: contextlib.nullcontext()  # the kernels' launch on the host
sys.path.insert(0, TESTS)
from test_split_kv import check_strided_layouts
from ferry.ops import split_kv
check_strided_layouts("cpu", torch.float16, split_kv._on_gpu)
counts = torch.zeros(64, dtype=torch.int32)  # the one-launch form: the last program of a KV head combines
check_strided_layouts("cpu", torch.float16, lambda q, k, v, m, scale: split_kv._on_gpu(
    q, k, v, m, scale, counts=counts[:q.shape[0] * k.shape[1]]))
assert not counts.any()  # left zero for the next call
print("ok")
"""


def test_the_triton_kernels_equal_eager_sdpa_under_tritons_interpreter():
    """The GPU kernels themselves, run on the host by Triton's interpreter where Triton imports
    (fp16: the interpreter has no bf16), on the layouts a decode graph hands over; in two launches,
    and in one (bench/split_kv_variants.py's experiment)."""
    import os
    import subprocess
    import sys
    if not split_kv.available():
        pytest.skip("Triton does not import here")
    script = f"TESTS = {str(Path(__file__).parent)!r}\n" + _INTERPRETED
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def favour_split_kv(monkeypatch) -> None:
    """On the emulated device: Triton as if it imported (the op's CPU kernel stands in), the
    device taken for a GPU, and a clock by which split-KV always wins (both forms still run)."""
    from ferry.choices import timing

    monkeypatch.setattr(split_kv, "available", lambda: True)
    monkeypatch.setattr(timing, "gpu_of", lambda operands, device=None: device or timing.real_device(operands))
    monkeypatch.setattr(timing, "on", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(timing, "time_both", lambda eager, other, stream=None: (eager(), other()) and (10.0, 1.0))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma4", "phi3",
                                    "mistral"])
def test_every_familys_bf16_decode_step_with_split_kv_follows_eager(family, fresh, emu, monkeypatch):
    """Each family's decode step (transformers' export recipe: static or hybrid cache, sliding
    masks, Gemma 4's layers sharing a cache) in bf16, graphs on the emulated device, every
    attention split-KV wherever it computes it (a fake clock): each step's logits follow
    transformers' own step within bf16 rounding, fed the same tokens, past the sliding window."""
    import copy

    pytest.importorskip("transformers")
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from test_generate_families import CACHE, make_model

    favour_split_kv(monkeypatch)
    model = make_model(family)
    recipe, eager = (TorchExportableModuleForDecoderOnlyLM(copy.deepcopy(model).to(torch.bfloat16), batch_size=1,
                                                           max_cache_len=CACHE) for _ in range(2))
    with torch.no_grad():
        ep = recipe.export(input_ids=torch.zeros(1, 1, dtype=torch.long), cache_position=torch.tensor([0]))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0")), cuda_graphs=True)
    module.load_method()
    made = [d for d in DECISIONS.values() if d.family == "attention"]
    assert all(d.pick == "split-KV" for d in made)
    sdpa_calls = sum(n.target is SDPA for n in ep.graph.nodes)
    assert bool(made) == bool(sdpa_calls), (family, sdpa_calls)
    tokens = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for i in range(tokens.shape[1]):
            ids, pos = tokens[:, i:i + 1], torch.tensor([i])
            got, want = module(ids, pos), eager.model(input_ids=ids, cache_position=pos)
            scale = want.float().abs().max().item()
            assert torch.allclose(got.float(), want.float(), rtol=2 ** -5, atol=2 ** -5 * scale), (family, i)


def test_a_bf16_whisper_decoder_with_split_kv_is_as_close_to_fp32_as_eager_bf16(fresh, emu, monkeypatch):
    """Whisper's shape (ferry.seq2seq's encode and decode, bf16, graphs on the emulated device):
    every self- and cross-attention of the decoder split-KV. Fed the same tokens, each step's
    logits are as close to the fp32 model's as transformers' bf16 decoder is (run over the whole
    sequence at once): this tiny model's large weights make bf16 drift from fp32 by up to 20% of
    the logits' range, in eager as in ferry, so bf16 against bf16 would test the rounding."""
    import copy

    from ferry.seq2seq import EncoderDecoderExport
    from test_seq2seq import features, whisper

    favour_split_kv(monkeypatch)
    model = copy.deepcopy(whisper()).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        programs = EncoderDecoderExport(model, max_cache_len=32).export(features(0).to(torch.bfloat16))
    module = ferry.Module(ferry.compile(programs, ferry.OpSupportPartitioner("emu:0")), cuda_graphs=True)
    module.load_method("decode")
    made = [d for d in DECISIONS.values() if d.family == "attention"]
    assert len(made) == 2 and all(d.taken for d in made)  # self-attention over the cache, cross over the audio
    tokens = torch.cat([torch.tensor([[1]]), torch.randint(3, 96, (1, 15), generator=torch.Generator().manual_seed(4))], 1)
    for seed in (1, 2):  # a second utterance: the cross cache encoded afresh
        module.run_method("encode", [features(seed).to(torch.bfloat16)])
        with torch.no_grad():
            exact = whisper()(input_features=features(seed), decoder_input_ids=tokens).logits[0]
            eager = model(input_features=features(seed).to(torch.bfloat16), decoder_input_ids=tokens).logits[0]
            for i in range(tokens.shape[1]):
                got = module.run_method("decode", [tokens[:, i:i + 1], torch.tensor([i])])
                got = (got[0] if isinstance(got, (list, tuple)) else got).float().reshape(-1)
                ours, theirs = ((x.float() - exact[i]).abs().max().item() for x in (got, eager[i]))
                assert ours <= 1.5 * theirs + 2 ** -6 * exact[i].abs().max().item(), (seed, i, ours, theirs)

"""ferry::split_kv_attention (ops/split_kv.py) against eager SDPA: the arithmetic on the CPU, the
Triton kernels on CUDA, fresh random inputs, every mask form, grouped and plain heads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

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


def test_the_cache_is_split_into_stretches_that_fill_the_gpu():
    assert split_kv.splits(1, 8, 1024) == (16, 64)  # 128 programs of one block each
    assert split_kv.splits(1, 8, 4096) == (32, 128)
    assert split_kv.splits(8, 8, 1024) == (4, 256)
    assert split_kv.splits(1, 8, 1) == (1, 64)
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
])
def test_what_it_does_not_compute_is_refused(args, why):
    dtype, qs, ks, ms = args
    q, k = torch.zeros(qs, dtype=dtype), torch.zeros(ks, dtype=dtype)
    mask = None if ms is None else torch.zeros(ms, dtype=torch.bool)
    assert not split_kv.fits(q, k, k, mask), why
    with pytest.raises(ValueError, match="split_kv_attention"):
        split_kv.split_kv_attention(q, k, k, mask, 0.125)


def test_its_fake_results_are_the_real_ones_shapes_and_layouts():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = _inputs(2, 8, 2, 3, 200, 64, torch.bfloat16, "cpu", 5)
    real = SPLIT_KV_ATTENTION(q, k, v, None, 0.125)
    with FakeTensorMode() as mode:
        fake = SPLIT_KV_ATTENTION(*(mode.from_tensor(x) for x in (q, k, v)), None, 0.125)
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


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

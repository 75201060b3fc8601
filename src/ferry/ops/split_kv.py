"""Attention of a few query rows against a long KV cache, the cache split across the GPU
(`ferry::split_kv_attention`): what a decode step runs, chosen at load where it is faster.

A decode step's attention reads each KV head's cache once for a handful of query rows (one token
times the query heads that share the KV head). SDPA's kernels give each head one program, so at
batch 1 a GPU of 132 SMs runs 8 programs for Llama-1B's 8 KV heads, each streaming its whole
cache. Here the first kernel gives each KV head as many programs as fill the GPU, each over one
stretch of the cache (flash-decoding): the rows' unnormalised result, running maximum and sum for
its stretch. The second kernel combines the stretches of each row. Masks are read as they are
(additive or boolean, any broadcast), with no copy per call.

Schema (namespace `ferry`):

    split_kv_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> (Tensor, Tensor)

q [B, H, T, D], k and v [B, HKV, S, D] with H a multiple of HKV (grouped heads as SDPA's
`enable_gqa`), mask broadcastable to [B, H, T, S]. Results: the attention [B, H, T, D] (laid out
as SDPA's fused kernels lay it out, [B, T, H, D] in memory), and the first kernel's partial
results (fp32; 135 KB for a step of Llama-1B at a 1024-token cache), a result of their own so
that whatever calls the op allocates and frees them as it does any result (Inductor's code, a
graph's pool), not an allocation inside the op. A row no key may attend is zero, as SDPA's math is.

On CUDA with Triton the two kernels run; elsewhere the same arithmetic in torch ops (the CPU
kernel, and the reference the GPU kernels are tested against).
"""

from __future__ import annotations

import functools
import math

import torch

from ferry.layout import element_span
from ferry.ops.library import new_fragment, triton_imports

__all__ = ["BLOCK_N", "MAX_ROWS", "SPLIT_KV_ATTENTION", "available", "fits", "split_kv_attention", "splits"]

BLOCK_N = 64  # keys per step of the first kernel's loop
MAX_ROWS = 64  # query rows per KV head (query heads of a group x tokens) the kernels hold at once
MAX_HEAD_DIM = 128  # the widest head measured (a wider one's K and V tiles may not fit a smaller GPU's shared memory)
MAX_STRETCHES = 64  # per KV head: the second kernel holds one row's stretches at once
_PROGRAMS = 256  # first-kernel programs to aim for: about two per SM of an H100/H200
_DTYPES = (torch.bfloat16, torch.float16)
_INT32 = 1 << 31
_SCHEMA = "split_kv_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> (Tensor, Tensor)"


def splits(batch: int, kv_heads: int, keys: int) -> tuple[int, int]:
    """(stretches, keys per stretch) of each KV head's cache: enough stretches for about
    `_PROGRAMS` programs in all (at most MAX_STRETCHES), each a whole number of BLOCK_N keys."""
    blocks = -(-keys // BLOCK_N)
    count = max(1, min(blocks, -(-_PROGRAMS // (batch * kv_heads)), MAX_STRETCHES))
    length = -(-blocks // count) * BLOCK_N
    return -(-keys // length), length


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """The op computes this SDPA call: 4-D half-precision q, k, v of one dtype and device, k and v
    of one shape, grouped heads, at most MAX_ROWS query rows per KV head, a float or bool mask
    broadcastable to the scores, and the kernels' 32-bit offsets reach every element (`_spans_fit`)."""
    return _computes(q, k, v, mask) and _spans_fit(q, k, v, mask)


def _spans_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Each operand's farthest element, and the result's, within a 32-bit offset of its first: a
    slice of a longer cache may reach far past its own element count."""
    spans = [element_span(t.shape, t.stride())[1] for t in (q, k, v, mask) if t is not None]
    return max(spans + [q.numel()]) < _INT32


def _computes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """`fits` but for the operands' layouts: what the op computes in either form."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return False
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype or k.shape != v.shape:
        return False
    (b, h, t, d), (bk, hkv, s, dk) = q.shape, k.shape
    if bk != b or dk != d or hkv == 0 or h % hkv or (h // hkv) * t > MAX_ROWS or d > MAX_HEAD_DIM:
        return False
    if q.numel() == 0 or k.numel() == 0:
        return False  # (SDPA's own empty result)
    if mask is None:
        return True
    if mask.dtype not in (torch.bool, q.dtype, torch.float32) or mask.dim() > 4:
        return False
    try:
        torch.broadcast_shapes(mask.shape, (b, h, t, s))
    except RuntimeError:
        return False
    return True


def _outputs(q: torch.Tensor, k: torch.Tensor, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The result, [B, T, H, D] in memory, and the partials [B * HKV, stretches, rows, D + 2]
    (each row's unnormalised result, then its maximum and sum)."""
    (b, h, t, d), (hkv, s) = q.shape, k.shape[1:3]
    count = count or splits(b, hkv, s)[0]
    out = q.new_empty((b, t, h, d)).transpose(1, 2)
    return out, q.new_empty((b * hkv, count, (h // hkv) * t, d + 2), dtype=torch.float32)


def _reference(q, k, v, mask, scale):
    """The kernels' arithmetic in torch ops: scores in fp32 from the half-precision operands, each
    stretch's exponentials rounded to q's dtype before they multiply v (as the kernel's second
    product takes them), stretches combined by their maxima."""
    (b, h, t, d), (hkv, s) = q.shape, k.shape[1:3]
    rows, (count, length) = (h // hkv) * t, splits(b, hkv, s)
    out, partials = _outputs(q, k)
    scores = (q.reshape(b, hkv, rows, d).float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        m = mask.expand(b, h, t, s).reshape(b, hkv, rows, s)
        scores = scores.masked_fill(~m, -math.inf) if m.dtype == torch.bool else scores + m.float()
    part = partials.view(b, hkv, count, rows, d + 2)
    for i in range(count):
        piece = scores[..., i * length:(i + 1) * length]
        top = piece.amax(-1)
        shift = torch.where(top == -math.inf, 0.0, top)
        p = torch.exp(piece - shift[..., None])
        part[:, :, i, :, :d] = p.to(q.dtype).float() @ v[:, :, i * length:(i + 1) * length].float()
        part[:, :, i, :, d], part[:, :, i, :, d + 1] = top, p.sum(-1)
    result = _combined(part[..., :d], part[..., d], part[..., d + 1])
    out.copy_(result.reshape(b, h, t, d))
    return out, partials


def _combined(acc: torch.Tensor, top: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Rows from their stretches (dim 2): each stretch weighed by exp(its maximum - the row's)."""
    best = top.amax(2, keepdim=True)
    w = torch.exp(top - torch.where(best == -math.inf, 0.0, best))
    norm = (w * total).sum(2)
    summed = (w[..., None] * acc).sum(2)
    return torch.where(norm[..., None] > 0, summed / norm.clamp_min(torch.finfo(torch.float32).tiny)[..., None], 0.0)


@functools.cache
def available() -> bool:
    """Triton imports (the CUDA kernels are built from it)."""
    return triton_imports()


def _kernels():
    from ferry.ops import split_kv_triton  # (imports Triton)

    return split_kv_triton.stretches, split_kv_triton.combine


def _on_gpu(q, k, v, mask, scale, length: int | None = None, counts: torch.Tensor | None = None, **launch):
    """The kernels. `length` (keys per stretch, a multiple of BLOCK_N) and `launch` (Triton's
    num_warps, num_stages) override the defaults; with `counts` (int32, one zero per batch row
    and KV head, left zero again) the last program of each KV head combines its rows, in one
    launch: experiments of bench/split_kv_variants.py, not what the op runs."""
    (b, h, t, d), (hkv, s) = q.shape, k.shape[1:3]
    if length is not None and (length <= 0 or length % BLOCK_N):
        raise ValueError(f"split_kv: keys per stretch must be a positive multiple of {BLOCK_N}, not {length}")
    if counts is not None and (counts.dtype != torch.int32 or counts.numel() < b * hkv or counts.device != q.device):
        raise ValueError(f"split_kv: counts must be {b * hkv} int32 zeros on {q.device}")
    import triton

    g, (count, length) = h // hkv, (((s + length - 1) // length, length) if length else splits(b, hkv, s))
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out, partials = _outputs(q, k, count)
    kind = 0 if mask is None else (2 if mask.dtype == torch.bool else 1)
    m = mask.expand(b, h, t, s) if mask is not None else q
    mstrides = m.stride() if mask is not None else (0, 0, 0, 0)
    dp, cp = max(16, triton.next_power_of_2(d)), max(2, triton.next_power_of_2(count))
    stretches, combine = _kernels()
    with torch.cuda.device(q.device):
        stretches[(b * hkv, count)](
            q, k, v, m, partials, out, partials if counts is None else counts, *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], *mstrides, *out.stride()[:3], float(scale), s, count, hkv, T=t, G=g,
            ROWS=max(16, triton.next_power_of_2(g * t)), D=d, DP=dp, LENGTH=length, BLOCK=BLOCK_N, MASK=kind, CP=cp,
            COMBINE=counts is not None, **launch)
        if counts is None:
            combine[(b * hkv, g * t)](partials, out, *out.stride()[:3], count, hkv, T=t, G=g, D=d, DP=dp, CP=cp)
    return out, partials


def split_kv_attention(q, k, v, mask, scale):
    """The op's kernel for any device: the two Triton kernels on CUDA where Triton imports, the
    same arithmetic in torch ops elsewhere."""
    if not _computes(q, k, v, mask):
        raise ValueError(f"split_kv_attention: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"mask {None if mask is None else (tuple(mask.shape), mask.dtype)}: not a grouped-heads "
                         f"half-precision attention of at most {MAX_ROWS} query rows per KV head")
    # (a layout Inductor chose after the choice, padded past 32-bit offsets, takes the torch ops)
    if q.device.type == "cuda" and available() and _spans_fit(q, k, v, mask):
        return _on_gpu(q, k, v, mask, scale)
    return _reference(q, k, v, mask, scale)


def _register() -> torch.library.Library | None:
    lib = new_fragment("split_kv_attention")
    if lib is None:
        return None
    # any layout: the kernels read every operand through its strides, and Inductor then computes a
    # mask several calls share once, where the default constraint had it copy the mask per call
    flexible = getattr(torch.Tag, "flexible_layout", None)
    lib.define(_SCHEMA, tags=(flexible,) if flexible is not None else ())
    lib.impl("split_kv_attention", split_kv_attention, "CompositeExplicitAutograd")
    torch.library.register_fake("ferry::split_kv_attention", lambda q, k, v, mask, scale: _outputs(q, k), lib=lib)
    return lib


_lib = globals().get("_lib") or _register()  # kept: the registrations live as long as it does
SPLIT_KV_ATTENTION = torch.ops.ferry.split_kv_attention.default

"""Attention for one decode step with grouped KV heads: which formulation is fastest on this GPU.

transformers' export repeats each KV head for its query heads (`repeat_kv`: an expand and a copy
of the whole cache, twice per layer) and then calls SDPA with the causal mask over the static
cache. Candidates, timed on the same tensors (bf16, batch 1, Llama-3.2-1B's 32 query and 8 KV
heads of 64, one query token):

- repeat + sdpa: what the exported graph runs;
- sdpa enable_gqa: SDPA told the heads are grouped (no copy of the cache);
- grouped matmuls: the query heads of a group as rows against their KV head (bmm, masked
  softmax in fp32, bmm): no copy of the cache either;
- sdpa enable_gqa under each of SDPA's kernels (cuDNN, memory-efficient, math), for a choice
  of kernel at load;
- grouped matmuls and sdpa enable_gqa compiled by Inductor with its block sizes tuned (what the
  inductor backend would make of either form);
- ferry's split-KV kernels (ferry/ops/split_kv.py), which spread each KV head's cache over the GPU.

By default the three that matter (SDPA, SDPA under Inductor, split-KV) at Llama-1B's, Qwen3-0.6B's
and Whisper-small's heads; `--all-candidates` runs every formulation at Llama-1B's.

`python bench/decode_attention.py` prints a table and writes bench/results/decode_attention.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, table, write_json  # noqa: E402
from gemm_kernels import graph_us  # noqa: E402

from ferry.ops.split_kv import SPLIT_KV_ATTENTION  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64


def repeat_sdpa(q, k, v, mask):
    rep = q.shape[1] // k.shape[1]
    b, h, n, d = k.shape
    k = k[:, :, None].expand(b, h, rep, n, d).reshape(b, h * rep, n, d)
    v = v[:, :, None].expand(b, h, rep, n, d).reshape(b, h * rep, n, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def gqa_sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def grouped_matmuls(q, k, v, mask):
    b, h, s, d = q.shape
    g = k.shape[1]
    qg = q.reshape(b, g, (h // g) * s, d)
    scores = (qg @ k.transpose(-1, -2)).float() * d ** -0.5
    scores = scores.view(b, g, h // g, s, -1) + mask.float().log().unsqueeze(1)  # bool mask -> 0 / -inf
    probs = scores.softmax(-1).to(q.dtype).view(b, g, (h // g) * s, -1)
    return (probs @ v).view(b, h, s, d)


def _on(backend):
    def fn(q, k, v, mask):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return gqa_sdpa(q, k, v, mask)
    return fn


def _compiled(fn):
    made: list = []

    def run(q, k, v, mask):
        if not made:
            made.append(torch.compile(fn, fullgraph=True, options={"coordinate_descent_tuning": True}))
        return made[0](q, k, v, mask)
    return run


CANDIDATES = {"repeat + sdpa": repeat_sdpa, "sdpa enable_gqa": gqa_sdpa, "grouped matmuls": grouped_matmuls,
              **{f"sdpa enable_gqa, {b.lower()}": _on(b) for b in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION",
                                                                    "FLASH_ATTENTION", "MATH")},
              "grouped matmuls, Inductor tuned": _compiled(grouped_matmuls),
              "sdpa enable_gqa, Inductor tuned": _compiled(gqa_sdpa)}


def split_kv(q, k, v, mask):
    """ferry's split-KV kernels (ferry/ops/split_kv.py), the mask read as it is."""
    return SPLIT_KV_ATTENTION(q, k, v, mask, q.shape[-1] ** -0.5)[0]


CANDIDATES["ferry split-KV"] = split_kv
QUICK = ("sdpa enable_gqa", "sdpa enable_gqa, Inductor tuned", "ferry split-KV")
# (model, query heads, KV heads, head dim)
SHAPES = (("llama-1b", HEADS, KV_HEADS, HEAD_DIM), ("qwen3-0.6b", 16, 8, 128), ("whisper-small", 12, 12, 64))


def cases(full: bool):
    """(model, heads, kv heads, dim, batch, cache, mask kind): the grid the LLM benchmark decodes at."""
    if full:
        yield from (("llama-1b", HEADS, KV_HEADS, HEAD_DIM, 1, c, "bool") for c in (1024, 4096))
        return
    for model, h, hkv, d in SHAPES:
        for batch in ((1, 8) if model == "llama-1b" else (1,)):
            for cache in (128, 1024, 4096) if model != "whisper-small" else (448, 1500):
                yield model, h, hkv, d, batch, cache, "additive"


def main():
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--all-candidates", action="store_true", help="every formulation (Llama-1B's heads only)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("decode_attention: skipped: needs a CUDA device")
        return
    rows, out = [], []
    for model, h, hkv, d, batch, cache, kind in cases(args.all_candidates):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, h, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(batch, hkv, cache, d, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        mask = torch.zeros(batch, 1, 1, cache, dtype=torch.bool, device="cuda")
        mask[..., : cache // 2] = True  # the positions written so far
        if kind == "additive":  # as a decode graph has it (choices/attention.py additive_masks)
            mask = torch.where(mask, 0.0, float("-inf")).to(torch.bfloat16)
        want = repeat_sdpa(q.float(), k.float(), v.float(), mask if kind == "bool" else mask.float())
        names = CANDIDATES if args.all_candidates else QUICK
        for name in names:
            fn = CANDIDATES[name]
            try:
                err = float((fn(q, k, v, mask).float() - want).abs().max())
                us = graph_us(lambda fn=fn: fn(q, k, v, mask))
            except Exception as e:  # noqa: BLE001 - a candidate this build cannot run is a row
                rows.append([model, batch, cache, name, f"FAILED {type(e).__name__}: {str(e)[:80]}", ""])
                continue
            rows.append([model, batch, cache, name, round(us, 1), f"{err:.2e}"])
            out.append({"model": model, "heads": h, "kv_heads": hkv, "head_dim": d, "batch": batch, "cache": cache,
                        "mask": kind, "candidate": name, "us": us, "max_err_vs_fp32": err})
    print(table("Decode attention, one layer, one query token (bf16; a CUDA graph of 20 calls)",
                ["model", "batch", "cache", "candidate", "us per call", "max err vs fp32"], rows))
    print(f"wrote {write_json('decode_attention', {'settings': machine(), 'rows': out})}")


if __name__ == "__main__":
    main()

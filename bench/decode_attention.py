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
  inductor backend would make of either form).

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


def main():
    if not torch.cuda.is_available():
        print("decode_attention: skipped: needs a CUDA device")
        return
    rows, out = [], []
    for cache in (1024, 4096):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, KV_HEADS, cache, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        mask = torch.zeros(1, 1, 1, cache, dtype=torch.bool, device="cuda")
        mask[..., : cache // 2] = True  # the positions written so far
        want = repeat_sdpa(q.float(), k.float(), v.float(), mask)
        for name, fn in CANDIDATES.items():
            try:
                err = float((fn(q, k, v, mask).float() - want).abs().max())
                us = graph_us(lambda fn=fn: fn(q, k, v, mask))
            except Exception as e:  # noqa: BLE001 - a candidate this build cannot run is a row
                rows.append([cache, name, f"FAILED {type(e).__name__}", ""])
                continue
            rows.append([cache, name, round(us, 1), f"{err:.2e}"])
            out.append({"cache": cache, "candidate": name, "us": us, "max_err_vs_fp32": err})
    print(table("Decode attention, one layer (bf16, 32 query / 8 KV heads of 64, batch 1)",
                ["cache", "candidate", "us per call", "max err vs fp32"], rows))
    print(f"wrote {write_json('decode_attention', {'settings': machine(), 'rows': out})}")


if __name__ == "__main__":
    main()

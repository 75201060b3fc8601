"""Split-KV decode attention: what its launch settings and a one-kernel form would gain.

    python bench/split_kv_variants.py              # on a GPU: a table and bench/results/split_kv_variants.json
    python bench/split_kv_variants.py --interpret  # on the CPU, Triton's interpreter: the one-kernel form checked

ferry's split-KV attention (ferry/ops/split_kv.py) runs two kernels: each program of the first
computes one stretch of one KV head's cache, the second combines each row's stretches. Timed at
each decode shape of bench/decode_attention.py (a CUDA graph of 20 calls, µs per call):

- `sdpa`: SDPA with `enable_gqa` (cuDNN on an H200), what runs where split-KV is not chosen;
- `split-KV`: ferry's kernels as the op launches them;
- `split-KV, swept`: the fastest of keys per stretch (64-512) x warps (2, 4, 8) x pipeline stages
  (1-3), with the setting that won;
- `split-KV, one kernel`: the last program of each KV head to finish combines its rows (an atomic
  count per KV head, reset by that program), so the second launch goes. An experiment: its
  ordering (every program's partials visible to the last one) is what a GPU run checks: 200
  results in a row bit for bit equal to the two launches', the counts zero after them.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from pathlib import Path

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, table, write_json  # noqa: E402

from ferry.ops import split_kv  # noqa: E402

# (model, query heads, KV heads, head dim, batch, cache)
CASES = (("llama-1b", 32, 8, 64, 1, 1024), ("llama-1b", 32, 8, 64, 1, 4096), ("llama-1b", 32, 8, 64, 8, 1024),
         ("llama-1b", 32, 8, 64, 8, 4096), ("qwen3-0.6b", 16, 8, 128, 1, 1024), ("qwen3-0.6b", 16, 8, 128, 1, 4096),
         ("whisper-small", 12, 12, 64, 1, 448), ("whisper-small", 12, 12, 64, 1, 1500))
SWEEP = {"length": (64, 128, 256, 512), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3)}


_COUNTS: dict = {}  # per (device, batch rows x KV heads): the counts, zero between calls


def one_kernel(q, k, v, mask, scale):
    """Split-KV as one launch (see the module's docstring)."""
    key = (str(q.device), q.shape[0] * k.shape[1])
    if key not in _COUNTS:
        _COUNTS[key] = torch.zeros(key[1], dtype=torch.int32, device=q.device)
    return split_kv._on_gpu(q, k, v, mask, scale, counts=_COUNTS[key])[0]


def _same_as_two_launches(args, calls: int = 200) -> str:
    """The one-launch form's ordering, checked: `calls` results in a row bit for bit equal to the
    two launches' (the same arithmetic in the same order: a partial read before its program
    stored it would differ), and the counts zero after them."""
    want = split_kv._on_gpu(*args)[0]
    same = all(torch.equal(one_kernel(*args), want) for _ in range(calls))
    torch.cuda.synchronize()
    zero = not any(c.any() for c in _COUNTS.values())
    return f"{calls} calls {'equal' if same else 'DIFFER'} to two launches, counts {'zero' if zero else 'NOT zero'}"


def inputs(h, hkv, d, batch, cache, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, h, 1, d, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(batch, hkv, cache, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    allowed = torch.arange(cache, device=device) < cache // 2  # the positions written so far
    mask = torch.where(allowed, 0.0, -math.inf).to(dtype).expand(batch, 1, 1, cache)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(),
                                          enable_gqa=h != hkv)
    return (q, k, v, mask, d ** -0.5), want


def interpret() -> None:
    """The one-kernel form against SDPA on the CPU (fp16: the interpreter has no bf16)."""
    torch.cuda.device = lambda device: __import__("contextlib").nullcontext()
    for model, h, hkv, d, batch, cache in sorted({(m, h, hkv, d, min(b, 2), min(c, 512)) for m, h, hkv, d, b, c in CASES}):
        args, want = inputs(h, hkv, d, batch, cache, "cpu", torch.float16)
        err = float((one_kernel(*args).float() - want).abs().max())
        print(f"{model} batch {batch} cache {cache}: max err {err:.2e}")
        assert err < 4e-3 and not any(c.any() for c in _COUNTS.values()), err  # the counts left zero


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interpret", action="store_true", help="check the one-kernel form on the CPU (Triton's interpreter)")
    args = p.parse_args()
    if args.interpret:
        interpret()
        return
    if not torch.cuda.is_available() or not split_kv.available():
        print("split_kv_variants: skipped: needs a CUDA device and Triton")
        return
    from gemm_kernels import graph_us

    rows, out = [], []
    for model, h, hkv, d, batch, cache in CASES:
        args, want = inputs(h, hkv, d, batch, cache, "cuda", torch.bfloat16)
        q, k, v, mask, scale = args
        forms = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h != hkv),
                 "split-KV": lambda: split_kv._on_gpu(*args)[0], "split-KV, one kernel": lambda: one_kernel(*args)}
        found = {}
        for name, fn in forms.items():
            try:
                found[name] = (graph_us(fn), float((fn().float() - want).abs().max()), "")
            except Exception as e:  # noqa: BLE001 - a form this build cannot run is a row
                found[name] = (math.nan, math.nan, f"{type(e).__name__}: {str(e)[:60]}")
        best = (math.inf, math.nan, "")
        for length, warps, stages in itertools.product(*SWEEP.values()):
            if length > max(64, cache):
                continue
            fn = lambda: split_kv._on_gpu(*args, length=length, num_warps=warps, num_stages=stages)[0]  # noqa: E731
            try:
                us = graph_us(fn)
            except Exception:  # noqa: BLE001 - a setting past the GPU's resources
                continue
            if us < best[0]:
                best = (us, float((fn().float() - want).abs().max()), f"{length} keys, {warps} warps, {stages} stages")
        found["split-KV, swept"] = best
        found["split-KV, one kernel"] = (*found["split-KV, one kernel"][:2], _same_as_two_launches(args))
        for name, (us, err, note) in found.items():
            rows.append([model, batch, cache, name, round(us, 1), f"{err:.1e}", note])
            out.append({"model": model, "batch": batch, "cache": cache, "form": name, "us": us,
                        "max_err_vs_fp32": err, "note": note})
    print(table("Split-KV variants, one layer, one query token (bf16; a CUDA graph of 20 calls)",
                ["model", "batch", "cache", "form", "us per call", "max err vs fp32", "setting / error"], rows))
    print(f"wrote {write_json('split_kv_variants', {'settings': machine(), 'rows': out})}")


if __name__ == "__main__":
    main()

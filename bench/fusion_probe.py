"""How many kernels Inductor launches for a decoder layer's small work under its fusion settings.

`python bench/fusion_probe.py` compiles LAYERS Llama-shaped layers' rotary (32 query and 8 KV heads
of 64), KV-cache writes and per-layer position counters, alone, once with each setting below, and
counts the kernel launches in Inductor's code: Triton kernels on a GPU, C++ kernels on the CPU
(where combo kernels do not apply). Each compiled result is checked against eager in fp32 within
bf16 rounding. This is what made ferry compile decode graphs with pointwise combo kernels
(backends/inductor.py COMBO_KERNELS; docs/benchmarks.md, 2026-12-04, night).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_json  # noqa: E402

LAYERS, HEADS, KV_HEADS, DIM, CACHE = 4, 32, 8, 64, 128
SETTINGS = {
    "default": {},
    "aggressive_fusion": {"aggressive_fusion": True},
    "combo_kernels": {"combo_kernels": True},
    "combo_kernels, pointwise only": {"combo_kernels": True, "combo_kernels_pointwise_only": True},
}


def rotate_half(x):
    return torch.cat((-x[..., DIM // 2:], x[..., :DIM // 2]), -1)


def layers(qkv, cos, sin, pos, caches, counters):
    """Each layer: q and k rotated (as transformers' Llama), k and v written into the cache at
    `pos`, the layer's counter set to the next position. Returns the rotated queries."""
    outs = []
    q_end, k_end = HEADS * DIM, (HEADS + KV_HEADS) * DIM
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    for i, row in enumerate(qkv):
        q = row[..., :q_end].view(1, 1, HEADS, DIM).transpose(1, 2)
        k = row[..., q_end:k_end].view(1, 1, KV_HEADS, DIM).transpose(1, 2)
        v = row[..., k_end:].view(1, 1, KV_HEADS, DIM).transpose(1, 2)
        caches[2 * i].index_copy_(2, pos, k * c + rotate_half(k) * s)
        caches[2 * i + 1].index_copy_(2, pos, v)
        outs.append(q * c + rotate_half(q) * s)
        counters[i].copy_(pos[0] + 1)
    return outs


def state(device, dtype):
    caches = [torch.zeros(1, KV_HEADS, CACHE, DIM, device=device, dtype=dtype) for _ in range(2 * LAYERS)]
    return caches, [torch.zeros((), device=device, dtype=torch.long) for _ in range(LAYERS)]


def probe(name: str, options: dict, inputs: tuple, device: torch.device) -> list:
    known = {k: v for k, v in options.items() if hasattr(torch._inductor.config, k)}
    if len(known) < len(options):
        return [name, "-", "-", "this Inductor lacks " + ", ".join(sorted(set(options) - set(known)))]
    torch._dynamo.reset()
    caches, counters = state(device, torch.bfloat16)
    with torch._inductor.config.patch(fx_graph_cache=False, **known):
        compiled = torch.compile(layers, fullgraph=True)
        got, codes = run_and_get_code(compiled, *inputs, caches, counters)
    pattern = r"^\s+(triton_\w+)\.run\(" if device.type == "cuda" else r"^\s+(cpp_fused_\w+)\("
    launches = re.findall(pattern, "\n".join(codes), re.M)
    qkv, cos, sin, pos = inputs
    fp32 = ([row.float() for row in qkv], cos.float(), sin.float(), pos)
    ref_caches, ref_counters = state(device, torch.float32)
    want = layers(*fp32, ref_caches, ref_counters)
    close = all(torch.allclose(g.float(), w, rtol=2 ** -7, atol=2 ** -7 * w.abs().max().item())
                for g, w in zip(got + caches, want + ref_caches))
    counted = all(int(c) == int(pos[0]) + 1 for c in counters)
    return [name, len(launches), "yes" if close and counted else "NO", ", ".join(sorted(set(launches)))[:120]]


def main():
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, 1, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(device, torch.bfloat16)
           for _ in range(LAYERS)]
    angles = torch.rand(1, 1, DIM, generator=gen) * 6.3
    inputs = (qkv, angles.cos().to(device, torch.bfloat16), angles.sin().to(device, torch.bfloat16),
              torch.tensor([CACHE // 2], device=device))
    rows = [probe(name, options, inputs, device) for name, options in SETTINGS.items()]
    print(table(f"Kernel launches for {LAYERS} layers' rotary, cache writes and counters ({device})",
                ["setting", "launches", "equals eager", "kernels"], rows))
    print(f"wrote {write_json('fusion_probe', {'rows': rows})}")


if __name__ == "__main__":
    main()

"""fp32 GEMMs with a bias and attention on CUDA, eager's fused kernels against the composed forms
ferry may choose, at the shapes of BERT, ViT-B/16 and GPT-2; µs each, replayed from a CUDA graph
(the GPU's time alone). The measurements behind ferry/choices/gemm.py and
ferry/choices/attention.py.

    python bench/gemm_kernels.py

Columns: addmm (eager's kernel); mm+add (ferry's split); addmm_2d (a 2-D expanded bias, which
takes ATen's non-Lt path); mm (the product alone); mm_wcontig (the product with the weight laid
out (in, out) instead of transposed). Last, ViT's attention block: the fused
`_native_multi_head_attention` against its GEMMs and `scaled_dot_product_attention` run apart,
and against ferry's composed form with every part composed (attention_choice's). Then
`scaled_dot_product_attention` (fp32: the memory-efficient kernel) against q @ kᵀ, softmax, @ v
(`ferry.choices.attention.composed_attention`; causal ones with the mask applied to the scores, as
eager's math would: ferry keeps the fused kernel for those).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_json  # noqa: E402

SHAPES = {  # (rows, inner, cols) of each model's biased GEMMs at one batch
    "bert1": [(128, 768, 768), (128, 768, 3072), (128, 3072, 768)],
    "bert8": [(1024, 768, 768), (1024, 768, 3072), (1024, 3072, 768)],
    "vit1": [(197, 768, 2304), (197, 768, 768), (197, 768, 3072), (197, 3072, 768)],
    "vit4": [(788, 768, 2304), (788, 768, 768), (788, 768, 3072), (788, 3072, 768)],
    "gpt1": [(64, 512, 1536), (64, 512, 512), (64, 512, 2048), (64, 2048, 512)],
    "gpt8": [(512, 512, 1536), (512, 512, 512), (512, 512, 2048), (512, 2048, 512)],
    "big": [(4096, 4096, 4096), (8192, 1024, 4096)],
}
BF16_GROUPS = ("bert1", "vit1", "bert8")


def graph_us(fn, reps=20, rounds=5) -> float:
    """Median µs per call of `fn`, `reps` calls captured in one CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def one_shape(group, dtype, m, k, n) -> dict:
    x, w = torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(n, k, device="cuda", dtype=dtype)
    b, y = torch.randn(n, device="cuda", dtype=dtype), torch.empty(m, n, device="cuda", dtype=dtype)
    wt, be = w.t(), b.expand(m, n)
    wtc = wt.contiguous()
    row = {"group": group, "dtype": str(dtype).removeprefix("torch."), "mkn": [m, k, n],
           "addmm": graph_us(lambda: torch.addmm(b, x, wt, out=y)),
           "mm+add": graph_us(lambda: (torch.mm(x, wt, out=y), y.add_(b))),
           "addmm_2d": graph_us(lambda: torch.addmm(be, x, wt, out=y)),
           "mm": graph_us(lambda: torch.mm(x, wt, out=y)),
           "mm_wcontig": graph_us(lambda: torch.mm(x, wtc, out=y))}
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    torch.mm(x, wt, out=y)
    row["err_mm_add"] = float((y.add_(b).float() - ref).abs().max())
    return row


def attention(batch, embed=768, heads=12, seq=197) -> dict:
    mha = torch.nn.MultiheadAttention(embed, heads, batch_first=True).cuda().eval()
    x = torch.randn(batch, seq, embed, device="cuda")
    w, b, wo, bo = mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight, mha.out_proj.bias
    qkv, o = torch.empty(batch * seq, 3 * embed, device="cuda"), torch.empty(batch * seq, embed, device="cuda")

    def native():
        return torch._native_multi_head_attention(x, x, x, embed, heads, w, b, wo, bo, need_weights=False)[0]

    def apart(fused_bias):
        gemm = (lambda bias, a, m, out: torch.addmm(bias, a, m, out=out)) if fused_bias else (
            lambda bias, a, m, out: torch.mm(a, m, out=out).add_(bias))
        gemm(b, x.view(batch * seq, embed), w.t(), qkv)
        q, k, v = qkv.view(batch, seq, 3, heads, embed // heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch * seq, embed)
        gemm(bo, a, wo.t(), o)
        return o.view(batch, seq, embed)

    composed = _all_composed(x, [w, b, wo, bo], heads)
    with torch.no_grad():
        err = float((apart(False) - native()).abs().max())
        err_composed = float((composed(x, x, x, embed, heads, w, b, wo, bo)[0] - native()).abs().max())
        return {"batch": batch, "native": graph_us(native, reps=10), "apart_addmm": graph_us(lambda: apart(True), reps=10),
                "apart_mm_add": graph_us(lambda: apart(False), reps=10),
                "ferry_composed": graph_us(lambda: composed(x, x, x, embed, heads, w, b, wo, bo), reps=10),
                "err": err, "err_composed": err_composed}


def _all_composed(x, weights, heads):
    """attention_choice's multi-head form with every part composed (the timing forced to favour them)."""
    from ferry.choices import attention as attention_choice
    from ferry.choices import timing as kernel_timing
    from ferry.choices.decisions import Site

    saved = kernel_timing.KEEP_IF_ABOVE, kernel_timing.MIN_SAVING_US
    kernel_timing.KEEP_IF_ABOVE, kernel_timing.MIN_SAVING_US = float("inf"), -float("inf")
    try:
        fn = attention_choice.form(torch.ops.aten._native_multi_head_attention.default,
                                   [x, x, x, x.shape[2], heads, *weights], {"need_weights": False},
                                   Site(x.device, measure=True, captured=True))
    finally:
        kernel_timing.KEEP_IF_ABOVE, kernel_timing.MIN_SAVING_US = saved
    assert fn is not None and fn.parts == (True, True, True)
    return fn


ATTENTION = {  # (batch, heads, tokens, head_dim, causal)
    "vit1": (1, 12, 197, 64, False), "vit4": (4, 12, 197, 64, False), "bert1": (1, 12, 128, 64, False),
    "bert8": (8, 12, 128, 64, False), "gpt1": (1, 8, 64, 64, True), "gpt8": (8, 8, 64, 64, True),
}


def sdpa(group, b, h, t, d, causal) -> dict:
    from ferry.choices.attention import composed_attention

    q, k, v = (torch.randn(b, h, t, d, device="cuda") for _ in range(3))
    mask = torch.ones(t, t, device="cuda", dtype=torch.bool).triu_(1) if causal else None

    def composed():
        if mask is None:
            return composed_attention(q, k, v)
        scores = torch.matmul(q, k.transpose(-2, -1)).mul_(d ** -0.5).masked_fill_(mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, -1), v)

    fused = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    return {"group": group, "shape": [b, h, t, d], "causal": causal, "fused": graph_us(fused),
            "composed": graph_us(composed), "err_fused": float((fused() - ref).abs().max()),
            "err_composed": float((composed() - ref).abs().max())}


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = [one_shape(g, dtype, *s) for dtype in (torch.float32, torch.bfloat16)
            for g, shapes in SHAPES.items() if dtype == torch.float32 or g in BF16_GROUPS for s in shapes]
    cols = ["addmm", "mm+add", "addmm_2d", "mm", "mm_wcontig"]
    print(table("Biased GEMMs, µs each (CUDA graph replay)", ["shapes", "dtype", "rows x inner x cols", *cols],
                [[r["group"], r["dtype"], "x".join(map(str, r["mkn"])), *(r[c] for c in cols)] for r in rows]))
    attn = [attention(b) for b in (1, 4)]
    print(table("ViT-B/16 multi-head attention, µs each", ["batch", "native MHA", "apart, addmm", "apart, mm+add",
                                                           "ferry composed"],
                [[a["batch"], a["native"], a["apart_addmm"], a["apart_mm_add"], a["ferry_composed"]] for a in attn]))
    kernels = [sdpa(g, *shape) for g, shape in ATTENTION.items()]
    print(table("fp32 attention, µs each", ["shapes", "batch x heads x tokens x dim", "causal", "fused", "composed"],
                [[r["group"], "x".join(map(str, r["shape"])), r["causal"], r["fused"], r["composed"]] for r in kernels]))
    print(f"wrote {write_json('gemm_kernels', {'rows': rows, 'attention': attn, 'sdpa': kernels})}")


if __name__ == "__main__":
    main()

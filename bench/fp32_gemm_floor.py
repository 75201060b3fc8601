"""How fast ViT-B/16's layers can run at batch 1 in fp32 (TF32 off) on this GPU, against half
of eager's time for the whole model: the bound on issue 12's "at most half of eager with CUDA
graphs" for that model.

    python bench/fp32_gemm_floor.py [--no-triton]

For each GEMM of a layer (µs, replayed from a CUDA graph): cuBLAS's `mm` and `addmm`; split-K
(the inner dimension cut into s parts as one batched GEMM, then summed, for the s that does
best); Inductor's Triton templates (max-autotune, cuBLAS left out, slow to tune: --no-triton
skips it); and which kernels TunableOp can pick from on this GPU. Then one whole layer as ferry
composes it in a captured plan (layer norms, GEMMs, attention as GEMMs and a softmax, GELU,
residuals) in one graph, times the model's 12 layers, against eager's ViT-B/16 (torchvision,
random weights) in the same process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import table, time_host, write_json  # noqa: E402
from gemm_kernels import graph_us  # noqa: E402

TOKENS, WIDTH, HEADS, HIDDEN, LAYERS = 197, 768, 12, 3072, 12
SHAPES = [(TOKENS, WIDTH, 3 * WIDTH), (TOKENS, WIDTH, WIDTH), (TOKENS, WIDTH, HIDDEN), (TOKENS, HIDDEN, WIDTH)]


def split_k(bias, x, wt, parts):
    rows, inner = x.shape
    partial = torch.bmm(x.view(rows, parts, inner // parts).transpose(0, 1), wt.view(parts, inner // parts, -1))
    return partial.sum(0).add_(bias)


def triton_us(bias, x, w) -> float:
    import torch._inductor.config as inductor

    inductor.max_autotune_gemm_backends = "TRITON"
    torch._dynamo.reset()
    fn = torch.compile(lambda b, a, w: torch.addmm(b, a, w.t()), mode="max-autotune-no-cudagraphs", dynamic=False)
    return graph_us(lambda: fn(bias, x, w))


def tunable_choices(shapes) -> list[str]:
    """The kernels TunableOp picked among for these GEMMs (on CUDA: cuBLAS's default alone, so far)."""
    import tempfile

    from torch.cuda import tunable

    tunable.set_filename(str(Path(tempfile.mkdtemp()) / "tunableop_results.csv"))  # not into the working tree
    tunable.enable(True)
    tunable.tuning_enable(True)
    try:
        for m, k, n in shapes:
            torch.mm(torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda").t())
        torch.cuda.synchronize()
        return sorted({r[2] for r in tunable.get_results()})
    finally:
        tunable.enable(False)


def one_gemm(m, k, n, triton: bool) -> dict:
    x, w, bias = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"), torch.randn(n, device="cuda")
    wt = w.t()
    row = {"mkn": [m, k, n], "mm": graph_us(lambda: torch.mm(x, wt)),
           "addmm": graph_us(lambda: torch.addmm(bias, x, wt)),
           "mm+add": graph_us(lambda: torch.mm(x, wt).add_(bias))}
    splits = {s: graph_us(lambda s=s: split_k(bias, x, wt, s)) for s in (2, 3, 4, 6, 8) if k % s == 0}
    row["split_k_parts"], row["split_k"] = min(splits.items(), key=lambda kv: kv[1])
    row["triton"] = triton_us(bias, x, w) if triton else None
    row["best"] = min(v for key, v in row.items() if key in ("mm", "addmm", "mm+add", "split_k", "triton") and v)
    return row


def layer(x, p):
    """One encoder layer as ferry runs it in a captured plan at batch 1 (attention composed)."""
    from ferry.choices.attention import composed_attention

    h = F.layer_norm(x, (WIDTH,), p["ln1_w"], p["ln1_b"])
    qkv = torch.addmm(p["in_b"], h, p["in_w"].t())
    q, k, v = qkv.view(1, TOKENS, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
    a = composed_attention(q, k, v).transpose(1, 2).reshape(TOKENS, WIDTH)
    x = x + torch.mm(a, p["out_w"].t()).add_(p["out_b"])
    h = F.gelu(torch.addmm(p["fc1_b"], F.layer_norm(x, (WIDTH,), p["ln2_w"], p["ln2_b"]), p["fc1_w"].t()))
    return x + torch.mm(h, p["fc2_w"].t()).add_(p["fc2_b"])


def layer_params() -> dict:
    shapes = {"ln1_w": (WIDTH,), "ln1_b": (WIDTH,), "ln2_w": (WIDTH,), "ln2_b": (WIDTH,),
              "in_w": (3 * WIDTH, WIDTH), "in_b": (3 * WIDTH,), "out_w": (WIDTH, WIDTH), "out_b": (WIDTH,),
              "fc1_w": (HIDDEN, WIDTH), "fc1_b": (HIDDEN,), "fc2_w": (WIDTH, HIDDEN), "fc2_b": (WIDTH,)}
    return {name: torch.randn(shape, device="cuda") * 0.02 for name, shape in shapes.items()}


def eager_vit_ms() -> float:
    from models import MODELS

    model, (x,) = MODELS["vit_b_16"][0](1)
    model, x = model.cuda().eval(), x.cuda()
    with torch.no_grad():
        return time_host(lambda: model(x), repeat=50, warmup=10) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-triton", action="store_true", help="skip Inductor's Triton templates (minutes of tuning)")
    p.add_argument("--smoke", action="store_true", help="as --no-triton")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("fp32_gemm_floor: skipped: no CUDA device (it measures cuBLAS and Triton kernels)")
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = [one_gemm(*s, triton=not (args.no_triton or args.smoke)) for s in SHAPES]
    cols = ["mm", "addmm", "mm+add", "split_k", "triton", "best"]
    print(table("ViT-B/16 batch 1 fp32 GEMMs, µs each (CUDA graph replay)", ["rows x inner x cols", *cols],
                [["x".join(map(str, r["mkn"])), *(r[c] if r[c] is not None else "-" for c in cols)] for r in rows]))
    params, x = layer_params(), torch.randn(TOKENS, WIDTH, device="cuda")
    with torch.no_grad():
        layer_us = graph_us(lambda: layer(x, params))
    eager_ms = eager_vit_ms()
    result = {"gemms": rows, "tunable_op_kernels": tunable_choices(SHAPES), "layer_us": layer_us,
              "best_gemms_per_layer_us": sum(r["best"] for r in rows), "eager_model_ms": eager_ms,
              "layers_ms": LAYERS * layer_us / 1e3, "half_of_eager_ms": eager_ms / 2}
    print(table("ViT-B/16 at batch 1: the bound", ["", "ms"], [
        ["12 layers' GEMMs, each at the best kernel found", LAYERS * result["best_gemms_per_layer_us"] / 1e3],
        ["12 layers as ferry composes them, one graph", result["layers_ms"]],
        ["eager, the whole model (this process)", eager_ms], ["half of eager", eager_ms / 2]]))
    print("TunableOp's kernels on this GPU:", ", ".join(result["tunable_op_kernels"]))
    print(f"wrote {write_json('fp32_gemm_floor', result)}")


if __name__ == "__main__":
    main()

"""ResNet's convolutions of one image on CUDA: cuDNN (as eager runs them, the fused call ferry's
ops make, and channels-last) against ferry's GEMM over the image's patches
(`ferry.choices.conv.conv_as_gemm`: im2col, one GEMM, the bias and the ReLU in place), µs each replayed
from a CUDA graph, TF32 off. The measurements behind ferry/choices/conv.py.

    python bench/conv_gemm.py

Each row is one convolution shape of ResNet-18 or ResNet-50 at batch 1 (224 x 224), with how many
times each model runs it; the last rows sum each model's convolutions per column, and the best of
cuDNN's fused call and the GEMM per shape (what ferry's timing at load picks). Writes
bench/results/conv_gemm.json (FERRY_BENCH_OUT).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_json  # noqa: E402
from gemm_kernels import graph_us  # noqa: E402

from ferry.choices.conv import conv_as_gemm  # noqa: E402

# (in, out, image side, kernel, stride, padding, times in ResNet-50, times in ResNet-18)
SHAPES = [(3, 64, 224, 7, 2, 3, 1, 1),
          (64, 64, 56, 3, 1, 1, 3, 4), (128, 128, 56, 3, 2, 1, 1, 0), (128, 128, 28, 3, 1, 1, 3, 3),
          (64, 128, 56, 3, 2, 1, 0, 1), (256, 256, 28, 3, 2, 1, 1, 0), (256, 256, 14, 3, 1, 1, 5, 3),
          (128, 256, 28, 3, 2, 1, 0, 1), (512, 512, 14, 3, 2, 1, 1, 0), (512, 512, 7, 3, 1, 1, 2, 3),
          (256, 512, 14, 3, 2, 1, 0, 1), (64, 256, 56, 1, 1, 0, 4, 0), (256, 64, 56, 1, 1, 0, 2, 0),
          (1024, 256, 14, 1, 1, 0, 5, 0), (256, 1024, 14, 1, 1, 0, 6, 0), (2048, 512, 7, 1, 1, 0, 2, 0),
          (512, 2048, 7, 1, 1, 0, 3, 0)]
FORMS = ("cudnn", "cudnn_fused", "channels_last", "gemm")


def one_shape(ci, co, hw, k, stride, pad) -> dict:
    x = torch.randn(1, ci, hw, hw, device="cuda")
    w = torch.randn(co, ci, k, k, device="cuda") / (ci * k * k) ** 0.5
    b = torch.randn(co, device="cuda")
    xcl, wcl = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    forms = {
        "cudnn": lambda: torch.relu_(F.conv2d(x, w, b, stride, pad)),
        "cudnn_fused": lambda: torch.cudnn_convolution_relu(x, w, b, (stride, stride), (pad, pad), (1, 1), 1),
        "channels_last": lambda: torch.relu_(F.conv2d(xcl, wcl, b, stride, pad)),
        "gemm": lambda: conv_as_gemm(x, w, b, None, (stride, stride), (pad, pad)),
    }
    want = F.conv2d(x.double(), w.double(), b.double(), stride, pad).relu()
    row: dict = {}
    for name, fn in forms.items():
        row[name] = graph_us(fn)
        row[name + "_err"] = float((fn().double() - want).abs().max() / want.abs().max())
    return row


def main() -> None:
    if not torch.cuda.is_available():
        print("conv_gemm: skipped: no CUDA device")
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for ci, co, hw, k, stride, pad, n50, n18 in SHAPES:
        row = {"in": ci, "out": co, "side": hw, "kernel": k, "stride": stride, "padding": pad,
               "resnet50": n50, "resnet18": n18, **one_shape(ci, co, hw, k, stride, pad)}
        row["best"] = min(row["cudnn_fused"], row["gemm"])
        rows.append(row)
    totals = {m: {f: sum(r[m] * r[f] for r in rows) for f in (*FORMS, "best")} for m in ("resnet50", "resnet18")}
    header = ["in", "out", "side", "kernel", "stride", "x R50", "x R18", *FORMS, "gemm err"]
    cells = [[r["in"], r["out"], r["side"], r["kernel"], r["stride"], r["resnet50"], r["resnet18"],
              *(r[f] for f in FORMS), r["gemm_err"]] for r in rows]
    cells += [[m, "", "", "", "", "", "", *(t[f] for f in FORMS), f"best of each: {t['best']:.0f}"]
              for m, t in totals.items()]
    print(table("Convolutions of one image, µs each replayed from a CUDA graph (TF32 off)", header, cells))
    print("wrote", write_json("conv_gemm", {"rows": rows, "totals_us": totals}))


if __name__ == "__main__":
    main()

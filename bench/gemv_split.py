"""One-row products split along K: would a hand-written Triton GEMV stream small weights faster?

    python bench/gemv_split.py --model qwen3-0.6b   # on a GPU: a table and bench/results/gemv_split.json
    python bench/gemv_split.py --interpret          # on the CPU, Triton's interpreter: the kernel checked

A decode step's narrow projections (few outputs, a long reduction: Qwen3-0.6B's down projection,
3072 -> 1024, and o projection, 2048 -> 1024) ran at 1.0-1.2 TB/s as Inductor's tuned reductions
in the step's profile (bench/results/llm_profile_combo_pointwise.json), where the wide ones reach
2.5 and the head 4.5: with one program per few outputs, 1024 outputs give too few programs, each
reading its rows in a loop, to keep enough bytes in flight. Here each program computes BN outputs
over one of SPLIT stretches of K; with SPLIT > 1 the last program of each block of outputs to
finish (an atomic count, left zero again) sums the stretches' partials in a fixed order, so the
result is deterministic and one launch. Swept: BN x BK x SPLIT x warps x stages, against cuBLAS's
`linear` and Inductor's tuned reduction (bench/gemv_kernels.py's), weights cold (rotated through
more copies than L2 holds), in CUDA graphs. Not yet run on a GPU: its one run (2026-12-06, an
H200) had 80 s, too few for the sweep's compiles; checked under the interpreter only.
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
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, table, write_json  # noqa: E402
from gemv_kernels import COLD_BYTES, SHAPES, time_graph, variants  # noqa: E402

SWEEP = {"BN": (2, 4, 8, 16), "BK": (256, 512, 1024), "SPLIT": (1, 2, 4, 8), "num_warps": (4, 8), "num_stages": (1, 3)}
QUICK = {"BN": (2, 4, 8, 16), "BK": (256, 512), "SPLIT": (1, 2, 4), "num_warps": (4, 8), "num_stages": (1,)}


@triton.jit
def gemv(X, W, Out, Part, Counts, N, K, swn, CHUNK, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
         STAGES: tl.constexpr):
    """Program (block of BN outputs, stretch of K): the block's sums over the stretch, fp32."""
    pn, ps = tl.program_id(0), tl.program_id(1)
    n = pn * BN + tl.arange(0, BN)
    n_ok = n < N
    acc = tl.zeros([BN, BK], tl.float32)
    for i in tl.range(0, CHUNK, BK, num_stages=STAGES):
        k = ps * CHUNK + i + tl.arange(0, BK)
        k_ok = k < K
        x = tl.load(X + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(W + n[:, None] * swn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    s = tl.sum(acc, 1)
    if SPLIT == 1:
        tl.store(Out + n, s.to(Out.dtype.element_ty), mask=n_ok)
    else:
        tl.store(Part + ps * N + n, s, mask=n_ok)
        tl.debug_barrier()  # every thread's partials stored before the count says so
        if tl.atomic_add(Counts + pn, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros([BN], tl.float32)
            for j in tl.static_range(SPLIT):
                total += tl.load(Part + j * N + n, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(Out + n, total.to(Out.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(Counts + pn, 0)  # ready for the next call (a graph replays the same counts)


_SCRATCH: dict = {}


def split_gemv(x: torch.Tensor, w: torch.Tensor, BN=4, BK=256, SPLIT=1, num_warps=4, num_stages=1) -> torch.Tensor:
    """x [K] (one row), w [N, K] -> [N], x's dtype."""
    (n, k), out = w.shape, x.new_empty(w.shape[0])
    chunk = triton.cdiv(triton.cdiv(k, SPLIT), BK) * BK
    blocks = triton.cdiv(n, BN)
    key = (str(x.device), n, blocks, SPLIT)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(SPLIT * n, dtype=torch.float32, device=x.device),
                         torch.zeros(blocks, dtype=torch.int32, device=x.device))
    part, counts = _SCRATCH[key]
    gemv[(blocks, triton.cdiv(k, chunk))](x, w, out, part, counts, n, k, w.stride(0), chunk, BN=BN, BK=BK,
                                          SPLIT=triton.cdiv(k, chunk), STAGES=num_stages, num_warps=num_warps)
    return out


def interpret() -> None:
    """The kernel against fp32 on the CPU (fp16: the interpreter has no bf16), every SPLIT."""
    g = torch.Generator().manual_seed(0)
    for n, k in ((100, 300), (64, 1024), (33, 77)):
        x, w = torch.randn(k, generator=g).half(), torch.randn(n, k, generator=g).half()
        want = w.float() @ x.float()
        for split, bn in itertools.product((1, 2, 4), (1, 4, 16)):
            got = split_gemv(x, w, BN=bn, BK=64, SPLIT=split)
            err = float((got.float() - want).abs().max())
            assert err < 0.05 * max(1.0, float(want.abs().max())) ** 0.5, (n, k, split, bn, err)
            assert not any(c.any() for _, c in _SCRATCH.values())  # the counts left zero
        print(f"{n} x {k}: every split and block size within fp16 rounding")


def _cold(n: int, k: int, dtype) -> list[torch.Tensor]:
    copies = max(2, math.ceil(COLD_BYTES / (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(copies)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--out", default="gemv_split")
    p.add_argument("--shapes", default="", help="comma-separated linears of the model (default: all but the head)")
    p.add_argument("--quick", action="store_true", help="a smaller sweep (one stage count, BK up to 512)")
    args = p.parse_args()
    if args.interpret:
        interpret()
        return
    torch.manual_seed(0)
    rows, out = [], []
    for name, (k, n) in SHAPES[args.model].items():
        if name == "lm_head" if not args.shapes else name not in args.shapes.split(","):
            continue
        ws = _cold(n, k, torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = (ws[0].float() @ x[0].float())
        found = {}
        base = variants()
        for form in ("linear", "reduce_tuned"):
            us = time_graph(base[form], x, ws, [w.t() for w in ws])
            found[form] = (us, "")
        best = (math.inf, "")
        for bn, bk, split, warps, stages in itertools.product(*(QUICK if args.quick else SWEEP).values()):
            if bk * split > 2 * k or bn * bk > 8192:
                continue
            fn = lambda x_, w_, wt_: split_gemv(x_[0], w_, bn, bk, split, warps, stages)  # noqa: E731
            try:
                err = float((fn(x, ws[0], None).float() - want).abs().max())
                if err > 0.05 * float(want.abs().max()):
                    print(f"  {name} BN {bn} BK {bk} SPLIT {split}: WRONG, max err {err:.3g}")
                    continue
                us = time_graph(fn, x, ws, ws)
            except Exception as e:  # noqa: BLE001 - a setting past the GPU's resources
                print(f"  {name} BN {bn} BK {bk} SPLIT {split} warps {warps}: {type(e).__name__}")
                continue
            if us < best[0]:
                best = (us, f"BN {bn}, BK {bk}, SPLIT {split}, {warps} warps, {stages} stages")
        found["triton split"] = best
        for form, (us, note) in found.items():
            tbps = n * k * 2 / (us * 1e-6) / 1e12
            rows.append([name, f"{k} -> {n}", form, round(us, 2), round(tbps, 2), note])
            out.append({"linear": name, "in": k, "out": n, "form": form, "us": us, "tbps": tbps, "setting": note})
            print(f"{name} {k} -> {n}: {form} {us:.2f} µs ({tbps:.2f} TB/s) {note}", flush=True)
        del ws
        torch.cuda.empty_cache()
    print(table(f"one-row products, {args.model}", ["linear", "shape", "form", "µs", "TB/s", "best setting"], rows))
    write_json(args.out, {"machine": machine(), "model": args.model, "rows": out})


if __name__ == "__main__":
    main()

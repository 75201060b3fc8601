"""int4 matrix-vector products at a decoder's decode shapes: tinygemm's kernel against Inductor's
reductions over the plain int4 values.

    python bench/int4_gemv_kernels.py [--model llama-1b] [--group 128]

torchao's `Int4WeightOnlyConfig` packs each weight into tinygemm's tiles; a decode step multiplies
one row by each. For each linear of the model (as torchao quantizes it: q, k, v, o, gate, up, down,
the head) this times, from a CUDA graph with the weights rotated through more copies than fit in
L2 (a decode step reads them cold):

- `tinygemm`: `_weight_int4pack_mm` on the packed tiles (what torchao runs);
- `words`: each element of the sum an int32 word of eight values, its scale applied once
  (`s sum_j x_j q_j + (z - 8 s) sum_j x_j`), the row read as it is;
- `words inlined`: the same, Inductor told not to store the word's eight products first (its
  default, for a pointwise of more than 8 reads, made a second kernel and an fp32 buffer 8x the weight);
- `words xt inlined`: the same, the row given transposed ([8, k / 8], as the kernel producing it
  could store it), so each of its eight loads per word is contiguous;
- `flat`: one element of the sum per value (a flat sum over k), scales indexed by k // group;
- `bytes`: the values read a byte at a time, each dequantized and rounded to bf16, summed over
  (groups, values of a group);
- `triton`: a hand-written Triton kernel over the words (each program: a block of rows, one or
  two groups of words per step taken a nibble at a time, a share of the groups; partial sums per
  share added after), its block of rows, warps, shares and groups per step swept, the fastest
  reported (`--forms triton` runs it alone), timed alone and with its partial sums added up;
- `bf16 linear`: cuBLAS on the bf16 weight of the same shape, for scale.
The Inductor forms are compiled with coordinate-descent tuning, as ferry compiles its bf16
reductions. `--interpret` checks the Triton kernel against the exact product on the CPU (Triton's
interpreter; no timing), for work on it without a GPU.

Columns give µs per product and the achieved TB/s (bytes of packed weight and scales / time).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, table, write_json  # noqa: E402

from ferry.choices import gemv, timing  # noqa: E402

aten = torch.ops.aten
SHAPES = {  # name: (in, out) of each linear torchao quantizes in one layer, then the head
    "llama-1b": {"q/o": (2048, 2048), "k/v": (2048, 512), "gate/up": (2048, 8192), "down": (8192, 2048),
                 "lm_head": (2048, 128256)},
    "qwen3-0.6b": {"q": (1024, 2048), "k/v": (1024, 1024), "o": (2048, 1024), "gate/up": (1024, 3072),
                   "down": (3072, 1024), "lm_head": (1024, 151936)},
}


def by_words(x, words, scales, group):
    """Words of eight values ([n, k / 8]: value j of a word is bits 4j to 4j + 3)."""
    n, k = words.shape[0], words.shape[1] * 8
    xw = x.float().view(x.shape[0], 1, k // 8, 8)
    dots = sum(((words >> (4 * j)) & 15).float() * xw[..., j] for j in range(8))  # [m, n, k / 8]
    per_word = [n, k // group, group // 8]
    scale = scales[..., 0].t().float().unsqueeze(-1).expand(per_word).reshape(n, k // 8)
    zero = scales[..., 1].t().float().unsqueeze(-1).expand(per_word).reshape(n, k // 8)
    return (scale * dots + (zero - 8 * scale) * xw.sum(-1)).sum(-1).to(x.dtype)


def by_bytes(x, values, scales, group):
    """The first form: values a byte at a time, each dequantized and rounded to x's dtype."""
    n, k = values.shape[0], values.shape[1] * 2
    q = torch.stack([values & 15, values >> 4], -1).view(n, k // group, group).float()
    weight = ((q - 8) * scales[..., 0].t().unsqueeze(-1).float() + scales[..., 1].t().unsqueeze(-1).float())
    return (x.float().view(1, 1, k // group, group) * weight.to(x.dtype).float()).sum([-2, -1]).to(x.dtype)


def by_words_t(xt, words, scales, group):
    """Words of eight values, the row given transposed ([8, k / 8], as a producer would store it),
    so each of its eight loads per word is contiguous along the sum."""
    n, k = words.shape[0], words.shape[1] * 8
    per_word = [n, k // group, group // 8]
    scale = scales[..., 0].t().float().unsqueeze(-1).expand(per_word).reshape(n, k // 8)
    zero = scales[..., 1].t().float().unsqueeze(-1).expand(per_word).reshape(n, k // 8)
    dots = sum(((words >> (4 * j)) & 15).float() * xt[j] for j in range(8))
    return (scale * dots + (zero - 8 * scale) * xt.sum(0)).sum(-1).unsqueeze(0).to(torch.bfloat16)


def by_flat(x, values, scales, group):
    """One element of the sum per value (a flat sum over k), scales indexed by k // group."""
    n, k = values.shape[0], values.shape[1] * 2
    shifts = torch.arange(0, 8, 4, dtype=torch.uint8, device=values.device)
    q = ((values.unsqueeze(-1) >> shifts) & 15).view(n, k).float()
    scale = scales[..., 0].t().float().unsqueeze(-1).expand(n, k // group, group).reshape(n, k)
    zero = scales[..., 1].t().float().unsqueeze(-1).expand(n, k // group, group).reshape(n, k)
    return (x.float().unsqueeze(-2) * ((q - 8) * scale + zero)).sum(-1).to(x.dtype)


FORMS = ("words", "words inlined", "words xt inlined", "flat", "bytes")
INLINE = {"realize_acc_reads_threshold": 64, "realize_opcount_threshold": 400}  # keep a word's sum in the kernel


def triton_kernels():
    """The Triton kernel (Triton ships with CUDA builds of PyTorch), by name: out[share, n] = this
    share's groups of x . dequantized row n, as s sum_j x_j q_j + (z - 8 s) sum_j x_j per group, a
    step reading STEP_GROUPS groups of words of BLOCK_N rows, their eight values taken one nibble
    at a time, each multiplied by its strided slice of x into one [rows, words] sum. (A first
    kernel that unpacked each word into a [rows, words, 8] block ran 1.05-3.2x slower on the
    H200: `int4_gemv_triton.json`, its `triton` column; history has it.)"""
    import triton
    import triton.language as tl

    @triton.jit
    def nibbles(x_ptr, w_ptr, sz_ptr, out_ptr, N, K8, G, GROUP8: tl.constexpr, BLOCK_N: tl.constexpr,
                STEP_GROUPS: tl.constexpr, STEPS: tl.constexpr):
        pid_n, share = tl.program_id(0), tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        live = rows < N
        acc = tl.zeros([BLOCK_N, STEP_GROUPS], dtype=tl.float32)
        for i in range(STEPS):
            step = share * STEPS + i
            cols = step * STEP_GROUPS * GROUP8 + tl.arange(0, STEP_GROUPS * GROUP8)
            w = tl.load(w_ptr + rows[:, None] * K8 + cols[None, :], mask=live[:, None], other=0,
                        eviction_policy="evict_first")
            part = tl.zeros([BLOCK_N, STEP_GROUPS * GROUP8], dtype=tl.float32)
            xsum = tl.zeros([STEP_GROUPS * GROUP8], dtype=tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(x_ptr + cols * 8 + j).to(tl.float32)
                part += ((w >> (4 * j)) & 15).to(tl.float32) * xj[None, :]
                xsum += xj
            dots = tl.sum(tl.reshape(part, [BLOCK_N, STEP_GROUPS, GROUP8]), axis=2)
            sums = tl.sum(tl.reshape(xsum, [STEP_GROUPS, GROUP8]), axis=1)
            at = sz_ptr + rows[:, None] * (2 * G) + 2 * (step * STEP_GROUPS + tl.arange(0, STEP_GROUPS))[None, :]
            scale = tl.load(at, mask=live[:, None], other=0).to(tl.float32)
            zero = tl.load(at + 1, mask=live[:, None], other=0).to(tl.float32)
            acc += scale * dots + (zero - 8 * scale) * sums[None, :]
        tl.store(out_ptr + share * N + rows, tl.sum(acc, axis=1), mask=live)

    return triton, {"triton": nibbles}


TRITON_FORMS = ("triton",)


def triton_form(name: str, scales: torch.Tensor, group: int, block_n: int, warps: int, shares: int,
                step_groups: int):
    """(launch, finish): launch(x [1, k] bf16, words [n, k / 8]) runs the kernel alone (one share:
    straight into a bf16 [1, n]; more: fp32 partial sums [shares, n], which in a program Inductor
    adds up inside the kernel that reads them); finish(launched) -> [1, n] bf16."""
    triton, kernels = triton_kernels()
    groups, n = scales.shape[:2]
    per_row = scales.transpose(0, 1).contiguous()  # [n, groups, 2]: a row's scales side by side

    def launch(x, words):
        out = torch.empty(shares, n, dtype=torch.float32 if shares > 1 else x.dtype, device=x.device)
        kernels[name][(triton.cdiv(n, block_n), shares)](
            x, words, per_row, out, n, words.shape[1], groups, GROUP8=group // 8, BLOCK_N=block_n,
            STEP_GROUPS=step_groups, STEPS=groups // shares // step_groups, num_warps=warps)
        return out

    def finish(out):
        return out if shares == 1 else out.sum(0, keepdim=True).to(torch.bfloat16)

    return launch, finish


def triton_configs(groups: int):
    """(rows per program, warps, shares of the groups, groups per step) that divide the groups."""
    sweep = itertools.product((4, 8, 16, 32), (2, 4), (1, 2, 4, 8), (1, 2))
    return [(rows, warps, shares, step) for rows, warps, shares, step in sweep if groups % (shares * step) == 0]


def compiled(fn, x, weights, scales, group, options=None):
    gm = make_fx(lambda x, v, s: (fn(x, v, s, group),), tracing_mode="fake")(x, weights, scales)
    run = torch._inductor.compile(gm, [x, weights, scales], options={**gemv.TUNING, **(options or {})})
    return lambda x, v, s: run(x, v, s)[0]


def against_tinygemm(x, packed, group: int, scales, weight, product) -> tuple[float, float]:
    """(tinygemm µs, the form's µs) per product, each weight cold: both read copies of their
    weight past the L2 cache in turn, replayed from CUDA graphs (as a plan with graphs runs them:
    no launch gaps, and a Triton kernel's Python launcher out of the timing). `product(w)`: the
    form on one copy `w` of `weight`."""
    copies = [(packed, weight)] + [(packed.clone(), weight.clone()) for _ in range(gemv.cold_copies(weight) - 1)]
    with timing.on(x.device):
        times = timing.time_both(lambda: [aten._weight_int4pack_mm(x, p, group, scales) for p, _ in copies],
                                 lambda: [product(w) for _, w in copies], stream=torch.cuda.Stream(x.device))
    return times[0] / len(copies), times[1] / len(copies)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want).abs().max().item() / want.abs().max().item()


def sweep_triton(name: str, x, packed, words, scales, group: int, want: torch.Tensor) -> dict:
    """Every configuration of a Triton kernel timed alone against tinygemm, weights cold: the
    fastest, and that one timed again with its partial sums added up (as eager would)."""
    best: dict = {name: float("inf")}
    for config in triton_configs(scales.shape[0]):
        launch, finish = triton_form(name, scales, group, *config)
        tinygemm_us, us = against_tinygemm(x, packed, group, scales, words, lambda w, f=launch: f(x, w))
        if us < best[name]:
            best = {name: us, f"{name} rel err": relative_error(finish(launch(x, words)), want),
                    f"{name} config": list(config), f"tinygemm ({name}'s timing)": tinygemm_us, "launch": launch,
                    "finish": finish}
    launch, finish = best.pop("launch"), best.pop("finish")
    best[f"{name} summed"] = against_tinygemm(x, packed, group, scales, words, lambda w: finish(launch(x, w)))[1]
    return best


def one_shape(k: int, n: int, group: int, wanted: tuple[str, ...]) -> dict:
    g = torch.Generator().manual_seed(k + n)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8).cuda()
    scales = torch.stack([torch.rand(k // group, n, generator=g) * 0.05 + 0.01,
                          torch.randn(k // group, n, generator=g) * 0.05], -1).to(torch.bfloat16).cuda()
    packed = aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    values = q[:, ::2] | (q[:, 1::2] << 4)  # value 2j in the low nibble of byte j
    words, x = values.view(torch.int32), torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    want = aten._weight_int4pack_mm(x, packed, group, scales).float()
    out = {}
    xt = x.float().view(k // 8, 8).t().contiguous()
    forms = (("words", by_words, words, x, None), ("words inlined", by_words, words, x, INLINE),
             ("words xt inlined", by_words_t, words, xt, INLINE), ("flat", by_flat, values, x, None),
             ("bytes", by_bytes, values, x, None))
    for name, fn, weight, row, options in (f for f in forms if f[0] in wanted):
        try:
            reduction = compiled(fn, row, weight, scales, group, options)
            out["tinygemm"], out[name] = against_tinygemm(x, packed, group, scales, weight,
                                                          lambda w, f=reduction, r=row: f(r, w, scales))
            out[f"{name} rel err"] = relative_error(reduction(row, weight, scales), want)
        except Exception as e:  # noqa: BLE001 - a form that fails is reported, the others still run
            print(f"{k}x{n} {name}: {type(e).__name__}: {str(e)[:300]}")
            out[name], out[f"{name} rel err"] = float("nan"), float("nan")
    for name in TRITON_FORMS:
        if name in wanted:
            out.update(sweep_triton(name, x, packed, words, scales, group, want))
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    copies = [w] + [w.clone() for _ in range(gemv.cold_copies(w) - 1)]
    with timing.on(w.device):
        out["bf16 linear"] = timing.time_both(lambda: [F.linear(x, c) for c in copies],
                                              lambda: [F.linear(x, c) for c in copies])[0] / len(copies)
    out["int4 bytes"] = values.numel() + scales.numel() * 2
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--forms", default=",".join(FORMS + TRITON_FORMS))
    p.add_argument("--interpret", action="store_true", help="check the Triton kernel on the CPU (no timing)")
    p.add_argument("--out", default="int4_gemv_kernels")
    args = p.parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported
        try:
            import triton  # noqa: F401
        except ImportError:
            print("int4_gemv_kernels: --interpret needs Triton (pip install triton; CUDA builds of PyTorch bring it)")
            return
        interpret(args.model, args.group)
        return
    if not torch.cuda.is_available():
        print("int4_gemv_kernels: skipped: tinygemm's int4 kernel needs a CUDA GPU")
        return
    wanted = tuple(args.forms.split(","))
    rows, records = [], []
    for name, (k, n) in SHAPES[args.model].items():
        r = one_shape(k, n, args.group, wanted)
        records.append({"linear": name, "in": k, "out": n, "group": args.group, **r})
        cell = lambda us: f"{us:.1f} ({r['int4 bytes'] / us / 1e6:.2f})"
        shown = [f for f in (*FORMS, *TRITON_FORMS) if f in wanted]
        tinygemm = r.get("tinygemm", next((r[k] for k in r if k.startswith("tinygemm (")), math.nan))
        rows.append([name, f"{k} x {n}", cell(tinygemm)] + [cell(r[f]) for f in shown]
                    + [f"{max(r[f + ' rel err'] for f in shown):.1e}", f"{r['bf16 linear']:.1f}"]
                    + [f"{r[f + ' summed']:.1f} {r[f + ' config']}" for f in TRITON_FORMS if f in shown])
    print(table(f"{args.model}, int4 groups of {args.group}: µs per one-row product (TB/s of int4 bytes), weights cold",
                ["linear", "in x out", "tinygemm", *shown, "max err / max", "bf16 linear µs"]
                + [f"{f} summed µs, [rows, warps, shares, groups a step]" for f in TRITON_FORMS if f in wanted],
                rows))
    print(f"wrote {write_json(args.out, {'machine': machine(), 'model': args.model, 'rows': records})}")


def interpret(model: str, group: int) -> None:
    """The Triton kernel on the CPU through Triton's interpreter, at each shape with its rows cut to
    at most 256 (the interpreter is slow), every configuration against the exact product."""
    os.environ["TRITON_INTERPRET"] = "1"
    for name, (k, n) in SHAPES[model].items():
        n = min(n, 256)
        g = torch.Generator().manual_seed(k + n)
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scales = torch.stack([torch.rand(k // group, n, generator=g) * 0.05 + 0.01,
                              torch.randn(k // group, n, generator=g) * 0.05], -1).to(torch.bfloat16)
        words = (q[:, ::2] | (q[:, 1::2] << 4)).view(torch.int32)
        x = torch.randn(1, k, dtype=torch.bfloat16, generator=g)
        weight = ((q.float() - 8) * scales[..., 0].t().float().repeat_interleave(group, 1)
                  + scales[..., 1].t().float().repeat_interleave(group, 1))
        want = x.float() @ weight.t()
        worst = max((finish(launch(x, words)).float() - want).abs().max().item()
                    for name in TRITON_FORMS for c in triton_configs(k // group)[::3]
                    for launch, finish in [triton_form(name, scales, group, *c)]) / want.abs().max().item()
        print(f"{name} {k} x {n}: largest error over the configurations {worst:.1e} of the largest output")
        assert worst < 2 ** -7, "the Triton kernel does not compute the product"


if __name__ == "__main__":
    main()

"""Where a decode step's GPU time goes: kernels per step by kind, for each runner of bench/llm.py.

`python bench/llm_profile.py --models llama-1b --cache 1024` (one H200: about 2 minutes) profiles
STEPS decode steps of each runner with torch.profiler (CUDA graphs replayed as they are in the
benchmark; the profiler sees the kernels inside them) and sorts every kernel into a kind by its
name: GEMM/GEMV, attention, copies, fused (Triton) kernels, other elementwise and reductions.
The table gives kernels and microseconds per step of each kind, the GPU-busy total and the wall
time per step: the gap between the two is launch overhead and idle GPU.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import llm  # noqa: E402
from common import machine, table, write_json  # noqa: E402

STEPS = 10
KINDS = (  # first match wins
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient", re.I)),
    ("gemm/gemv", re.compile(r"gemm|gemv|cutlass|sm90_xmma|cublas|nvjet|matmul|_mm_|splitk|dot", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset|index_copy|cat|scatter", re.I)),
    ("triton (fused)", re.compile(r"^triton", re.I)),
    ("reduction", re.compile(r"reduce|norm|softmax|argmax|mean|sum", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise", re.I)),
)


def kind_of(name: str) -> str:
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def profile_steps(r: llm.Runner, batch: int, cache: int, env: llm.Env) -> tuple[dict, float, list]:
    """({kind: [kernels, us]} per step, wall us per step, every kernel, costliest first)."""
    ids = r.feed(torch.zeros(batch, 1, dtype=torch.long))
    pos = r.feed(torch.tensor([cache // 2]))
    for _ in range(5):
        ids = r.feed(r.step(ids, pos)[:, -1:].argmax(-1))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(STEPS):
            ids = r.feed(r.step(ids, pos)[:, -1:].argmax(-1))
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / STEPS * 1e6
    kinds: dict = {}
    by_name: dict = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time if hasattr(e, "device_time") else e.cuda_time
        k = kinds.setdefault(kind_of(e.name), [0, 0.0])
        k[0] += 1 / STEPS
        k[1] += us / STEPS
        n = by_name.setdefault(e.name[:90], [0, 0.0])
        n[0] += 1 / STEPS
        n[1] += us / STEPS
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return kinds, wall, top


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-1b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cache", type=int, default=1024)
    p.add_argument("--runners", default="compile,ferry-graphs,ferry-inductor-graphs")
    p.add_argument("--combo-kernels", choices=llm.COMBO_CHOICES, default="reductions", help="as bench/llm.py's")
    p.add_argument("--fuse-norms", choices=("on", "off"), default="on", help="as bench/llm.py's")
    p.add_argument("--time-regions", choices=("on", "off"), default="on", help="as bench/llm.py's")
    p.add_argument("--steady-tuning", choices=("on", "off"), default="on", help="as bench/llm.py's")
    p.add_argument("--out", default="llm_profile")
    args = p.parse_args()
    llm.set_combo_kernels(args.combo_kernels)
    llm.gemv.FUSE_NORMS = args.fuse_norms == "on"
    llm.gemv.TIME_REGIONS = args.time_regions == "on"
    llm.kernel_tuning.STEADY = args.steady_tuning == "on"
    if not torch.cuda.is_available():
        print("llm_profile: skipped: needs a CUDA device")
        return
    env = llm.Env(tiny=False, ferry_device="cuda:0", device=torch.device("cuda:0"), dtype=torch.bfloat16,
                  repeat=1, prefill_repeat=1)
    results = []
    for name in args.models.split(","):
        model = llm.build_model(name, env)
        built: dict = {}
        for runner in args.runners.split(","):
            r = llm.make_runner(runner, model, args.batch, args.cache, [], env, built)
            try:
                kinds, wall, top = profile_steps(r, args.batch, args.cache, env)
            finally:
                r.close()
                llm._fresh(env)
            busy = sum(us for _, us in kinds.values())
            rows = [[k, round(n, 1), round(us, 1)] for k, (n, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1])]
            rows += [["GPU busy", round(sum(n for n, _ in kinds.values()), 1), round(busy, 1)], ["wall", "", round(wall, 1)]]
            print(table(f"{name} {runner}: per decode step (batch {args.batch}, cache {args.cache})",
                        ["kind", "kernels", "us"], rows))
            print(table("costliest kernels (30)", ["kernel", "per step", "us"],
                        [[n, round(c, 1), round(us, 1)] for n, (c, us) in top[:30]]))
            print(flush=True)
            results.append({"model": name, "runner": runner, "kinds": kinds, "wall_us": wall, "busy_us": busy,
                            "top": top})
    print(f"wrote {write_json(args.out, {'settings': {**machine(), **vars(args)}, 'profiles': results})}")


if __name__ == "__main__":
    main()

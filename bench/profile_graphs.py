"""Where a captured call's GPU time goes, for each runner that replays CUDA graphs.

    python bench/profile_graphs.py --models efficientnet_b0,swin_t

For every model (bench/models.py's list, batch 1, device I/O, TF32 off) and runner, in this
process one after another: the median ms per call, and from single profiled calls the kernels
a call launches, the GPU's busy time (the kernels' durations summed) and its idle time inside
the call (first kernel's start to last kernel's end, less the busy time: the gaps between
kernels that a graph's launches leave), then the kernels taking the most time. It says whether
a runner is slower for its kernels' work or for their count. And the host's share: how long a
call takes from its entry to its first graph launch (the GPU waits that long), and its whole
host time with the GPU idle at its start (no synchronisation inside). JSON: profile_graphs.json.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import table, time_host, write_json  # noqa: E402

import models as bench_models  # noqa: E402
from ferry.aot import gemm_scales, layout_chains, permuted_reads  # noqa: E402
from ferry.choices import norms  # noqa: E402

RUNNERS = ("eager-graphs", "compile-ro", "ferry-graphs", "ferry-inductor-graphs")
# the rewrites and choices a run may switch off, one flag each (--layout-chains off, ...): the
# module, its switch, what it does
SWITCHES = {
    "layout-chains": (layout_chains, "ON", "data-movement chains run as one view or gather, q/k/v slices copied once"),
    "gemm-scales": (gemm_scales, "ON", "a product scaled by a number or per column (a layer scale): the scale in the GEMM"),
    "permuted-reads": (permuted_reads, "ON", "an elementwise op reads a permuted value where it read a contiguous copy"),
    "layer-norms": (norms, "ON", "each layer norm timed at load against ops/layer_norm.py's Triton kernel"),
    "rms-norms": (norms, "RMS", "an RMS norm written out as one op, one Triton kernel where timed faster"),
    "residual-norms": (norms, "RESIDUALS", "a residual add and the layer norm of its sum as one op, one Triton kernel "
                                           "where timed faster"),
}


def kernels_of_one_call(call) -> list:
    """The GPU kernels one call ran (memory copies and sets apart), as profiler events."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))]


def breakdown(call, calls: int = 5, top: int = 12) -> dict:
    """Kernels per call, busy and idle µs per call (medians over `calls` profiled calls), and
    the `top` kernels by time per call."""
    for _ in range(3):
        call()
    counts, busy, idle = [], [], []
    per_kernel: dict = collections.defaultdict(lambda: [0, 0.0])
    for _ in range(calls):
        events = kernels_of_one_call(call)
        spent = sum(e.time_range.elapsed_us() for e in events)
        span = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
        counts.append(len(events))
        busy.append(spent)
        idle.append(span - spent)
        for e in events:
            per_kernel[e.name][0] += 1
            per_kernel[e.name][1] += e.time_range.elapsed_us()
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": statistics.median(counts), "busy_us": statistics.median(busy),
            "idle_us": statistics.median(idle),
            "top": [{"kernel": k[:120], "calls": n / calls, "us": t / calls} for k, (n, t) in ranked]}


def host_share(call, calls: int = 50) -> dict:
    """Median µs from a call's entry to its first CUDA graph launch, and its host µs in all
    (each call starts with the GPU idle; nothing synchronised until it returns)."""
    launches: list[float] = []
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph):
        launches.append(time.perf_counter())
        return replay(graph)

    to_launch, in_all = [], []
    torch.cuda.CUDAGraph.replay = timed_replay
    try:
        for _ in range(calls):
            torch.cuda.synchronize()
            launches.clear()
            t = time.perf_counter()
            call()
            in_all.append(time.perf_counter() - t)
            if launches:
                to_launch.append(launches[0] - t)
    finally:
        torch.cuda.CUDAGraph.replay = replay
    torch.cuda.synchronize()
    return {"to_launch_us": statistics.median(to_launch) * 1e6 if to_launch else None,
            "host_us": statistics.median(in_all) * 1e6}


def host_functions(call, calls: int = 200, top: int = 25) -> str:
    """The Python functions a call spends its host time in (cProfile, cumulative)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def profile_runner(name: str, runner: str, device: torch.device, python_profile: bool = False) -> dict:
    model, (x,) = bench_models.MODELS[name][0](1)
    with torch.no_grad():
        want = model.to(device)(x.to(device)).cpu()
    row, call, module = bench_models._one_runner(name, 1, "device", runner, model.cpu(), x, want, device, {})
    out = {"model": name, "runner": runner, "ms": time_host(call, repeat=60) * 1e3, "rel_err": row["rel_err"],
           **breakdown(call), **host_share(call)}
    if python_profile:
        out["python_profile"] = host_functions(call)
    if module is not None:
        module.close()
    del call, module
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="efficientnet_b0,swin_t")
    p.add_argument("--runners", default=",".join(RUNNERS))
    for flag, (module, name, what) in SWITCHES.items():
        p.add_argument(f"--{flag}", choices=("on", "off"), default="on",
                       help=f"{what} (on: ferry's default, {module.__name__.removeprefix('ferry.')}.{name}), or not "
                            "(off: for an A/B)")
    p.add_argument("--python-profile", action="store_true", help="print each runner's host functions (cProfile)")
    p.add_argument("--out", default="profile_graphs")
    args = p.parse_args()
    for flag, (module, name, _) in SWITCHES.items():
        setattr(module, name, getattr(args, flag.replace("-", "_")) == "on")
    if not torch.cuda.is_available():
        print("profile_graphs: skipped: no CUDA device")
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda:0")
    rows = [profile_runner(m, r, device, args.python_profile) for m in args.models.split(",") for r in args.runners.split(",")]
    print(table("A captured call's GPU time (batch 1, device I/O; µs per call)",
                ["model", "runner", "ms", "kernels", "busy µs", "idle µs", "host µs to launch", "host µs"],
                [[r["model"], r["runner"], r["ms"], int(r["kernels"]), r["busy_us"], r["idle_us"],
                  "-" if r["to_launch_us"] is None else r["to_launch_us"], r["host_us"]] for r in rows]))
    for r in rows:
        print(f"\n{r['model']} / {r['runner']}:")
        for k in r["top"]:
            print(f"  {k['us']:8.1f} µs {k['calls']:5.0f}x  {k['kernel'][:100]}")
        if "python_profile" in r:
            print(r["python_profile"])
    print("wrote", write_json(args.out, {"rows": rows}))


if __name__ == "__main__":
    main()

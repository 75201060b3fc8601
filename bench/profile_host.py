"""Where a call's host time goes at small batch, eager against ferry (device I/O, no graphs).

    python bench/profile_host.py resnet50 1 [bert 1 ...]

For each model: median ms per call; per call, the CUDA kernels launched and the ATen ops
called (torch.profiler), the ops with the most host self time; for ferry, the Python
functions with the most time (cProfile). A tool for finding overhead, not a benchmark table.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from models import timed_side_by_side  # noqa: E402

CALLS = 10


def counts(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA") / CALLS
    aten = Counter({e.key: e.count // CALLS for e in events if e.key.startswith("aten::")})
    print(f"  kernels per call {kernels:.0f}; aten calls per call {sum(aten.values())}")
    top = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)[:14]
    for e in top:
        print(f"    {e.key[:58]:58s} {e.count // CALLS:5d}/call  self {e.self_cpu_time_total / CALLS:8.1f} us/call")


def python_time(fn):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(CALLS * 5):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(16)
    print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))


def one(name, batch):
    device = torch.device("cuda:0")
    _, eager, call, module = timed_side_by_side(name, batch, device)
    print(" eager")
    counts(eager)
    print(" ferry")
    counts(call)
    python_time(call)
    module.close()


def main():
    args = sys.argv[1:]
    for name, batch in zip(args[::2], args[1::2]):
        one(name, int(batch))


if __name__ == "__main__":
    main()

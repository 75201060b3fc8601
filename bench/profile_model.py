"""Where a model's GPU time goes, eager against ferry: the top CUDA kernels of each.

    python bench/profile_model.py vit_b_16 4

Uses bench/models.py's model list; prints, for each runner, the median ms per call and the
kernels that take the most GPU time, with their call counts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from models import timed_side_by_side  # noqa: E402


def top(fn, n=14):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=60))


def main():
    name, batch = sys.argv[1], int(sys.argv[2])
    device = torch.device("cuda:0")
    program, eager, call, _ = timed_side_by_side(name, batch, device, repeat=20)
    print("=== eager")
    top(eager)
    print("=== ferry")
    top(call)
    m = program.method("forward")
    kernels = [i.kernel for d in program.delegates
               for i in __import__("ferry").load_program(program.segments[d.payload]).method("forward").instructions
               if hasattr(i, "kernel")]
    print("ferry instructions in delegates:", len(kernels))
    from collections import Counter
    print(Counter(kernels).most_common(25))
    print(m.kernel_choices)


if __name__ == "__main__":
    main()

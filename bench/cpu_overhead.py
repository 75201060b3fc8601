"""Runtime overhead per instruction: a chain of 1,000 tiny CPU ops.

Side by side in one run: eager PyTorch running the module, ferry's Module running the
compiled program, and a bare Python loop calling the same ATen .out overloads (the floor for
any Python interpreter of ATen kernels).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import table, time_host, write_json  # noqa: E402

import ferry  # noqa: E402

N_OPS = 1000


class Chain(torch.nn.Module):
    def forward(self, x):
        for _i in range(N_OPS // 2):
            x = x * 1.0001
            x = x + 0.5
        return x


def main():
    torch.set_num_threads(1)
    model, x = Chain().eval(), torch.randn(16)
    program = ferry.compile(torch.export.export(model, (x,)))
    module = ferry.Module(program, outputs="view")
    module.load_method()
    assert torch.allclose(module(x), model(x))

    # the same kernels, called from a plain Python loop into preallocated outputs
    bufs = [torch.empty(16) for _ in range(2)]
    mul, add = torch.ops.aten.mul.out, torch.ops.aten.add.out

    def raw():
        a = x
        for _i in range(N_OPS // 2):
            mul(a, 1.0001, out=bufs[0])
            add(bufs[0], 0.5, out=bufs[1])
            a = bufs[1]

    with torch.no_grad():
        results = {
            "eager PyTorch": time_host(lambda: model(x), repeat=30),
            "ferry Module": time_host(lambda: module(x), repeat=30),
            "Python loop of ATen .out calls": time_host(raw, repeat=30),
        }
    rows = [[name, t * 1e3, t / N_OPS * 1e6] for name, t in results.items()]
    print(table(f"chain of {N_OPS} tiny CPU ops (1 thread)", ["runner", "ms per call", "µs per op"], rows))
    path = write_json("cpu_overhead", {"n_ops": N_OPS, "seconds_per_call": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

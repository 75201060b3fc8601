"""Where a model's peak GPU memory comes from, eager against ferry, step by step.

    python bench/memory_trace.py resnet18 32 [gpt2 8 ...]

For each model and batch of bench/models.py (device I/O, no graphs, TF32 off): eager's peak
with the leaf modules that reach it, and ferry's peak with what it holds at load (weights and
the planned arena) and the steps that reach it. A step's row: what was allocated before it,
the most allocated during it, and after it (MiB). Prints a table per model and writes JSON.
"""

from __future__ import annotations

import gc
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_json  # noqa: E402

import ferry  # noqa: E402
from ferry.runtime.stages import run as run_module  # noqa: E402
from models import MODELS, _at_load_mib, _ferry_program, _fresh_gpu  # noqa: E402

MiB = 2**20


class _Trace:
    """Memory around each call it wraps: (label, before, peak during, after), from `base`."""

    def __init__(self):
        self.rows: list[tuple[str, float, float, float]] = []
        self.base = 0
        self.on = False

    def wrap(self, label: str, call):
        def traced(*args, **kwargs):
            if not self.on:
                return call(*args, **kwargs)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = call(*args, **kwargs)
            torch.cuda.synchronize()
            self.rows.append((label, (before - self.base) / MiB, (torch.cuda.max_memory_allocated() - self.base) / MiB,
                              (torch.cuda.memory_allocated() - self.base) / MiB))
            return out

        return traced

    def top(self, n=6):
        return sorted(self.rows, key=lambda r: -r[2])[:n]


def _eager(model, x, device, trace: _Trace):
    base = _fresh_gpu(device)
    trace.base = base
    m = model.to(device)
    xd = x.to(device)
    for mod_name, mod in m.named_modules():
        if not list(mod.children()):
            mod.forward = trace.wrap(f"{mod_name} ({type(mod).__name__})", mod.forward)
    with torch.no_grad():
        for _ in range(3):
            m(xd)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = m(xd)
        torch.cuda.synchronize()
        whole = (torch.cuda.max_memory_allocated() - base) / MiB
        trace.on = True
        m(xd)
    del out
    return whole


def _ferry(program, x, device, trace: _Trace):
    launch = run_module.Plan._launch

    def traced_launch(self, step):
        return trace.wrap(f"{self.name} {step.label}", launch(self, step))

    run_module.Plan._launch = traced_launch
    try:
        base = _fresh_gpu(device)
        trace.base = base
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            module = ferry.Module(program, outputs="view")
            module.load_method()
        xd = x.to(device)
        for _ in range(3):
            module(xd)
        torch.cuda.synchronize()
        first_calls = (torch.cuda.max_memory_allocated() - base) / MiB
        torch.cuda.reset_peak_memory_stats()
        module(xd)
        torch.cuda.synchronize()
        whole = (torch.cuda.max_memory_allocated() - base) / MiB
        trace.on = True
        module(xd)
        at_load = _at_load_mib(module, device)
        module.close()
    finally:
        run_module.Plan._launch = launch
    return whole, first_calls, at_load


def one(name: str, batch: int, device) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, (x,) = MODELS[name][0](batch)
    program, _ = _ferry_program(model, x, device, "device")
    et, ft = _Trace(), _Trace()
    eager_peak = _eager(model, x, device, et)
    model.cpu()
    gc.collect()
    ferry_peak, ferry_first, at_load = _ferry(program, x, device, ft)
    print(f"=== {name} batch {batch}: peak MiB eager {eager_peak:.1f}, ferry {ferry_peak:.1f} "
          f"({ferry_peak / eager_peak:.3f}x; first calls {ferry_first:.1f}), ferry at load {at_load:.1f}")
    for who, tr in (("eager", et), ("ferry", ft)):
        print(table(f"{name} batch {batch}: {who}'s highest steps (MiB)", ["step", "before", "peak", "after"],
                    [[lbl[:70], round(b, 1), round(p, 1), round(a, 1)] for lbl, b, p, a in tr.top(10)]))
    return {"model": name, "batch": batch, "eager_peak_mib": eager_peak, "ferry_peak_mib": ferry_peak,
            "ferry_first_calls_peak_mib": ferry_first, "ferry_at_load_mib": at_load,
            "eager_top": et.top(10), "ferry_top": ft.top(10)}


def main():
    args = sys.argv[1:]
    device = torch.device("cuda:0")
    rows = [one(name, MODELS[name][1] if b == "serving" else int(b), device) for name, b in zip(args[::2], args[1::2])]
    print(f"wrote {write_json('memory_trace', {'rows': rows})}")


if __name__ == "__main__":
    main()

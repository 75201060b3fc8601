"""An op forced to the CPU in the middle of a transformer: ferry's inductor backend against torch.compile.

The model is ferry.examples.TransformerBlock with its softmax on the CPU and everything else
on the device, CPU tensors in and out, every runner in one process and timed in interleaved rounds:
- eager: that placement written by hand (`.cuda()`, `.cpu()` around the softmax);
- compile / compile-ro: `torch.compile` of the same hand-placed function, default and
  `mode="reduce-overhead"`;
- ferry / ferry-graphs: `OpSupportPartitioner(device, exclude=["aten.softmax"])`, the `torch`
  backend, without and with CUDA graphs;
- ferry-inductor / ferry-inductor-graphs: the same with `backend_id="inductor"`.
Target (issue 14): ferry-inductor faster than torch.compile of the same placement.

    python bench/inductor_fallback.py [--device cuda:0] [--batches 1,64] [--repeat 60]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_json  # noqa: E402
from cpu_fallback import CONFIG, hand_placed  # noqa: E402

import ferry  # noqa: E402
from ferry.examples import TransformerBlock  # noqa: E402
from models import _time_interleaved  # noqa: E402

RUNNERS = ("eager", "compile", "compile-ro", "ferry", "ferry-graphs", "ferry-inductor", "ferry-inductor-graphs")


def build(runner, model, x, device):
    """(call, setup seconds) of one runner on CPU input `x`."""
    t0 = time.perf_counter()
    if runner in ("eager", "compile", "compile-ro"):
        dev_model = copy.deepcopy(model).to(device)
        fn = lambda inp: hand_placed(dev_model, inp, device)  # noqa: E731
        if runner != "eager":
            fn = torch.compile(fn, mode=None if runner == "compile" else "reduce-overhead", dynamic=False)
        call = lambda: fn(x)  # noqa: E731
    else:
        backend = "inductor" if "inductor" in runner else "torch"
        part = ferry.OpSupportPartitioner(str(device), exclude=["aten.softmax"], backend_id=backend)
        program = ferry.compile(torch.export.export(model, (x,)), part)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            module = ferry.Module(program, cuda_graphs=runner.endswith("graphs") and device.type == "cuda")
            module.load_method()
        call = lambda: module(x)  # noqa: E731
    with torch.no_grad():
        for _ in range(3):
            call()
    return call, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", default=",".join(str(b) for b in CONFIG["batches"]))
    p.add_argument("--runners", default=",".join(RUNNERS))
    p.add_argument("--repeat", type=int, default=60)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = TransformerBlock(CONFIG["dim"], CONFIG["heads"], CONFIG["hidden"]).eval()
    rows, lines = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        x = torch.randn(batch, CONFIG["seq"], CONFIG["dim"])
        with torch.no_grad():
            want = model(x)
        live = []
        for runner in args.runners.split(","):
            try:
                call, setup = build(runner, model, x, device)
                with torch.no_grad():
                    err = float((call() - want).abs().max())
                live.append((runner, call, setup, err))
            except Exception as e:  # noqa: BLE001 - one runner failing must not lose the others
                print(f"batch {batch} {runner}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append({"batch": batch, "runner": runner, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        with torch.no_grad():
            times = _time_interleaved([c for _, c, _, _ in live], device, args.repeat)
        eager = dict(zip([r for r, *_ in live], times)).get("eager")
        for (runner, _, setup, err), ms in zip(live, times):
            rows.append({"batch": batch, "runner": runner, "ms": ms, "setup_s": setup, "max_abs_err": err})
            lines.append([batch, runner, round(ms, 3), round(ms / eager, 2) if eager else "-", round(setup, 1), f"{err:.1e}"])
        torch._dynamo.reset()
    print(table(f"TransformerBlock, softmax on the CPU, the rest on {device}; CPU tensors in and out (median ms)",
                ["batch", "runner", "ms", "vs eager", "setup s", "max |err|"], lines))
    print(f"wrote {write_json('inductor_fallback' + ('' if device.type == 'cuda' else '_cpu'), {'rows': rows})}")


if __name__ == "__main__":
    main()

"""Does cuDNN's benchmark mode (convolution algorithms chosen by timing) speed the ResNets up?

    python bench/cudnn_benchmark_mode.py resnet50 1 off|on|load-only

One model, batch and mode per process (the mode is a process-wide setting, and cuDNN caches the
algorithm it chose per shape for the life of the process): `off`, eager's default; `on`,
benchmark mode throughout; `load-only`, on while ferry loads and warms up, then off (a plan chosen
under benchmark mode stays cached). Runners, timed in interleaved rounds: eager, eager's kernels
captured in one CUDA graph, eager in channels-last, ferry and ferry with CUDA graphs (device I/O,
TF32 off). Appends one row to bench/results/cudnn_benchmark_mode.json (FERRY_BENCH_OUT).

On an H200 it gave nothing worth keeping (README): ResNet-18 at batch 1 with graphs 1.21 against
1.20 ms, ResNet-50 2.10 against 2.15.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

import models as M  # noqa: E402


def main():
    name, batch, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = mode in ("on", "load-only")
    dev = torch.device("cuda:0")
    model, (x,) = M.MODELS[name][0](batch)
    with torch.no_grad():
        want = model.to(dev)(x.to(dev)).cpu()
    model.cpu()
    program, _ = M._ferry_program(model, x, dev, "device")
    ferry_call, _, _ = M._ferry(program, x, dev, "device", False)
    graphs_call, _, _ = M._ferry(program, x, dev, "device", True)
    for _ in range(3):
        ferry_call(), graphs_call()
    if mode == "load-only":
        torch.backends.cudnn.benchmark = False
    eager_call, _ = M._eager_like(copy.deepcopy(model), x, dev, "device", None)
    eager_graphs, _ = M._eager_graphed(copy.deepcopy(model), x, dev, "device")
    last = copy.deepcopy(model).to(dev).to(memory_format=torch.channels_last)
    x_last = x.to(dev).to(memory_format=torch.channels_last)

    def channels_last():
        with torch.no_grad():
            return last(x_last)

    calls = {"eager": eager_call, "eager-graphs": eager_graphs, "eager-channels-last": channels_last,
             "ferry": ferry_call, "ferry-graphs": graphs_call}
    row = {"model": name, "batch": batch, "cudnn_benchmark": mode}
    for (key, call), ms in zip(calls.items(), M._time_interleaved(list(calls.values()), dev, 60)):
        row[key] = round(ms, 3)
        row[key + "_rel_err"] = M._check(call(), want)
    print(json.dumps(row), flush=True)
    path = Path(os.environ.get("FERRY_BENCH_OUT", Path(__file__).parent / "results")) / "cudnn_benchmark_mode.json"
    data = json.loads(path.read_text()) if path.exists() else {"machine": machine(), "rows": []}
    data["rows"].append(row)
    path.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()

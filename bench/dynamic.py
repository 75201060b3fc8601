"""Dynamic batch at static speed: ferry compiled once with a dynamic batch, called at batch
sizes 1..N in random order, against ferry compiled for each fixed batch and against eager.

Models: an nn.TransformerEncoder (4 layers, 256 wide, 4 heads, sequence 64) and a transformers
GPT2Model decoder (4 layers, 256 wide, sequence 64), random weights, float32. The dynamic
program is exported once with torch.export.Dim("batch", max=N); the fixed ones once per batch
size. On a GPU everything is delegated to cuda:0, and three more columns compare CUDA graphs:
fixed-shape ferry with graphs at each size, against the dynamic program with graphs (a graph set
per shape it meets) and with shape buckets [1, 2, 4, 8, ...] (a call is padded up to its
bucket). `--io host`: CPU tensors in and out (eager too); `--io device`: the programs compiled
with the skip flags, tensors in and out on the GPU. Without a GPU, ferry and eager run on the
CPU.

Every size is called once untimed first (the call that records its shapes and binds its
plan); then the timed calls come in one shuffled sequence, every size R times, and each cell is
the median for that size. Targets: dynamic within 1.1x of fixed at every size; with buckets
within 1.2x of fixed with graphs; no C++ warning lines on stderr in the steady state (captured
at the file-descriptor level).
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import result_name, table, write_json  # noqa: E402

import ferry  # noqa: E402

DYNAMIC_TARGET, BUCKET_TARGET = 1.1, 1.2


def encoder(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


class Decoder(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        import transformers

        cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, n_positions=256, bos_token_id=0,
                                      eos_token_id=0)
        torch.manual_seed(0)
        self.m = transformers.GPT2Model(cfg).eval()

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).last_hidden_state


def make_input(model_name: str, batch: int, seq: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if model_name == "decoder":
        return torch.randint(0, 50257, (batch, seq), generator=g)
    return torch.randn(batch, seq, width, generator=g)


def compile_for(model, example, device: str, dynamic: int | None, io: str = "host"):
    """`io="device"`: inputs and outputs stay on the device (the skip flags)."""
    shapes = ({0: torch.export.Dim("batch", max=dynamic)},) if dynamic else None
    skip = io == "device"
    config = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(skip, skip))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, (example,), dynamic_shapes=shapes)
        return ferry.compile(ep, ferry.OpSupportPartitioner(device) if device != "cpu" else None, config)


class FdCapture:
    """Counts the lines C++ code writes to stderr (fd 2) while active."""

    def __enter__(self):
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile(mode="w+")
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        self.text = self.file.read()
        self.file.close()


def timed_sizes(runners: dict, sizes: list[int], repeat: int, make) -> dict:
    """{runner: {size: median ms}}: every (runner, size) called `repeat` times in one shuffled order."""
    cuda = torch.cuda.is_available()
    order = [(name, b) for name in runners for b in sizes for _ in range(repeat)]
    random.Random(0).shuffle(order)
    samples: dict = {name: {b: [] for b in sizes} for name in runners}
    for i, (name, b) in enumerate(order):
        x = make(b, i)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        runners[name](b)(x)
        if cuda:
            torch.cuda.synchronize()
        samples[name][b].append((time.perf_counter() - t) * 1e3)
    return {name: {b: statistics.median(v) for b, v in per.items()} for name, per in samples.items()}


def bench_model(model_name: str, args, device: str, io: str = "host") -> tuple[list, dict]:
    width, seq, n = (32, 8, 4) if args.smoke else (256, 64, args.max_batch)
    model = encoder(width, 2 if args.smoke else 4) if model_name == "encoder" else Decoder(width, 2 if args.smoke else 4)
    sizes = list(range(1, n + 1))
    gpu = device.startswith("cuda")
    on = torch.device(device if gpu else "cpu")
    feed = on if io == "device" else torch.device("cpu")  # where the caller's tensors are
    make = lambda b, i: make_input(model_name, b, seq, width, i).to(feed)  # noqa: E731
    dynamic = ferry.Module(compile_for(model, make(min(2, n), 0).cpu(), device, n, io))
    fixed = {b: ferry.Module(compile_for(model, make(b, 0).cpu(), device, None, io)) for b in sizes}
    eager = copy.deepcopy(model).to(on)  # tensors in and out where ferry's are
    runners = {"eager": lambda b: lambda x: eager(x.to(on)).to(feed), "ferry fixed": lambda b: fixed[b],
               "ferry dynamic": lambda b: dynamic}
    if gpu:
        buckets = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < n] + [n]
        bucketed = ferry.Module(dynamic.program, cuda_graphs=True, shape_buckets=buckets)
        per_shape = ferry.Module(dynamic.program, cuda_graphs=True)
        fixed_graphs = {b: ferry.Module(fixed[b].program, cuda_graphs=True) for b in sizes}
        runners.update({"ferry fixed + graphs": lambda b: fixed_graphs[b], "ferry dynamic + graphs": lambda b: per_shape,
                        "ferry dynamic + buckets": lambda b: bucketed})
    with torch.no_grad():
        for r in runners.values():  # the first calls: bind, record shapes, capture graphs
            for b in sizes:
                for i in range(3):
                    r(b)(make(b, i))
        with FdCapture() as cap:
            ms = timed_sizes(runners, sizes, args.repeat, make)
        x = make(n, 99)
        err = (dynamic(x).cpu() - model(x.cpu())).abs().max().item()
    rows = []
    for b in sizes:
        row = [model_name, io, b, ms["eager"][b], ms["ferry fixed"][b], _against(ms, "ferry dynamic", "ferry fixed", b)]
        if gpu:
            row += [ms["ferry fixed + graphs"][b], _against(ms, "ferry dynamic + graphs", "ferry fixed + graphs", b),
                    _against(ms, "ferry dynamic + buckets", "ferry fixed + graphs", b)]
        rows.append(row)
    worst = max(ms["ferry dynamic"][b] / ms["ferry fixed"][b] for b in sizes)
    result = {"ms": ms, "worst_dynamic_vs_fixed": worst, "stderr_lines": len(cap.text.splitlines()),
              "max_abs_err": err, "sizes": sizes}
    if gpu:
        result["worst_buckets_vs_fixed_graphs"] = max(ms["ferry dynamic + buckets"][b] / ms["ferry fixed + graphs"][b]
                                                      for b in sizes)
        result["worst_dynamic_graphs_vs_fixed_graphs"] = max(
            ms["ferry dynamic + graphs"][b] / ms["ferry fixed + graphs"][b] for b in sizes)
        result["graph_report"] = repr(per_shape.graph_report())[:2000]  # what was captured at each shape
    return rows, result


def _against(ms: dict, runner: str, base: str, b: int) -> str:
    return f"{ms[runner][b]:.3g} ({ms[runner][b] / ms[base][b]:.2f}x)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny models, few calls")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=20, help="timed calls per size and runner")
    p.add_argument("--models", default="encoder,decoder")
    p.add_argument("--io", default=None, help="host,device (default on a GPU; host only on the CPU)")
    args = p.parse_args()
    if args.smoke:
        args.repeat = 3
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    header = ["model", "I/O", "batch", "eager ms", "ferry fixed", "ferry dynamic"]
    if device != "cpu":
        header += ["ferry fixed + graphs", "ferry dynamic + graphs", "ferry dynamic + buckets"]
    ios = (args.io or ("host,device" if device != "cpu" else "host")).split(",")
    rows, results = [], {}
    for name in args.models.split(","):
        for io in ios:
            r, res = bench_model(name, args, device, io)
            rows += r
            results[f"{name} {io}"] = res
            print(f"  {name} ({io} I/O): dynamic at most {res['worst_dynamic_vs_fixed']:.2f}x fixed; "
                  f"{res['stderr_lines']} stderr lines in the steady state", flush=True)
    where = torch.cuda.get_device_name(0) if device != "cpu" else "the CPU"
    print(table(f"dynamic batch 1..{args.max_batch if not args.smoke else 4} in random order, on {where} "
                "(median ms per call; ratios against fixed-shape ferry)", header, rows))
    for name, res in results.items():
        line = f"{name}: worst dynamic/fixed {res['worst_dynamic_vs_fixed']:.2f}x (target <= {DYNAMIC_TARGET}x)"
        if "worst_buckets_vs_fixed_graphs" in res:
            line += (f", worst dynamic+graphs/fixed+graphs {res['worst_dynamic_graphs_vs_fixed_graphs']:.2f}x "
                     f"(target <= {DYNAMIC_TARGET}x), worst buckets/fixed+graphs "
                     f"{res['worst_buckets_vs_fixed_graphs']:.2f}x (target <= {BUCKET_TARGET}x)")
        print(line + f", stderr lines {res['stderr_lines']}, max abs err {res['max_abs_err']:.1e}")
    path = write_json(result_name(f"dynamic_{'gpu' if device != 'cpu' else 'cpu'}", args.smoke),
                      {"device": device, "results": results})
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

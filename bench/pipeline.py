"""One model over two GPUs: ferry's pipelined micro-batches against the same split without
them, Hugging Face accelerate's dispatch_model with the same map, and the whole model on one
GPU in eager PyTorch — side by side in one process.

Model: transformers GPT2Model from its config, by default 24 layers, 1024 wide, 16 heads
(GPT-2 medium's shape; --layers/--width/--heads), random weights, float32 with TF32 matmuls
allowed for every contender; a serving batch of 32 sequences of 128 tokens (--batch/--seq);
CPU tensors in and out (token ids in, the last hidden state out), as a server sees them.
Split: the embeddings and the first half of the layers on cuda:0, the second half and the
final norm on cuda:1.

ferry with micro-batches exports the model at one part's size (batch/k rows) and runs
Module(program, microbatches=k); without, it exports at 32 rows. Throughput is rows per
second at the median call time. Target: micro-batching >= 1.7x the split without it.

Also reported: each program's planned memory per GPU (one micro-batch's worth), the bytes
crossing between the GPUs per call, the time and GB/s of one such copy alone, and the GB/s of
a 256 MiB peer copy (the link), each timed alone. torch.distributed.pipelining is not in the table: its stages
are one process each (a PipelineStage belongs to a process-group rank), so it does not run in
one process.

--smoke: a 2-layer, 64-wide model on two emulated devices (no GPU needed; accelerate when
installed), to check the script itself.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import result_name, table, time_host, write_json  # noqa: E402

import ferry  # noqa: E402
from ferry.inspect import device_memory  # noqa: E402
from ferry.program.report import copy_report  # noqa: E402

TARGET = 1.7


class Hidden(nn.Module):
    """GPT2Model returning only the last hidden state (one tensor out)."""

    def __init__(self, layers: int, width: int, heads: int):
        super().__init__()
        import transformers

        cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=1024,
                                      bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        self.m = transformers.GPT2Model(cfg).eval()

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).last_hidden_state


def device_map(layers: int, devices: list[str], prefix: str = "m.") -> dict[str, str]:
    half = layers // 2
    m = {f"{prefix}wte": devices[0], f"{prefix}wpe": devices[0], f"{prefix}ln_f": devices[1]}
    m.update({f"{prefix}h.{i}": devices[int(i >= half)] for i in range(layers)})
    return m


def peer_bandwidth(nbytes: int, repeat: int = 20) -> float:
    """Seconds of one cuda:0 -> cuda:1 copy of `nbytes` (median of CUDA-event timings)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    times = []
    for _ in range(repeat + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        times.append(start.elapsed_time(end) / 1e3)
    times = sorted(times[3:])
    return times[len(times) // 2]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model on two emulated devices (no GPU needed)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--parts", default="2,4,8", help="micro-batch counts to try (each must divide --batch)")
    return p.parse_args()


def main() -> int:
    args = parse()
    gpus = torch.cuda.device_count()
    if gpus < 2 and not args.smoke:
        print(f"pipeline: skipped: needs two GPUs, found {gpus}; --smoke runs it on emulated devices")
        return 0
    if gpus >= 2:
        devices = ["cuda:0", "cuda:1"]
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    else:
        from ferry.runtime import EmulatedAllocator, register_allocator

        register_allocator(EmulatedAllocator(num_devices=2))
        devices = ["emu:0", "emu:1"]
    layers, width, heads, batch, seq = (2, 64, 4, 8, 16) if args.smoke else (
        args.layers, args.width, args.heads, args.batch, args.seq)
    counts = [1] + [int(k) for k in args.parts.split(",")]
    repeat = 3 if args.smoke else 20
    model = Hidden(layers, width, heads)
    x = torch.randint(0, model.m.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    dmap = device_map(layers, devices)
    rows, results = [], {}

    def record(name: str, fn, programs=None, parts=1):
        out = fn()  # warm-up, capture, and the answer checked against eager
        seconds = time_host(fn, repeat=repeat, warmup=3)
        err = (out.float().cpu() - want).abs().max().item()
        results[name] = {"ms": seconds * 1e3, "rows_per_s": batch / seconds, "max_abs_err": err, "parts": parts}
        rows.append([name, seconds * 1e3, batch / seconds, err])
        print(f"  {name}: {seconds * 1e3:.2f} ms", flush=True)

    # the whole model on one GPU, eager (the answer everyone is checked against)
    one = torch.device(devices[0]) if devices[0].startswith("cuda") else torch.device("cpu")
    with torch.no_grad():
        want = model(x).float()
        eager = Hidden(layers, width, heads).to(one)
        record("eager, one GPU", lambda: eager(x.to(one)).cpu())
        try:
            from accelerate import dispatch_model
        except ImportError:
            print("  accelerate not installed: its row is skipped")
        else:
            dispatched = dispatch_model(Hidden(layers, width, heads), device_map=device_map(layers, devices))
            record("accelerate dispatch_model, same map", lambda: dispatched(x).cpu())
            del dispatched
        torch.cuda.empty_cache() if gpus else None

    programs, crossing = {}, {}
    for parts in counts:
        rows_per_part = batch // parts
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(model, (x[:rows_per_part],))
            program = ferry.compile(ep, device_map=dmap)
        programs[parts] = program
        rep = copy_report(program, "forward")
        crossing[parts] = rep.totals()["d2d"][1] * parts
        for graphs in (False, True):
            label = f"ferry, {'no micro-batches' if parts == 1 else f'{parts} micro-batches'}" + (
                " + CUDA graphs" if graphs else "")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = ferry.Module(program, cuda_graphs=graphs, microbatches=parts if parts > 1 else None)
                record(label, lambda: module(x), parts=parts)
            module.close()

    with torch.no_grad():  # again, last: the order of the contenders does not decide the table
        record("eager, one GPU (measured again, last)", lambda: eager(x.to(one)).cpu())
    ms = {k: v["ms"] for k, v in results.items()}
    speedup = {g: ms.get(f"ferry, no micro-batches{g}", float("nan")) / min(
        ms.get(f"ferry, {p} micro-batches{g}", float("inf")) for p in counts[1:]) for g in ("", " + CUDA graphs")}
    print(table(f"GPT-2 {layers}x{width}, batch {batch}x{seq}, split over {devices[0]} and {devices[1]} "
                "(CPU tensors in and out)", ["contender", "ms / call", "rows / s", "max abs err vs eager"], rows))
    print(f"\nmicro-batching vs the same split without it: {speedup[''] :.2f}x eager kernels, "
          f"{speedup[' + CUDA graphs']:.2f}x with CUDA graphs (target >= {TARGET}x)")

    mem_rows, link = [], {}
    for parts, program in programs.items():
        mem = device_memory(program, program.method("forward"))
        mem_rows.append([parts, batch // parts] + [f"{mem.get(d, {}).get('planned', 0) / 2**20:.1f} MiB" for d in devices]
                        + [f"{crossing[parts] / 2**20:.2f} MiB"])
    print(table("planned memory per GPU and bytes crossing between them per call",
                ["micro-batches", "rows per part", *[f"{d} planned" for d in devices], "cuda:0 -> cuda:1 per call"],
                mem_rows))
    if gpus >= 2:
        part_bytes = crossing[counts[-1]] // counts[-1]
        sizes = sorted({part_bytes, crossing[1], 256 << 20})
        link = {"part_bytes": part_bytes, "copies": []}
        for n in sizes:
            t = peer_bandwidth(n)
            link["copies"].append({"bytes": n, "us": t * 1e6, "gb_s": n / t / 1e9})
        print(table("one cuda:0 -> cuda:1 copy alone (CUDA events)", ["bytes", "us", "GB/s"],
                    [[f"{c['bytes'] / 2**20:.2f} MiB", c["us"], c["gb_s"]] for c in link["copies"]]))
    path = write_json(result_name(f"pipeline_{layers}x{width}_b{batch}", args.smoke), {
        "model": {"layers": layers, "width": width, "heads": heads, "batch": batch, "seq": seq},
        "device_map": dmap, "results": results, "speedup": speedup, "target": TARGET,
        "crossing_bytes_per_call": crossing, "link": link,
        "planned": {p: device_memory(prog, prog.method("forward")) for p, prog in programs.items()},
    })
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

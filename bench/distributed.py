"""One model over two processes: ferry across ranks against ferry in one process on the same
two devices and against torch.distributed.pipelining (same stages, same micro-batches).

Model: the GPT-2 of bench/pipeline.py (transformers GPT2Model from its config, random
weights), split in half: the embeddings and the first half of the layers on rank 0's first
device, the second half and the final norm on rank 1's. Token ids in and the last hidden
state out, as CPU tensors on rank 0 for ferry (rank 0 takes the call and returns the
answer); torch.distributed.pipelining takes the ids on rank 0 and leaves its answer on rank
1's GPU (its schedule returns the output on the last stage), so it is timed there with the
copy of the answer to the host, one crossing fewer than ferry makes.

On two GPUs: rank r uses cuda:r, NCCL between them (ferry: `rank1:cuda:1`). Without GPUs
(or with --cpu): emulated devices and Gloo over the loopback address, a small model.
Reported: rows per second at the median call, the bytes crossing between the ranks per call,
one such copy alone over the same transport (its GB/s), and the time ferry adds per crossing
over the same split in one process. Every answer is checked against eager on the CPU.

Internally the script starts itself once per rank (`--worker ferry|pipelining`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import result_name, table, time_host, write_json  # noqa: E402
from pipeline import Hidden, device_map  # noqa: E402

import ferry  # noqa: E402
from ferry.program.ranks import boundaries  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="emulated devices and Gloo, even with GPUs")
    p.add_argument("--smoke", action="store_true", help="a tiny model, few calls")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--parts", type=int, default=8, help="micro-batches per call")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--worker", choices=["ferry", "pipelining"], help=argparse.SUPPRESS)
    p.add_argument("--program", help=argparse.SUPPRESS)
    p.add_argument("--graphs", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    gpu = torch.cuda.device_count() >= 2 and not args.cpu
    small = args.smoke or not gpu
    args.gpu = gpu
    args.layers = args.layers or (2 if args.smoke else 4 if small else 24)
    args.width = args.width or (64 if args.smoke else 256 if small else 1024)
    args.heads = 4 if small else args.heads
    args.batch = args.batch or (8 if small else 32)
    args.seq = 16 if args.smoke else (64 if small else args.seq)
    args.repeat = 3 if args.smoke else args.repeat
    return args


def inputs(args, model) -> torch.Tensor:
    return torch.randint(0, model.m.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))


def devices(args, ranks: bool) -> list[str]:
    if args.gpu:
        return ["cuda:0", "rank1:cuda:1" if ranks else "cuda:1"]
    return ["emu:0", "rank1:emu:0" if ranks else "emu:1"]


def use_emulated(args) -> None:
    if not args.gpu:
        from ferry.runtime import EmulatedAllocator, register_allocator

        register_allocator(EmulatedAllocator(num_devices=2))


# ---------------------------------------------------------------- workers (one per rank)


def ferry_worker(args) -> None:
    """Rank 0 times calls of the program over ranks; rank 1 serves them."""
    import torch.distributed as dist

    import ferry.distributed

    use_emulated(args)
    if args.gpu:  # as every contender: TF32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    want = torch.load(Path(args.out).with_name("want.pt"))
    model = Hidden(args.layers, args.width, args.heads)
    x = inputs(args, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = ferry.distributed.Module(args.program, microbatches=args.parts, cuda_graphs=args.graphs, timeout=120)
    with module:
        if rank == 0:
            out = module(x)
            ms = time_host(lambda: module(x), repeat=args.repeat, warmup=3) * 1e3
            result = {"ms": ms, "max_abs_err": (out - want).abs().max().item()}
        else:
            module.serve()
    link = link_speed(args, rank, [b.nbytes for b in boundaries(ferry.load_program(args.program))])
    if rank == 0:
        Path(args.out).write_text(json.dumps({**result, "link": link}))
    dist.destroy_process_group()


def link_speed(args, rank: int, sizes: list[int], repeat: int = 20) -> list[dict]:
    """Seconds of one rank 0 -> rank 1 transfer of each size alone, over the transport ferry
    uses (NCCL between GPUs, Gloo otherwise), timed on rank 0 around a send and a 4-byte
    acknowledgement."""
    import torch.distributed as dist

    group = dist.new_group(backend="nccl") if args.gpu else None
    dev = torch.device("cuda", rank) if args.gpu else torch.device("cpu")
    ack = torch.zeros(1, dtype=torch.int32, device=dev)
    out = []
    for n in sorted(set(sizes)):
        buf = torch.empty(n, dtype=torch.uint8, device=dev)
        times = []
        for _ in range(repeat + 3):
            if args.gpu:
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1, group=group)
                dist.recv(ack, 1, group=group)
            else:
                dist.recv(buf, 0, group=group)
                dist.send(ack, 0, group=group)
            if args.gpu:
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - start)
        t = statistics.median(times[3:])
        out.append({"bytes": n, "us": t * 1e6, "gb_s": n / t / 1e9})
    if group is not None:
        dist.destroy_process_group(group)
    return out


class _Front(nn.Module):
    def __init__(self, m, blocks):
        super().__init__()
        self.wte, self.wpe, self.h = m.wte, m.wpe, nn.ModuleList(blocks)

    def forward(self, ids):
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.h:
            h = _first(b(h))
        return h


class _Back(nn.Module):
    def __init__(self, m, blocks):
        super().__init__()
        self.h, self.ln_f = nn.ModuleList(blocks), m.ln_f

    def forward(self, h):
        for b in self.h:
            h = _first(b(h))
        return self.ln_f(h)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def pipelining_worker(args) -> None:
    """torch.distributed.pipelining's GPipe schedule over the same two stages."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", rank) if args.gpu else torch.device("cpu")
    if args.gpu:
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    dist.init_process_group("nccl" if args.gpu else "gloo", device_id=dev if args.gpu else None)
    model = Hidden(args.layers, args.width, args.heads)
    x = inputs(args, model)
    m, half = model.m, args.layers // 2
    part = (_Front(m, m.h[:half]) if rank == 0 else _Back(m, m.h[half:])).to(dev).eval()
    stage = PipelineStage(part, rank, 2, dev)
    schedule = ScheduleGPipe(stage, n_microbatches=args.parts)
    with torch.no_grad():
        step = (lambda: schedule.step(x.to(dev))) if rank == 0 else (lambda: schedule.step().cpu())
        out = step()
        ms = time_host(step, repeat=args.repeat, warmup=3) * 1e3
    if rank == 1:
        want = torch.load(Path(args.out).with_name("want.pt"))
        Path(args.out).write_text(json.dumps({"ms": ms, "max_abs_err": (out - want).abs().max().item()}))
    dist.destroy_process_group()


# ---------------------------------------------------------------- launcher


def launch(args, worker: str, extra: list[str], out: Path, limit: float = 540) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads), "--batch",
             str(args.batch), "--seq", str(args.seq), "--parts", str(args.parts), "--repeat", str(args.repeat)]
    flags += ["--cpu"] * (not args.gpu) + ["--smoke"] * args.smoke
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", worker, "--out", str(out), *flags, *extra],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2))))  # as torchrun
             for r in range(2)]
    deadline = time.monotonic() + limit
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return {"error": f"timed out after {limit:g} s"}
    if any(p.returncode for p in procs) or not out.exists():
        return {"error": f"exit codes {[p.returncode for p in procs]}"}
    return json.loads(out.read_text())


def main() -> int:
    args = parse()
    if args.worker == "ferry":
        ferry_worker(args)
        return 0
    if args.worker == "pipelining":
        pipelining_worker(args)
        return 0
    use_emulated(args)
    if args.gpu:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    model = Hidden(args.layers, args.width, args.heads)
    x = inputs(args, model)
    rows_per_part = args.batch // args.parts
    tmp = Path(tempfile.mkdtemp(prefix="ferry-dist-"))
    with torch.no_grad():
        want = model(x)
    torch.save(want, tmp / "want.pt")
    programs = {}
    for ranks in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(model, (x[:rows_per_part],))
            programs[ranks] = ferry.compile(ep, device_map=device_map(args.layers, devices(args, ranks)))
    path = tmp / "ranks.ferry"
    programs[True].save(path)
    crossings = boundaries(programs[True])
    results: dict = {}
    for graphs in (False, True) if args.gpu else (False,):
        tag = " + CUDA graphs" if graphs else ""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = ferry.Module(programs[False], microbatches=args.parts, cuda_graphs=graphs)
            out = module(x)
            ms = time_host(lambda: module(x), repeat=args.repeat, warmup=3) * 1e3
            module.close()
        results[f"ferry, one process, two devices{tag}"] = {"ms": ms, "max_abs_err": (out - want).abs().max().item()}
        print(f"  one process{tag}: {ms:.2f} ms", flush=True)
        got = launch(args, "ferry", ["--program", str(path)] + ["--graphs"] * graphs, tmp / f"ferry{graphs}.json")
        results[f"ferry, two processes{tag}"] = got
        print(f"  two processes{tag}: {got}", flush=True)
    got = launch(args, "pipelining", [], tmp / "pipelining.json")
    results["torch.distributed.pipelining (GPipe), two processes"] = got
    print(f"  pipelining: {got}", flush=True)

    transport = "NCCL" if args.gpu else "Gloo (loopback)"
    per_call = sum(b.nbytes for b in crossings) * args.parts
    rows = [[name, r.get("ms", float("nan")), args.batch / r["ms"] * 1e3 if "ms" in r else r.get("error"),
             r.get("max_abs_err", float("nan"))] for name, r in results.items()]
    where = "two H200s" if args.gpu else "two emulated devices, CPU"
    print(table(f"GPT-2 {args.layers}x{args.width}, batch {args.batch}x{args.seq} in {args.parts} micro-batches, "
                f"split over {where}", ["contender", "ms / call", "rows / s", "max abs err vs eager"], rows))
    link = next((r["link"] for r in results.values() if "link" in r), [])
    added = {}
    for graphs in ("", " + CUDA graphs"):
        one, two = results.get(f"ferry, one process, two devices{graphs}"), results.get(f"ferry, two processes{graphs}")
        if one and two and "ms" in two:
            added[graphs or "eager kernels"] = (two["ms"] - one["ms"]) / (len(crossings) * args.parts) * 1e3
    print(table(f"copies between the ranks ({transport}): {len(crossings)} per micro-batch, "
                f"{per_call / 2**20:.2f} MiB per call", ["bytes", "one copy alone, us", "GB/s"],
                [[f"{c['bytes'] / 2**20:.3f} MiB", c["us"], c["gb_s"]] for c in link]))
    for k, us in added.items():
        print(f"time ferry adds per crossing over one process ({k}): {us:.0f} us")
    out = write_json(result_name(f"distributed_{'gpu' if args.gpu else 'cpu'}", args.smoke), {
        "model": {"layers": args.layers, "width": args.width, "batch": args.batch, "seq": args.seq,
                  "parts": args.parts}, "transport": transport, "results": results,
        "crossings": [{"instruction": b.instruction, "src": str(b.src), "dst": str(b.dst), "bytes": b.nbytes,
                       "nccl": b.nccl} for b in crossings],
        "bytes_per_call": per_call, "link": link, "added_us_per_crossing": added})
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

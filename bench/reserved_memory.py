"""What each runner reserves from the GPU, alone in a fresh process, segment by segment.

    python bench/reserved_memory.py --models resnet50,distilbert --runners eager,ferry-graphs

bench/models.py measures every runner of a model in one process, where a runner's blocks may land
in segments an earlier runner left. Here each (model, runner) runs in a process of its own, with
the caching allocator's history recorded: after its first calls (a capture included) it prints
the peak allocated and reserved MiB and, per memory pool (the default pool, a graph's private
pool), the segments it holds: their size, what is allocated in them, and the frame that made
their largest block. Device I/O, batch 1, TF32 off. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import allocated_by, table, write_json  # noqa: E402

from models import MODELS, _eager_like, _ferry, _ferry_program, _fresh_gpu  # noqa: E402

MiB = 2**20


def one(name: str, runner: str) -> dict:
    """Build and call one runner; its peak, its reserved peak and its segments by pool."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda:0")
    model, (x,) = MODELS[name][0](1)
    _fresh_gpu(device)
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    if runner == "eager":
        call, _ = _eager_like(model, x, device, "device", None)
    else:
        backend = "inductor" if "inductor" in runner else "torch"
        program, _ = _ferry_program(model, x, device, "device", backend=backend)
        call, _, _module = _ferry(program, x, device, "device", runner.endswith("graphs"))
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    pools: dict = {}
    for seg in snap["segments"]:
        pool = "default" if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) else f"private {seg['segment_pool_id']}"
        big = max(seg["blocks"], key=lambda b: b["size"] if b["state"] == "active_allocated" else -1)
        p = pools.setdefault(pool, {"pool": pool, "segments": 0, "reserved_mib": 0.0, "allocated_mib": 0.0, "largest": []})
        p["segments"] += 1
        p["reserved_mib"] += seg["total_size"] / MiB
        p["allocated_mib"] += seg["allocated_size"] / MiB
        p["largest"].append([round(seg["total_size"] / MiB, 2), round(seg["allocated_size"] / MiB, 2),
                             allocated_by(big.get("frames", [])) if big["state"] == "active_allocated" else "(free)"])
    for p in pools.values():
        p["largest"] = sorted(p["largest"], key=lambda s: -s[0])[:8]
    return {"model": name, "runner": runner, "peak_mib": torch.cuda.max_memory_allocated() / MiB,
            "reserved_peak_mib": torch.cuda.max_memory_reserved() / MiB,
            "reserved_now_mib": torch.cuda.memory_reserved() / MiB, "pools": list(pools.values()),
            "segment_events": _segment_events(snap)}


def _segment_events(snap: dict) -> list:
    """Each segment the allocator took from the driver or gave back, in order: [action, MiB,
    reserved MiB after it, the frame that asked]. Shows which phase (weights, the arena, timing
    at load, a first call, a capture) made the reserved peak."""
    out, reserved = [], 0.0
    for event in snap["device_traces"][0]:
        if event["action"] not in ("segment_alloc", "segment_free"):
            continue
        size = event["size"] / MiB
        reserved += size if event["action"] == "segment_alloc" else -size
        out.append([event["action"].removeprefix("segment_"), round(size, 2), round(reserved, 1),
                    allocated_by(event.get("frames", []), ferry_frames=3)])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet50,distilbert")
    p.add_argument("--runners", default="eager,ferry-graphs")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "RUNNER"), help=argparse.SUPPRESS)
    p.add_argument("--out", default="reserved_memory")
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    rows = []
    for name in args.models.split(","):
        for runner in args.runners.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                done = subprocess.run([sys.executable, __file__, "--one", name, runner], capture_output=True,
                                      text=True, timeout=300, env={**os.environ, "FERRY_BENCH_OUT": tmp})
            if done.returncode != 0:
                rows.append({"model": name, "runner": runner, "error": done.stderr[-600:]})
                print(f"{name} {runner}: FAILED\n{done.stderr[-600:]}", flush=True)
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(table("Each runner alone in a process (MiB)", ["model", "runner", "peak MiB", "reserved peak MiB", "reserved now MiB"],
                [[r["model"], r["runner"], f"{r['peak_mib']:.1f}", f"{r['reserved_peak_mib']:.1f}",
                  f"{r['reserved_now_mib']:.1f}"] for r in rows if "error" not in r]))
    for r in rows:
        for pool in r.get("pools", []):
            print(f"\n{r['model']} {r['runner']} {pool['pool']}: {pool['segments']} segments, "
                  f"{pool['reserved_mib']:.1f} MiB reserved, {pool['allocated_mib']:.1f} allocated")
            for size, used, frame in pool["largest"]:
                print(f"  {size:8.2f} MiB segment, {used:8.2f} used; largest block by {frame}")
        if r.get("segment_events"):
            print(f"\n{r['model']} {r['runner']}: segments taken (+) and given back (-), reserved MiB after each")
            for action, size, total, frame in r["segment_events"]:
                print(f"  {'+' if action == 'alloc' else '-'}{size:8.2f} -> {total:8.1f}  {frame}")
    write_json(args.out, {"rows": rows})


if __name__ == "__main__":
    main()

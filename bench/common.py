"""Shared helpers for the benchmarks: timing, a table printer, JSON output, machine info."""

from __future__ import annotations

import json
import linecache
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch


def machine() -> dict:
    info = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def time_host(fn, *, repeat: int = 50, warmup: int = 5, inner: int = 1) -> float:
    """Median seconds per call of `fn` (host clock; synchronises CUDA around each sample)."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) / inner)
    return statistics.median(samples)


def table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [f"### {title}", "", line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def write_json(name: str, payload: dict) -> Path:
    out_dir = Path(os.environ.get("FERRY_BENCH_OUT", Path(__file__).parent / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=1))
    return path


def parse_args(description: str):
    """The command line every benchmark takes: `--smoke` (tiny sizes, few repeats)."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes and few repeats; without a GPU, run ferry on the emulated device 'emu:0'")
    return p.parse_args()


def bench_device(name: str, smoke: bool) -> str | None:
    """Where the benchmark's delegates run: 'cuda:0' when a GPU is present; without one, the
    emulated device 'emu:0' under --smoke (registered here), else None after a skip line."""
    if torch.cuda.is_available():
        return "cuda:0"
    if not smoke:
        print(f"{name}: skipped: no CUDA device (torch.cuda.is_available() is False); "
              "--smoke runs the ferry code paths on the emulated device")
        return None
    from ferry.runtime import EmulatedAllocator, get_allocator, register_allocator

    if get_allocator("emu") is None:
        register_allocator(EmulatedAllocator())
    return "emu:0"


def torch_device(device: str) -> torch.device:
    """The torch device eager baselines use for a ferry device ('emu' lives in host memory)."""
    return torch.device(device) if device.startswith("cuda") else torch.device("cpu")


def result_name(name: str, smoke: bool) -> str:
    """Smoke runs write NAME_smoke.json, never over a real result."""
    return f"{name}_smoke" if smoke else name


def allocated_by(frames: list, ferry_frames: int = 1) -> str:
    """Where a GPU block was made, from the caching allocator's recorded Python frames: the
    innermost frame of library code, then the innermost `ferry_frames` of ferry's, innermost
    first; where Inductor's generated code made the call, its line too (which op allocated)."""
    code = [f for f in frames if "/bench/" not in f["filename"]
            and ("site-packages" in f["filename"] or "/ferry/" in f["filename"])]  # not the standard library
    picked = code[:1] + [f for f in code[1:] if "/ferry/" in f["filename"]][:ferry_frames]
    where = " < ".join(f"{Path(f['filename']).parent.name}/{Path(f['filename']).name}:{f['line']} {f['name']}"
                       for f in picked) or "(no Python frame)"
    for f in [f for f in frames if "torchinductor" in f["filename"]][:1]:
        where += f" [Inductor code: {linecache.getline(f['filename'], f['line']).strip()[:160]}]"
    return where

"""Shared helpers for the benchmarks: timing, a table printer, JSON output, machine info."""

from __future__ import annotations

import json
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

"""One Module shared by threads: throughput at 1, 2, 4, 8 threads.

Runners, side by side in one process, the transformer block example on the CPU:
- shared, concurrency=1: calls wait for each other (one set of planned memory);
- shared, concurrency=k: k sets of planned memory, up to k calls at once;
- one Module per thread: each thread its own Module (what a server would do without ferry's help).
Calls per second over a fixed number of calls per thread (torch intra-op threads: 1).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_json  # noqa: E402

import ferry  # noqa: E402
from ferry.examples import transformer_block  # noqa: E402

CALLS = 200


def _throughput(modules, threads: int) -> float:
    x = torch.randn(2, 16, 64)
    barrier = threading.Barrier(threads + 1)

    def work(module):
        barrier.wait()
        for _ in range(CALLS):
            module(x)

    ts = [threading.Thread(target=work, args=(modules[i % len(modules)],)) for i in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return threads * CALLS / (time.perf_counter() - t0)


def main():
    torch.set_num_threads(1)
    model, example = transformer_block()
    program = ferry.compile(torch.export.export(model, example))
    rows, results = [], {}
    for threads in (1, 2, 4, 8):
        shared = ferry.Module(program)
        pooled = ferry.Module(program, concurrency=threads)
        own = [ferry.Module(program) for _ in range(threads)]
        r = {"shared, concurrency=1": _throughput([shared], threads)}
        if threads > 1:
            r[f"shared, concurrency={threads}"] = _throughput([pooled], threads)
        r["one Module per thread"] = _throughput(own, threads)
        results[threads] = r
        rows += [[threads, k, round(v)] for k, v in r.items()]
    print(table(f"Calls per second, {CALLS} calls per thread ({torch.get_num_threads()} intra-op thread)",
                ["threads", "runner", "calls/s"], rows))
    print(f"wrote {write_json('threads', {'calls_per_thread': CALLS, 'results': results})}")


if __name__ == "__main__":
    main()

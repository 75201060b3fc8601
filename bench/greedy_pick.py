"""The greedy pick of a decode step: the next token as the argmax of one row of logits per sequence.

Every runner of `bench/llm.py` pays it once a step. Candidates, timed on the same bf16 logits at the
vocabularies of Llama 3, Qwen2/3, Llama 2 and Whisper, batch 1 and 8:

- torch argmax: `logits.argmax(-1)`, what transformers' greedy `generate` runs;
- two passes: the maximum of each row of a split vocabulary, then the row of the first maximum
  (`ferry.runtime.sampling.by_rows`);
- ferry greedy: `ferry.runtime.sampling.greedy`, which times the two above once per shape and keeps
  the faster (what `ferry.generate` runs);
- Inductor argmax: `torch.compile` of the argmax with its block sizes tuned.

Each is timed as a generation loop without CUDA graphs runs it (launched from the host, one
call after the other: `host`) and inside a CUDA graph (`graph`).
`python bench/greedy_pick.py` prints a table and writes bench/results/greedy_pick.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, table, write_json  # noqa: E402
from gemm_kernels import graph_us  # noqa: E402

from ferry.runtime.sampling import _chunk, by_rows, greedy  # noqa: E402

VOCABS = {"llama-3": 128256, "qwen3": 151936, "llama-2": 32000, "whisper": 51865}


def host_us(fn, reps: int = 200) -> float:
    """µs per call of `fn` launched back to back from the host (the GPU synchronised at both ends)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / reps


def main():
    if not torch.cuda.is_available():
        print("greedy_pick: skipped: needs a CUDA device")
        return
    inductor = torch.compile(lambda x: x.argmax(-1), options={"coordinate_descent_tuning": True}, dynamic=False)
    candidates = {"torch argmax": lambda x: x.argmax(-1), "two passes": lambda x: by_rows(x, _chunk(x.shape[-1])),
                  "ferry greedy": greedy, "Inductor argmax": inductor}
    rows, out = [], []
    for family, vocab in VOCABS.items():
        for batch in (1, 8):
            g = torch.Generator(device="cuda").manual_seed(vocab + batch)
            logits = torch.randn(batch, vocab, device="cuda", generator=g).to(torch.bfloat16)
            want = logits.argmax(-1)
            for name, fn in candidates.items():
                same = bool(torch.equal(fn(logits), want))
                host, graph = host_us(lambda fn=fn: fn(logits)), graph_us(lambda fn=fn: fn(logits))
                rows.append([family, vocab, batch, name, round(host, 1), round(graph, 1), same])
                out.append({"family": family, "vocab": vocab, "batch": batch, "candidate": name,
                            "host_us": host, "graph_us": graph, "equals_argmax": same})
    print(table("Greedy pick over bf16 logits (µs per call)",
                ["model", "vocab", "batch", "candidate", "host", "graph", "equals argmax"], rows))
    print(f"wrote {write_json('greedy_pick', {'settings': machine(), 'rows': out})}")


if __name__ == "__main__":
    main()

"""CPU fallback inside a GPU model: a transformer block whose softmax runs on the CPU.

ferry: ferry.examples.TransformerBlock compiled with OpSupportPartitioner(device,
exclude=['aten.softmax']): everything but the softmax is delegated to the GPU, and ferry
inserts the copies (input h2d, scores d2h, probabilities h2d, output d2h).

Eager baseline, the same placement written by hand: parameters on the GPU, input moved with
.cuda(), the same math on the GPU, the scores moved to the CPU with .cpu(), softmax there, the
probabilities moved back with .cuda(), the result returned with .cpu(). Target: ferry no slower.

Also the bytes ferry copies per call (ferry.copy_report(program, 'forward').totals()) against
the minimum this placement needs, computed from the shapes: input h2d + scores d2h +
probabilities h2d + output d2h.

A second ferry row runs the same program with Module(cuda_graphs=True): each device segment
between two host instructions (copies + delegate on each side of the softmax) replays as a
CUDA graph. The target is judged on the default Module (cuda_graphs=False); both are reported.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_device, parse_args, result_name, table, time_host, torch_device, write_json  # noqa: E402

import ferry  # noqa: E402
from ferry.examples import TransformerBlock  # noqa: E402

CONFIG = {"seq": 128, "dim": 256, "heads": 4, "hidden": 1024, "batches": (1, 64)}
SMOKE_CONFIG = {"seq": 32, "dim": 64, "heads": 4, "hidden": 256, "batches": (1, 4)}


def hand_placed(m: TransformerBlock, x_cpu: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """TransformerBlock.forward with ferry's placement written by hand: softmax on the CPU."""
    x = x_cpu.to(dev)
    b, t, d = x.shape
    q, k, v = m.qkv(m.ln1(x)).chunk(3, dim=-1)
    q, k, v = (z.reshape(b, t, m.heads, d // m.heads).transpose(1, 2) for z in (q, k, v))
    scores = q @ k.transpose(-2, -1) / (d // m.heads) ** 0.5
    att = torch.softmax(scores.cpu(), dim=-1).to(dev)
    y = (att @ v).transpose(1, 2).reshape(b, t, d)
    x = x + m.proj(y)
    return (x + m.fc2(F.gelu(m.fc1(m.ln2(x))))).cpu()


def minimum_copies(batch, seq, dim, heads, itemsize=4) -> dict[str, int]:
    act = batch * seq * dim * itemsize  # input in, output out
    scores = batch * heads * seq * seq * itemsize  # scores out, probabilities back in
    return {"h2d": act + scores, "d2h": scores + act}


def main():
    args = parse_args(__doc__.splitlines()[0])
    device = bench_device("cpu_fallback", args.smoke)
    if device is None:
        return
    tdev = torch_device(device)
    cfg = SMOKE_CONFIG if args.smoke else CONFIG
    seq, dim, heads, hidden = cfg["seq"], cfg["dim"], cfg["heads"], cfg["hidden"]
    torch.manual_seed(0)
    model = TransformerBlock(dim, heads, hidden).eval()
    dev_model = TransformerBlock(dim, heads, hidden).eval()
    dev_model.load_state_dict(model.state_dict())
    dev_model.to(tdev)
    part = ferry.OpSupportPartitioner(device, exclude=["aten.softmax"])

    rows, runs = [], []
    with torch.no_grad():
        for batch in cfg["batches"]:
            x0 = torch.randn(batch, seq, dim)
            program = ferry.compile(torch.export.export(model, (x0,)), part)
            report = ferry.copy_report(program, "forward")
            totals = report.totals()
            minimum = minimum_copies(batch, seq, dim, heads)
            copied = {d: totals[d][1] for d in ("h2d", "d2h")}
            module = ferry.Module(program)
            graphed = ferry.Module(program, cuda_graphs=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module.load_method()
                graphed.load_method()
                for _ in range(4):  # fresh random inputs (warm-up, capture, replays): all agree
                    x = torch.randn(batch, seq, dim)
                    want = model(x)
                    got_ferry, got_graph, got_hand = module(x), graphed(x), hand_placed(dev_model, x, tdev)
                    assert torch.allclose(got_ferry, want, rtol=1e-4, atol=1e-4), "ferry differs from eager"
                    assert torch.allclose(got_graph, want, rtol=1e-4, atol=1e-4), "ferry (CUDA graphs) differs from eager"
                    assert torch.allclose(got_hand, want, rtol=1e-4, atol=1e-4), "hand-placed eager differs"
            notes = sorted({str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)})
            for n in notes:
                print(f"note (batch {batch}): {n}")
            captured = sum(1 for g in graphed._methods["forward"].graphs if g.graph is not None)
            x = torch.randn(batch, seq, dim)
            rep = 5 if args.smoke else (50 if batch == 1 else 20)
            t_ferry = time_host(lambda: module(x), repeat=rep, warmup=5)
            t_graph = time_host(lambda: graphed(x), repeat=rep, warmup=5)
            t_hand = time_host(lambda: hand_placed(dev_model, x, tdev), repeat=rep, warmup=5)
            module.close()
            graphed.close()
            run = {
                "batch": batch, "seq": seq, "dim": dim, "heads": heads, "hidden": hidden,
                "seconds": {"ferry": t_ferry, "ferry_cuda_graphs": t_graph, "eager_hand_placed": t_hand},
                "speedup_vs_eager": t_hand / t_ferry, "no_slower": t_ferry <= t_hand,
                "speedup_vs_eager_cuda_graphs": t_hand / t_graph, "no_slower_cuda_graphs": t_graph <= t_hand,
                "cuda_graphs_captured": captured, "runtime_warnings": notes,
                "copies": {d: {"count": totals[d][0], "bytes": totals[d][1]} for d in totals},
                "minimum_bytes": minimum, "copied_bytes": copied,
                "copies_equal_minimum": copied == minimum,
                "delegates": len(program.delegates),
            }
            runs.append(run)
            rows.append([batch, t_ferry * 1e3, t_graph * 1e3, t_hand * 1e3, t_hand / t_ferry, t_hand / t_graph,
                         run["no_slower"],
                         f"{copied['h2d'] + copied['d2h']:,}", f"{minimum['h2d'] + minimum['d2h']:,}",
                         run["copies_equal_minimum"]])
            print(f"batch {batch}: {len(program.delegates)} delegates; ferry copies h2d {totals['h2d'][0]} / "
                  f"{copied['h2d']:,} B, d2h {totals['d2h'][0]} / {copied['d2h']:,} B; minimum h2d {minimum['h2d']:,} B, "
                  f"d2h {minimum['d2h']:,} B; equal: {copied == minimum}")
    path = write_json(result_name("cpu_fallback", args.smoke), {
        "device": device, "smoke": args.smoke, "partitioner_exclude": ["aten.softmax"], "runs": runs,
        "target": {"ferry_no_slower_all": all(r["no_slower"] for r in runs),
                   "ferry_cuda_graphs_no_slower_all": all(r["no_slower_cuda_graphs"] for r in runs),
                   "copies_equal_minimum_all": all(r["copies_equal_minimum"] for r in runs)},
    })
    print(f"wrote {path}\n")
    print(table(f"transformer block (seq {seq}, dim {dim}, hidden {hidden}), softmax on the CPU, rest on {device} (median)",
                ["batch", "ferry ms", "ferry+graphs ms", "eager (same placement) ms", "speed-up",
                 "speed-up (graphs)", "no slower",
                 "bytes copied", "minimum bytes", "equal"], rows))


if __name__ == "__main__":
    main()

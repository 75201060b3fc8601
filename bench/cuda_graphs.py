"""CUDA-graph replay: a method of 100 small GPU ops, ferry with and without CUDA graphs vs eager.

The model is 100 alternating elementwise ops (x * 1.0001, x + 0.01) on a (64, 64) float32
tensor, every op delegated to the device with OpSupportPartitioner (one delegate).

Host I/O (the default): the ferry method takes a CPU input and returns a CPU output
(h2d + delegate + d2h: one device segment, captured as one CUDA graph when asked). Eager does
the same work: x_cpu.cuda() -> model -> .cpu(). Target: ferry with CUDA graphs >= 4x faster
than eager.

Device-resident: compiled with skip_h2d/skip_d2h (PropagateDeviceConfig(True, True)), so the
caller passes a GPU tensor and gets a GPU tensor back, against eager on GPU tensors. With
cuda_graphs=True the runtime copies the caller's tensor into a fixed device tensor (one
device-to-device copy) so the segment can be captured; the table reports how many graphs were
actually captured.

Results are checked against eager (torch.allclose) before timing, and again after graph capture
on a fresh input (a replay must read the new input).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_device, parse_args, result_name, table, time_host, torch_device, write_json  # noqa: E402

import ferry  # noqa: E402
from ferry.runtime import clone_to  # noqa: E402

N_OPS = 100
SHAPE = (64, 64)
GRAPH_TARGET = 4.0


class Chain(torch.nn.Module):
    def forward(self, x):
        for _ in range(N_OPS // 2):
            x = x * 1.0001
            x = x + 0.01
        return x


def graphs_captured(module: ferry.Module) -> int:
    return sum(1 for m in module._methods.values() for g in m.graphs if g.graph is not None)


def graph_segments(module: ferry.Module) -> int:
    return sum(len(m.graphs) for m in module._methods.values())


def close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-5)


def load(program, cuda_graphs: bool):
    """A loaded Module plus the runtime warnings loading it raised (segments left uncaptured)."""
    module = ferry.Module(program, cuda_graphs=cuda_graphs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.load_method("forward")
    return module, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def run_checked(module, make_input, model_fn, calls: int = 4) -> list[str]:
    """Call a few times (warm-up, capture, replays), each on fresh random data, comparing with eager."""
    notes = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(calls):
            x = make_input()
            got, want = module(x), model_fn(x)
            assert close(got, want), "ferry result differs from eager"
    notes += [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return notes


def main():
    args = parse_args(__doc__.splitlines()[0])
    device = bench_device("cuda_graphs", args.smoke)
    if device is None:
        return
    tdev = torch_device(device)
    cuda = tdev.type == "cuda"
    repeat, inner = (5, 2) if args.smoke else (100, 5)

    model = Chain().eval()
    x0 = torch.randn(SHAPE)
    ep = torch.export.export(model, (x0,))
    part = ferry.OpSupportPartitioner(device)
    host_io = ferry.compile(ep, part)
    resident = ferry.compile(ep, part, ferry.CompileConfig(
        propagate_device=ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)))
    n_delegates = len(host_io.delegates)
    eager_model = Chain().eval().to(tdev)

    def on_device(x):
        return x.to(tdev) if cuda else clone_to(x, device)

    x_cpu = torch.randn(SHAPE)
    x_dev = on_device(torch.randn(SHAPE))
    results, rows, notes = {}, [], {}
    with torch.no_grad():
        eager_host = lambda: eager_model(x_cpu.to(tdev)).cpu()  # noqa: E731
        eager_dev = lambda: eager_model(x_dev)  # noqa: E731
        assert close(eager_host(), model(x_cpu))

        # --- host I/O: CPU in, CPU out
        for graphs in (True, False):
            name = f"ferry cuda_graphs={graphs}"
            mod, load_notes = load(host_io, graphs)
            run_notes = run_checked(mod, lambda: torch.randn(SHAPE), model)
            t = time_host(lambda: mod(x_cpu), repeat=repeat, warmup=5, inner=inner)
            assert close(mod(x_cpu), model(x_cpu))
            results[("host", name)] = {"seconds": t, "graphs_captured": graphs_captured(mod),
                                       "graph_segments": graph_segments(mod)}
            notes[f"host I/O, {name}"] = load_notes + run_notes
            mod.close()
        results[("host", "eager")] = {"seconds": time_host(eager_host, repeat=repeat, warmup=5, inner=inner)}

        # --- device-resident: device tensor in, device tensor out (skip_h2d / skip_d2h)
        for graphs in (True, False):
            name = f"ferry cuda_graphs={graphs}"
            mod, load_notes = load(resident, graphs)
            run_notes = run_checked(mod, lambda: on_device(torch.randn(SHAPE)), lambda x: model(x.cpu()))
            t = time_host(lambda: mod(x_dev), repeat=repeat, warmup=5, inner=inner)
            results[("device", name)] = {"seconds": t, "graphs_captured": graphs_captured(mod),
                                         "graph_segments": graph_segments(mod)}
            notes[f"device-resident, {name}"] = load_notes + run_notes
            mod.close()
        results[("device", "eager")] = {"seconds": time_host(eager_dev, repeat=repeat, warmup=5, inner=inner)}

    for io in ("host", "device"):
        base = results[(io, "eager")]["seconds"]
        for (kind, name), r in results.items():
            if kind != io:
                continue
            r["speedup_vs_eager"] = base / r["seconds"]
            label = "CPU in/out" if io == "host" else "device in/out (skip_h2d/skip_d2h)"
            rows.append([label, name, r["seconds"] * 1e6, r["seconds"] / N_OPS * 1e6, r["speedup_vs_eager"],
                         r.get("graphs_captured", "-")])
    speedup = results[("host", "ferry cuda_graphs=True")]["speedup_vs_eager"]
    met = speedup >= GRAPH_TARGET
    path = write_json(result_name("cuda_graphs", args.smoke), {
        "device": device, "smoke": args.smoke, "n_ops": N_OPS, "shape": list(SHAPE), "delegates": n_delegates,
        "results": {f"{io}/{name}": r for (io, name), r in results.items()},
        "runtime_warnings": notes,
        "target": {"speedup_with_graphs_vs_eager": GRAPH_TARGET, "measured": speedup, "met": met},
    })
    for label, msgs in notes.items():
        for m in sorted(set(msgs)):
            print(f"note ({label}): {m}")
    print(f"delegates in the program: {n_delegates}")
    print(f"target: ferry with CUDA graphs >= {GRAPH_TARGET}x eager (CPU in/out): measured {speedup:.2f}x, met: {met}"
          + ("" if cuda else " (emulated device: no CUDA graphs, the number means nothing)"))
    print(f"wrote {path}\n")
    print(table(f"{N_OPS} elementwise ops on {SHAPE} on {device} (median)",
                ["I/O", "runner", "µs per call", "µs per op", "speed-up vs eager", "graphs captured"], rows))


if __name__ == "__main__":
    main()

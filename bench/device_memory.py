"""Device memory: ferry's ahead-of-time plan against PyTorch's caching allocator, same models.

Every model is compiled with OpSupportPartitioner(device) (the whole model on the GPU); ferry
still copies the CPU input in and the output back, so both sides hold the input and output
on the device.

ferry, planned: the program's device buffers (the method's own: the input's device copy and
the delegate outputs) plus every delegate payload's device buffers (its intermediates),
read from the Program (program.method(...).buffers, and for each delegate
ferry.load_program(payload).method('forward').buffers). Cross-checked against what a loaded
Module owns (LoadedMethod.memory.owned of the method and of each delegate handle) and, on a GPU,
against torch.cuda.memory_allocated() around load, and the extra peak during a call (the
design says ferry allocates nothing while executing; a non-zero number means some kernel
allocates temporaries, e.g. an ATen `.out` overload that is a wrapper around the functional
op). ferry's actual footprint is planned + that extra, reported beside the plan.

PyTorch, eager: the same model on the GPU, `model(x_cpu.cuda()).cpu()`, peak of
torch.cuda.max_memory_allocated() above the memory allocated before the call (weights and the
cuBLAS workspace, both allocated by warm-up calls, are below that baseline).

Weights are EXCLUDED from both compared numbers (reported separately: ferry's device
constants, the eager model's parameters and buffers). Both include the input's and the
output's device copies and the intermediates; the eager side also counts any per-call
workspace (cuDNN) the caching allocator hands out, which ferry's plan does not see.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_device, parse_args, result_name, table, torch_device, write_json  # noqa: E402

import ferry  # noqa: E402
from ferry.examples import SmallCNN, TransformerBlock  # noqa: E402
from ferry.program.schema import DelegateCall, TensorValue  # noqa: E402
from ferry.runtime import get_allocator  # noqa: E402


def cases(smoke: bool):
    seq, dim, hidden = (32, 64, 256) if smoke else (128, 256, 1024)
    big = 4 if smoke else 64
    for batch in (1, big):
        torch.manual_seed(0)
        yield f"TransformerBlock b{batch} t{seq} d{dim}", TransformerBlock(dim, 4, hidden).eval(), torch.randn(batch, seq, dim)
    cnn_batch = 4 if smoke else 64
    torch.manual_seed(0)
    yield f"SmallCNN b{cnn_batch} 3x32x32", SmallCNN().eval(), torch.randn(cnn_batch, 3, 32, 32)


def planned_device_bytes(program, method: str = "forward") -> dict[str, int]:
    """Device bytes a program plans (buffers) and uploads (constants), its delegates included."""
    m = program.method(method)
    planned = sum(b.size for b in m.buffers[1:] if not b.device.is_cpu)
    weights = sum(v.nbytes for v in m.values if isinstance(v, TensorValue) and v.plan is None
                  and v.constant is not None and not v.device.is_cpu)
    for d in sorted({i.delegate for i in m.instructions if isinstance(i, DelegateCall)}):
        sub = planned_device_bytes(ferry.load_program(bytes(program.segments[program.delegates[d].payload])))
        planned += sub["planned"]
        weights += sub["weights"]
    return {"planned": planned, "weights": weights}


def loaded_device_bytes(module: ferry.Module, method: str = "forward") -> int:
    """Bytes of every device DeviceMemoryBuffer a loaded Module owns (planned buffers and constants)."""
    owned = list(module._methods[method].memory.owned)
    for handle in module._delegates.values():
        owned += handle.method.memory.owned
    return sum(b.nbytes for b in owned if not b.closed and not b.device.is_cpu)


def eager_peak(model, x, tdev) -> int:
    """Peak bytes the caching allocator hands out above its baseline during model(x.cuda()).cpu()."""
    for _ in range(2):  # warm-up: cuBLAS workspace and lazy state allocated before the baseline
        model(x.to(tdev)).cpu()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = model(x.to(tdev)).cpu()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def main():
    args = parse_args(__doc__.splitlines()[0])
    device = bench_device("device_memory", args.smoke)
    if device is None:
        return
    tdev = torch_device(device)
    cuda = tdev.type == "cuda"
    emu = None if cuda else get_allocator("emu")
    rows, runs = [], []
    with torch.no_grad():
        for name, model, x in cases(args.smoke):
            program = ferry.compile(torch.export.export(model, (x,)), ferry.OpSupportPartitioner(device))
            plan = planned_device_bytes(program)

            # ferry: load, check the accounting, run
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
            else:
                before = emu.live_bytes
            module = ferry.Module(program)
            module.load_method()
            loaded = loaded_device_bytes(module)
            if loaded != plan["planned"] + plan["weights"]:
                print(f"warning: {name}: the loaded Module owns {loaded:,} device bytes, the program plans "
                      f"{plan['planned']:,} + {plan['weights']:,} (weights)")
            measured_load = (torch.cuda.memory_allocated() if cuda else emu.live_bytes) - before
            for _ in range(3):
                xi = torch.randn_like(x)
                assert torch.allclose(module(xi), model(xi), rtol=1e-4, atol=1e-4), f"{name}: ferry differs from eager"
            exec_extra = None
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                module(x)
                torch.cuda.synchronize()
                exec_extra = torch.cuda.max_memory_allocated() - base
            else:
                emu.reset_counters()
                module(x)
                exec_extra = emu.allocations  # allocations during a call: should be 0

            # eager PyTorch on the GPU, same model and input
            dev_model = copy.deepcopy(model).to(tdev)
            eager_weights = sum(t.nbytes for t in (*dev_model.parameters(), *dev_model.buffers()))
            peak = eager_peak(dev_model, x, tdev) if cuda else None
            module.close()
            del dev_model

            run = {
                "model": name, "delegates": len(program.delegates),
                "ferry_planned_bytes": plan["planned"], "ferry_weight_bytes": plan["weights"],
                "ferry_loaded_bytes": loaded, "loaded_matches_plan": loaded == plan["planned"] + plan["weights"],
                "ferry_measured_load_bytes": measured_load,
                "ferry_execute_extra": exec_extra,
                "ferry_execute_extra_unit": "bytes (peak above baseline)" if cuda else "emulated allocations",
                "eager_peak_bytes": peak, "eager_weight_bytes": eager_weights,
                "ferry_over_eager": (plan["planned"] / peak) if peak else None,
                "ferry_planned_plus_call_extra_bytes": (plan["planned"] + exec_extra) if cuda else None,
                "ferry_actual_over_eager": ((plan["planned"] + exec_extra) / peak) if peak else None,
            }
            runs.append(run)
            rows.append([name, f"{plan['planned']:,}", "-" if peak is None else f"{peak:,}",
                         "-" if not peak else plan["planned"] / peak,
                         "-" if not peak else f"{plan['planned'] + exec_extra:,}",
                         "-" if not peak else (plan["planned"] + exec_extra) / peak,
                         f"{plan['weights']:,}", f"{eager_weights:,}", f"{measured_load:,}", f"{exec_extra:,}"])
    path = write_json(result_name("device_memory", args.smoke), {
        "device": device, "smoke": args.smoke, "weights": "excluded from ferry_planned_bytes and eager_peak_bytes",
        "runs": runs,
    })
    print(f"wrote {path}\n")
    print(table(f"device memory on {device}, weights excluded from both compared columns",
                ["model", "ferry planned B", "eager peak B", "planned/eager", "ferry planned + call extra B",
                 "(planned + extra)/eager", "ferry weights B",
                 "eager weights B", "ferry measured at load B", "extra during a call"], rows))


if __name__ == "__main__":
    main()

"""Host<->device copy throughput of ferry's copy path, against PyTorch's own copies.

The ferry path is exactly what a loaded method runs for `_h2d_copy` / `_d2h_copy`: a
page-locked host buffer and a device buffer (DeviceMemoryBuffer), float32 tensors over them
(make_tensor), a CopyKernel, issued through CopyStreams.run on the copy stream and followed
by CopyStreams.wait_host (what the runtime does before host code touches the memory).

Side by side, per size and direction:
  - ferry (the path above);
  - PyTorch from page-locked memory: dst.copy_(src_pinned, non_blocking=True) + synchronize
    (the hardware ceiling; target: ferry >= 90% of it);
  - PyTorch from ordinary pageable memory: dst.copy_(src_pageable) + synchronize (what the
    reference design does; target at 256 MiB: ferry >= 3.5x faster).

Then one end-to-end check: a ferry Module whose program is one delegate `y = x + 1` on the
device, at the largest size (h2d + delegate + d2h), against eager `(x.cuda() + 1).cpu()`.

On a machine without a GPU, --smoke runs the ferry pieces on the emulated device (no copy
streams there: the runtime calls the CopyKernel directly, and so does this script).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_device, parse_args, result_name, table, time_host, torch_device, write_json  # noqa: E402

import ferry  # noqa: E402
from ferry.device import CPU, Device  # noqa: E402
from ferry.runtime import DeviceMemoryBuffer, make_tensor  # noqa: E402
from ferry.runtime.stages.kernels import CopyKernel  # noqa: E402

MiB = 1 << 20
SIZES = (1 * MiB, 16 * MiB, 256 * MiB)
SMOKE_SIZES = (64 * 1024, 1 * MiB)
PINNED_TARGET = 0.90  # ferry / PyTorch pinned, every size and direction
PAGEABLE_TARGET = 3.5  # ferry / PyTorch pageable, at the largest size


def repeats(nbytes: int, smoke: bool) -> int:
    if smoke:
        return 5
    return 200 if nbytes <= MiB else 50 if nbytes <= 16 * MiB else 15


class AddOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


def ferry_copy(direction: str, host: torch.Tensor, dev: torch.Tensor, device: Device, in_flight: int = 1):
    """One runtime copy step, as LoadedMethod binds it, plus the host wait that follows it."""
    if direction == "h2d":
        kernel, src, out, devices = CopyKernel("h2d", CPU, device, dev.nbytes), host, dev, (CPU, device)
    else:
        kernel, src, out, devices = CopyKernel("d2h", device, CPU, host.nbytes), dev, host, (device, CPU)
    copy = kernel.bind_static(src, out)  # what LoadedMethod binds for planned tensors
    if device.type != "cuda":
        return copy  # the runtime has no copy streams without CUDA
    from ferry.runtime.devices.streams import CUDA_API, CopyStreams

    streams = CopyStreams(CUDA_API)
    run = streams.bind(("bench", direction), copy, devices, src.nbytes)

    def step():
        for _ in range(in_flight):
            run()
        streams.wait_host()

    return step


def torch_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool, in_flight: int = 1):
    if dst.is_cuda or src.is_cuda:
        def step():
            for _ in range(in_flight):
                dst.copy_(src, non_blocking=non_blocking)
            torch.cuda.synchronize()
    else:
        def step():
            dst.copy_(src)
    return step


def bench_copies(device: Device, sizes, smoke: bool):
    tdev = torch_device(str(device))
    cuda = device.type == "cuda"
    rows, results = [], []
    for nbytes in sizes:
        numel = nbytes // 4
        # ferry: the runtime's own buffers, float32 views over them
        host_buf = DeviceMemoryBuffer.create(nbytes, "cpu", pin_memory=True)
        dev_buf = DeviceMemoryBuffer.create(nbytes, device)
        if cuda:
            assert host_buf.pinned and host_buf.memory.is_pinned(), "ferry's host buffer is not page-locked"
        host = make_tensor(host_buf.memory, (numel,), torch.float32, CPU)
        dev = make_tensor(dev_buf.memory, (numel,), torch.float32, device)
        # PyTorch: its own pinned, pageable and device tensors
        pinned = torch.empty(numel, pin_memory=cuda)
        pageable = torch.empty(numel)
        tdst = torch.empty(numel, device=tdev)
        for t in (host, pinned, pageable):
            t.copy_(torch.randn(numel))
        if cuda:
            dev.copy_(torch.randn(numel, device=tdev))
            tdst.copy_(torch.randn(numel, device=tdev))
        else:  # the emulated device's memory is host memory: fill it through its allocator
            ferry_copy("h2d", pageable, dev, device)()
            tdst.copy_(torch.randn(numel))

        # correctness of the ferry path, both directions, before any timing
        ferry_copy("h2d", host, dev, device)()
        expect = host.clone()
        got = dev.cpu() if cuda else dev.clone()
        assert torch.equal(got, expect), f"ferry h2d copy of {nbytes} bytes is wrong"
        host.copy_(torch.randn(numel))
        ferry_copy("d2h", host, dev, device)()
        assert torch.equal(host, expect), f"ferry d2h copy of {nbytes} bytes is wrong"

        rep = repeats(nbytes, smoke)
        for direction in ("h2d", "d2h"):
            if direction == "h2d":
                fns = {"ferry": ferry_copy("h2d", host, dev, device),
                       "torch_pinned": torch_copy(tdst, pinned, True),
                       "torch_pageable": torch_copy(tdst, pageable, False)}
            else:
                fns = {"ferry": ferry_copy("d2h", host, dev, device),
                       "torch_pinned": torch_copy(pinned, tdst, True),
                       "torch_pageable": torch_copy(pageable, tdst, False)}
            # a stream of copies (8 in flight, one host wait): host-side cost overlaps transfers
            if direction == "h2d":
                fns["ferry_x8"] = ferry_copy("h2d", host, dev, device, in_flight=8)
                fns["torch_pinned_x8"] = torch_copy(tdst, pinned, True, in_flight=8)
            else:
                fns["ferry_x8"] = ferry_copy("d2h", host, dev, device, in_flight=8)
                fns["torch_pinned_x8"] = torch_copy(pinned, tdst, True, in_flight=8)
            secs = {k: time_host(fn, repeat=rep, warmup=3) for k, fn in fns.items()}
            for k in ("ferry_x8", "torch_pinned_x8"):
                secs[k] /= 8
            gbps = {k: nbytes / s / 1e9 for k, s in secs.items()}
            vs_pinned_stream = gbps["ferry_x8"] / gbps["torch_pinned_x8"]
            vs_pinned = gbps["ferry"] / gbps["torch_pinned"]
            vs_pageable = gbps["ferry"] / gbps["torch_pageable"]
            largest = nbytes == max(sizes)
            results.append({
                "bytes": nbytes, "direction": direction, "seconds": secs, "gb_per_s": gbps,
                "ferry_vs_pinned": vs_pinned, "ferry_vs_pageable": vs_pageable,
                "ferry_overhead_us": (secs["ferry"] - secs["torch_pinned"]) * 1e6,
                "pinned_target_met": vs_pinned >= PINNED_TARGET,
                "ferry_vs_pinned_8_in_flight": vs_pinned_stream,
                "pageable_target_met": (vs_pageable >= PAGEABLE_TARGET) if largest else None,
            })
            rows.append([f"{nbytes / MiB:g} MiB", direction, gbps["ferry"], gbps["torch_pinned"],
                         gbps["torch_pageable"], vs_pinned, vs_pageable,
                         (secs["ferry"] - secs["torch_pinned"]) * 1e6, gbps["ferry_x8"], gbps["torch_pinned_x8"],
                         vs_pinned_stream])
        host_buf.close()
        dev_buf.close()
        del host, dev, pinned, pageable, tdst
    return rows, results


def bench_module(device: str, nbytes: int, smoke: bool):
    """Whole-method check: h2d + delegate `x + 1` + d2h through ferry.Module vs eager."""
    tdev = torch_device(device)
    numel = nbytes // 4
    model = AddOne()
    x = torch.randn(numel)
    program = ferry.compile(torch.export.export(model, (x,)), ferry.OpSupportPartitioner(device))
    totals = ferry.copy_report(program, "forward").totals()
    views = ferry.Module(program, outputs="view")
    copies = ferry.Module(program, outputs="copy")
    expect = x + 1
    for mod in (views, copies):
        assert torch.equal(mod(x), expect), "ferry Module result differs from eager"

    def eager():
        return (x.to(tdev) + 1).cpu()

    assert torch.equal(eager(), expect)
    rep = 5 if smoke else 10
    secs = {
        "ferry Module (outputs='view')": time_host(lambda: views(x), repeat=rep, warmup=2),
        "ferry Module (outputs='copy')": time_host(lambda: copies(x), repeat=rep, warmup=2),
        "eager (x.cuda() + 1).cpu()": time_host(eager, repeat=rep, warmup=2),
    }
    views.close()
    copies.close()
    base = secs["eager (x.cuda() + 1).cpu()"]
    rows = [[name, nbytes / MiB, s * 1e3, base / s] for name, s in secs.items()]
    return rows, {"bytes": nbytes, "seconds": secs, "copy_totals": {k: list(v) for k, v in totals.items()}}


def main():
    args = parse_args(__doc__.splitlines()[0])
    device = bench_device("copy_throughput", args.smoke)
    if device is None:
        return
    sizes = SMOKE_SIZES if args.smoke else SIZES
    with torch.no_grad():
        rows, copies = bench_copies(Device.parse(device), sizes, args.smoke)
        mod_rows, module = bench_module(device, max(sizes), args.smoke)
    largest = [r for r in copies if r["bytes"] == max(sizes)]
    summary = {
        "pinned_target": PINNED_TARGET, "pageable_target": PAGEABLE_TARGET,
        "pinned_target_met_all_sizes": all(r["pinned_target_met"] for r in copies),
        "pinned_target_met_largest": all(r["pinned_target_met"] for r in largest),
        "pageable_target_met_largest": all(r["pageable_target_met"] for r in largest),
    }
    path = write_json(result_name("copy_throughput", args.smoke), {
        "device": device, "smoke": args.smoke, "copies": copies, "module": module, "targets": summary,
    })
    print(table(f"end to end on {device}: y = x + 1, one delegate (h2d + delegate + d2h)",
                ["runner", "MiB", "ms per call", "speed-up vs eager"], mod_rows))
    print()
    print(f"targets: ferry >= {PINNED_TARGET:.0%} of PyTorch pinned at every size: "
          f"{summary['pinned_target_met_all_sizes']} (at {max(sizes) / MiB:g} MiB: {summary['pinned_target_met_largest']}); "
          f"ferry >= {PAGEABLE_TARGET}x pageable at {max(sizes) / MiB:g} MiB: {summary['pageable_target_met_largest']}")
    print(f"wrote {path}\n")
    print(table(f"host<->device copy throughput on {device} (GB/s, float32, median)",
                ["size", "dir", "ferry", "torch pinned", "torch pageable", "ferry/pinned", "ferry/pageable",
                 "ferry - pinned, µs per copy", "ferry, 8 in flight", "torch pinned, 8 in flight",
                 "ferry/pinned, 8 in flight"], rows))


if __name__ == "__main__":
    main()

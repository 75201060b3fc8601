"""The `ferry` command: compile a model, inspect a program file, run it."""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time

from ferry.errors import FerryError


class UserError(Exception):
    """A mistake on the command line: printed as one line, exit code 2."""


def _stage(name: str):
    class _Timer:
        def __enter__(self):
            self.t = time.perf_counter()
            print(f"[ferry] {name} ...", file=sys.stderr, flush=True)

        def __exit__(self, *exc):
            if exc[0] is None:
                print(f"[ferry] {name} done in {time.perf_counter() - self.t:.2f}s", file=sys.stderr, flush=True)

    return _Timer()


def _ensure_device_type(device_type: str) -> None:
    """`emu` is ferry's emulated device: register it when a program or flag asks for it by name."""
    from ferry.runtime import EmulatedAllocator, get_allocator, register_allocator

    if device_type == "emu" and get_allocator("emu") is None:
        register_allocator(EmulatedAllocator())


def _resolve_spec(spec: str):
    """SPEC -> its factory function; every mistake in SPEC is a UserError, found before any work."""
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise UserError(f"SPEC must look like package.module:function, got {spec!r}")
    if "." not in sys.path and "" not in sys.path:
        sys.path.insert(0, ".")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or the module itself failed while importing
        raise UserError(f"cannot import {mod_name!r}: {type(e).__name__}: {e}") from None
    factory = getattr(module, fn_name, None)
    if not callable(factory):
        raise UserError(f"{mod_name!r} has no function {fn_name!r}")
    return factory


def _load_spec(spec: str, factory=None):
    got = (factory or _resolve_spec(spec))()
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], (tuple, list))):
        raise UserError(f"{spec} must return (model, example_inputs) with example_inputs a tuple of tensors")
    return got


def cmd_compile(args) -> int:
    import torch

    import ferry

    device = args.device.strip().lower()
    _ensure_device_type(device.partition(":")[0])
    # check the device, the op names and SPEC before any progress output or slow work, so that a
    # mistake on the command line is one error line
    exclude = [s for s in (args.exclude or "").split(",") if s.strip()]
    partitioner = ferry.OpSupportPartitioner(device, exclude=exclude)
    factory = _resolve_spec(args.spec)
    with _stage(f"load {args.spec}"):
        model, inputs = _load_spec(args.spec, factory)
    with _stage("torch.export"):
        ep = torch.export.export(model, tuple(inputs))
    config = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(args.skip_h2d, args.skip_d2h))
    with _stage(f"partition, place, plan and emit for {device}"):
        program = ferry.compile(ep, partitioner, config)
    with _stage(f"save {args.output}"):
        program.save(args.output)
    print(_summary(program))
    return 0


def _summary(program) -> str:
    from ferry.inspect import program_summary

    return program_summary(program, instructions=False)


def cmd_inspect(args) -> int:
    import ferry
    from ferry.inspect import program_json, program_summary

    program = ferry.load_program(args.file)
    if args.html:
        from ferry.html import write_html

        write_html(program, args.html, method=args.method)
        print(f"wrote {args.html}")
        return 0
    if args.json:
        print(json.dumps(program_json(program), indent=1))
    else:
        print(program_summary(program, instructions=True))
    return 0


def _random_inputs(meta):
    import torch


    inputs = []
    for i in range(meta.num_inputs()):
        im = meta.input_meta(i)
        if im.dtype.is_floating_point:
            t = torch.randn(im.shape, dtype=im.dtype)
        elif im.dtype == torch.bool:
            t = torch.rand(im.shape) > 0.5
        else:
            t = torch.randint(0, 8, im.shape, dtype=im.dtype)
        if not im.device.is_cpu:
            from ferry.runtime import clone_to

            t = clone_to(t, im.device)
        inputs.append(t)
    return inputs


def _npz_inputs(path, meta):
    import numpy as np
    import torch

    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read inputs from {path}: {e}") from None
    keys = sorted(data.files, key=lambda k: (len(k), k))
    if len(keys) != meta.num_inputs():
        raise UserError(f"{path} holds {len(keys)} arrays but the method takes {meta.num_inputs()} inputs")
    return [torch.from_numpy(data[k]) for k in keys]


def cmd_run(args) -> int:
    import ferry
    from ferry.report import copy_report

    program = ferry.load_program(args.file)
    types = {b.device.type for m in program.methods.values() for b in m.buffers}
    for t in types:
        _ensure_device_type(t)
    if "emu" in types:
        print("running on the emulated device (host memory standing in for a GPU)")
    module = ferry.Module(program)
    meta = module.method_meta(args.method)
    inputs = _random_inputs(meta) if args.inputs == "random" else _npz_inputs(args.inputs, meta)
    module.load_method(args.method)
    times = []
    for _ in range(max(1, args.repeat)):
        t0 = time.perf_counter()
        outs = module.run_method(args.method, inputs)
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    print(f"method {args.method!r}: {len(times)} runs, median {statistics.median(times):.3f} ms, p90 {p90:.3f} ms")
    for i, o in enumerate(outs):
        print(f"  output {i}: {str(o.dtype).removeprefix('torch.')}{list(o.shape)}")
    print(copy_report(program, args.method))
    return 0


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferry", description="Place, plan and run torch.export programs on the CPU plus GPUs.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="export a model and compile it to a .ferry file")
    c.add_argument("spec", help="package.module:function returning (model, example_inputs)")
    c.add_argument("-o", "--output", required=True, help="program file to write")
    c.add_argument("--device", default="cuda:0", help="device of the delegated partition (cuda:0, emu:0, ...)")
    c.add_argument("--exclude", help="comma-separated ops kept on the CPU, e.g. aten._softmax,aten.gelu")
    c.add_argument("--skip-h2d", action="store_true", help="inputs read on the device are passed in already there")
    c.add_argument("--skip-d2h", action="store_true", help="device outputs stay on the device")
    c.set_defaults(func=cmd_compile)

    i = sub.add_parser("inspect", help="show methods, instructions, copies and buffers of a program file")
    i.add_argument("file")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--html", metavar="OUT", help="write a picture of the placement and memory plan")
    i.add_argument("--method", default=None, help="method to draw with --html (default: the first)")
    i.set_defaults(func=cmd_inspect)

    r = sub.add_parser("run", help="run a program file and print latency and copy statistics")
    r.add_argument("file")
    r.add_argument("--method", default="forward")
    r.add_argument("--inputs", default="random", help="'random' or an .npz file with one array per input")
    r.add_argument("--repeat", type=int, default=10)
    r.set_defaults(func=cmd_run)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head`: not an error
        sys.stderr.close()
        return 0
    except (UserError, FerryError, ValueError, KeyError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"ferry {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

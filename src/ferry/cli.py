"""The `ferry` command: compile a model, inspect a program file, run it, generate tokens with it.

torch and the rest of ferry are imported inside the commands that need them, so `ferry
--help` and command-line mistakes answer at once (this module is the top layer: nothing
imports it, so these imports hide no cycle)."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time

from ferry.cli_generate import add_generate_parser, run_generate
from ferry.cli_progress import progress_bars
from ferry.errors import FerryError


class UserError(Exception):
    """A mistake on the command line: printed as one line, exit code 2."""


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return safe_text(text[0] if text else "")


def _printable(text: str) -> str:
    return "\n".join(safe_text(line) for line in text.split("\n"))


def safe_text(s: str) -> str:
    """`s` with control characters escaped: names from files must not drive the terminal."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in s)


def _stage(name: str):
    class _Timer:
        def __enter__(self):
            self.t = time.perf_counter()
            print(f"[ferry] {name} ...", file=sys.stderr, flush=True)

        def __exit__(self, *exc):
            if exc[0] is None:
                print(f"[ferry] {name} done in {time.perf_counter() - self.t:.2f}s", file=sys.stderr, flush=True)

    return _Timer()


_MAX_COUNT = 1_000_000  # calls, parts: more is a mistake, not a request


def _positive_int(text: str) -> int:
    return _count(text, 1)


def _non_negative_int(text: str) -> int:
    return _count(text, 0)


def _count(text: str, least: int) -> int:
    try:
        n = int(text) if len(text) <= 20 else least - 1
    except ValueError:
        n = least - 1
    if not least <= n <= _MAX_COUNT:
        kind = "a positive" if least else "a non-negative"
        raise argparse.ArgumentTypeError(f"must be {kind} integer of at most {_MAX_COUNT:,}, got {text[:40]!r}")
    return n


def _parse_device(text: str, flag: str = "--device"):
    """A device named on the command line, as a Device; `emu` (the emulated device) is known to
    the CLI. A device map's may name a rank first ('rank1:cuda:0')."""
    import re

    from ferry.device import Device, known_device_types

    local = re.sub(r"(?i)^\s*rank\s*[0-9]+\s*:", "", text) if flag == "--device-map" else text
    kind = local.strip().lower().partition(":")[0].strip()
    known = tuple(dict.fromkeys(known_device_types() + ("emu",)))
    if kind not in known:
        raise UserError(f"unknown device type {kind!r} in {flag} {text!r}; known types: {', '.join(known)}")
    _ensure_device_type(kind)
    try:
        return Device.parse(text)
    except ValueError as e:
        raise UserError(str(e)) from None


def _check_output_path(path: str) -> None:
    """Fail before any slow work when the program file cannot be written where asked."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise UserError(f"-o {path}: is a directory; give a file name")
    if not os.path.isdir(parent):
        raise UserError(f"-o {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UserError(f"-o {path}: folder {parent} is not writable")


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
    try:
        got = (factory or _resolve_spec(spec))()
    except UserError:
        raise
    except Exception as e:  # the user's factory failed: say so, in one line
        raise UserError(f"{spec} raised {type(e).__name__}: {_one_line(e)}") from None
    if not (isinstance(got, tuple) and len(got) in (2, 3) and isinstance(got[1], (tuple, list))
            and (len(got) == 2 or isinstance(got[2], dict))):
        raise UserError(f"{spec} must return (model, example_args) or (model, example_args, example_kwargs), "
                        "with example_args a tuple and example_kwargs a dict")
    return got[0], tuple(got[1]), (got[2] if len(got) == 3 else {})


def cmd_compile(args) -> int:
    import torch

    import ferry

    # check the device, the output path, the op names and SPEC before any progress output or
    # slow work, so that a mistake on the command line is one error line
    partitioner, where = _partitioner(args)
    _check_output_path(args.output)
    factory = _resolve_spec(args.spec)
    with _stage(f"load {args.spec}"):
        model, inputs, keywords = _load_spec(args.spec, factory)
    with _stage("torch.export"):
        try:
            ep = torch.export.export(model, inputs, keywords)
        except Exception as e:  # torch.export refused the model: its first line says why
            raise UserError(f"torch.export of {args.spec} failed: {type(e).__name__}: {_one_line(e)}") from None
    config = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(args.skip_h2d, args.skip_d2h),
                                 fuse_for_inference=not args.traced_ops,
                                 last_position_only=["forward"] if args.last_position else ())
    with _stage(f"partition, place, plan and emit for {where}"), progress_bars(args) as bars:
        program = ferry.compile(ep, partitioner, config, progress=bars)
    with _stage(f"save {args.output}"):
        program.save(args.output)
    print(_printable(_summary(program)))
    return 0


def _partitioner(args):
    """The partitioner the flags ask for, and where it places the model, in words."""
    import ferry

    exclude = [s for s in (args.exclude or "").split(",") if s.strip()]
    no_split = [s.strip() for s in args.no_split_module_classes.split(",") if s.strip()] \
        if args.no_split_module_classes is not None else None
    if args.device_map is None:
        if args.max_memory is not None:
            raise UserError("--max-memory goes with --device-map (a map or 'auto')")
        if no_split is not None:
            raise UserError("--no-split-module-classes goes with --device-map auto")
        device = str(_parse_device(args.device or "cuda:0"))
        return ferry.OpSupportPartitioner(device, exclude=exclude, backend_id=args.backend), device
    if args.device is not None:
        raise UserError("give --device (one device) or --device-map (several), not both")
    device_map = "auto" if args.device_map.strip() == "auto" else _read_device_map(args.device_map)
    max_memory = _read_max_memory(args.max_memory) if args.max_memory is not None else None
    for value in device_map.values() if isinstance(device_map, dict) else ():
        if isinstance(value, str) and not value.strip().isdigit():
            _parse_device(value, "--device-map")
    for value in max_memory or {}:
        if isinstance(value, str) and not value.strip().isdigit():
            _parse_device(value, "--max-memory")
    try:
        partitioner = ferry.DeviceMapPartitioner(device_map, exclude=exclude, max_memory=max_memory,
                                                 backend_id=args.backend, no_split_module_classes=no_split)
    except ferry.ConfigError as e:
        raise UserError(f"--device-map: {e}") from None
    devices = partitioner.budgets if partitioner.auto else partitioner.device_map.values()
    return partitioner, ", ".join(sorted({str(d) for d in devices}))


def _read_max_memory(text: str) -> dict:
    """--max-memory: 'cuda:0=20GiB,cuda:1=20GiB' (or the same as a JSON object)."""
    if text.lstrip().startswith("{"):
        return _read_device_map(text)
    budgets = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        device, sep, size = item.partition("=")
        if not sep:
            raise UserError(f"--max-memory: {item!r} is not DEVICE=SIZE, e.g. cuda:0=20GiB")
        budgets[device.strip()] = size.strip()
    return budgets


def _read_device_map(text: str) -> dict:
    """--device-map: a JSON object, inline or in a file."""
    source = text
    if not text.lstrip().startswith("{"):
        try:
            with open(text, encoding="utf-8") as f:
                source = f.read()
        except OSError as e:
            raise UserError(f"--device-map {text}: not a JSON object and not a readable file ({e.strerror})") from None
    try:
        got = json.loads(source)
    except json.JSONDecodeError as e:
        raise UserError(f"--device-map: not valid JSON: {e}") from None
    except RecursionError:
        raise UserError("--device-map: JSON nested too deeply (a map is one object of module path -> device)") from None
    if not isinstance(got, dict):
        raise UserError(f"--device-map must be a JSON object {{module path: device}}, got {type(got).__name__}")
    return got


def _summary(program) -> str:
    from ferry.views import program_summary

    return program_summary(program, instructions=False)


def cmd_inspect(args) -> int:
    import ferry
    from ferry.views import program_json, program_summary

    program = ferry.load_program(args.file, verify=args.verify)
    if args.verify:
        print(f"{args.file}: every checksum matches (metadata, {len(program.segments)} segments)")
    if args.method is not None and args.method not in program.methods:
        raise UserError(f"{args.file} has no method {args.method!r}; methods: {', '.join(program.methods)}")
    if args.html:
        from ferry.views import write_html

        write_html(program, args.html, method=args.method)
        print(f"wrote {args.html}")
        return 0
    if args.json:
        print(json.dumps(program_json(program, args.method), indent=1))
    else:
        print(_printable(program_summary(program, instructions=True, method=args.method)))
    return 0


def _random_inputs(meta, parts: int = 1):
    """Random inputs of the method's shapes (`parts` times its batch, for micro-batches)."""
    import torch

    shapes = [(meta.input_meta(i), _parts_shape(meta.input_meta(i).shape, parts)) for i in range(meta.num_inputs())]
    total = sum(math.prod(shape) * im.dtype.itemsize for im, shape in shapes)
    if total > _host_bytes() // 2:
        raise UserError(f"random inputs for {parts} micro-batch(es) would take {total:,} bytes, more than half of this "
                        "machine's memory: pass fewer --microbatches, or inputs of your own (--inputs FILE.npz)")
    inputs = []
    for im, shape in shapes:
        if im.dtype.is_floating_point:
            t = torch.randn(shape, dtype=im.dtype)
        elif im.dtype == torch.bool:
            t = torch.rand(shape) > 0.5
        else:
            t = torch.randint(0, 8, shape, dtype=im.dtype)
        if not im.device.is_cpu:
            from ferry.runtime import clone_to

            t = clone_to(t, im.device)
        inputs.append(t)
    return inputs


def _parts_shape(shape, parts: int) -> tuple:
    return (shape[0] * parts, *shape[1:]) if parts > 1 and len(shape) else tuple(shape)


def _host_bytes() -> int:
    """Physical memory of this machine (no limit where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


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


def _check_devices(program, path) -> set[str]:
    """The device types the program's buffers use, each one usable here (emu registered on demand)."""
    types = {b.device.type for m in program.methods.values() for b in m.buffers}
    for t in types:
        _ensure_device_type(t)
    if "cuda" in types:
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"{path} was compiled for a CUDA GPU and this machine has none: compile it with "
                            "--device emu:0 to run it on the emulated device")
    return types


def cmd_run(args) -> int:
    import ferry

    program = ferry.load_program(args.file)
    _check_devices(program, args.file)
    with progress_bars(args) as bars:
        module = _open(program, args, bars)
        if module is None:  # a serving rank of a distributed job: done when rank 0 closed it
            return 0
        with module:
            return _timed_runs(module, program, args, bars)


def _open(program, args, progress=None):
    """A ferry.Module, or under torchrun for a program over ranks, this rank's part (None once a
    serving rank has served every call of rank 0). `progress`: bars for loading (cli_progress.py)."""
    import ferry
    from ferry.program.ranks import program_ranks

    ranks = program_ranks(program)
    if len(ranks) == 1:
        if any(b.device.type == "emu" for m in program.methods.values() for b in m.buffers):
            print("running on the emulated device (host memory standing in for a GPU)")
        return ferry.Module(program, cuda_graphs=args.cuda_graphs, microbatches=args.microbatches, progress=progress)
    import ferry.distributed

    module = ferry.distributed.Module(program, cuda_graphs=args.cuda_graphs, microbatches=args.microbatches,
                                      timeout=args.timeout)
    if module.rank != 0:
        with module:
            module.serve()
        return None
    print(f"rank 0 of {module.world_size}: stages on ranks {', '.join(map(str, ranks))}; "
          f"{len(module.boundaries)} copies cross between ranks per call")
    return module


def _timed_runs(module, program, args, bars=None) -> int:
    from ferry.choices import summary as kernel_choices
    from ferry.program.report import copy_report
    from ferry.runtime.stages.graph_report import report_lines

    meta = module.method_meta(args.method)
    inputs = _random_inputs(meta, args.microbatches or 1) if args.inputs == "random" else _npz_inputs(args.inputs, meta)
    module.load_method(args.method)
    if bars is not None:
        bars.close()  # loading is done: the timings below print with no bar left on the terminal
    for _ in range(args.warmup):  # first calls bind, check shapes and capture graphs: not timed
        module.run_method(args.method, inputs)
    _sync()
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        outs = module.run_method(args.method, inputs)
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    print(f"method {args.method!r}: {len(times)} runs after {args.warmup} warm-up, "
          f"median {statistics.median(times):.3f} ms, p90 {p90:.3f} ms")
    for line in kernel_choices.summary():
        print(f"  kernels chosen at load, {line}")
    for line in kernel_choices.details() if args.decisions else ():
        print(f"    {line}")
    for i, o in enumerate(outs):
        print(f"  output {i}: {str(o.dtype).removeprefix('torch.')}{list(o.shape)}")
    if args.cuda_graphs and hasattr(module, "graph_report"):
        for line in report_lines(module.graph_report(args.method)):
            print(f"  {line}")
    print(_printable(str(copy_report(program, args.method))))
    return 0


def cmd_generate(args) -> int:
    with progress_bars(args) as bars:
        return run_generate(args, _stage, _check_devices, bars)


def _sync():
    import torch

    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        torch.cuda.synchronize(i)


class _Parser(argparse.ArgumentParser):
    """A command-line mistake is one line on stderr and exit status 2 (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ferry", description="Place, plan and run torch.export programs on the CPU plus GPUs.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="export a model and compile it to a .ferry file")
    c.add_argument("spec", help="package.module:function returning (model, example_args[, example_kwargs])")
    c.add_argument("-o", "--output", required=True, help="program file to write")
    c.add_argument("--device", default=None, help="device of the delegated partition (default cuda:0; emu:0, ...)")
    c.add_argument("--device-map", metavar="JSON", help="module path -> device, as accelerate writes it: "
                   "inline JSON or a file, e.g. '{\"encoder\": \"cuda:0\", \"decoder\": 1}', or 'auto' "
                   "(ferry splits the model under --max-memory)")
    c.add_argument("--max-memory", metavar="BUDGETS", help="what each device may hold, e.g. cuda:0=20GiB,cuda:1=20GiB; "
                   "compile fails, naming the device and the shortfall, when the program does not fit")
    c.add_argument("--no-split-module-classes", metavar="CLASSES", help="with --device-map auto: comma-separated "
                   "module class names never split over two devices, e.g. LlamaDecoderLayer (a transformers model's "
                   "own _no_split_modules are read without it)")
    c.add_argument("--exclude", help="comma-separated ops kept on the CPU, e.g. aten.softmax,aten.gelu")
    c.add_argument("--skip-h2d", action="store_true", help="inputs read on the device are passed in already there")
    c.add_argument("--skip-d2h", action="store_true", help="device outputs stay on the device")
    c.add_argument("--backend", choices=("torch", "inductor"), default="torch",
                   help="what runs each delegate: torch (ATen ops in planned memory) or inductor (compiled by "
                        "Inductor when the program loads; static shapes)")
    c.add_argument("--traced-ops", action="store_true", help="run the ops export traced, without the inference "
                   "rewrites (fused attention, batch norms folded into convolutions): eager's results bit for bit")
    c.add_argument("--last-position", action="store_true", help="the results keep only their last position "
                   "along dimension 1 (a language model's logits, of which generation reads the last)")
    _no_progress(c)
    c.set_defaults(func=cmd_compile)

    i = sub.add_parser("inspect", help="show methods, instructions, copies and buffers of a program file")
    i.add_argument("file")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--html", metavar="OUT", help="write a picture of the placement and memory plan")
    i.add_argument("--method", default=None, help="only this method (with --html, default: the first)")
    i.add_argument("--verify", action="store_true", help="check every segment (weights included) against its SHA-256")
    i.set_defaults(func=cmd_inspect)

    r = sub.add_parser("run", help="run a program file and print latency and copy statistics")
    r.add_argument("file")
    r.add_argument("--method", default="forward")
    r.add_argument("--inputs", default="random", help="'random' or an .npz file with one array per input")
    r.add_argument("--repeat", type=_positive_int, default=10, help="timed calls (default 10)")
    r.add_argument("--warmup", type=_non_negative_int, default=3, help="untimed calls first (default 3)")
    r.add_argument("--cuda-graphs", action="store_true", help="capture each device segment as a CUDA graph")
    r.add_argument("--microbatches", type=_positive_int, default=None, metavar="K",
                   help="pipeline K parts per call (random inputs: K times the program's batch)")
    r.add_argument("--decisions", action="store_true",
                   help="print every kernel decision timed at load (forms, times, the pick and why)")
    r.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="a program over ranks (under torchrun): seconds a rank waits for another before it fails")
    _no_progress(r)
    r.set_defaults(func=cmd_run)
    g = add_generate_parser(sub, _positive_int)
    _no_progress(g)
    g.set_defaults(func=cmd_generate)
    return p


def _no_progress(parser) -> None:
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr (they are drawn only "
                        "where stderr is a terminal)")


def main(argv=None) -> int:
    try:
        args, extra = build_parser().parse_known_args(argv)
    except SystemExit as e:  # --help, or a mistake argparse found (already printed as one line)
        return e.code if isinstance(e.code, int) else 2
    if extra:
        print(f"ferry {args.command}: error: unrecognized arguments: {' '.join(extra)} "
              f"(see ferry {args.command} --help)", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head`: not an error
        sys.stderr.close()
        return 0
    except (UserError, FerryError, ValueError, KeyError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"ferry {args.command}: error: {safe_text(str(msg).strip().splitlines()[0] if str(msg).strip() else '')}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""ferry.compile: torch.export program(s) -> placed graph -> planned, emitted Program."""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Mapping

import torch

from ferry import node_meta as M
from ferry.aot.auto_map import Choice, diagnose, parse_budgets
from ferry.aot.config import CompileConfig, MethodOptions
from ferry.aot.device_map import DeviceMapPartitioner
from ferry.aot.emit import emit_method
from ferry.aot.fallbacks import kernel_fallbacks
from ferry.aot.input_guards import input_guards
from ferry.aot.input_sizes import checked_sizes, derived_sizes, equal_sizes, size_minimums
from ferry.aot.lifted_state import one_name_per_state, refuse_stale_views
from ferry.aot.lower import LoweredProgram, to_backend
from ferry.aot.place import PropagateDevicePass
from ferry.aot.signature import signature_of, warn_merged_inputs
from ferry.aot.storage_reads import storage_inputs
from ferry.aot.subclass_weights import quantized_weights
from ferry.aot.values import ProgramBuilder
from ferry.backend_registry import ProgramData
from ferry.choices.attention import CHECKED_SIZES
from ferry.device import CPU as CPU_DEVICE
from ferry.device import Device
from ferry.errors import CompileError, ConfigError, ProgramError
from ferry.node_meta import get_device
from ferry.program import Method, Program
from ferry.program.footprint import load_bytes
from ferry.program.states import program_states
from ferry.progress import Progress, checked, tell


def _methods(ep_or_dict) -> dict[str, torch.export.ExportedProgram]:
    if isinstance(ep_or_dict, torch.export.ExportedProgram):
        return {"forward": ep_or_dict}
    if isinstance(ep_or_dict, Mapping) and ep_or_dict:
        for name, ep in ep_or_dict.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise CompileError(f"method names must be identifiers, got {name!r}")
            if not isinstance(ep, torch.export.ExportedProgram):
                raise CompileError(f"method {name!r}: expected a torch.export.ExportedProgram, got {type(ep).__name__}")
        return dict(ep_or_dict)
    raise CompileError(
        "ferry.compile takes a torch.export.ExportedProgram or a non-empty {method name: ExportedProgram} dict, "
        f"got {type(ep_or_dict).__name__}"
    )


def place(exported_program, partitioner=None, config: CompileConfig | None = None, method: str = "forward") -> LoweredProgram:
    """Lower and place one method: every value gets a Device, every transfer an et_copy op."""
    config = config or CompileConfig()
    others = sorted(set(config.last_position_only) - {method})
    if others:
        raise ConfigError(f"last_position_only names method(s) {others} that are not placed here; method: {method!r}")
    return _place(exported_program, partitioner, config.options_for(method))


def _place(exported_program, partitioner, options: MethodOptions, state_homes=None) -> LoweredProgram:
    """`state_homes`: {buffer: device} of state another method updates, where it keeps it."""
    lowered = to_backend(exported_program, partitioner, frozenset(state_homes or ()),
                         last_position_of=options.name if options.last_position_only else None)
    PropagateDevicePass.for_options(options, state_homes)(lowered.graph_module)
    return lowered


def compile(ep_or_dict, partitioner=None, config: CompileConfig | None = None, *,  # noqa: A001
            device_map=None, max_memory=None, no_split_module_classes=None,
            progress: Progress | None = None) -> Program:
    """Compile one program (method 'forward') or several named methods into a ferry Program.

    `device_map` ({module path: device} or "auto") splits the model over devices, as
    DeviceMapPartitioner(device_map, max_memory=max_memory) would. `max_memory` ({device:
    size}) is checked against what loading the program allocates on each device; a device
    map chosen with "auto" is chosen again under tighter budgets when the plan overshoots;
    "auto" never splits a module whose class is in `no_split_module_classes` (as accelerate
    takes it) or in the model's own `_no_split_modules`. `progress(task, done, total, unit)`
    hears of each method placed and emitted (ferry/progress.py)."""
    progress = checked(progress)
    if device_map is not None:
        if partitioner is not None:
            raise ConfigError("give a partitioner or a device_map, not both")
        partitioner = DeviceMapPartitioner(device_map, max_memory=max_memory,
                                           no_split_module_classes=no_split_module_classes)
    elif no_split_module_classes is not None:
        raise ConfigError("no_split_module_classes goes with device_map='auto'")
    budgets = parse_budgets(max_memory) if max_memory is not None else getattr(partitioner, "budgets", None)
    eps = one_name_per_state(_methods(ep_or_dict))
    options = (config or CompileConfig()).resolve(eps)
    auto = getattr(partitioner, "auto", False)
    for attempt in range(auto_attempts(budgets) if auto else 1):
        with warnings.catch_warnings():
            if attempt:  # a retry lowers the same methods again: what it warns was said already
                warnings.simplefilter("ignore")
            task = "compile" if not attempt else f"compile, split {attempt + 1}"
            program = _compile(eps, partitioner, options, budgets, functools.partial(tell, progress, task))
        over = over_budget(program, budgets)
        if not over:
            return program
        choice = partitioner.last_choice if auto else None
        if choice is None or not choice.fits:
            break  # no split fit the estimates either: the closest one was tried
        partitioner.tighten(device_bytes(program))
    raise budget_error(program, budgets, over, auto, choice)


def auto_attempts(budgets) -> int:
    """How many splits device_map="auto" tries: each retry moves work off a device that
    overflowed, so a few per device."""
    return 2 * len(budgets or ()) + 1


def _compile(eps, partitioner, options, budgets, done: Callable[[int, int], object] = lambda n, total: None) -> Program:
    """`done(n, total)`: n of the total steps (placing a method, emitting it) are finished."""
    builder = ProgramBuilder()
    methods: dict[str, Method] = {}
    unmatched: list[dict[str, warnings.WarningMessage]] = []
    placed_methods = {}
    for name, ep in eps.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            placed_methods[name] = _place(ep, partitioner, options[name])
        done(len(placed_methods), 2 * len(eps))
        unmatched.append(_reemit_but_unmatched(caught))
    _place_shared_state(eps, partitioner, options, placed_methods)
    for name, placed in placed_methods.items():
        fallbacks = kernel_fallbacks(placed.graph_module, name)
        checked = CHECKED_SIZES.set(checked_sizes(placed.graph_module))  # what rewrites may assume of sizes
        try:
            method = emit_method(name, placed.graph_module, placed.constants, builder, options[name],
                                 placed.range_constraints)
        finally:
            CHECKED_SIZES.reset(checked)
        method.kernel_choices.update(fallbacks)
        method.quantized_weights = quantized_weights(eps[name], placed.weights)
        method.signature = signature_of(eps[name], name)
        warn_merged_inputs(eps[name], name)
        method.storage_inputs = storage_inputs(placed.graph_module)
        method.equal_sizes = equal_sizes(placed.graph_module)
        method.size_minimums = size_minimums(placed.graph_module, placed.range_constraints)
        method.derived_sizes = derived_sizes(placed.graph_module)
        method.input_guards = input_guards(eps[name], placed.graph_module, method)
        method.device_map = {path: str(d) for path, d in placed.device_map.items()}
        method.max_memory = {str(d): n for d, n in (budgets or {}).items()}
        methods[name] = method
        done(len(eps) + len(methods), 2 * len(eps))
    for key, w in unmatched[0].items():  # an op name is a mistake only if no method has that op
        if all(key in per_method for per_method in unmatched[1:]):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    try:
        program_states(methods)  # methods share each mutable buffer by name: they must agree on it
    except ProgramError as e:
        raise CompileError(str(e)) from None
    return Program(methods, builder.delegates, builder.segments)


def _place_shared_state(eps, partitioner, options, placed: dict) -> None:
    """A method reading a buffer that another method updates holds it as the program's state too,
    updated or not (an `encode` fills a cross-attention cache that `decode` only reads): it reads
    what the last method wrote, as eager's methods of one model object do, never the buffer's
    initial value. Such a method is placed again, told which buffers are state and where the
    method updating each keeps it (read elsewhere, it gets a copy like any value)."""
    homes = _state_homes(placed)
    for name, ep in eps.items():
        refuse_stale_views(ep, name, frozenset(homes))
    for name, p in placed.items():
        if any(not writes and t in homes for t, writes in p.buffers.items()):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # told once, by the first placement
                placed[name] = _place(eps[name], partitioner, options[name], homes)


def _state_homes(placed: dict) -> dict[str, Device]:
    """{buffer: device} of every buffer some method updates, where that method keeps it."""
    homes: dict[str, Device] = {}
    for p in placed.values():
        for n in p.graph_module.graph.nodes:
            info = M.input_info(n) if n.op == "placeholder" else None
            if info is not None and info.mutable and p.buffers.get(info.target):
                homes.setdefault(info.target, get_device(n) or CPU_DEVICE)
    return homes


_UNMATCHED = re.compile(r"^(\w+=\S+) matches no op in this program")


def _reemit_but_unmatched(caught) -> dict[str, warnings.WarningMessage]:
    """Re-emit what lowering warned, except `ops=`/`exclude=` names matching nothing: those are
    returned by name, to be told only when they match nothing in any method."""
    unmatched = {}
    for w in caught:
        m = _UNMATCHED.match(str(w.message))
        if m:
            unmatched[m.group(1)] = w
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return unmatched


def device_bytes(program: Program) -> dict[Device, int]:
    """What loading every method of `program` allocates per device."""
    need: dict[Device, int] = {}
    data = ProgramData(program.segments)  # weights and state the methods share: counted once
    for method in program.methods.values():
        for device, n in load_bytes(program, method, data=data).items():
            need[device] = need.get(device, 0) + n
    return need


def over_budget(program: Program, budgets: dict[Device, int] | None) -> dict[Device, int]:
    """{device: bytes over its budget} for the devices the program overfills."""
    need = device_bytes(program)
    return {d: need[d] - b for d, b in (budgets or {}).items() if need.get(d, 0) > b}


def budget_error(program: Program, budgets, over: dict[Device, int], auto: bool,
                 choice: Choice | None = None) -> CompileError:
    """The program overflows `budgets` (the caller's, never ones lowered by retries): the device
    it overflows most, by how much, and for "auto" the module placed there that needs the most."""
    need = device_bytes(program)
    worst = max(over, key=over.__getitem__)
    if not auto:
        tried = "the program"
    elif choice is not None and not choice.fits:
        tried = "device_map='auto' found no split of the model's modules that fits max_memory; the closest"
    else:
        tried = f"device_map='auto' tried {auto_attempts(budgets)} splits; the last"
    fix = "raise max_memory or add a device" if auto else (
        "raise max_memory, move modules to another device, or use device_map='auto'")
    return CompileError(
        f"{tried} does not fit max_memory on {worst}: loading it allocates {need[worst]:,} bytes there "
        f"(weights and planned buffers), over its budget of {budgets[worst]:,}: short by {over[worst]:,} bytes"
        f"{diagnose(choice, worst) if choice is not None else ''}; {fix}"
    )

"""The `inductor` backend: a delegate compiled by PyTorch's Inductor when the program loads.

Its payload is a ferry program, like the `torch` backend's, but functional: every op is its
functional overload and nothing is planned, which is the graph a graph compiler wants. It is
stored in ferry's own format, so the file holds no pickle and no native code: kernel names
resolve only to operators registered with PyTorch (none that reaches outside the tensors), and
every call is checked against its schema before anything runs. At load the method is rebuilt as
a torch.fx graph, with its constants uploaded to the delegate's device, run once op by op on
inputs of its declared shapes (ATen checks the bounds of every view; compiled code would not),
on CUDA, where its sizes are static, given its one-row products as tuned reductions where those
were timed faster, and compiled by Inductor for that device (Triton kernels on CUDA, C++ on the
CPU) with tuning settings ferry chooses, not the process's (choices/gemv.py). Inductor's
on-disk cache makes a later load of the same graph fast. Inductor allocates its results, and
they become the delegate's outputs (storage `runtime`: the method plans no memory for them;
each is checked against its declared shape, dtype and device every call, and copied only when it
shares memory with the delegate's inputs or constants or is laid out otherwise than declared:
runtime/stages/bind.py). An input laid out otherwise than compiled for is copied to that layout first.

A partition with dynamic sizes is compiled once for every size up to its bounds (Dynamo traces it
with those dimensions marked dynamic; a dimension of 1 compiles once more when first met); one
given a size that is no input's dimension runs op by op (backend "torch"), with a warning at
compile time and a note `ferry inspect` shows. A graph Inductor fails to compile
still loads: it runs op by op, with a warning. Ahead-of-time AOTInductor packages are not offered: loading one crashed the
process (SIGSEGV) on the H200 machines this was tested on, and native code would need an
explicit opt-in to load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import warnings
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from ferry.aot.emit import emit_method
from ferry.aot.fuse import merge_for_compiler
from ferry.aot.place import delegate_target_device
from ferry.aot.values import ProgramBuilder
from ferry.backend_registry import NOT_CAPTURED, Backend, CallerPlan, DelegateHandle, ProgramData
from ferry.backends.torch import check_payload_call, payload_call_bytes, payload_load_bytes, payload_load_pieces, payload_program
from ferry.capture import keep_workspace, on_side_stream
from ferry.choices import attention, conv, gemv, kernel_tuning
from ferry.choices.decisions import Site
from ferry.device import CPU
from ferry.errors import CompileError, ProgramError, UnsupportedByBackend
from ferry.op_names import resolve_kernel
from ferry.ops.aliasing import STORAGE_OFFSET_AT, view_base
from ferry.ops.strings import safe_text
from ferry.program import Program, program_to_bytes
from ferry.program.dataflow import in_place_outputs
from ferry.program.ranks import localized
from ferry.program.schema import CONST_KIND_TABLE, LIST_KINDS, ConstValue, KernelCall, Method, TensorValue, memory_owner
from ferry.runtime.stages.kernel_steps import offset_in_owner
from ferry.runtime.stages.kernels import bind_aten, check_call, returns_list
from ferry.runtime.stages.load import Memory, load_memory
from ferry.runtime.stages.refs import LAYOUT_VIEWS, Fixed, Listed, NoMeta, PerCall, Ref, ref
from ferry.runtime.stages.sizes import check_kernel

__all__ = ["COMBINE_REDUCTIONS", "COMBO_KERNELS", "InductorBackend", "graph_of"]

# Inductor's horizontal fusion for graphs replayed as CUDA graphs: a decoder layer's independent
# small kernels (q's rotary, k's with its cache write, v's cache write) become one launch, and so do
# the per-layer position counters a step updates (bench/llm.py --combo-kernels off: the A/B).
# Pointwise kernels only, and not at all with an Inductor that cannot say so: a combined persistent
# reduction (Qwen3's q and k norms with their rotary), untimed, ran 12.9 µs where its parts took 4.8.
# With COMBINE_REDUCTIONS a decode step (compiled with gemv.TUNING) combines reductions too, each
# combination kept only where Inductor times it faster (_DECODE_COMBO_OPTIONS): on an H100,
# Qwen3-0.6B 0.98-0.99 ms a step against 1.03, Llama-1B 1.16 either way, the load 14 s longer
# (bench/results/llm_combo_*_h100.json; bench/llm.py --combo-kernels reductions|pointwise is the A/B).
# Only a decode step's graph (compiled with gemv.TUNING) combines: elsewhere ConvNeXt-T's five
# layout copies of the image and its patch weights (one 3 x 50,176 tile, others 294,912 x 4) made
# one kernel whose shared grid ran 8.9 ms where the copies take a few µs, 10 ms a call against 1.0,
# timed by Inductor or not (bench/results/profile_graphs_convnext_inductor_h100.json,
# models_convnext_combo_h100.json).
# Inductor's other combo settings (how many kernels a combination takes, ...) are its defaults.
aten = torch.ops.aten
COMBO_KERNELS = True
COMBINE_REDUCTIONS = True
# device types where a kernel's check of its values is a device-side assert, not an exception
ASSERTS_ON_DEVICE = frozenset({"cuda"})
# ops that read LAPACK's pivots (counting from 1), and which argument
_PIVOTS_AT = {aten.lu_unpack.default: 1, aten.linalg_lu_solve.default: 1, aten.lu_solve.default: 2,
              aten.linalg_ldl_solve.default: 1}
# what pivots may pass through on their way from an input (besides views): casts and copies
_PIVOT_PASSES = (aten._to_copy.default, aten.clone.default, torch.ops.prims.convert_element_type.default)
_COMBO_OPTIONS = {"combo_kernels": True, "combo_kernels_pointwise_only": True, "benchmark_combo_kernel": False}
_DECODE_COMBO_OPTIONS = {"combo_kernels": True, "combo_kernels_pointwise_only": False, "benchmark_combo_kernel": True}


class InductorBackend(Backend):
    backend_id = "inductor"
    returns_outputs = True  # its results are Inductor's own tensors: the method plans none for them
    takes_overwrites = True  # results the caller keeps in an argument's memory are copied there in the graph
    takes_reservation = True  # its weights come from the load's one allocation per device (devices/slab.py)
    # its weights are the program's segments (ProgramData), as the torch backend's are: a weight the
    # delegates of several methods use (prefill and decode) is stored and uploaded once
    shares_program_data = True

    def check_call(self, payload, args: list, outputs: list, *, host_io: bool = False,
                   data: ProgramData | None = None) -> None:
        check_payload_call(payload, args, outputs, host_io, data)

    def preprocess(self, lowered, options, range_constraints=None, data: ProgramData | None = None) -> bytes:
        device = delegate_target_device(lowered) or CPU
        if any(n.target is aten._int_mm.default for n in lowered.original_module.graph.nodes):
            # torch 2.13, CPU: `_int_mm(x.to(int8).reshape(-1, k), w.t())` of a [1, 1, k] x (torchao's
            # int8 dynamic-activation linear at a decode step) compiled to wrong values (errors of 1e5);
            # and CUDA's kernel needs the rows ferry's own backend pads (aot/kernel_limits.py)
            raise UnsupportedByBackend("Inductor's code for an int8 product (_int_mm) of an input it computes was "
                                       "seen to give wrong values; ferry's own backend runs this partition")
        if options.fuse_for_inference:
            merge_for_compiler(lowered.original_module, data.store.merged if data is not None else None)
        passed = sizes_from_shapes(lowered.original_module)
        if passed:
            raise UnsupportedByBackend(f"Inductor compiles tensors' sizes here; this partition is given sizes that "
                                       f"are no input's dimension ({', '.join(passed[:3])})")
        opts = dataclasses.replace(options, device_placement=True, alloc_graph_input=False, alloc_graph_output=False,
                                   functional_kernels=True, fuse_for_inference=False)
        builder = ProgramBuilder(outer=data.store if data is not None else None)
        method = emit_method("forward", lowered.original_module, {}, builder, opts, range_constraints, device)
        if builder.delegates:
            raise CompileError("backend 'inductor': a partition must not contain delegates")
        try:
            check_sizes(method)  # what the load checks: a kernel whose results' sizes meta cannot tell
        except ProgramError as e:  # (geqrf), a string Inductor must not see, a layout it cannot check: ferry's
            # own backend runs it
            raise UnsupportedByBackend(str(e)) from None
        if data is None:
            return program_to_bytes(Program({"forward": method}, [], builder.segments))
        return program_to_bytes(Program({"forward": method}, [], list(data.segments)), with_segments=False)

    def writes_over(self, payload, data: ProgramData | None = None) -> dict[int, int]:
        """Its compiled graph writes such a result over its argument as its last step (init's
        `overwrites`), after every read of the argument: a result it returns may be any
        argument's memory of its layout (program/dataflow.py)."""
        return in_place_outputs(payload_program(payload, data).method("forward"))

    def memory_needs(self, payload, data: ProgramData | None = None) -> list:
        return []  # nothing is planned: Inductor allocates what it computes

    def load_pieces(self, payload, given_memory: bool, data: ProgramData | None = None) -> list:
        return payload_load_pieces(payload, given_memory, data)

    def load_bytes(self, payload, given_memory: bool, data: ProgramData | None = None) -> dict:
        return payload_load_bytes(payload, given_memory, data)  # the constants it uploads (nothing is planned)

    def call_bytes(self, payload, data: ProgramData | None = None) -> dict:
        return payload_call_bytes(payload, data)  # counted op by op, as eager allocates (the dry run too)

    def init(self, payload, compile_specs, *, pin_host: bool = True, memory=None,
             caller: CallerPlan = NOT_CAPTURED, overwrites: dict[int, int] | None = None,
             data: ProgramData | None = None) -> DelegateHandle:
        """`overwrites`: {result: argument} the caller keeps in the argument's memory (a KV cache
        updated in place): the compiled graph copies each such result there as its last step."""
        program = payload_program(payload, data)
        uploads = data.uploads if data is not None and program.holder_segments else None
        method = localized(program.method("forward"))
        overwrites = overwrites or {}
        allowed = in_place_outputs(method)
        if any(allowed.get(r) != a for r, a in overwrites.items()):
            raise ProgramError(f"an inductor delegate is asked to write results over arguments {overwrites}; its "
                               f"graph allows {allowed}")
        mem = load_memory(program.segments, method, pin_host=False, uploads=uploads,
                          reservation=data.reservation if data is not None else None)
        try:
            check_sizes(method, mem)  # before the dry run allocates what the file declares
            gm = _rebuilt(method, mem, overwrites)
            with _load_stream(method, caller):
                shapes, examples = _dry_run(gm, method)
                static = not _dynamic(method)
                if static:  # kernels chosen by timing: split-KV attention, convolutions as GEMMs
                    attention.split_kv_rewrites(gm, shapes, _site(method, caller))
                    conv.gemm_rewrites(gm, shapes, _site(method, caller))
                # a decode step: its one-row products chosen (timed), its kernels tuned; else untuned
                tuning = gemv.settings(gm, shapes, static=static)
        except BaseException:
            mem.close()
            raise
        try:
            with _load_stream(method, caller):
                compiled = _inductor_compile(gm, examples, method, tuning, combo=static and caller.captured)
        except Exception as e:  # noqa: BLE001 - the same graph still runs, op by op: never a failed load
            warnings.warn(f"Inductor could not compile this delegate ({type(e).__name__}: {str(e)[:200]}); it runs "
                          "op by op instead (give its partition backend_id='torch' to say so at compile time)",
                          RuntimeWarning, stacklevel=2)
            # as the program states it: products rewritten as reductions would make fp32 copies op by op
            compiled = _rebuilt(method, mem, overwrites) if tuning is gemv.TUNING else gm
        else:
            if static and _tunes_at_first_launch(method):  # (a dynamic graph's compile ran it already)
                _first_launch(compiled, examples, method, caller, mem, tuned=tuning is gemv.TUNING)
        return _Compiled(compiled, mem, method)


def _tunes_at_first_launch(method: Method) -> bool:
    """Inductor's GPU kernels are tuned when first launched; its C++ code for the CPU is not."""
    device = _device(method)
    return device is not None and device.type == "cuda"


def _first_launch(compiled, examples: list, method: Method, caller: CallerPlan, memory: Memory,
                  tuned: bool = False) -> None:
    """The compiled code run once on the examples (scratch tensors), so that Inductor's tuning at a
    kernel's first launch (an L2-sized buffer to flush the cache, copies of the arguments the
    kernel writes) allocates inside the load: made in the first decode call, it raised a Llama-1B
    step's peak 62 MiB above eager's (H200). `tuned`: a graph compiled with TUNING, its candidates
    timed as a decode step's graph runs them (choices/kernel_tuning.py). A kernel that fails here
    would fail the first call: the load fails instead, its memory freed."""
    try:
        with _load_stream(method, caller), kernel_tuning.steady(tuned), torch.no_grad():
            compiled(*examples)
    except torch.linalg.LinAlgError:
        return  # a kernel that checks its values refused the scratch ones: the first call tunes instead
    except BaseException:
        memory.close()
        raise


@contextlib.contextmanager
def _load_stream(method: Method, caller: CallerPlan):
    """Where the load runs its kernels (the dry run, the products it times, Inductor's tuning):
    in a plan captured as CUDA graphs, on the plan's capture stream of the delegate's GPU, whose
    cuBLAS workspace the graphs use (made first, in its kept pool). On the caller's stream they
    would make that stream's workspace too: 32 MiB more than eager holds, used by nothing later."""
    streams, device = caller.streams, _device(method)
    if (not caller.captured or streams is None or streams.api.device_type != "cuda" or device is None
            or device.type != "cuda"):
        yield
        return
    stream = streams.capture_stream(device.index or 0)
    keep_workspace(stream)
    with torch.cuda.device(device), on_side_stream(stream):
        yield


def _site(method: Method, caller: CallerPlan) -> Site:
    """Where the load's kernel choices are asked: this load may time them, in the caller's plan."""
    return Site(_device(method), measure=True, captured=caller.captured, streams=caller.streams)


def _device(method: Method) -> torch.device | None:
    """The one device of the delegate's tensor inputs, or None."""
    devices = {method.tensor(v).device.to_torch() for v in tensor_inputs(method)}
    return next(iter(devices)) if len(devices) == 1 else None


def _rebuilt(method: Method, memory: Memory, overwrites: dict[int, int]) -> torch.fx.GraphModule:
    gm = graph_of(method, memory, overwrites)
    _drop_size_inputs(gm, method)
    return gm


def tensor_inputs(method: Method) -> list[int]:
    """The inputs the compiled graph takes: its tensors (a size the caller passes in goes unused:
    sizes_from_shapes)."""
    return [vid for vid in method.inputs if isinstance(method.values[vid], TensorValue)]


def _drop_size_inputs(gm: torch.fx.GraphModule, method: Method) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, vid in zip(placeholders, method.inputs):
        if isinstance(method.values[vid], TensorValue):
            continue
        if node.users:
            raise ProgramError(f"method {method.name!r}: an inductor delegate reads its sizes from its tensors; "
                               f"input {vid} is a size it uses")
        gm.graph.erase_node(node)
    gm.recompile()


def sizes_from_shapes(gm: torch.fx.GraphModule) -> list[str]:
    """A size the partition is given (computed outside it: `x.shape[1]` read on the host) is read
    from the input tensor it is a dimension of, inside the graph: Inductor then sees one set of
    symbols, and the size input goes unused. Returns the sizes no input's dimension matches."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    dims: dict[str, tuple[torch.fx.Node, int]] = {}
    for p in placeholders:
        val = p.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, dim in enumerate(val.shape):
                if isinstance(dim, torch.SymInt):
                    dims.setdefault(str(dim.node.expr), (p, d))
    unmatched = []
    for p in placeholders:
        val = p.meta.get("val")
        if not isinstance(val, torch.SymInt) or not p.users:
            continue
        match = dims.get(str(val.node.expr))
        if match is None:
            unmatched.append(p.name)
            continue
        with gm.graph.inserting_after(placeholders[-1]):
            size = gm.graph.call_function(torch.ops.aten.sym_size.int, match)
        size.meta.update(p.meta)
        p.replace_all_uses_with(size)
    gm.recompile()
    return unmatched


def _inductor_compile(gm: torch.fx.GraphModule, examples: list, method: Method, tuning: dict | None = None,
                      combo: bool = False):
    """Inductor's code for the graph: for its one shape, or, where inputs have dynamic sizes, for
    every size up to their bounds at once (Dynamo traces the graph with those dimensions marked
    dynamic, so a new size within the bounds runs the same kernels, never a new compile; a
    dimension of 1 is a shape of its own, compiled when first met). `tuning`: Inductor settings
    for this compile (choices/gemv.py). `combo`: a graph of static sizes in a plan captured as CUDA
    graphs; one compiled with gemv.TUNING (a decode step) has its independent kernels launched
    together where COMBO_KERNELS (Inductor's code for the CPU, the emulated device's, has none)."""
    dynamic = {i: [d for d, dyn in enumerate(method.tensor(vid).dynamic) if dyn and examples[i].shape[d] >= 2]
               for i, vid in enumerate(tensor_inputs(method))}
    options: dict[str, Any] = dict(tuning or gemv.UNTUNED)  # every key set: nothing from the process's config
    # (a key this Inductor lacks would fail the compile)
    chosen = _DECODE_COMBO_OPTIONS if COMBINE_REDUCTIONS else _COMBO_OPTIONS
    combine = (combo and tuning is gemv.TUNING and COMBO_KERNELS
               and all(hasattr(torch._inductor.config, k) for k in chosen))
    options.update(chosen if combine else {"combo_kernels": False})
    with torch.no_grad():
        if not any(dynamic.values()):
            return torch._inductor.compile(gm, examples, options=options)
        for i, dims in dynamic.items():
            for d in dims:
                torch._dynamo.mark_dynamic(examples[i], d, min=2, max=examples[i].shape[d])
        # options: every compile of it, a later one at call time too (a dimension of 1), has the same settings
        compiled = torch.compile(gm, backend="inductor", fullgraph=True, options=options)
        compiled(*examples)  # compiled here, at load
    return compiled


def _dynamic(method: Method) -> bool:
    return any(any(method.tensor(vid).dynamic) for vid in tensor_inputs(method))


def check_sizes(method: Method, memory: Memory | None = None) -> None:
    """Every kernel of the payload makes what it declares, on meta tensors (runtime/stages/sizes.py):
    the dry run and Inductor's code then allocate no more than `call_bytes` counted. A size known
    only per call (dynamic inputs) is checked by the dry run at the bounds and on each call's
    results (bind.py); explicit strides, which neither check bounds, are refused. Without
    `memory` (at compile time) every tensor is read as its declared shape."""
    texts_for_codegen(method)  # each instruction a kernel the loader allows, called as its schema says
    refuse_strides_per_size(method)
    slots, fixed = (memory.slots, memory.fixed) if memory is not None else _scalars(method)
    for index, ins in enumerate(method.instructions):
        assert isinstance(ins, KernelCall)  # (texts_for_codegen checked every instruction)
        op = resolve_kernel(ins.kernel)
        pos, kw = bind_aten(op, ins.args, lambda vid: ref(slots, fixed, method, vid))
        try:
            check_kernel(method, op, pos, kw, ins.outputs, f"method {method.name!r} instruction {index} ({ins.kernel})")
        except NoMeta:  # a size known per call: the dry run at the bounds, and each call's results, are checked
            if not _dynamic(method):
                raise ProgramError(f"method {method.name!r} instruction {index}: a size computed per call in an "
                                   "inductor delegate whose inputs are static") from None


def _scalars(method: Method) -> tuple[list, list]:
    """Slots as a load fills them, scalars only: every tensor is read per call (at its shape)."""
    slots: list = [None] * len(method.values)
    fixed = [False] * len(method.values)
    for vid, v in enumerate(method.values):
        if isinstance(v, ConstValue) and v.kind not in LIST_KINDS and v.kind != "symint":
            slots[vid], fixed[vid] = CONST_KIND_TABLE[v.kind].runtime(v.value), True
    return slots, fixed


def refuse_strides_per_size(method: Method) -> None:
    """A payload with dynamic inputs must not lay out a view by explicit strides (`as_strided`):
    the dry run checks such a view inside its input at the bounds only, and compiled code would
    read past a smaller input. (Other views are sized from their input, or fail Dynamo's guards.)"""
    if not any(any(method.tensor(vid).dynamic) for vid in tensor_inputs(method)):
        return
    for index, ins in enumerate(method.instructions):
        assert isinstance(ins, KernelCall)  # (texts_for_codegen checked every instruction)
        if _views_by_strides(resolve_kernel(ins.kernel)):
            raise ProgramError(f"method {method.name!r} instruction {index} ({ins.kernel}): explicit strides in an "
                               "inductor delegate with dynamic inputs, which no check at its bounds can bound; "
                               "give this partition backend_id='torch'")


def _views_by_strides(op) -> bool:
    """`op` lays its tensor argument out by sizes and strides it is given (`as_strided`,
    `_reshape_alias`), not by the tensor's own (a convolution's `stride` is another thing)."""
    args = op._schema.arguments
    names = {a.name for a in args}
    return "size" in names and "stride" in names and bool(args) and str(args[0].type) == "Tensor"


def _dry_run(gm: torch.fx.GraphModule, method: Method) -> tuple[dict[torch.fx.Node, torch.Tensor], list]:
    """Run the rebuilt graph once, op by op, on inputs of its declared shapes and layouts. ATen
    checks what compiled code trusts (a view's bounds inside its storage, shapes that fit), so a
    payload that would read outside its tensors is refused here, before Inductor sees it.
    Returns a meta tensor of each node's tensor result, for the load-time kernel choices, and the
    scratch inputs it ran on: integers 0 (indices in range), 1 where LAPACK's pivots are read
    (they count from 1: lu_unpack's); off CUDA, all 1 if a kernel refused those. On CUDA a kernel's
    check of its integers is a device-side assert, which ends the process's CUDA context: there
    is no second try, so the first fill must suit every input (all 0 would have lu_unpack gather
    row -1). A bound is broken at both."""
    failure = None
    inputs = [method.values[v] for v in tensor_inputs(method)]
    ones = _pivot_inputs(gm)
    fills = [[int(i in ones) for i in range(len(inputs))]]
    if not any(v.device.type in ASSERTS_ON_DEVICE for v in inputs if isinstance(v, TensorValue)):
        fills.append([1] * len(inputs))
    for fill in fills:
        examples = [_example(v, integers) for v, integers in zip(inputs, fill)]
        try:
            with torch.no_grad():
                return _Shapes(gm).shapes(examples), examples
        except Exception as e:  # noqa: BLE001 - any refusal by a kernel at both: the program is at fault
            failure = failure or e
    text = str(failure).strip()
    raise ProgramError(f"an inductor delegate's graph fails on inputs of its own declared shapes: "
                       f"{type(failure).__name__}: {text.splitlines()[0] if text else ''}") from None


def _pivot_inputs(gm: torch.fx.GraphModule) -> set[int]:
    """Positions of the graph's inputs read, directly or through views and casts, as LAPACK's pivots."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = set()
    for node in gm.graph.nodes:
        at = _PIVOTS_AT.get(node.target)
        source = node.args[at] if at is not None and len(node.args) > at else None
        source = view_base(source, lambda n: 0 if n.target in _PIVOT_PASSES else None)
        if isinstance(source, torch.fx.Node) and source.op == "placeholder":
            found.add(placeholders.index(source))
    return found


class _Shapes(torch.fx.Interpreter):
    """Runs the graph (each value freed after its last use) and keeps what each tensor looked like."""

    def shapes(self, examples: list) -> dict[torch.fx.Node, torch.Tensor]:
        self.seen: dict[torch.fx.Node, torch.Tensor] = {}
        self.run(*examples)
        return self.seen

    def run_node(self, n: torch.fx.Node):
        try:
            result = super().run_node(n)
        except torch.linalg.LinAlgError:  # the scratch values (a matrix not positive-definite), not the graph
            result = self._stand_in(n)
        if isinstance(result, torch.Tensor) and result.layout == torch.strided:
            self.seen[n] = torch.empty_strided(result.shape, result.stride(), dtype=result.dtype, device="meta")
        return result

    def _stand_in(self, n: torch.fx.Node):
        """Scratch tensors of the result `n` would have (traced with fake tensors), so the run goes
        on past a kernel that refused the scratch values, every later view still checked."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        args, kwargs = self.fetch_args_kwargs_from_env(n)
        assert callable(n.target)  # (a kernel raised: a call_function node)
        with FakeTensorMode(allow_non_fake_inputs=True):
            traced = n.target(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, lambda t: _scratch(t.shape, t.stride(), t.dtype, t.device), traced)


def _scratch(shape, strides, dtype: torch.dtype, device: torch.device, integers: int = 0) -> torch.Tensor:
    """Scratch values the kernels that check theirs take: floating ones in [0, 1) (bernoulli's
    probabilities, multinomial's weights, a std), integers all `integers`."""
    t = torch.empty_strided(shape, strides, dtype=dtype, device=device)
    return t.uniform_() if dtype.is_floating_point or dtype.is_complex else t.fill_(integers)


class _Compiled(DelegateHandle):
    returns_outputs = True

    def __init__(self, fn, memory: Memory, method: Method):
        self.fn, self.memory = fn, memory
        self.takes = [i for i, v in enumerate(method.inputs) if isinstance(method.values[v], TensorValue)]
        self.devices = [method.tensor(v).device.to_torch() for v in tensor_inputs(method)]
        # a dynamic input is compiled for contiguous tensors of any size within its bounds
        self.strides = [None if any(method.tensor(v).dynamic) else method.tensor(v).layout_strides
                        for v in tensor_inputs(method)]

    def execute(self, inputs, outputs):
        """The results, as a list (`outputs` None), or copied into `outputs` (a program compiled
        without device placement plans them)."""
        # legacy mode (no device placement) passes host tensors: move them as the torch backend does;
        # compiled code assumes the layouts it was compiled for: an input laid out otherwise is copied
        tensors = [inputs[i] for i in self.takes]
        args = [_as_compiled(t if t.device == d else t.to(d), s) for t, d, s in zip(tensors, self.devices, self.strides)]
        with torch.no_grad():
            results = [_materialized(r) for r in self.fn(*args)]
        if outputs is None:
            return results
        for out, r in zip(outputs, results):
            out.copy_(r)
        return None

    def storages(self) -> set[int]:
        """The addresses of its constants' memory: a result that is a view of one is copied."""
        return {t.untyped_storage().data_ptr() for t in self.memory.slots if isinstance(t, torch.Tensor)}

    def close(self) -> None:
        self.fn = None
        self.memory.close()


def _example(v, integers: int = 0) -> torch.Tensor:
    """A tensor of input `v`'s shape, dtype, device and layout (eager's strides where the program
    records them): what Inductor compiles for, holding `_scratch` values (the dry run and the
    first launch run on it)."""
    if not isinstance(v, TensorValue):
        raise ProgramError("an inductor delegate takes tensors only")
    return _scratch(v.shape, v.layout_strides, v.torch_dtype, v.device.to_torch(), integers)


def _materialized(r):
    """A result as plain values: Inductor may return a lazy conjugate or negated view (ihfft on
    the CPU, ifft on CUDA), which a copy to another device cannot read as bytes."""
    if isinstance(r, torch.Tensor) and (r.is_conj() or r.is_neg()):
        return r.resolve_conj().resolve_neg()
    return r


def _as_compiled(t: torch.Tensor, strides) -> torch.Tensor:
    if strides is None:
        return t.contiguous()
    if t.stride() == strides:
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def texts_for_codegen(method: Method) -> dict[tuple[int, int], str]:
    """Check every instruction (a kernel the loader allows, called as its schema says) and every
    string it passes: {(instruction, value id): the text code generation may see}
    (ops/strings.py). A string no allowlist admits is a ProgramError: it never reaches Inductor."""
    texts = {}
    for index, ins in enumerate(method.instructions):
        where = f"method {method.name!r} instruction {index}"
        if not isinstance(ins, KernelCall):
            raise ProgramError(f"{where}: an inductor delegate runs kernels only")
        try:
            op = resolve_kernel(ins.kernel)
        except LookupError as e:
            raise ProgramError(f"{where}: {e}") from None
        check_call(op, ins.args, ins.outputs, method.values, where)
        for a, vid in zip(op._schema.arguments, ins.args):
            v = method.values[vid] if 0 <= vid < len(method.values) else None
            if isinstance(v, ConstValue) and v.kind == "str":
                try:
                    texts[index, vid] = safe_text(ins.kernel, a.name, v.value)  # type: ignore[arg-type]
                except ValueError as e:
                    raise ProgramError(f"{where}: {e}") from None
    return texts


def _offset_in_slab(method: Method, memory: Memory, ins: KernelCall, pos: list) -> list:
    """`as_strided`'s storage offset counts from the start of its input's memory, as in eager: a
    constant uploaded into a slab starts inside it, so the offset moves by where it starts (the
    torch backend does the same, runtime/stages/kernel_steps.py)."""
    at = STORAGE_OFFSET_AT.get(ins.kernel)
    if at is None or at >= len(pos) or not ins.args or not isinstance(pos[at], Fixed):
        return pos
    owner = memory_owner(method.values, ins.args[0])
    base = memory.slots[owner] if memory.fixed[owner] else None
    if not isinstance(base, torch.Tensor) or not isinstance(pos[at].value, int):
        return pos
    return offset_in_owner(method, ins, pos, base, "an inductor delegate's graph")


def graph_of(method: Method, memory: Memory, overwrites: dict[int, int] | None = None) -> torch.fx.GraphModule:
    """The method as a torch.fx graph: inputs are placeholders, constants buffers of the module,
    each instruction one call of its (checked) operator. `overwrites` {result: input}: the result
    is copied into that input last, and the input is returned in its place."""
    graph, root, env = torch.fx.Graph(), torch.nn.Module(), {}
    for i, vid in enumerate(method.inputs):
        env[vid] = graph.placeholder(f"input_{i}")

    def ref(vid: int) -> Ref:
        if vid in env:
            return PerCall(vid)
        v = method.values[vid]
        if isinstance(v, ConstValue) and v.kind in LIST_KINDS:
            # member by member, even when the loader built the list of constants once: a tensor
            # inside a literal list would be pasted into the graph's code as text it cannot run
            return Listed(tuple(v.value))  # type: ignore[arg-type]
        if memory.fixed[vid]:
            value = memory.slots[vid]
            if not isinstance(value, torch.Tensor):
                return Fixed(value)
            root.register_buffer(f"constant_{vid}", value)
            env[vid] = graph.get_attr(f"constant_{vid}")
            return PerCall(vid)
        raise ProgramError(f"method {method.name!r}: value {vid} is read before it is computed")

    def resolve(r: Ref):
        """The graph's argument for a reference: a constant, a node, or a list of nodes."""
        if isinstance(r, Fixed):
            return r.value
        if isinstance(r, PerCall):
            return env[r.vid]
        return [None if e is None else resolve(ref(e)) for e in r.ids]

    texts = texts_for_codegen(method)  # (each instruction a kernel the loader allows, called as its schema says)
    for index, ins in enumerate(method.instructions):
        assert isinstance(ins, KernelCall)  # (texts_for_codegen checked every instruction)
        op = resolve_kernel(ins.kernel)
        pos, kw = bind_aten(op, ins.args, lambda vid, index=index: Fixed(texts[index, vid]) if (index, vid) in texts
                            else ref(vid))
        target = torch.ops.aten.reshape.default if op in LAYOUT_VIEWS else op  # bind.py's LAYOUT_VIEWS: why
        pos = _offset_in_slab(method, memory, ins, pos)
        node = graph.call_function(target, tuple(resolve(r) for r in pos), {k: resolve(r) for k, r in kw.items()})
        if len(ins.outputs) == 1 and not returns_list(op):  # check_call: one output per returned value
            env[ins.outputs[0]] = node
        else:
            for j, out in enumerate(ins.outputs):
                env[out] = graph.call_function(operator.getitem, (node, j))
    results = [resolve(ref(o)) for o in method.outputs]
    for r, i in (overwrites or {}).items():
        kept = env[method.inputs[i]]
        graph.call_function(torch.ops.aten.copy_.default, (kept, results[r]))
        results[r] = kept
    graph.output(tuple(results))
    return torch.fx.GraphModule(root, graph)

"""Lowering: each partition becomes one call_delegate node whose outputs are read with getitem."""

from __future__ import annotations

import functools
import operator
import warnings
from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import cast

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import default_decompositions
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind
from torch.fx.experimental.symbolic_shapes import ShapeEnv, is_concrete_int

from ferry import node_meta as M
from ferry.aot.device_shapes import check_symbolic_shapes, fit_to_devices
from ferry.aot.gathered_rows import gather_rows_first
from ferry.aot.higher_order import out_dtype_as_aten
from ferry.aot.last_position import keep_last_position
from ferry.aot.lifted_state import written_constants_as_state
from ferry.aot.partition import TARGET_DEVICE, Partition, Partitioner
from ferry.device import Device
from ferry.errors import CompileError, InputError
from ferry.op_names import kernel_name
from ferry.ops.aliasing import STORAGE_OFFSET_AT, is_view, view_base


class LoweredBackendModule(torch.nn.Module):
    """A lowered partition: backend id, compile specs, and its subgraph with the constants it uses."""

    def __init__(self, backend_id: str, compile_specs, graph_module: torch.fx.GraphModule):
        super().__init__()
        self.backend_id = backend_id
        self.compile_specs = tuple((str(k), bytes(v)) for k, v in compile_specs)
        self.original_module = graph_module

    def compile_spec(self, key: str) -> bytes | None:
        for k, v in self.compile_specs:
            if k == key:
                return v
        return None

    def forward(self, *args):
        # run eagerly on a GPU machine, the subgraph's constants follow its inputs' device
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        first = next(iter(self.original_module.buffers()), None)
        if dev is not None and first is not None and first.device != dev:
            self.original_module.to(dev)
        return tuple(self.original_module(*args))


def call_delegate(lowered: LoweredBackendModule, *args):
    """The graph node for a delegate call; run eagerly it runs the subgraph in PyTorch."""
    return lowered(*args)


def is_delegate_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is call_delegate


@dataclass
class LoweredProgram:
    """A flat graph (parameters, buffers and constants as placeholders) with delegate nodes.

    `constants` maps placeholder names to their tensors; mutable buffers are updated in it
    when the program is called eagerly. `device_map` is the module path -> device map the
    partitioner followed, when it follows one (its `last_map`)."""

    graph_module: torch.fx.GraphModule
    constants: dict[str, torch.Tensor]
    range_constraints: dict = field(default_factory=dict)
    device_map: dict = field(default_factory=dict)
    buffers: dict[str, bool] = field(default_factory=dict)  # the model's buffers it reads: name -> it writes it
    # every weight, buffer and constant by name as the program stores it, delegates' included
    # (an int4 table two to a byte: aot/gathered_rows.py)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)

    def placeholders(self) -> list[torch.fx.Node]:
        return [n for n in self.graph_module.graph.nodes if n.op == "placeholder"]

    def user_inputs(self) -> list[torch.fx.Node]:
        return [n for n in self.placeholders() if M.input_info(n).kind == M.USER_INPUT]

    def __call__(self, *inputs):
        """Run the graph eagerly (on the CPU while tensors are CPU); returns the user outputs."""
        wanted = [n.name for n in self.user_inputs()]
        if len(inputs) != len(wanted):
            raise InputError(f"this program takes {len(wanted)} input(s) ({', '.join(wanted)}), got {len(inputs)}")
        user = iter(inputs)
        args = []
        for n in self.placeholders():
            fixed = M.input_info(n).kind == M.FIXED  # (unread: torch.export folded its value in)
            args.append(self.constants[n.name] if n.name in self.constants else None if fixed else next(user))
        outs = self.graph_module(*args)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        infos = M.output_infos(self.graph_module.graph.output_node())
        by_target = {M.input_info(n).target: n.name for n in self.placeholders()}
        given = dict(zip([n.name for n in self.placeholders()], args))
        result = []
        for info, value in zip(infos, outs):
            if info.kind == M.BUFFER_MUTATION:
                self.constants[by_target[info.target]].copy_(value)
            elif info.kind == M.USER_INPUT_MUTATION:
                given[info.target].copy_(value)
            else:
                result.append(value)
        if not result:
            return None  # (a forward that only writes its inputs)
        return result[0] if len(result) == 1 else tuple(result)


_INPUT_KINDS = MappingProxyType({
    InputKind.USER_INPUT: M.USER_INPUT,
    InputKind.PARAMETER: M.PARAMETER,
    InputKind.BUFFER: M.BUFFER,
    InputKind.CONSTANT_TENSOR: M.CONSTANT,
})


# checks of what tracing saw on the CPU (dtype, device): placement changes the device, so they
# would fail or force copies; they are dropped before partitioning
EXPORT_TIME_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)


def functional_aten(ep: torch.export.ExportedProgram, shared_state=frozenset()) -> torch.export.ExportedProgram:
    """The program as functional ATen with every op the user wrote kept whole.

    Nothing is decomposed: `linear`, `layer_norm`, `softmax`, `silu`, `scaled_dot_product_attention`
    stay what `print(exported_program)` shows, so partitioners see those names and each target
    runs its own fused kernels (CUDA's flash attention, the CPU's fused softmax). Only what is
    not functional, or not an operator of its own (`chunk`, `reshape`), becomes the ATen ops
    eager PyTorch would run for it. `shared_state`: buffers other methods update (to_backend)."""
    dynamic = _dynamic_dims(ep, as_exported=True)
    ep = written_constants_as_state(ep)
    exported_state = {s.target for s in ep.graph_signature.input_specs if s.target}
    reshaped = _shape_writes(ep)
    _refuse_storage_reads_of_written_views(ep)
    try:
        with warnings.catch_warnings():
            # torch >= 2.13 deep-copies the program's call signature here, and copying its
            # LeafSpec trips torch's own deprecation of `isinstance(treespec, LeafSpec)`: noise
            # from torch's internals that the user can do nothing about (any warning from
            # elsewhere still shows).
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning,
                                    module="copyreg")
            ep = ep.run_decompositions({})
    except Exception as e:  # torch's functionalization failed on some op
        raise CompileError(reshaped or f"torch.export could not turn the program into functional ATen ops: "
                                       f"{type(e).__name__}: {e}") from e
    ep = _without_hidden_mutations(ep, exported_state, reshaped)
    _refuse_specialized(dynamic, _dynamic_dims(ep))
    out_dtype_as_aten(ep.graph_module)  # torchao's int8 products on CUDA
    _drop_export_time_checks(ep.graph_module)
    _contiguous_gemm_inputs(ep.graph_module)
    gather_rows_first(ep, shared_state)
    return ep


def _shape_writes(ep) -> str:
    """Why the program cannot run as ferry runs programs, when an op changes an input's sizes or
    strides in place (`t_`, `squeeze_`, `as_strided_`, `resize_`): "" when none does."""
    ops = list(dict.fromkeys(str(n.target) for n in ep.graph.nodes if n.op == "call_function"
                             and isinstance(n.target, torch._ops.OpOverload) and torch.Tag.inplace_view in n.target.tags
                             and n.target not in (torch.ops.aten.detach_.default,)
                             and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder"))
    if not ops:
        return ""
    return (f"{', '.join(ops)} changes a tensor's sizes or strides in place; a ferry program writes values into "
            "the caller's tensors but never changes their shape: use the op that returns a new view "
            "(x = x.t() for x.t_()) and return it")


def _refuse_storage_reads_of_written_views(ep) -> None:
    """`as_strided` reads memory, not values. Where an op wrote in place into a tensor laid out
    otherwise than row-major (a transposed view, a column slice, a transposed buffer), torch's
    functional form of the program computes the write into a new tensor laid out as the op's
    functional twin lays out its result, and an `as_strided` over that memory reads other elements
    than eager's (torch's own `run_decompositions()` program does too). Pointwise ops, copies and
    fills keep the layout they write (checked on OpInfo's samples, tests/test_constants_sweep.py);
    indexed writes (`masked_fill_`, `scatter_`, `index_copy_`, ...) and `out=` results do not:
    those are refused, naming both ops."""
    written: dict[torch.fx.Node, str] = {}  # memory (its root node) -> the op that wrote it so
    for node in ep.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        if kernel_name(op) in STORAGE_OFFSET_AT and _memory_of(node.args[0]) in written:
            raise CompileError(
                f"{kernel_name(op)} (node {node.name!r}) reads the memory that {written[_memory_of(node.args[0])]} "
                "wrote in place into a tensor not laid out row-major (a transposed view, a column slice): ferry "
                "runs the functional form of a program, where that write makes a tensor laid out otherwise, so the "
                "read would give other elements than eager's. Index the values instead (slicing, unfold), or write "
                "into a contiguous tensor")
        for arg, value in _written_arguments(op, node):
            val = value.meta.get("val")
            keeps_layout = not arg.kwarg_only and (torch.Tag.pointwise in op.tags or op in _LAYOUT_KEEPING_WRITES)
            if isinstance(val, torch.Tensor) and not keeps_layout and not M.surely(val.is_contiguous()):
                written.setdefault(_memory_of(value), f"{kernel_name(op)} (node {node.name!r})")


_LAYOUT_KEEPING_WRITES = frozenset({torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar,
                                    torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default})


def _written_arguments(op: torch._ops.OpOverload, node: torch.fx.Node) -> list:
    """(schema argument, node) of each tensor `node` writes in place, positional or keyword (`out=`)."""
    out = []
    for i, arg in enumerate(op._schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.fx.Node):
            out.append((arg, value))
    return out


def _memory_of(node):
    """The node whose memory `node` is, through views and the results of in-place ops (`x.add_(y)`
    returns x)."""
    return view_base(node, _returned_input)


def _returned_input(node: torch.fx.Node) -> int | None:
    """The position of the argument an in-place op writes and returns, or None."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or len(op._schema.returns) != 1:
        return None
    returned = op._schema.returns[0].alias_info
    if returned is None or not returned.is_write:
        return None
    return next((i for i, a in enumerate(op._schema.arguments)
                 if a.alias_info is not None and set(a.alias_info.before_set) & set(returned.before_set)), None)


def _without_hidden_mutations(ep, exported_state: set[str], reshaped: str = "") -> torch.export.ExportedProgram:
    """An input a composite op writes in place while its schema says nothing of it (eager's
    `instance_norm` updates the running statistics it is given) shows in the trace's version
    counter but not in the program's signature. Such ops are decomposed (torch's decompositions
    record the update, which ferry writes back into the caller's tensor); one that has no
    decomposition, or still hides its update after it, is a CompileError naming it rather than a
    program that silently skips the update."""
    found = _hidden_mutations(ep, exported_state)
    table = default_decompositions() if found else {}
    ops = {op for _, writers in found for op in writers if op in table}
    if ops:
        ep = ep.run_decompositions({op: table[op] for op in ops})
        found = _hidden_mutations(ep, exported_state)
    if found and reshaped:
        raise CompileError(reshaped)
    if found:
        node, writers = found[0]
        names = ", ".join(map(str, writers)) or ", ".join(_readers(node)[:3]) or "an op of the program"
        raise CompileError(f"{names} writes input {node.name!r} in place without saying so in its schema (eager "
                           "updates it; the exported program does not record it): ferry cannot keep that update; "
                           "export the model in eval mode, or without the state it updates")
    return ep


def _hidden_mutations(ep, exported_state: set[str]) -> list[tuple[torch.fx.Node, list]]:
    """(placeholder, the ops that write it unrecorded) for each input written in place that the
    signature does not record.

    State the decomposition made (`exported_state` lacks it: the inner tensors of a tensor-subclass
    weight such as torchao's, set once as torch unwrapped it) was written by torch, not the model; a
    tensor made inside forward (`x[[0, 2]]`'s index) counts its own making, so it is listed only
    where an op that reads it writes it again."""
    recorded = {s.arg.name for s in ep.graph_signature.output_specs
                if s.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)}
    targets = {s.target for s in ep.graph_signature.output_specs if s.target}
    found = []
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(val, torch.Tensor) or val.is_inference() or not val._version:
            continue  # (an inference tensor keeps no version counter: traced in inference mode, nothing is written)
        spec = next((s for s in ep.graph_signature.input_specs if s.arg.name == node.name), None)
        if (spec is not None and spec.target is not None and spec.target not in exported_state
                and ".parametrizations." in spec.target):
            continue  # an inner tensor of an unwrapped subclass weight (`w.parametrizations.<attr>.original<i>`)
        if node.name in targets or (spec is not None and spec.target in targets) or node.name in recorded:
            continue  # a mutation the signature records (refused or kept as the program's state elsewhere)
        writers = _hidden_writers(node)
        if writers or spec is None or spec.kind != InputKind.CONSTANT_TENSOR:
            found.append((node, writers))
    return found


def _hidden_writers(node: torch.fx.Node) -> list:
    """The ops that write `node` in place although their schema says nothing of it: each op
    reading it (through views) run again on fresh fake tensors at the traced sizes, in a fake mode
    of its own (outside inference mode, where tensors keep no version counter), its version
    counter watched. An op that cannot be run so is taken for a writer."""
    found: list = []
    with torch.inference_mode(False), FakeTensorMode(shape_env=ShapeEnv()):
        mine = _fresh(node.meta["val"])
        todo = deque((user, node, mine) for user in node.users)
        while todo:
            user, source, tensor = todo.popleft()
            if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
                continue
            before = mine._version
            try:
                args, kwargs = torch.fx.node.map_aggregate((user.args, user.kwargs), functools.partial(
                    _fresh_arg, source=source, tensor=tensor))
                out = user.target(*args, **kwargs)
            except Exception:
                found.append(user.target)
                continue
            if mine._version != before:
                found.append(user.target)
            elif is_view(user.target) and isinstance(out, torch.Tensor):
                todo.extend((u, user, out) for u in user.users)
            elif is_view(user.target) and isinstance(out, (list, tuple)):  # split, unbind: views read by getitem
                todo.extend((u, item, out[cast(int, item.args[1])]) for item in user.users
                            if item.target is operator.getitem for u in item.users)
    return found


def _fresh(v):
    """A new fake tensor like `v` at its traced sizes (a size: its traced value); else `v`."""
    if isinstance(v, torch.SymInt):
        return M.hint_ints([v])[0]
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(M.hint_ints(v.shape), M.hint_ints(v.stride()), dtype=v.dtype, device=v.device)
    return v


def _fresh_arg(a, source: torch.fx.Node, tensor: torch.Tensor):
    return tensor if a is source else _fresh(a.meta.get("val") if isinstance(a, torch.fx.Node) else a)


def _dynamic_dims(ep, as_exported: bool = False) -> dict[tuple[str, int], tuple[str, list[str]]]:
    """(input, dim) -> (its size's symbol, the ops that read it) for every dynamic input dim: as
    it is now (a symbol torch has since fixed reads as its value), or as it was exported
    (`as_exported`: an earlier decomposition of the same program may have fixed it already)."""
    out = {}
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            raw = getattr(getattr(size, "node", None), "_expr", None) if as_exported else None
            if not is_concrete_int(size) or (raw is not None and not getattr(raw, "is_number", True)):
                out[node.name, d] = (str(raw if raw is not None else size), _readers(node))
    return out


def _readers(node: torch.fx.Node) -> list[str]:
    """The ops that read `node`, through views and element-wise ops, that could fix its sizes."""
    found, todo, seen = [], list(node.users), set()
    while todo:
        user = todo.pop(0)
        if user in seen or user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
            continue
        seen.add(user)
        if is_view(user.target) or torch.Tag.pointwise in user.target.tags:
            todo.extend(user.users)
        elif str(user.target) not in found:
            found.append(str(user.target))
    return found


def _refuse_specialized(before: dict, after: dict) -> None:
    """A dynamic input dim that torch's shape propagation fixed to one size (a decomposition that
    asks for a size as a plain int, as `fft_fftn` with `norm='ortho'` does) is a CompileError
    naming the op, not a program that silently takes one size only."""
    for (name, d), (symbol, readers) in before.items():
        if (name, d) in before and (name, d) not in after:
            ops = ", ".join(readers[:3]) or "an op of the program"
            raise CompileError(f"dim {d} of input {name!r} ({symbol}) was exported dynamic, but torch fixed it to one "
                               f"size while propagating shapes through {ops}: export that dim static, or keep "
                               "such ops out of the dynamic part of the program")


# GEMMs whose batched input arrives transposed: `matmul` then runs one small GEMM per row (a
# bmm with a broadcast weight) instead of folding the batch into one large GEMM. Measured on
# ViT-B/16 (its attention transposes the tokens before the input projection): 2.4x slower
# end to end. One contiguous copy of the input (a few microseconds) gives the large GEMM back.
_GEMMS = (torch.ops.aten.linear.default, torch.ops.aten.matmul.default)


def _contiguous_gemm_inputs(gm: torch.fx.GraphModule) -> None:
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _GEMMS or not node.args:
            continue
        x = node.args[0]
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() < 3 or _is_contiguous(val):
            continue
        with gm.graph.inserting_before(node):
            copy = gm.graph.call_function(torch.ops.aten.clone.default, (x,),
                                          {"memory_format": torch.contiguous_format})
        copy.meta["val"] = val.clone(memory_format=torch.contiguous_format)
        copy.meta.update({k: x.meta[k] for k in ("nn_module_stack", "stack_trace") if k in x.meta})
        node.replace_input_with(x, copy)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _is_contiguous(val: torch.Tensor) -> bool:
    return not M.surely(torch.sym_not(val.is_contiguous()))  # (symbolic strides: leave it as traced)


def _drop_export_time_checks(gm: torch.fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in EXPORT_TIME_CHECKS and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def _annotate(ep: torch.export.ExportedProgram, shared_state=frozenset()) -> dict[str, torch.Tensor]:
    """Record input/output kinds on the graph; return placeholder name -> constant tensor. A
    buffer in `shared_state` is the program's state (`mutable`) even where this method only reads it."""
    sig = ep.graph_signature
    mutated = {s.target for s in sig.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    constants: dict[str, torch.Tensor] = {}
    for spec in sig.input_specs:
        kind = _INPUT_KINDS.get(spec.kind)
        if kind is None:
            raise CompileError(f"input {spec.arg.name!r} is a {spec.kind.name}, which ferry does not support yet")
        node = by_name[spec.arg.name]
        if kind == M.USER_INPUT and isinstance(spec.arg, ConstantArgument):
            M.set_input_info(node, M.InputInfo(M.FIXED))  # (torch.export left it unread)
            continue
        state = spec.target in mutated or (kind == M.BUFFER and spec.target in shared_state)
        M.set_input_info(node, M.InputInfo(kind, spec.target or "", state))
        if kind != M.USER_INPUT:
            t = ep.state_dict.get(spec.target) if spec.target in ep.state_dict else ep.constants.get(spec.target)
            if t is None:
                raise CompileError(f"no value for {kind} {spec.target!r} in the exported program")
            constants[node.name] = t.detach() if isinstance(t, torch.nn.Parameter) else t
    infos = []
    for spec in sig.output_specs:
        if spec.kind == OutputKind.USER_OUTPUT:
            infos.append(M.OutputInfo(M.USER_OUTPUT))
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            infos.append(M.OutputInfo(M.BUFFER_MUTATION, spec.target))
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            infos.append(M.OutputInfo(M.USER_INPUT_MUTATION, spec.target))  # written into the caller's tensor
        else:
            raise CompileError(f"output {spec.arg} is a {spec.kind.name}, which ferry does not support yet")
    M.set_output_infos(ep.graph.output_node(), infos)
    return constants


def _check_partitions(partitions, nodes_by_name) -> list[list[torch.fx.Node]]:
    seen: dict[str, int] = {}
    groups = []
    for i, p in enumerate(partitions):
        if not isinstance(p, Partition):
            raise CompileError(f"partitioner returned {type(p).__name__}; it must return a list of ferry.Partition")
        group = []
        for name in p.nodes:
            node = nodes_by_name.get(name)
            if node is None or node.op != "call_function":
                raise CompileError(f"partition {i} names {name!r}, which is not a call_function node of the program")
            if name in seen:
                raise CompileError(f"node {name!r} is in partitions {seen[name]} and {i}; partitions must be disjoint")
            seen[name] = i
            group.append(node)
        # a multi-output op and the getitems that read it belong together
        for node in list(group):
            for user in node.users:
                if user.target is operator.getitem and user.name not in seen:
                    seen[user.name] = i
                    group.append(user)
        groups.append(group)
    # a tuple crosses no delegate boundary: a getitem belongs to the partition of the op it reads
    index = {n: i for i, g in enumerate(groups) for n in g}
    for i, group in enumerate(groups):
        for n in group:
            src = n.args[0] if n.target is operator.getitem and n.args else None
            if isinstance(src, torch.fx.Node) and index.get(src) != i:
                where = "no partition" if src not in index else f"partition {index[src]}"
                raise CompileError(
                    f"partition {i} has {n.name!r}, a getitem of {src.name!r}, which is in {where}; "
                    f"put {src.name!r} in partition {i} too, or leave {n.name!r} out"
                )
    return groups


def to_backend(exported_program: torch.export.ExportedProgram, partitioner: Partitioner | None,
               shared_state=frozenset(), last_position_of: str | None = None) -> LoweredProgram:
    """Replace each partition the partitioner proposes by one call_delegate node. `shared_state`:
    buffers another method compiled with this one updates: read here, they are state too.
    `last_position_of`: this method's name, where its results keep their last position only."""
    ep = functional_aten(exported_program, shared_state)
    if last_position_of is not None:
        keep_last_position(ep, last_position_of)
        _contiguous_gemm_inputs(ep.graph_module)  # a cut of several sequences' rows is strided
    check_symbolic_shapes(ep.graph_module)
    constants = _annotate(ep, shared_state)
    partitions = list(partitioner.partition(ep)) if partitioner is not None else []
    nodes = list(ep.graph.nodes)
    groups = _check_partitions(partitions, {n.name: n for n in nodes})
    pos = {n: i for i, n in enumerate(nodes)}
    devices = {n: d for p, group in zip(partitions, groups) if (d := _spec_device(p)) is not None for n in group}
    fit_to_devices(nodes, devices)
    root, g = torch.nn.Module(), torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for kind, unit in _unit_order(nodes, groups, partitions):
        if kind == "n":
            node = cast(torch.fx.Node, unit)
            env[node] = g.node_copy(node, lambda x: env[x])
        else:
            gi = cast(int, unit)
            _emit_delegate_call(root, g, env, groups_sorted(groups[gi], pos), partitions[gi], constants)
    # constants every consumer of which was absorbed into delegates are gone from the graph, and
    # so is state this method neither reads nor updates (another method's)
    updated = set(ep.graph_signature.buffers_to_mutate.values())
    for n in list(g.nodes):
        if (n.op == "placeholder" and n.name in constants and not n.users
                and (not M.input_info(n).mutable or M.input_info(n).target not in updated)):
            g.erase_node(n)
            constants = {k: v for k, v in constants.items() if k != n.name}
    g.lint()
    gm = torch.fx.GraphModule(root, g)
    buffers = {s.target: s.target in ep.graph_signature.buffers_to_mutate.values()
               for s in ep.graph_signature.input_specs if s.kind == InputKind.BUFFER and s.target}
    return LoweredProgram(gm, constants, dict(ep.range_constraints), dict(getattr(partitioner, "last_map", None) or {}),
                          buffers, {**ep.state_dict, **ep.constants})


def _unit_order(nodes: list, groups: list, partitions: list) -> list[tuple[str, object]]:
    """Units (plain nodes ("n", node) and whole partitions ("p", index)) in a topological order,
    stable by first position."""
    group_of = {n: gi for gi, g in enumerate(groups) for n in g}
    unit_of = {n: ("p", group_of[n]) if n in group_of else ("n", n) for n in nodes}
    first: dict[tuple[str, object], int] = {}
    for i, n in enumerate(nodes):
        first.setdefault(unit_of[n], i)
    deps: dict[tuple[str, object], set[tuple[str, object]]] = {u: set() for u in first}
    for n in nodes:
        for inp in n.all_input_nodes:
            if unit_of[inp] != unit_of[n]:
                deps[unit_of[n]].add(unit_of[inp])
    return _stable_topo(deps, first, partitions)


def _emit_delegate_call(root: torch.nn.Module, g: torch.fx.Graph, env: dict, members_in_order: list,
                        p: Partition, constants: dict) -> None:
    """One partition as a lowered module called by one call_delegate node, its outputs getitems."""
    members = set(members_in_order)
    inputs, outputs = [], []
    for n in members_in_order:
        for inp in n.all_input_nodes:
            if inp not in members and inp not in inputs:
                inputs.append(inp)
        if any(u not in members for u in n.users) and n not in outputs:
            outputs.append(n)
    absorbed = [x for x in inputs if x.op == "placeholder" and x.name in constants and not M.input_info(x).mutable]
    runtime_inputs = [x for x in inputs if x not in absorbed]
    sub = _subgraph(members_in_order, runtime_inputs, absorbed, outputs, constants)
    attr = f"lowered_module_{len(list(root.children()))}"
    root.add_module(attr, LoweredBackendModule(p.backend_id, p.compile_specs, sub))
    call = g.call_function(call_delegate, (g.get_attr(attr), *[env[x] for x in runtime_inputs]))
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    for k, o in enumerate(outputs):
        item = g.call_function(operator.getitem, (call, k))
        item.meta.update({key: o.meta[key] for key in ("val", "tensor_meta") if key in o.meta})
        env[o] = item


def _spec_device(p: Partition) -> Device | None:
    """The device a partition's compile specs place it on, or None (the CPU, or a device of a rank)."""
    spec = dict(p.compile_specs).get(TARGET_DEVICE)
    try:
        return Device.parse(spec.decode()) if spec is not None else None
    except (ValueError, UnicodeDecodeError):
        return None


def groups_sorted(group, pos):
    return sorted(group, key=pos.__getitem__)


def _stable_topo(deps, first, partitions):
    import heapq

    users = {u: [] for u in deps}
    indeg = {u: len(d) for u, d in deps.items()}
    for u, d in deps.items():
        for x in d:
            users[x].append(u)
    ready = [(first[u], i, u) for i, u in enumerate(deps) if indeg[u] == 0]
    heapq.heapify(ready)
    key = {u: i for i, u in enumerate(deps)}
    order = []
    while ready:
        _, _, u = heapq.heappop(ready)
        order.append(u)
        for v in users[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(ready, (first[v], key[v], v))
    if len(order) != len(deps):
        stuck = sorted({u[1] for u in deps if indeg[u] and u[0] == "p"})
        raise CompileError(
            f"partition(s) {stuck} are not convex: a path leaves the partition and comes back into it, "
            "so it cannot become one delegate call; split the partition or add the nodes on that path"
        )
    return order


def _subgraph(members, inputs, absorbed, outputs, constants) -> torch.fx.GraphModule:
    holder = torch.nn.Module()
    sg = torch.fx.Graph()
    senv = {}
    for x in inputs:
        ph = sg.placeholder(x.name)
        ph.meta.update({k: x.meta[k] for k in ("val", "tensor_meta") if k in x.meta})
        senv[x] = ph
    for x in absorbed:
        holder.register_buffer(x.name, constants[x.name])
        ga = sg.get_attr(x.name)
        ga.meta.update({k: x.meta[k] for k in ("val", "tensor_meta") if k in x.meta})
        senv[x] = ga
    for n in members:
        senv[n] = sg.node_copy(n, lambda x: senv[x])
    sg.output(tuple(senv[o] for o in outputs))
    sg.lint()
    return torch.fx.GraphModule(holder, sg)

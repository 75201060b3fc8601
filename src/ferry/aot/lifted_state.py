"""Constants a program writes are its state.

A non-strict export (`torch.export.export(..., strict=False)`) lifts a tensor the model reaches
through a plain Python object, not through a module's buffers, as a *constant*, even when the
model writes it in place: transformers' static cache for ExecuTorch registers each layer's keys
as a buffer ('key_cache_0') but writes them through the cache object, so the exported program
writes a constant that is the buffer's tensor. torch cannot functionalize a write into a
constant (`run_decompositions` fails), yet eager's meaning is plain: the tensor keeps what each
call writes, as a buffer does. So before functionalizing, a written constant becomes that
buffer where a buffer holds the same tensor (the state keeps the buffer's name, and the program
reads one tensor, not two copies of it), else a non-persistent buffer of its own. A constant
the program only reads that is a buffer's tensor is that buffer too: another method may update
it (Whisper's cross-attention cache, filled by `encode`, read by `decode` through the cache
object), and the read must see what was written, not the value at export time.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.fx
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputKind

from ferry.errors import CompileError
from ferry.ops.aliasing import view_base

__all__ = ["one_name_per_state", "refuse_stale_views", "same_tensor", "written_constants_as_state"]

_HELD = (InputKind.BUFFER, InputKind.CONSTANT_TENSOR)  # what one tensor may be held as, in some method


def written_constants_as_state(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`ep` with every constant it writes in place, or that is a buffer's tensor, made a buffer
    (the caller's program unchanged)."""
    buffers = _buffer_tensors(ep)
    written = _written_constants(ep) | _buffer_aliases(ep, buffers)
    if not written:
        return ep
    graph = copy.deepcopy(ep.graph)  # the nodes copied, keeping their names; their meta shared
    nodes = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    constants, specs = dict(ep.constants), []
    for spec in ep.graph_signature.input_specs:
        if spec.arg.name not in written:
            specs.append(spec)
            continue
        tensor = constants.pop(spec.target)
        same = next((name for name, (b, t) in buffers.items() if same_tensor(t, tensor)), None)
        if same is None:  # a buffer of its own, kept where torch keeps non-persistent buffers
            constants[spec.target] = tensor
            specs.append(InputSpec(InputKind.BUFFER, spec.arg, spec.target, persistent=False))
        else:  # the buffer holding this tensor: its placeholder is read and written instead
            node = nodes[spec.arg.name]
            node.replace_all_uses_with(nodes[buffers[same][0]])
            graph.erase_node(node)
    signature = ExportGraphSignature(specs, list(ep.graph_signature.output_specs))
    return torch.export.ExportedProgram(
        root=torch.fx.GraphModule(ep.graph_module, graph), graph=graph, graph_signature=signature,
        state_dict=ep.state_dict, range_constraints=dict(ep.range_constraints),
        module_call_graph=list(ep.module_call_graph), example_inputs=ep.example_inputs, constants=constants,
        verifiers=ep.verifiers)


def one_name_per_state(eps: dict[str, torch.export.ExportedProgram]) -> dict[str, torch.export.ExportedProgram]:
    """Methods exported from different wrappers of one model may name one buffer differently
    ('cache' in one, 'model.cache' in another); eager's methods share it all the same, and ferry
    shares state by name. So a buffer some method updates takes, in every method, the name the
    first method holding that tensor gives it (a read after another method's write sees it). A
    constant another method updates (a plain attribute holding the buffer's tensor) becomes that
    buffer too."""
    if len(eps) < 2:
        return eps
    tensors = {name: {target: t for target, (_, t) in _buffer_tensors(ep, _HELD).items()} for name, ep in eps.items()}
    updated = [t for ep in eps.values() for t in _updated_tensors(ep)]
    out: dict[str, torch.export.ExportedProgram] = {}
    named: list[tuple[str, torch.Tensor, str]] = []  # (first name, tensor, its method) of each updated tensor
    for method, ep in eps.items():
        renames, buffers = {}, _buffer_tensors(ep)
        for target, tensor in tensors[method].items():
            if not any(same_tensor(tensor, u) for u in updated):
                continue
            first = next(((n, m) for n, t, m in named if same_tensor(t, tensor)), None)
            if first is None:
                named.append((target, tensor, method))
            if target not in buffers and any(same_tensor(b, tensor) for _, b in buffers.values()):
                continue  # a constant that is this method's own buffer: written_constants_as_state reads it so
            name = first[0] if first is not None and first[1] != method else target
            if name != target or target not in buffers:
                renames[target] = name
        out[method] = _renamed_buffers(ep, method, renames) if renames else ep
    return out


def _updated_tensors(ep) -> list[torch.Tensor]:
    """The tensors of the buffers and constants `ep` writes: its buffer mutations, and what its
    ops write in place (a constant written through a cache object, not yet made state)."""
    targets = {s.target for s in ep.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    written = _written_inputs(ep, (InputKind.BUFFER, InputKind.CONSTANT_TENSOR))
    targets |= {s.target for s in ep.graph_signature.input_specs if s.arg.name in written}
    found = [ep.state_dict.get(t, ep.constants.get(t)) for t in targets]
    return [t for t in found if isinstance(t, torch.Tensor)]


def _renamed_buffers(ep, method: str, renames: dict[str, str]) -> torch.export.ExportedProgram:
    taken = {s.target for s in ep.graph_signature.input_specs if s.target is not None} - set(renames)
    clash = sorted(set(renames.values()) & taken)
    if clash:
        raise CompileError(f"method {method!r} holds the buffer another method names {clash[0]!r} under another name, "
                           f"and a different tensor as {clash[0]!r}: ferry shares state between methods by name; "
                           "export the methods from one model object, where each buffer has one name")

    def spec(s):
        if s.target not in renames or s.kind not in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR,
                                                     OutputKind.BUFFER_MUTATION):
            return s
        if s.kind == InputKind.CONSTANT_TENSOR:  # a buffer now, kept where torch keeps non-persistent ones
            return InputSpec(InputKind.BUFFER, s.arg, renames[s.target], persistent=False)
        return dataclasses.replace(s, target=renames[s.target])

    signature = ExportGraphSignature([spec(s) for s in ep.graph_signature.input_specs],
                                     [spec(s) for s in ep.graph_signature.output_specs])
    state = {renames.get(k, k): v for k, v in ep.state_dict.items()}
    constants = {renames.get(k, k): v for k, v in ep.constants.items()}
    graph = copy.deepcopy(ep.graph)  # the nodes copied, keeping their names; their meta shared
    made = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR
            and s.target in renames}
    for node in graph.nodes:
        if node.name in made:  # a buffer now, read as one: its trace has not written it (the constant's
            node.meta = {**node.meta, "val": _unwritten(node.meta["val"])}  # fake counted the real one's writes)
    return torch.export.ExportedProgram(
        root=torch.fx.GraphModule(ep.graph_module, graph), graph=graph, graph_signature=signature, state_dict=state,
        range_constraints=dict(ep.range_constraints), module_call_graph=list(ep.module_call_graph),
        example_inputs=ep.example_inputs, constants=constants, verifiers=ep.verifiers)


def _unwritten(val: torch.Tensor) -> torch.Tensor:
    """A fake tensor like `val` whose version counter has seen no write."""
    with val.fake_mode:  # type: ignore[attr-defined]
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)


def _written_constants(ep) -> set[str]:
    """Placeholder names of the constant tensors an op writes, directly or through a view."""
    return _written_inputs(ep, (InputKind.CONSTANT_TENSOR,))


def _written_inputs(ep, kinds: tuple) -> set[str]:
    """Placeholder names of the inputs of `kinds` an op writes, directly or through a view."""
    constant = {s.arg.name for s in ep.graph_signature.input_specs if s.kind in kinds}
    found = set()
    for node in ep.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for i, arg in enumerate(node.target._schema.arguments):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.fx.Node):
                base = view_base(value)  # (a write through an in-place op's result wrote its base already)
                if base.name in constant:
                    found.add(base.name)
    return found


def _buffer_aliases(ep, buffers: dict) -> set[str]:
    """Placeholder names of the constant tensors that are a buffer's tensor."""
    return {s.arg.name for s in ep.graph_signature.input_specs
            if s.kind == InputKind.CONSTANT_TENSOR and isinstance(t := ep.constants.get(s.target), torch.Tensor)
            and any(same_tensor(b, t) for _, b in buffers.values())}


def refuse_stale_views(ep, method: str, updated: frozenset[str]) -> None:
    """A constant sharing memory with a buffer some method updates without being that buffer's
    tensor as a whole (which `written_constants_as_state` reads as the buffer) is a part of it as
    export time saw it: every call would read a stale copy. Refused, never a wrong answer."""
    buffers = {t.untyped_storage().data_ptr(): (target, t) for target, (_, t) in _buffer_tensors(ep).items()
               if target in updated and t.device.type != "meta"}
    for spec in ep.graph_signature.input_specs:
        t = ep.constants.get(spec.target) if spec.kind == InputKind.CONSTANT_TENSOR else None
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        target, whole = buffers.get(t.untyped_storage().data_ptr(), (None, t))
        if target is not None and not same_tensor(whole, t):
            raise CompileError(
                f"method {method!r} reads part of buffer {target!r}, which a method updates, through the constant "
                f"{spec.target!r} that export captured with its value at export time: export it with strict=True "
                "(torch.export.export(..., strict=True) sees that the tensor is the buffer's)")


def _buffer_tensors(ep, kinds=(InputKind.BUFFER,)) -> dict[str, tuple[str, torch.Tensor]]:
    """Target -> (its placeholder's name, its tensor) of each input of `ep` of those kinds
    (buffers; with CONSTANT_TENSOR, the constants export lifted too)."""
    out = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind in kinds and spec.target is not None:
            tensor = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
            if isinstance(tensor, torch.Tensor):
                out[spec.target] = (spec.arg.name, tensor)
    return out


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One tensor: the same memory seen with the same shape, strides and dtype."""
    return (a.numel() > 0 and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)

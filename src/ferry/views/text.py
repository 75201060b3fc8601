"""Human and JSON views of a Program (what `ferry inspect` prints): methods, instructions with
devices, copies, buffers, bytes per device, the delegates' kernel choices."""

from __future__ import annotations

import dataclasses
import json
import math
from types import MappingProxyType

from ferry.errors import FerryError
from ferry.program import Program, guards, load_program
from ferry.program.report import copy_report
from ferry.program.schema import DEFAULT_ARG, ConstValue, DelegateCall, Method, TensorValue, element_size
from ferry.program.signature import call_text, size_name
from ferry.program.states import program_states
from ferry.views.facts import device_memory, fmt_bytes, owner, plan_of

__all__ = ["program_json", "program_summary", "size_checks"]

# the short tag an instruction listing shows per storage kind (planned values show their place)
_SHORT = MappingProxyType({"constant": "const", "input": "caller", "output": "caller", "runtime": "run time",
                           "scratch": "scratch", "view": "view", "state": "state"})


def _value(m: Method, vid: int) -> str:
    if vid == DEFAULT_ARG:
        return "_"
    v = m.values[vid]
    if isinstance(v, ConstValue):
        return repr(v.value) if v.kind != "none" else "None"
    where = f"b{plan_of(v).buffer}+{plan_of(v).offset}" if v.storage == "planned" else _SHORT[v.storage]
    return f"%{v.name or vid}@{v.device}[{where}]"


def _tensor_line(v: TensorValue) -> str:
    return f"{v.dtype}{list(v.shape)} on {v.device}" + (" (dynamic)" if any(v.dynamic) else "")


def _io_line(m: Method, vid: int) -> str:
    v = m.values[vid]
    if isinstance(v, ConstValue):
        return f"the constant {v.value!r}"
    return f"{_tensor_line(v)} ({owner(m, vid)})"


def _methods(program: Program, method: str | None) -> list[tuple[str, Method]]:
    """(name, method) pairs: all of them, or the one asked for."""
    return [(method, program.methods[method])] if method is not None else list(program.methods.items())


def _instruction_lines(program: Program, m: Method) -> list[str]:
    out = ["  instructions:"]
    for i, ins in enumerate(m.instructions):
        if isinstance(ins, DelegateCall):
            d = program.delegates[ins.delegate]
            target = (d.spec("target_device") or b"cpu").decode(errors="replace")
            head = f"delegate {ins.delegate} ({d.backend_id} on {target})"
            shown = ins.args
        else:
            head = ins.kernel
            shown = tuple(a for a in ins.args if a not in ins.outputs)
        args = ", ".join(_value(m, a) for a in shown)
        outs = ", ".join(_value(m, o) for o in ins.outputs)
        out.append(f"    #{i:<4} {head}({args}) -> {outs}")
    return out


def _memory_lines(program: Program, m: Method) -> list[str]:
    out = ["  memory plan:"]
    out += [f"    buffer {bi}: {fmt_bytes(b.size):>10} on {b.device}" for bi, b in enumerate(m.buffers[1:], start=1)]
    for dev, lb in m.lower_bounds.items():
        planned = sum(b.size for b in m.buffers[1:] if str(b.device) == dev)
        out.append(f"    {dev}: planned {planned:,} B, lower bound (peak live) {lb:,} B")
    if m.device_map:
        out.append("  device map (pass it back as device_map= to compile the same split):")
        out.append("    " + json.dumps(m.device_map))
    rows = device_memory(program, m)
    if len(rows) > 1 or m.max_memory:
        out.append(f"  per device: {'weights':>14} {'planned':>14} {'total':>14} {'budget':>14}")
        for dev, r in rows.items():
            budget = "-" if r["budget"] is None else f"{r['budget']:,}"
            out.append(f"    {dev:<9} {r['weights']:>14,} {r['planned']:>14,} {r['total']:>14,} {budget:>14}")
    return out


def _method_lines(program: Program, name: str, m: Method, instructions: bool) -> list[str]:
    out = [f"method {name!r}: {len(m.instructions)} instructions, {len(m.values)} values"]
    writes = {w.output: w.input for w in m.input_writes}
    if m.signature is not None:
        out.append(f"  called as {call_text(m.signature, name)}")
    out += [f"  input {i}: {_io_line(m, vid)}" for i, vid in enumerate(m.inputs)]
    checks = size_checks(m)
    if checks:
        out.append("  each call's sizes are checked as export's module checks them: " + "; ".join(checks))
    out += [f"  output {i}: {_io_line(m, vid)}" + (f", written into input {writes[i]} after the call" if i in writes else "")
            for i, vid in enumerate(m.outputs)]
    if instructions:
        out += _instruction_lines(program, m)
    out.append("  " + str(copy_report(program, name)).replace("\n", "\n  "))
    out += _memory_lines(program, m)
    if m.runtime_allocating_ops:
        out.append("  computed by their functional kernel (their results are allocated at run time):")
        out += [f"    {op}: {m.kernel_choices.get(op, 'no out variant')}" for op in m.runtime_allocating_ops]
    out += [f"  {what}: {why}" for what, why in m.kernel_choices.items()
            if what.startswith(("delegate ", "on the CPU: ")) and what not in m.runtime_allocating_ops]
    return out + _quantized_lines(m)


def size_checks(m: Method) -> list[str]:
    """What each call's sizes must meet beyond their bounds, as people read it: sizes traced as
    one, minimums, sizes traced as a*s + b of another, and export's guards."""
    def name(i: int, d: int) -> str:
        return size_name(m, i, d)

    out = [" == ".join(name(i, d) for i, d in group) for group in m.equal_sizes]
    out += [f"{name(i, d)} >= {low}" for i, d, low in m.size_minimums]
    out += [f"{name(i, d)} == {'' if a == 1 else f'{a} * '}{name(r, rd) if r >= 0 else 's'}{f' + {b}' if b else ''}"
            + ("" if r >= 0 else " for an integer s") for i, d, a, b, r, rd in m.derived_sizes]
    return out + [guards.render(guards.parse(text), name) for text in m.input_guards]


def _quantized_lines(m: Method) -> list[str]:
    """Each weight stored as a quantized tensor subclass's parts, and what it saves."""
    if not m.quantized_weights:
        return []
    stored = sum(q.nbytes for q in m.quantized_weights)
    dense = sum(math.prod(q.shape) * element_size(q.dtype) for q in m.quantized_weights)
    out = [f"  quantized weights: {len(m.quantized_weights)}, {fmt_bytes(stored)} stored where {fmt_bytes(dense)} "
           f"would be in their own dtype ({stored / max(dense, 1):.2f}x)"]
    for q in m.quantized_weights:
        parts = ", ".join(f"{a} {t}" for a, t in q.parts.items())
        out.append(f"    {q.name}: {q.scheme}, {q.dtype}{list(q.shape)} in {fmt_bytes(q.nbytes)} ({parts})"
                   + (f"; {q.details}" if q.details else ""))
    return out


def _delegate_lines(program: Program) -> list[str]:
    out = [f"delegates: {len(program.delegates)}, segments: {len(program.segments)} "
           f"({fmt_bytes(sum(len(memoryview(s)) for s in program.segments))})"]
    for i, d in enumerate(program.delegates):
        inside = _torch_payload(program, d)
        if inside is None:
            continue
        out.append(f"  delegate {i} ({d.backend_id}): {len(inside.instructions)} instructions")
        if d.backend_id == "inductor":
            out.append("    compiled by Inductor when the program loads (no native code in the file); "
                       "its results are Inductor's own tensors (not planned)")
            continue
        out += [f"    {op}: {why}" for op, why in inside.kernel_choices.items()]
    return out


def _state_lines(program: Program) -> list[str]:
    states = program_states(program.methods)
    if not states:
        return []
    total = sum(s.nbytes for s in states.values())
    out = [f"state: {len(states)} buffers, {total:,} bytes, held once for every method that reads or updates them"]
    for s in states.values():
        readers = [m for m in s.methods if m not in s.updated_by]
        out.append(f"  {s.name}: {_tensor_line(s.value)}, {s.nbytes:,} bytes, updated by "
                   f"{', '.join(s.updated_by) or 'no method'}" + (f"; read by {', '.join(readers)}" if readers else ""))
    return out


def program_summary(program: Program, instructions: bool = True, method: str | None = None) -> str:
    """The text `ferry inspect` prints: every method (or the one asked for), the program's state,
    then the delegates."""
    out = []
    for name, m in _methods(program, method):
        out += _method_lines(program, name, m, instructions)
    return "\n".join(out + _state_lines(program) + _delegate_lines(program))


def _torch_payload(program: Program, d):
    """The method inside a `torch` or `inductor` delegate's payload (a ferry program: data, never
    code), or None."""
    if d.backend_id not in ("torch", "inductor"):
        return None
    try:
        return load_program(program.segments[d.payload], segments=program.segments).method("forward")
    except (FerryError, IndexError, KeyError):
        return None


def _finite(x):
    """Strict JSON has no inf/nan: non-finite floats (masks of -inf, ...) become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def program_json(program: Program, method: str | None = None) -> dict:
    """What `ferry inspect --json` prints: the summary as data (strict JSON)."""
    return _finite({
        "methods": {name: _method_json(program, name, m) for name, m in _methods(program, method)},
        "state": {s.name: {"dtype": s.value.dtype, "shape": list(s.value.shape), "device": str(s.value.device),
                           "bytes": s.nbytes, "methods": list(s.methods),
                           "updated_by": list(s.updated_by)} for s in program_states(program.methods).values()},
        "delegates": [
            {"backend_id": d.backend_id, "compile_specs": {k: v.decode(errors="replace") for k, v in d.compile_specs},
             "kernel_choices": dict(inside.kernel_choices) if (inside := _torch_payload(program, d)) else {},
             "native_code": False}  # no built-in backend stores native code; inductor compiles at load
            for d in program.delegates
        ],
    })


def _method_json(program: Program, name: str, m: Method) -> dict:
    rep = copy_report(program, name)
    return {
        "inputs": [_io_json(m, v) for v in m.inputs],
        "outputs": [_io_json(m, v) for v in m.outputs],
        "input_writes": [{"output": w.output, "input": w.input} for w in m.input_writes],
        "called_as": call_text(m.signature, name) if m.signature is not None else None,
        "size_checks": size_checks(m),
        "instructions": [
            {
                "index": i,
                "kind": "delegate" if isinstance(ins, DelegateCall) else "kernel",
                "name": f"delegate:{ins.delegate}" if isinstance(ins, DelegateCall) else ins.kernel,
                "args": [None if a == DEFAULT_ARG else _arg_json(m, a) for a in ins.args],
                "outputs": [_arg_json(m, o) for o in ins.outputs],
            }
            for i, ins in enumerate(m.instructions)
        ],
        "copies": [r.__dict__ | {"shape": list(r.shape)} for r in rep.rows],
        "copy_totals": {d: {"count": n, "bytes": b} for d, (n, b) in rep.totals().items()},
        "buffers": [{"index": i, "size": b.size, "device": str(b.device)} for i, b in enumerate(m.buffers)],
        "lower_bounds": dict(m.lower_bounds),
        "runtime_allocating_ops": list(m.runtime_allocating_ops),
        "kernel_choices": dict(m.kernel_choices),
        "device_map": dict(m.device_map),
        "quantized_weights": [dataclasses.asdict(q) | {"shape": list(q.shape)} for q in m.quantized_weights],
        "devices": device_memory(program, m),
    }


def _io_json(m: Method, vid: int) -> dict:
    v = m.values[vid]
    return {"value": v.value, "kind": v.kind} if isinstance(v, ConstValue) else _tensor_json(v)


def _tensor_json(v: TensorValue) -> dict:
    return {"dtype": v.dtype, "shape": list(v.shape), "device": str(v.device), "storage": v.storage,
            "planned": v.storage == "planned", "dynamic": list(v.dynamic)}


def _arg_json(m: Method, vid: int) -> dict:
    v = m.values[vid]
    if isinstance(v, ConstValue):
        return {"value": v.value, "kind": v.kind}
    d = {"value_id": vid, "name": v.name, "device": str(v.device), "dtype": v.dtype, "shape": list(v.shape)}
    if v.plan:
        d["buffer"], d["offset"] = v.plan.buffer, v.plan.offset
    return d

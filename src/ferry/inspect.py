"""Human and JSON views of a Program: methods, instructions with devices, copies, buffers."""

from __future__ import annotations

import json
import math

from ferry.errors import BackendError, FerryError
from ferry.program import Program, load_program
from ferry.program.footprint import load_bytes
from ferry.program.report import copy_report
from ferry.program.schema import DEFAULT_ARG, STORAGE_KINDS, ConstValue, DelegateCall, TensorValue, root_storage

# the short tag an instruction listing shows per storage kind (planned values show their place)
_SHORT = {"constant": "const", "input": "caller", "output": "caller", "runtime": "run time", "scratch": "scratch",
          "view": "view"}


def _value(m, vid: int) -> str:
    if vid == DEFAULT_ARG:
        return "_"
    v = m.values[vid]
    if isinstance(v, ConstValue):
        return repr(v.value) if v.kind != "none" else "None"
    where = f"b{v.plan.buffer}+{v.plan.offset}" if v.storage == "planned" else _SHORT[v.storage]
    return f"%{v.name or vid}@{v.device}[{where}]"


def owner(m, vid: int) -> str:
    """Who holds the memory of a value, in words, as the program states it."""
    v = m.values[vid]
    short = STORAGE_KINDS[v.storage][0]
    return short if v.storage != "view" else f"view, {STORAGE_KINDS[root_storage(m.values, vid)][0]}"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _tensor_line(v: TensorValue) -> str:
    return f"{v.dtype}{list(v.shape)} on {v.device}" + (" (dynamic)" if any(v.dynamic) else "")


def _methods(program: Program, method: str | None):
    """(name, method) pairs: all of them, or the one asked for."""
    return [(method, program.methods[method])] if method is not None else list(program.methods.items())


def program_summary(program: Program, instructions: bool = True, method: str | None = None) -> str:
    out = []
    for name, m in _methods(program, method):
        out.append(f"method {name!r}: {len(m.instructions)} instructions, {len(m.values)} values")
        for kind, ids in (("input", m.inputs), ("output", m.outputs)):
            for i, vid in enumerate(ids):
                v = m.values[vid]
                out.append(f"  {kind} {i}: {_tensor_line(v)} ({owner(m, vid)})")
        if instructions:
            out.append("  instructions:")
            for i, ins in enumerate(m.instructions):
                if isinstance(ins, DelegateCall):
                    d = program.delegates[ins.delegate]
                    target = (d.spec("target_device") or b"cpu").decode(errors="replace")
                    head = f"delegate {ins.delegate} ({d.backend_id} on {target})"
                else:
                    head = ins.kernel
                shown = ins.args if isinstance(ins, DelegateCall) else [a for a in ins.args if a not in ins.outputs]
                args = ", ".join(_value(m, a) for a in shown)
                outs = ", ".join(_value(m, o) for o in ins.outputs)
                out.append(f"    #{i:<4} {head}({args}) -> {outs}")
        out.append("  " + str(copy_report(program, name)).replace("\n", "\n  "))
        out.append("  memory plan:")
        for bi, b in enumerate(m.buffers):
            if bi == 0:
                continue
            out.append(f"    buffer {bi}: {_fmt_bytes(b.size):>10} on {b.device}")
        for dev, lb in m.lower_bounds.items():
            planned = sum(b.size for b in m.buffers[1:] if str(b.device) == dev)
            out.append(f"    {dev}: planned {planned:,} B, lower bound (peak live) {lb:,} B")
        out.extend(_device_lines(program, m))
        if m.runtime_allocating_ops:
            out.append("  computed by their functional kernel (their results are allocated at run time):")
            for op in m.runtime_allocating_ops:
                out.append(f"    {op}: {m.kernel_choices.get(op, 'no out variant')}")
        out.extend(f"  {what}: {why}" for what, why in m.kernel_choices.items()
                   if what.startswith("delegate ") and what not in m.runtime_allocating_ops)
    out.append(f"delegates: {len(program.delegates)}, segments: {len(program.segments)} "
               f"({_fmt_bytes(sum(len(memoryview(s)) for s in program.segments))})")
    for i, d in enumerate(program.delegates):
        inside = _torch_payload(program, d)
        if inside is None:
            continue
        out.append(f"  delegate {i} ({d.backend_id}): {len(inside.instructions)} instructions")
        if d.backend_id == "inductor":
            out.append("    compiled by Inductor when the program loads (no native code in the file); "
                       "its results are Inductor's own tensors (not planned)")
            continue
        for op, why in inside.kernel_choices.items():
            out.append(f"    {op}: {why}")
    return "\n".join(out)


def _torch_payload(program: Program, d):
    """The method inside a `torch` or `inductor` delegate's payload (a ferry program: data, never
    code), or None."""
    if d.backend_id not in ("torch", "inductor"):
        return None
    try:
        return load_program(program.segments[d.payload]).method("forward")
    except (FerryError, IndexError, KeyError):
        return None


def device_memory(program: Program, m) -> dict[str, dict[str, int | None]]:
    """Per device: planned bytes, the rest loading allocates (weights, constants, a backend's
    own buffers), their total and the budget compile checked it against."""
    planned: dict[str, int] = {}
    for b in m.buffers[1:]:
        planned[str(b.device)] = planned.get(str(b.device), 0) + b.size
    try:
        total = {str(d): n for d, n in load_bytes(program, m).items()}
    except BackendError:  # a backend this process does not have: its weights are unknown here
        total = dict(planned)
    rows: dict[str, dict[str, int | None]] = {}
    for dev in sorted(set(planned) | set(total) | set(m.max_memory)):
        p, t = planned.get(dev, 0), max(total.get(dev, 0), planned.get(dev, 0))
        rows[dev] = {"planned": p, "weights": t - p, "total": t, "budget": m.max_memory.get(dev)}
    return rows


def _device_lines(program: Program, m) -> list[str]:
    out = []
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
    return _finite(_program_json(program, method))


def _program_json(program: Program, method: str | None) -> dict:
    methods = {}
    for name, m in _methods(program, method):
        rep = copy_report(program, name)
        methods[name] = {
            "inputs": [_tensor_json(m.values[v]) for v in m.inputs],
            "outputs": [_tensor_json(m.values[v]) for v in m.outputs],
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
            "devices": device_memory(program, m),
        }
    return {
        "methods": methods,
        "delegates": [
            {"backend_id": d.backend_id, "compile_specs": {k: v.decode(errors="replace") for k, v in d.compile_specs},
             "kernel_choices": dict(inside.kernel_choices) if (inside := _torch_payload(program, d)) else {},
             "native_code": False}  # no built-in backend stores native code; inductor compiles at load
            for d in program.delegates
        ],
    }


def _tensor_json(v: TensorValue) -> dict:
    return {"dtype": v.dtype, "shape": list(v.shape), "device": str(v.device), "storage": v.storage,
            "planned": v.storage == "planned", "dynamic": list(v.dynamic)}


def _arg_json(m, vid):
    v = m.values[vid]
    if isinstance(v, ConstValue):
        return {"value": v.value, "kind": v.kind}
    d = {"value_id": vid, "name": v.name, "device": str(v.device), "dtype": v.dtype, "shape": list(v.shape)}
    if v.plan:
        d["buffer"], d["offset"] = v.plan.buffer, v.plan.offset
    return d

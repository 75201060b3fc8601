"""The dataflow of a method is sound: what the program says it does, it can do safely.

Checked after the per-field checks of validate.py, so every id is in range here:

* every value is written once (by one instruction, or as an input or constant) and before
  anything reads it — a repeated instruction list or a read of memory nobody wrote is refused;
* values an instruction writes in place (planned, fresh outputs, scratch) are written through
  an out argument of that instruction, and a kernel's own results (storage `runtime`) are not;
  a delegate's outputs are memory it writes into, or results it returns (whether its backend
  returns them is checked when it is bound), either beside the state it writes in place;
* size arithmetic (ferry::sym_*) reads sizes, never tensors;
* no two planned values whose lifetimes overlap share bytes, and a buffer is no larger than its
  values need (a file cannot make the runtime allocate memory it never uses);
* a mutable buffer's update stored as the state itself (written over it in place by a delegate)
  is written by one delegate call that reads the state once and after which nothing reads it.
"""

from __future__ import annotations

from ferry.errors import ProgramError
from ferry.layout import contiguous_strides
from ferry.program import schema as S
from ferry.program.lifetimes import tensor_ids, value_lifetimes
from ferry.program.schema import DEFAULT_ARG, LIST_KINDS, ConstValue, DelegateCall, KernelCall, Method, TensorValue

__all__ = ["check_dataflow", "in_place_outputs", "state_overwrites"]

_WRITTEN_IN_PLACE = ("planned", "output", "scratch")


def check_dataflow(m: Method) -> None:
    pre = f"method {m.name!r}"
    _written_once_before_read(m, pre)
    _planned_memory_is_sound(m, pre)
    overwrites = state_overwrites(m)
    for j, mb in enumerate(m.mutable_buffers):
        if m.tensor(mb.update).storage == "state" and not mb.read_only and mb.update not in overwrites:
            raise ProgramError(f"{pre} mutable buffer {j}: its update (value {mb.update}) is stored as the state "
                               "itself, so one delegate call must write it, reading the state once, with nothing "
                               "reading the state after that call")


def _last_reads(m: Method) -> dict[int, int]:
    """Memory owner -> the last instruction reading its memory (itself or a view of it)."""
    last: dict[int, int] = {}
    for k, ins in enumerate(m.instructions):
        for a in ins.args:
            if a not in ins.outputs:
                for t in tensor_ids(m, a):
                    last[S.memory_owner(m.values, t)] = k
    return last


def state_overwrites(m: Method) -> dict[int, tuple[int, int, int]]:
    """Update value -> (instruction, argument position, result position) for each mutable buffer
    whose update can be written over its state in place: the delegate call that makes it reads
    the state exactly once, and no instruction reads the state after it. Whether the delegate may
    write that result over that argument is its backend's to say (Backend.writes_over)."""
    last = _last_reads(m)
    writer = {o: k for k, ins in enumerate(m.instructions) for o in ins.outputs}
    out = {}
    for mb in m.mutable_buffers:
        state, update = m.tensor(mb.value), m.tensor(mb.update)
        k = writer.get(mb.update)
        if (k is None or not isinstance(m.instructions[k], DelegateCall) or any(update.dynamic)
                or update.alias_of is not None or mb.update in m.outputs or mb.value in m.outputs
                or (state.dtype, state.shape, state.layout_strides, state.device)
                != (update.dtype, update.shape, update.layout_strides, update.device)):
            continue
        ins = m.instructions[k]
        at = [p for p, a in enumerate(ins.args) for t in tensor_ids(m, a) if S.memory_owner(m.values, t) == mb.value]
        if len(at) == 1 and ins.args[at[0]] == mb.value and last.get(mb.value) == k:
            out[mb.update] = (k, at[0], ins.outputs.index(mb.update))
    return out


def in_place_outputs(m: Method) -> dict[int, int]:
    """{result position: input position} of the method's results a caller may give the memory of
    that input (a delegate updating a KV cache in place), same dtype, shape, layout and device,
    static shapes: a result a kernel returns (storage `runtime`) is copied into the caller's
    tensor after the whole call, so any input may be its memory; a result written through an
    out argument may be where the input is read for the last time there, once, by a kernel that
    may write over it (ops/aliasing.py: overwrites_safely), or earlier."""
    out: dict[int, int] = {}
    writer = {o: k for k, ins in enumerate(m.instructions) for o in ins.outputs}
    last = _last_reads(m)
    for r, o in enumerate(m.outputs):
        v = m.values[o]
        if not isinstance(v, TensorValue) or v.storage not in ("output", "runtime") or m.outputs.count(o) != 1:
            continue
        for i, x in enumerate(m.inputs):
            if i in out.values() or m.inputs.count(x) != 1 or x in m.outputs or not _alike(m, x, o):
                continue
            if v.storage == "runtime" or (o in writer and _written_after_last_read(m, x, o, writer[o], last.get(x, -1))):
                out[r] = i
                break
    return out


def _alike(m: Method, x: int, o: int) -> bool:
    w = m.values[x]
    return (isinstance(w, TensorValue) and w.alias_of is None and not any(w.dynamic) and not any(m.tensor(o).dynamic)
            and (layout(m, x), w.device) == (layout(m, o), m.tensor(o).device))


def _written_after_last_read(m: Method, x: int, o: int, k: int, last: int) -> bool:
    """Whether input `x`, last read at instruction `last`, is read for the last time before
    instruction `k` writes result `o`, or at `k`, once, by a kernel that may write over it."""
    if last < k:
        return True
    ins = m.instructions[k]
    if last > k or not isinstance(ins, KernelCall) or ins.outputs != (o,):
        return False
    reads = [p for p, a in enumerate(ins.args) if a != o for t in tensor_ids(m, a) if S.memory_owner(m.values, t) == x]
    if len(reads) != 1 or whole_root(m, ins.args[reads[0]], whole_views(m)) != x or layout(m, ins.args[reads[0]]) != layout(m, o):
        return False
    from ferry.ops.aliasing import overwrites_safely  # torch operators: imported when needed

    op = _operator(ins.kernel)
    return op is not None and overwrites_safely(op, reads[0])


def _initially_defined(m: Method) -> set[int]:
    defined = set(m.inputs)
    for vid, v in enumerate(m.values):
        if isinstance(v, TensorValue) and v.constant is not None:
            defined.add(vid)  # weights, and the initial value of a mutable buffer
        elif isinstance(v, ConstValue) and v.kind not in ("symint", *LIST_KINDS):
            defined.add(vid)
    return defined


def _reads(m: Method, ins) -> list[int]:
    """The values an instruction reads (list constants stand for their members)."""
    out: list[int] = []
    for a in ins.args:
        if a == DEFAULT_ARG or a in ins.outputs:
            continue
        v = m.values[a]
        if isinstance(v, ConstValue) and v.kind in LIST_KINDS:
            out.extend(x for x in v.value if x is not None)  # type: ignore[attr-defined]
        elif isinstance(v, TensorValue) or (isinstance(v, ConstValue) and v.kind == "symint"):
            out.append(a)
    return out


def _written_once_before_read(m: Method, pre: str) -> None:
    defined = _initially_defined(m)
    held = {mb.value for mb in m.mutable_buffers}
    writer: dict[int, int] = {}
    for k, ins in enumerate(m.instructions):
        label = f"{pre} instruction {k}"
        for r in _reads(m, ins):
            if r not in defined:
                raise ProgramError(f"{label} reads value {r} ({_name(m, r)}) before anything writes it")
        _check_writes(m, ins, label, held)
        for o in ins.outputs:
            if o in writer or (o in defined and o not in ins.args):
                raise ProgramError(f"{label} writes value {o} ({_name(m, o)}), which "
                                   f"{'instruction ' + str(writer[o]) if o in writer else 'the method'} already defines")
            writer[o] = k
            defined.add(o)
    for j, vid in enumerate(m.outputs):
        if vid not in defined:
            raise ProgramError(f"{pre} output {j} (value {vid}) is never written")
    for j, mb in enumerate(m.mutable_buffers):
        if mb.update not in defined:
            raise ProgramError(f"{pre} mutable buffer {j}: its update (value {mb.update}) is never written")


def _check_writes(m: Method, ins, label: str, held: set[int]) -> None:
    """`held`: the values of the method's mutable buffers (its state)."""
    if any(o in held for o in ins.outputs):  # a state's memory is written only by an update over it
        raise ProgramError(f"{label}: it writes a mutable buffer's value (the program's state) directly; a state "
                           "changes only through its update")
    if isinstance(ins, DelegateCall):
        kinds = {v.storage if isinstance(v, TensorValue) else None for v in (m.values[o] for o in ins.outputs)}
        if not (kinds <= {"planned", "output", "state"} or (kinds <= {"runtime", "state"} and "runtime" in kinds)):
            raise ProgramError(f"{label}: a delegate's outputs are memory it writes into (planned, fresh outputs or "
                               "the state it updates) or results it returns (runtime, beside the state it updates); "
                               f"not {sorted(map(str, kinds))}")
        return
    if ins.kernel.startswith("ferry::sym_"):
        for a in ins.args:
            v = m.values[a]
            if not (isinstance(v, ConstValue) and v.kind in ("int", "symint")):
                raise ProgramError(f"{label} ({ins.kernel}): size arithmetic on value {a}, which is not a size")
        return
    _check_aliasing(m, ins, label)
    for o in ins.outputs:
        v = m.values[o]
        if not isinstance(v, TensorValue):
            continue
        if o in ins.args and (behind := S.root_storage(m.values, o)) in ("constant", "input", "state"):
            raise ProgramError(f"{label} ({ins.kernel}): value {o} is {behind} memory (the program "
                               "file's, the caller's or the program's state): a kernel may not write it")
        if v.storage in _WRITTEN_IN_PLACE and o not in ins.args:
            raise ProgramError(f"{label} ({ins.kernel}): value {o} is {v.storage} memory, so it must be written "
                               "through an out argument of the kernel")
        if v.storage in ("runtime", "view") and o in ins.args:
            raise ProgramError(f"{label} ({ins.kernel}): value {o} is a kernel's own result ({v.storage}), "
                               "not an out argument")


def _check_aliasing(m: Method, ins: KernelCall, label: str) -> None:
    """Results an op may share memory with an input are declared views of it (so lifetimes and
    planning see them): a view op's, of the argument its schema names; an unannotated op's (a
    composite's), of one of its tensor arguments if of any (ops/aliasing.py). And no kernel reads, in another argument,
    the memory it writes through an out argument."""
    op = _operator(ins.kernel)
    if op is None:
        return  # not a registered operator: refused when the method is bound
    from ferry.ops.aliasing import is_view, unannotated, view_source  # torch operators: imported when needed

    source = view_source(op)
    if is_view(op) and len(ins.args) > source and ins.args[source] != DEFAULT_ARG:
        base = S.memory_owner(m.values, ins.args[source])
        for o in ins.outputs:
            v = m.values[o]
            if isinstance(v, TensorValue) and (v.storage != "view" or v.alias_of != base):
                raise ProgramError(f"{label} ({ins.kernel}): value {o} is a view of value {base}, but the program "
                                   f"says {v.storage!r}" + (f" of value {v.alias_of}" if v.alias_of is not None else ""))
    elif unannotated(op):
        owners = {S.memory_owner(m.values, t) for a in ins.args for t in tensor_ids(m, a)}
        for o in ins.outputs:
            v = m.values[o]
            if isinstance(v, TensorValue) and v.storage == "view" and v.alias_of not in owners:
                raise ProgramError(f"{label} ({ins.kernel}): value {o} is declared a view of value {v.alias_of}, "
                                   "which is none of its arguments")
    schema = op._schema.arguments
    written = {S.memory_owner(m.values, a) for a, s in zip(ins.args, schema) if s.is_out and a != DEFAULT_ARG}
    read = {S.memory_owner(m.values, t) for a, s in zip(ins.args, schema) if not s.is_out for t in tensor_ids(m, a)}
    if written & read:
        raise ProgramError(f"{label} ({ins.kernel}): it reads value {min(written & read)} in an argument and "
                           "writes it through an out argument")


def _operator(kernel: str):
    from ferry.op_names import resolve_kernel  # torch operators: imported when needed

    try:
        return resolve_kernel(kernel)
    except LookupError:
        return None


def _planned_memory_is_sound(m: Method, pre: str) -> None:
    life, views = value_lifetimes(m), whole_views(m)
    by_buffer: dict[int, list[tuple[int, int, int]]] = {}
    for vid, v in enumerate(m.values):
        if isinstance(v, TensorValue) and v.plan is not None and v.nbytes:
            by_buffer.setdefault(v.plan.buffer, []).append((v.plan.offset, v.plan.offset + v.nbytes, vid))
    for b, buf in enumerate(m.buffers):
        spans = sorted(by_buffer.get(b, []))
        need = max((end for _, end, _ in spans), default=0)
        if buf.size > _align_up(need, buf.alignment):
            raise ProgramError(f"{pre} buffer {b} has {buf.size:,} bytes but its values need {need:,}: a buffer "
                               "larger than its values is malformed")
        for i, (_, hi, a) in enumerate(spans):
            for lo2, _, c in spans[i + 1:]:
                if lo2 >= hi:
                    break
                if _overlap(life.get(a), life.get(c)) and not written_over(m, life, a, c, views):
                    raise ProgramError(f"{pre} values {a} ({_name(m, a)}) and {c} ({_name(m, c)}) are alive at "
                                       f"the same time and share bytes of buffer {b}")


def written_over(m: Method, life: dict, a: int, c: int, views: dict | None = None) -> bool:
    """One of `a`, `c` is written over the other where the first dies and the second is made
    (emit.py plans a kernel's out argument over an input that dies there): the same bytes, read
    once by a kernel that may write over that argument, as itself or through a `view` of all of
    it laid out as the result is; static shapes only. `views`: `whole_views(m)`, made once."""
    (x, _), (y, _) = life[a], life[c]
    first, second = (a, c) if x < y else (c, a)
    v, w = m.tensor(first), m.tensor(second)
    if life[first][1] != life[second][0] or life[second][0] < 0 or v.plan != w.plan or any(v.dynamic) or any(w.dynamic):
        return False
    ins = m.instructions[life[second][0]]
    if not isinstance(ins, KernelCall) or ins.outputs != (second,):
        return False
    reads = [(p, t) for p, arg in enumerate(ins.args) for t in tensor_ids(m, arg)]
    at = [p for p, t in reads if S.memory_owner(m.values, t) == first]
    views = whole_views(m) if views is None else views
    if len(at) != 1 or whole_root(m, ins.args[at[0]], views) != first or layout(m, ins.args[at[0]]) != layout(m, second):
        return False  # read once (a view of it in another argument would overlap partly)
    from ferry.ops.aliasing import overwrites_safely  # torch operators: imported when needed

    op = _operator(ins.kernel)
    return op is not None and overwrites_safely(op, at[0])


WHOLE_VIEWS = frozenset({"aten::view.default", "aten::_unsafe_view.default"})


def whole_views(m: Method) -> dict[int, KernelCall]:
    """The instruction that makes each result of a `view`/`_unsafe_view`."""
    return {o: i for i in m.instructions if isinstance(i, KernelCall) and i.kernel in WHOLE_VIEWS for o in i.outputs}


def whole_root(m: Method, vid: int, views: dict[int, KernelCall]) -> int | None:
    """The value whose bytes `vid` is, element for element in order: itself when it owns its
    memory; its base when it is a `view` of all of a contiguous base, laid out contiguously."""
    v = m.values[vid]
    if not isinstance(v, TensorValue) or v.alias_of is None:
        return vid if isinstance(v, TensorValue) else None
    base, made = m.values[v.alias_of], views.get(vid)
    if (made is None or made.args[0] != v.alias_of or not isinstance(base, TensorValue) or base.nbytes != v.nbytes
            or layout(m, v.alias_of)[2] != contiguous_strides(base.shape) or layout(m, vid)[2] != contiguous_strides(v.shape)):
        return None
    return v.alias_of


def layout(m: Method, vid: int) -> tuple:
    """(dtype, shape, strides) of a tensor value, strides spelled out."""
    v = m.tensor(vid)
    return v.dtype, v.shape, v.layout_strides


def _overlap(x, y) -> bool:
    return x is not None and y is not None and x[0] <= y[1] and y[0] <= x[1]


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _name(m: Method, vid: int) -> str:
    v = m.values[vid]
    return repr(v.name) if isinstance(v, TensorValue) and v.name else type(v).__name__



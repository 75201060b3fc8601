"""Ranks: one program whose devices span processes, projected onto each of them.

A device may belong to another process of a torch.distributed job (`rank1:cuda:0`). Compile
stays one program: placement, copy insertion and per-device planning already treat two
ranks' `cuda:0` as two devices, so a copy between ranks is a copy op like any other, in the
file and in the copy report. Each rank then keeps its own part at load (`project`):

* its devices become local (`rank1:cuda:0` is `cuda:0` in the process of rank 1);
* instructions on other ranks are dropped, and values and buffers of other ranks are never
  allocated;
* a copy whose two ends are on two ranks becomes `ferry::send` on one side and `ferry::recv`
  into the planned destination on the other, tagged with the copy's instruction index. It
  goes over NCCL when both ranks have a GPU in the program (an end in host memory is staged
  through that rank's first GPU: GPUDirect between hosts, NVLink within one), else over
  Gloo in host memory.

The runtime (bind, schedule, streams, graphs) runs the result unchanged; only the two
transfer steps are new (runtime/parallel/transport.py). The method's inputs and outputs, and every
host op, belong to rank 0: other ranks run device stages only.
"""

from __future__ import annotations

import dataclasses

from ferry.device import CPU, Device
from ferry.errors import ConfigError, ProgramError
from ferry.ops import OUT_COPY_KERNELS
from ferry.program.schema import (
    LIST_KINDS,
    Buffer,
    ConstValue,
    KernelCall,
    Method,
    MutableBuffer,
    TensorValue,
)

__all__ = ["SEND", "RECV", "Boundary", "boundaries", "localized", "program_ranks", "project"]

SEND, RECV = "ferry::send", "ferry::recv"


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One copy between two ranks: what crosses, and over which transport."""

    method: str
    instruction: int
    src: Device
    dst: Device
    nbytes: int
    nccl: bool  # both ranks have a GPU: NCCL moves it; otherwise Gloo, in host memory


def program_ranks(program) -> tuple[int, ...]:
    """Every rank a device of the program belongs to (0 for a one-process program)."""
    return tuple(sorted({0}.union(*(_method_ranks(m) for m in program.methods.values()))))


def _method_ranks(m: Method) -> set[int]:
    return {v.device.rank for v in m.values if isinstance(v, TensorValue)} | {b.device.rank for b in m.buffers}


def _tensor_ids(values: list, ins) -> list[int]:
    ids = [*ins.args, *ins.outputs, *getattr(ins, "scratch", ())]
    out = []
    for a in ids:
        if a < 0:
            continue
        v = values[a]
        if isinstance(v, TensorValue):
            out.append(a)
        elif isinstance(v, ConstValue) and v.kind in LIST_KINDS:
            out += [x for x in v.value if x is not None and isinstance(values[x], TensorValue)]  # type: ignore[attr-defined]
    return out


def _cross_rank_copy(m: Method, ins) -> tuple[int, int] | None:
    """(src, dst) of a copy whose ends are on two ranks."""
    if not isinstance(ins, KernelCall) or ins.kernel not in OUT_COPY_KERNELS or len(ins.args) != 2:
        return None
    src, dst = ins.args[0], ins.outputs[0] if ins.outputs else -1
    if dst < 0 or m.tensor(src).device.rank == m.tensor(dst).device.rank:
        return None
    return src, dst


def boundaries(program) -> list[Boundary]:
    """The copies between ranks, method by method, in program order."""
    out = []
    for name, m in program.methods.items():
        gpus = _gpus(m)
        for i, ins in enumerate(m.instructions):
            ends = _cross_rank_copy(m, ins)
            if ends is not None:
                src, dst = (m.tensor(x) for x in ends)
                nccl = _nccl_device(src.device, gpus, dst.device) is not None
                out.append(Boundary(name, i, src.device, dst.device, dst.nbytes, nccl))
    return out


def _gpus(m: Method) -> dict[int, int]:
    """rank -> the first GPU of that rank the method uses."""
    out: dict[int, int] = {}
    for v in m.values:
        if isinstance(v, TensorValue) and v.device.type == "cuda":
            out[v.device.rank] = min(out.get(v.device.rank, v.device.index), v.device.index)
    return out


def _nccl_device(end: Device, gpus: dict[int, int], other: Device) -> int | None:
    """The GPU of `end`'s rank NCCL moves this end through (None: Gloo, in host memory)."""
    if end.rank not in gpus or other.rank not in gpus:
        return None
    return end.index if end.type == "cuda" else gpus[end.rank]


def _owner(m: Method, index: int, ins) -> int:
    ranks = {m.tensor(a).device.rank for a in _tensor_ids(m.values, ins)}
    if len(ranks) > 1:
        name = ins.kernel if isinstance(ins, KernelCall) else f"delegate {ins.delegate}"
        raise ProgramError(f"method {m.name!r} instruction {index} ({name}) touches tensors of ranks "
                           f"{sorted(ranks)}: only a copy may cross ranks")
    return ranks.pop() if ranks else 0


def check_static(m: Method) -> None:
    dynamic = [v.name or "a tensor" for v in m.values if isinstance(v, TensorValue) and any(v.dynamic)]
    if dynamic:
        raise ConfigError(f"method {m.name!r} spans ranks and has dynamic sizes ({dynamic[0]!r}): a rank receives "
                          "into memory planned at a fixed shape, so export a program split over ranks with static "
                          "shapes (compile one per batch size, or use microbatches=)")


def check_io_on_rank_0(m: Method) -> None:
    """Rank 0 takes a call's inputs and returns its outputs: none of them may live elsewhere."""
    for what, ids in (("input", m.inputs), ("output", m.outputs)):
        for i, vid in enumerate(ids):
            v = m.values[vid]
            if isinstance(v, TensorValue) and v.device.rank != 0:
                raise ConfigError(f"method {m.name!r}: {what} {i} lives on {v.device}, but rank 0 takes the inputs "
                                  "and returns the outputs; compile without skip_h2d/skip_d2h for a stage on "
                                  "another rank")


def project(program, rank: int):
    """The part of `program` that the process of `rank` runs (a new Program; the segments and
    delegates are shared, not copied)."""
    from ferry.program.program import Program

    return Program({name: _project_method(m, rank) for name, m in program.methods.items()},
                   program.delegates, program.segments)


def _project_method(m: Method, rank: int) -> Method:
    if len(_method_ranks(m) | {0}) > 1:
        check_static(m)
        check_io_on_rank_0(m)
    values = list(m.values)

    def const(kind: str, value) -> int:
        values.append(ConstValue(kind, value))
        return len(values) - 1

    kept: list = []
    gpus = _gpus(m)
    transfers: list[tuple[int, int]] = []  # (position in kept, destination) of each recv
    for i, ins in enumerate(m.instructions):
        ends = _cross_rank_copy(m, ins)
        if ends is None:
            if _owner(m, i, ins) == rank:
                kept.append(ins)
            continue
        src, dst = ends
        s, d = m.tensor(src).device, m.tensor(dst).device
        if s.rank == rank:
            via = _nccl_device(s, gpus, d)
            kept.append(KernelCall(SEND, (src, const("int", d.rank), const("int", i),
                                          const("none" if via is None else "int", via)), ()))
        elif d.rank == rank:
            via = _nccl_device(d, gpus, s)
            transfers.append((len(kept), dst))
            kept.append(KernelCall(RECV, (dst, const("int", s.rank), const("int", i),
                                          const("none" if via is None else "int", via), -1), (dst,)))
    written_back = {x for mb in m.mutable_buffers for x in (mb.value, mb.update)}
    for pos, dst in transfers:  # a destination nothing later reads is waited for at the end of the call
        seen = _views_of(m, dst)
        read_later = bool(seen & written_back) or any(seen.intersection(_tensor_ids(values, ins)) for ins in kept[pos + 1:])
        ins = kept[pos]
        kept[pos] = dataclasses.replace(ins, args=(*ins.args[:4], const("bool", not read_later)))
    for vid, v in enumerate(m.values):
        if isinstance(v, TensorValue):
            values[vid] = _local_value(v, rank)
    buffers = [dataclasses.replace(b, device=b.device.local) if b.device.rank == rank else Buffer(0, CPU)
               for b in m.buffers]
    mutable = [mb for mb in m.mutable_buffers if m.tensor(mb.value).device.rank == rank]
    ours = rank == 0  # the call's inputs and outputs are rank 0's
    return dataclasses.replace(m, values=values, instructions=kept, buffers=buffers,
                               mutable_buffers=[MutableBuffer(mb.value, mb.update, mb.name) for mb in mutable],
                               inputs=m.inputs if ours else [], outputs=m.outputs if ours else [],
                               input_writes=m.input_writes if ours else [], signature=m.signature if ours else None)


def _views_of(m: Method, vid: int) -> set[int]:
    """`vid` and every value that is a view of it."""
    out = {vid}
    for i, v in enumerate(m.values):  # views follow their base in the value table
        if isinstance(v, TensorValue) and v.alias_of in out:
            out.add(i)
    return out


def _local_value(v: TensorValue, rank: int) -> TensorValue:
    if v.device.rank == rank:
        return dataclasses.replace(v, device=v.device.local)
    # another rank's: never allocated here, never read (a placeholder the loader skips)
    return TensorValue(v.dtype, v.shape, CPU, dynamic=v.dynamic, name=v.name, storage="runtime")


def localized(m: Method) -> Method:
    """`m` with every device named as its own process names it: a delegate runs in the process
    that calls it, on that process's devices."""
    if all(not (isinstance(v, TensorValue) and v.device.rank) for v in m.values):
        return m
    values = [dataclasses.replace(v, device=v.device.local) if isinstance(v, TensorValue) else v for v in m.values]
    buffers = [dataclasses.replace(b, device=b.device.local) for b in m.buffers]
    return dataclasses.replace(m, values=values, buffers=buffers)

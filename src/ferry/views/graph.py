"""The graph the page draws, as plain data: one node per method input, mutable buffer,
instruction, output and buffer update, in program order (a valid topological order); one edge
from the node that last wrote a value to each node that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.device import CPU, Device
from ferry.program import Program
from ferry.program.lifetimes import tensor_ids
from ferry.program.schema import DelegateCall, KernelCall, Method, TensorValue
from ferry.views.facts import (
    delegate_of,
    fmt_bytes,
    instruction_device,
    is_copy,
    owner,
    plan_of,
    reads,
    shape_text,
    short_kernel,
)
from ferry.views.markup import clip

__all__ = ["Edge", "Graph", "Node", "build_graph"]


@dataclass(frozen=True)
class Node:
    key: str
    kind: str  # input | state | instr | delegate | copy | output | update
    row: int
    label: str
    title: str
    device: Device  # a copy's destination
    src_device: Device | None = None  # a copy's source
    index: int | None = None  # instruction index
    info: str = ""  # the line right of the drawing
    nbytes: int = 0  # the bytes a copy moves


@dataclass
class Edge:
    src: int  # node position
    dst: int
    values: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Graph:
    nodes: list[Node]
    edges: list[Edge]

    def devices(self) -> set[Device]:
        return {nd.device for nd in self.nodes} | {nd.src_device for nd in self.nodes if nd.src_device is not None}

    def copies(self) -> list[tuple[Device, Device]]:
        """(source, destination) of every copy node."""
        return [(nd.src_device, nd.device) for nd in self.nodes if nd.src_device is not None]


def _describe(m: Method, vid: int) -> str:
    """One line about a value, for tooltips."""
    v = m.values[vid]
    if not isinstance(v, TensorValue):
        return f"{v.kind} {v.value!r}"
    if v.storage == "planned":
        where = f"buffer {plan_of(v).buffer} + {plan_of(v).offset}"
    elif v.storage == "view" and v.alias_of is not None and 0 <= v.alias_of < len(m.values):
        where = f"view of %{m.tensor(v.alias_of).name or v.alias_of}"
    else:
        where = owner(m, vid)
    return f"%{v.name or f'v{vid}'} {shape_text(v)} on {v.device} ({fmt_bytes(v.nbytes)}, {where})"


def _summarize(m: Method, vid: int) -> str:
    """A compact line about a value, for the column right of the graph."""
    v = m.values[vid]
    if not isinstance(v, TensorValue):
        return f"{v.kind} {v.value!r}"
    where = f"b{plan_of(v).buffer}+{plan_of(v).offset}" if v.storage == "planned" else owner(m, vid)
    return f"%{v.name or f'v{vid}'}  {shape_text(v)}  {where}"


class _Builder:
    def __init__(self, program: Program, m: Method):
        self.program, self.m = program, m
        self.nodes: list[Node] = []
        self.edges: dict[tuple[int, int], Edge] = {}
        self.last_def: dict[int, int] = {}  # value id -> node position that last wrote it

    def value_node(self, key: str, kind: str, label: str, what: str, vid: int, say_owner: bool = False) -> int:
        """A node standing for one value at the edge of the method: an input, an output, a buffer."""
        v = self.m.values[vid]
        if isinstance(v, TensorValue):
            dev, who = v.device, owner(self.m, vid)
        else:
            dev, who = CPU, v.kind
        title = what + (f" ({who})" if say_owner else "") + f"\n{_describe(self.m, vid)}"
        self.nodes.append(Node(key, kind, len(self.nodes), label, title, dev, info=_summarize(self.m, vid)))
        return len(self.nodes) - 1

    def link(self, src: int | None, dst: int, vid: int) -> None:
        if src is None or src == dst:
            return
        e = self.edges.setdefault((src, dst), Edge(src, dst))
        if vid not in e.values:
            e.values.append(vid)

    def sources(self) -> None:
        m = self.m
        for k, vid in enumerate(m.inputs):
            v = m.values[vid]
            name = v.name if isinstance(v, TensorValue) else ""
            label = clip(f"input {k}" + (f": {name}" if name else ""), 28)
            self.last_def.setdefault(vid, self.value_node(f"in{k}", "input", label, f"method input {k}", vid, True))
        for k, mb in enumerate(m.mutable_buffers):
            if mb.value in self.last_def or not 0 <= mb.value < len(m.values):
                continue
            what = f"mutable buffer {mb.name!r}, kept between calls"
            self.last_def[mb.value] = self.value_node(f"st{k}", "state", clip(f"buffer {mb.name or k}", 28), what, mb.value)

    def instruction(self, i: int, ins) -> None:
        m = self.m
        ins_reads = reads(m, ins)
        dev = instruction_device(self.program, m, ins)
        outs = [t for o in ins.outputs for t in tensor_ids(m, o)]
        kind, label, head, src_dev, nbytes = self._head(i, ins, dev)
        lines = [head]
        lines += [f"reads  {_describe(m, r)}" for r in ins_reads if r not in set(outs) or r in self.last_def]
        lines += [f"writes {_describe(m, o)}" for o in outs]
        consts = [r for r in ins_reads if r not in self.last_def and m.tensor(r).storage == "constant"]
        if consts:
            lines.append(f"({len(consts)} constant{'s' if len(consts) != 1 else ''} read)")
        info = _summarize(m, outs[0]) + (f"  (+{len(outs) - 1} more)" if len(outs) > 1 else "") if outs else ""
        pos = len(self.nodes)
        self.nodes.append(Node(f"i{i}", kind, pos, clip(label, 30), "\n".join(lines), dev, src_dev, i, info, nbytes))
        for r in ins_reads:
            self.link(self.last_def.get(r), pos, r)
        for o in outs:
            self.last_def[o] = pos

    def _head(self, i: int, ins, dev: Device) -> tuple[str, str, str, Device | None, int]:
        """(kind, label, first tooltip line, source device of a copy, bytes a copy moves)."""
        if isinstance(ins, DelegateCall):
            d = delegate_of(self.program, ins)
            backend = d.backend_id if d is not None else "?"
            specs = ", ".join(f"{k}={v.decode(errors='replace')}" for k, v in d.compile_specs) if d is not None else ""
            head = f"#{i} delegate {ins.delegate}: backend {backend!r} on {dev}" + (f"\ncompile specs: {specs}" if specs else "")
            return "delegate", f"delegate {ins.delegate} ({backend})", head, None, 0
        assert isinstance(ins, KernelCall)
        if not is_copy(ins):
            return "instr", short_kernel(ins.kernel), f"#{i} {ins.kernel} on {dev}", None, 0
        src = tensor_ids(self.m, ins.args[0]) if ins.args else []
        src_dev = self.m.tensor(src[0]).device if src else dev
        nbytes = self.m.tensor(src[0]).nbytes if src else 0
        head = f"#{i} {ins.kernel}: {src_dev} -> {dev}, {fmt_bytes(nbytes)} ({nbytes:,} B)"
        return "copy", short_kernel(ins.kernel), head, src_dev, nbytes

    def sinks(self) -> None:
        m = self.m
        writes = {w.output: w.input for w in m.input_writes}
        for k, vid in enumerate(m.outputs):
            what = f"method output {k}" + (f", written into input {writes[k]} after the call" if k in writes else "")
            pos = self.value_node(f"out{k}", "output", f"output {k}", what, vid, True)
            self.link(self.last_def.get(vid), pos, vid)
        for k, mb in enumerate(m.mutable_buffers):
            if not 0 <= mb.update < len(m.values) or mb.read_only:  # (read only: nothing is written back)
                continue
            what = f"written back into mutable buffer {mb.name!r} after the call"
            pos = self.value_node(f"up{k}", "update", clip(f"update {mb.name or k}", 28), what, mb.update)
            self.link(self.last_def.get(mb.update), pos, mb.update)


def build_graph(program: Program, m: Method) -> Graph:
    b = _Builder(program, m)
    b.sources()
    for i, ins in enumerate(m.instructions):
        b.instruction(i, ins)
    b.sinks()
    return Graph(b.nodes, list(b.edges.values()))

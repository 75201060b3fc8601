"""ferry.compile end to end: per-device memory planning, mutable buffers, dynamic shapes, the
compile report and the program round trip (bytes and file), on hand-made and real models.

Every program compiled here goes through `check`: its plan is checked against lifetimes this
file computes itself from the instructions (no two values alive at once share bytes, each
planned value sits in a buffer of its own device, inside it, aligned), the lower bound of the
compile report is the peak of live bytes, and `to_bytes -> load_program` gives an equal
program. Programs on the emulated device (emu:k) also run and are compared with eager PyTorch
on fresh random inputs; programs labelled cuda:k are compiled only.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

import ferry
import ferry.examples
from ferry.device import Device
from ferry.inspect import program_summary
from ferry.program.dataflow import written_over
from ferry.program.lifetimes import value_lifetimes
from ferry.program.schema import DEFAULT_ARG, ConstValue, KernelCall, TensorValue
from models import (
    Add,
    AddChain,
    FanOut,
    InputToCpuAndDelegate,
    MultiOutput,
    PerAdd,
    SharedOutput,
    TwoLinears,
    WithParams,
    assert_like_eager,
    fresh_inputs,
    roundtrip,
    run_vs_eager,
    skip_config,
    small,
    small_cnn,
    transformer_block,
)

CPU, CUDA0, CUDA1, EMU0 = Device("cpu", 0), Device("cuda", 0), Device("cuda", 1), Device("emu", 0)
COPY_KERNELS = {"et_copy::_h2d_copy.out", "et_copy::_d2h_copy.out", "et_copy::_d2d_copy.out"}
DEFAULT_ALIGN = {"cpu": 64}  # everything else: 256


@functools.cache
def exported(name: str) -> torch.export.ExportedProgram:
    """Exports shared by several tests (compile never changes the ExportedProgram it is given)."""
    model, inputs = BUILDERS[name]()
    return torch.export.export(model, tuple(inputs))


BUILDERS = {
    "add": lambda: (Add(), small((2, 2))),
    "add_chain": lambda: (AddChain(), small()),
    "fan_out": lambda: (FanOut(), small()),
    "shared_output": lambda: (SharedOutput(), small()),
    "input_to_cpu_and_delegate": lambda: (InputToCpuAndDelegate(), small()),
    "multi_output": lambda: (MultiOutput(), small()),
    "with_params": lambda: (WithParams(), small((3, 8), n=1)),
    "two_linears": lambda: (TwoLinears(), small((3, 4), n=1)),
    "cnn": small_cnn,
    "transformer": transformer_block,
    "example_cnn": ferry.examples.small_cnn,
    "example_transformer": ferry.examples.transformer_block,
}


# ------------------------------------------------------------------ independent plan checks


def _root(m, vid):
    v = m.values[vid]
    while isinstance(v, TensorValue) and v.alias_of is not None:
        vid = v.alias_of
        v = m.values[vid]
    return vid


def lifetimes(m) -> dict[int, tuple[int, int]]:
    """root value id -> [first, last] instruction touching it or a view of it (inclusive);
    inputs and mutable buffers are alive from -1, method outputs and buffer updates until n."""
    n = len(m.instructions)
    first: dict[int, int] = {}
    last: dict[int, int] = {}

    def touch(vid, i):
        v = m.values[vid]
        if isinstance(v, ConstValue):
            if v.kind in ("tensors", "opt_tensors"):
                for x in v.value:
                    if x is not None:
                        touch(x, i)
            return
        r = _root(m, vid)
        first[r] = min(first.get(r, i), i)
        last[r] = max(last.get(r, i), i)

    for i, ins in enumerate(m.instructions):
        for a in (*ins.args, *ins.outputs, *getattr(ins, "scratch", ())):  # scratch: a delegate's working memory
            if a != DEFAULT_ARG:
                touch(a, i)
    for vid in m.outputs:
        touch(vid, n)
    for mb in m.mutable_buffers:
        touch(mb.update, n)
        touch(mb.value, n)
    host_copies = [[e for e in (ins.args[0], ins.outputs[0])] for ins in m.instructions
                   if getattr(ins, "kernel", "").startswith("et_copy::")
                   and len({m.values[e].device.is_cpu for e in (ins.args[0], ins.outputs[0])}) == 2]
    if len({m.values[e].device for ends in host_copies for e in ends if not m.values[e].device.is_cpu}) > 1:
        for ends in host_copies:  # two devices' copies touch host memory: it lives to the end of the call
            for e in ends:
                if m.values[e].device.is_cpu:
                    touch(e, n)
    for vid in [*m.inputs, *(mb.value for mb in m.mutable_buffers)]:
        r = _root(m, vid)
        first[r] = -1
        last.setdefault(r, -1)
    return {r: (first[r], last[r]) for r in first}


def _align_for(alignment, device: Device) -> int:
    if isinstance(alignment, int):
        return alignment
    table = dict(DEFAULT_ALIGN) if alignment is None else dict(alignment)
    return table.get(device.type, table.get("default", 64 if device.is_cpu else 256))


def check_plan(m, alignment=None, naive=False):
    """The memory plan of method `m` is sound, whatever algorithm made it."""
    bufs = m.buffers
    assert bufs[0].size == 0 and bufs[0].device == CPU, "buffer 0 is the empty constants slot"
    devices = [b.device for b in bufs[1:]]
    assert len(set(devices)) == len(devices), f"one buffer per device, got {devices}"
    assert devices == sorted(devices, key=lambda d: (d != CPU, d.type, d.index)), f"CPU first, then sorted: {devices}"
    life = lifetimes(m)
    planned = []
    for vid, v in enumerate(m.values):
        if not isinstance(v, TensorValue) or v.plan is None:
            continue
        assert v.alias_of is None, f"view {v.name} owns planned memory"
        assert v.plan.buffer >= 1
        buf = bufs[v.plan.buffer]
        assert buf.device == v.device, f"{v.name} on {v.device} planned in a {buf.device} buffer"
        assert v.plan.offset + v.nbytes <= buf.size
        assert v.plan.offset % _align_for(alignment, v.device) == 0, (v.name, v.plan.offset)
        start, end = life.get(vid, (0, 0))
        planned.append((v.plan.buffer, v.plan.offset, v.plan.offset + v.nbytes, start, end, v.name, vid))
    for i, a in enumerate(planned):
        for b in planned[i + 1:]:
            if a[0] != b[0] or a[1] == a[2] or b[1] == b[2]:
                continue
            share_bytes = a[1] < b[2] and b[1] < a[2]
            share_time = a[3] <= b[4] and b[3] <= a[4]
            if share_bytes and share_time and not naive and written_over(m, value_lifetimes(m), a[6], b[6]):
                continue  # a result planned over the input that dies where it is made (in place)
            assert not (share_bytes and (share_time or naive)), f"{a[5]} and {b[5]} overlap: {a} {b}"
    # compile report: the lower bound is the peak of live planned bytes, never above the plan
    assert set(m.lower_bounds) == {str(d) for d in devices}
    for d in devices:
        size = sum(b.size for b in bufs[1:] if b.device == d)
        peak = 0
        ends = {p[4] for p in planned} | {p[3] for p in planned}
        for t in ends:  # a value and the one written over it where it dies hold the same bytes: counted once
            live = sum(hi - lo for (bi, lo, hi) in {(bi, lo, hi) for (bi, lo, hi, s, e, *_) in planned
                                                    if bufs[bi].device == d and s <= t <= e})
            peak = max(peak, live)
        assert m.lower_bounds[str(d)] == peak, (d, m.lower_bounds, peak)
        assert m.lower_bounds[str(d)] <= size


def check(program, alignment=None, naive=False):
    for m in program.methods.values():
        check_plan(m, alignment, naive)
    for d in program.delegates:  # torch-backend payloads are planned ferry programs themselves
        if d.backend_id == "torch":
            payload = ferry.load_program(bytes(program.segments[d.payload]), segments=program.segments)
            for m in payload.methods.values():
                check_plan(m, alignment, naive)
    return roundtrip(program)


def compile_checked(ep, partitioner=None, config=None):
    program = ferry.compile(ep, partitioner, config)
    c = config or ferry.CompileConfig()
    check(program, c.alignment, c.memory_planning == "naive")
    return program


# ------------------------------------------------------------------ planning through compile


def test_values_grouped_by_device_two_gpus():
    program = compile_checked(exported("add_chain"), PerAdd("cuda:0", "cuda:1"))
    m = program.methods["forward"]
    assert [b.device for b in m.buffers] == [CPU, CPU, CUDA0, CUDA1]
    for v in m.values:
        if isinstance(v, TensorValue) and v.plan is not None:
            assert m.buffers[v.plan.buffer].device == v.device
            assert v.plan.buffer == {CPU: 1, CUDA0: 2, CUDA1: 3}[v.device]
    on = {d: [v for v in m.values if isinstance(v, TensorValue) and v.device == d and v.plan] for d in (CUDA0, CUDA1)}
    assert on[CUDA0] and on[CUDA1], "both GPUs hold planned values"
    assert "et_copy::_d2d_copy.out" in {i.kernel for i in m.instructions if isinstance(i, KernelCall)}
    meta = program.method_meta("forward")
    assert [meta.memory_planned_buffer_device(i) for i in range(meta.num_memory_planned_buffers())] == [CPU, CUDA0, CUDA1]


def test_buffers_sorted_whatever_the_partition_order():
    # FanOut has four adds: cuda:3, cuda:0, cuda:1, cuda:1 in graph order
    program = compile_checked(exported("fan_out"), PerAdd("cuda:3", "cuda:0", "cuda:1"))
    m = program.methods["forward"]
    assert [b.device for b in m.buffers[1:]] == [CPU, CUDA0, CUDA1, Device("cuda", 3)]
    assert all(b.size > 0 for b in m.buffers[1:])


def test_legacy_mode_is_one_cpu_pool():
    config = ferry.CompileConfig(enable_non_cpu_memory_planning=False)
    program = compile_checked(exported("add_chain"), PerAdd("cuda:0", "cuda:1"), config)
    m = program.methods["forward"]
    assert [b.device for b in m.buffers] == [CPU, CPU]
    assert all(v.device == CPU for v in m.values if isinstance(v, TensorValue))
    assert not any(isinstance(i, KernelCall) and i.kernel.startswith("et_copy::") for i in m.instructions)
    meta = program.method_meta("forward")
    assert meta.num_memory_planned_buffers() == 1 and meta.memory_planned_buffer_device(0) == CPU


@pytest.mark.parametrize("alloc_in", [True, False])
@pytest.mark.parametrize("alloc_out", [True, False])
def test_graph_inputs_and_outputs_planned_unless_disabled(emu, alloc_in, alloc_out):
    config = ferry.CompileConfig(alloc_graph_input=alloc_in, alloc_graph_output=alloc_out)
    model, inputs = MultiOutput(), small()
    program = compile_checked(torch.export.export(model, inputs), ferry.OpSupportPartitioner("emu:0", ops=["aten.add", "aten.mul"]), config)
    m = program.methods["forward"]
    assert all(m.values[v].device == CPU for v in [*m.inputs, *m.outputs])
    assert all((m.values[v].plan is not None) == alloc_in for v in m.inputs)
    assert all((m.values[v].plan is not None) == alloc_out for v in m.outputs if m.values[v].storage != "runtime")
    io = set(m.inputs) | set(m.outputs)
    inner = [v for vid, v in enumerate(m.values) if isinstance(v, TensorValue) and vid not in io and v.alias_of is None]
    assert inner and all(v.plan is not None for v in inner if v.storage != "runtime"), \
        "everything else is planned (but for functional kernels' results)"
    meta = program.method_meta("forward")
    assert [meta.input_meta(i).planned for i in range(meta.num_inputs())] == [alloc_in] * 2
    assert [meta.output_meta(i).planned for i in range(meta.num_outputs())] == [
        alloc_out and m.values[v].storage != "runtime" for v in m.outputs]
    run_vs_eager(program, model, inputs)


def test_legacy_mode_runs_on_the_emulated_device(emu):
    model, inputs = SharedOutput(), small()
    config = ferry.CompileConfig(enable_non_cpu_memory_planning=False)
    program = compile_checked(torch.export.export(model, inputs), PerAdd("emu:0"), config)
    assert {b.device for b in program.methods["forward"].buffers} == {CPU}
    run_vs_eager(program, model, inputs)


class PassThrough(nn.Module):
    """Inputs returned as they are, twice, and as a view; one computed output."""

    def forward(self, x, y):
        return x, x + y, y.t(), x


@pytest.mark.parametrize("alloc_in,alloc_out", [(True, True), (True, False), (False, True), (False, False)])
def test_inputs_returned_as_outputs_and_views(emu, alloc_in, alloc_out):
    model, inputs = PassThrough(), small()
    config = ferry.CompileConfig(alloc_graph_input=alloc_in, alloc_graph_output=alloc_out)
    part = ferry.OpSupportPartitioner("emu:0", ops=["aten.add"])
    program = compile_checked(torch.export.export(model, inputs), part, config)
    m = program.methods["forward"]
    assert m.outputs[0] == m.outputs[3] == m.inputs[0]
    assert m.values[m.outputs[2]].alias_of == m.inputs[1]
    run_vs_eager(program, model, inputs, seeds=(1, 2, 3))


@pytest.mark.parametrize("h2d,d2h", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("alloc", [True, False])
def test_inputs_outputs_on_device_never_planned(h2d, d2h, alloc):
    config = skip_config(h2d, d2h, alloc_graph_input=alloc, alloc_graph_output=alloc)
    program = compile_checked(exported("add"), ferry.OpSupportPartitioner("cuda:0"), config)
    m = program.methods["forward"]
    ins, outs = [m.values[v] for v in m.inputs], [m.values[v] for v in m.outputs]
    assert all(v.device == (CUDA0 if h2d else CPU) for v in ins)
    assert all(v.device == (CUDA0 if d2h else CPU) for v in outs)
    for v in ins + outs:
        assert (v.plan is not None) == (v.device == CPU and alloc), v
    copies = [i.kernel for i in m.instructions if isinstance(i, KernelCall) and i.kernel in COPY_KERNELS]
    assert copies.count("et_copy::_h2d_copy.out") == (0 if h2d else 2)
    assert copies.count("et_copy::_d2h_copy.out") == (0 if d2h else 1)


def test_skip_flags_run_on_the_emulated_device(emu):
    model, inputs = Add(), small((2, 2))
    program = compile_checked(torch.export.export(model, inputs), ferry.OpSupportPartitioner("emu:0"), skip_config(True, True))
    m = program.methods["forward"]
    assert all(m.values[v].device == EMU0 and m.values[v].plan is None for v in [*m.inputs, *m.outputs])
    run_vs_eager(program, model, inputs)


@pytest.mark.parametrize("name,device", [("transformer", None), ("transformer", "cuda:0"), ("cnn", None)])
def test_greedy_never_larger_than_naive(name, device):
    part = lambda: None if device is None else ferry.OpSupportPartitioner(device)  # noqa: E731
    greedy = compile_checked(exported(name), part())
    naive = compile_checked(exported(name), part(), ferry.CompileConfig(memory_planning="naive"))

    def per_device(p):
        sizes = {}
        for b in p.methods["forward"].buffers[1:]:
            sizes[b.device] = sizes.get(b.device, 0) + b.size
        return sizes

    g, n = per_device(greedy), per_device(naive)
    assert g.keys() == n.keys()
    assert all(g[d] <= n[d] for d in g), (g, n)
    if device is None:  # many intermediates on the CPU: sharing must save memory
        assert g[CPU] < n[CPU]


def test_unknown_planning_algorithm():
    with pytest.raises(ValueError, match="greedy"):
        ferry.compile(exported("add"), None, ferry.CompileConfig(memory_planning="best"))


@pytest.mark.parametrize("alignment", [128, {"cpu": 16, "cuda": 512}, {"default": 32}])
def test_alignment_is_configurable(alignment):
    config = ferry.CompileConfig(alignment=alignment, memory_planning="naive")
    program = compile_checked(exported("add"), ferry.OpSupportPartitioner("cuda:0"), config)
    m = program.methods["forward"]
    offsets = {CPU: [], CUDA0: []}
    for v in m.values:
        if isinstance(v, TensorValue) and v.plan is not None:
            offsets[v.device].append(v.plan.offset)
    for d, offs in offsets.items():
        a = _align_for(alignment, d)
        assert offs and all(o % a == 0 for o in offs)
        assert all(b.size % a == 0 for b in m.buffers[1:] if b.device == d)
    # the 16-byte values are packed as tightly as the alignment allows (not at the 64 default)
    assert sorted(offsets[CPU])[:2] == [0, _align_for(alignment, CPU)]
    with pytest.raises(ValueError, match="power of two"):
        ferry.compile(exported("add"), None, ferry.CompileConfig(alignment=48))


def test_reference_add_method_meta():
    """Reference M: add(2x2, 2x2) on cuda:0 -> 2 planned buffers, CPU then CUDA."""
    for algorithm in ("greedy", "naive"):
        program = compile_checked(exported("add"), ferry.OpSupportPartitioner("cuda:0"),
                                  ferry.CompileConfig(memory_planning=algorithm))
        meta = program.method_meta("forward")
        assert meta.num_memory_planned_buffers() == 2
        assert meta.memory_planned_buffer_device(0) == CPU
        assert meta.memory_planned_buffer_device(1) == CUDA0
        cpu_size, cuda_size = meta.memory_planned_buffer_size(0), meta.memory_planned_buffer_size(1)
        # CUDA: 2 h2d outputs and the delegate output are alive together at the delegate call
        assert cuda_size >= 48
        # CPU: 2 inputs + 1 output (the output may reuse an input slot once that one is dead)
        assert cpu_size >= (48 if algorithm == "naive" else 32)
        m = program.methods["forward"]
        assert m.lower_bounds == {"cpu:0": 32, "cuda:0": 48}
        for bad in (2, -1, True, "0"):
            with pytest.raises(IndexError):
                meta.memory_planned_buffer_size(bad)
            with pytest.raises(IndexError):
                meta.memory_planned_buffer_device(bad)
        assert meta.num_inputs() == 2 and meta.num_outputs() == 1
        im = meta.input_meta(0)
        assert (im.dtype, im.shape, im.device, im.nbytes, im.planned) == (torch.float32, (2, 2), CPU, 16, True)
        assert meta.output_meta(0).device == CPU
        with pytest.raises(IndexError):
            meta.input_meta(2)


@pytest.mark.parametrize("name", ["with_params", "two_linears", "cnn"])
def test_cpu_only_program_has_no_device_buffer(name):
    program = compile_checked(exported(name))
    m = program.methods["forward"]
    assert {b.device for b in m.buffers} == {CPU}
    assert list(m.lower_bounds) == ["cpu:0"]
    meta = program.method_meta("forward")
    assert meta.num_memory_planned_buffers() == 1
    assert meta.memory_planned_buffer_device(0) == CPU
    assert not program.delegates


# ------------------------------------------------------------------ mutable buffers


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.ones(2, 3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.total.mul_(0.5).add_(x)
        self.steps.add_(1)
        return self.total * 2, self.steps + 0


@pytest.mark.parametrize("on_device", [False, True])
def test_mutable_buffers_are_state_kept_between_calls(emu, on_device):
    model = Counter()
    ep = torch.export.export(copy.deepcopy(model), (torch.randn(2, 3),))
    part = ferry.OpSupportPartitioner("emu:0") if on_device else None
    program = compile_checked(ep, part)
    m = program.methods["forward"]
    assert {mb.name for mb in m.mutable_buffers} == {"total", "steps"}
    for mb in m.mutable_buffers:
        v = m.values[mb.value]
        assert v.storage == "state" and v.plan is None and v.constant is not None, "the module's state, initialised from its segment"
        assert m.values[mb.update].shape == v.shape
        init = getattr(model, mb.name)
        assert bytes(program.segments[v.constant]) == init.numpy().tobytes()
    module = ferry.Module(program)
    eager = copy.deepcopy(model)
    for seed in range(4):
        (x,) = fresh_inputs((torch.empty(2, 3),), seed)
        got, want = module.run_method("forward", [x]), eager(x)
        torch.testing.assert_close(got[0], want[0])
        assert int(got[1]) == int(want[1]) == seed + 1
    # a second module (and the loaded copy of the program) starts again from the initial state
    again = ferry.Module(ferry.load_program(program.to_bytes()))
    (x,) = fresh_inputs((torch.empty(2, 3),), 0)
    torch.testing.assert_close(again.run_method("forward", [x])[0], copy.deepcopy(model)(x)[0])


# ------------------------------------------------------------------ dynamic shapes


class Dyn(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.lin(x)) * 2
        return h + 1, h.sum(0)


RESIZE_WARNING = "ignore:An output with one or more elements was resized"  # ATen resizing planned outs


@pytest.mark.filterwarnings(RESIZE_WARNING)
@pytest.mark.parametrize("on_device", [False, True])
def test_bounded_dynamic_dim_is_planned_at_its_bound(emu, on_device):
    model = Dyn().eval()
    ep = torch.export.export(model, (torch.randn(4, 8),), dynamic_shapes=({0: torch.export.Dim("batch", max=16)},))
    program = compile_checked(ep, ferry.OpSupportPartitioner("emu:0") if on_device else None)
    m = program.methods["forward"]
    x = m.values[m.inputs[0]]
    assert x.shape == (16, 8) and x.dynamic == (True, False)
    out0, out1 = (m.values[v] for v in m.outputs)
    assert out0.shape == (16, 4) and out0.dynamic == (True, False)
    assert out1.shape == (4,) and not any(out1.dynamic)
    assert m.buffers[x.plan.buffer].size >= 16 * 8 * 4
    meta = program.method_meta("forward")
    assert meta.input_meta(0).dynamic == (True, False) and meta.input_meta(0).shape == (16, 8)
    module = ferry.Module(program)
    for n in (3, 16, 1, 7):
        x = torch.randn(n, 8)
        got = module.run_method("forward", [x])
        assert got[0].shape == (n, 4)
        assert_like_eager(got, model(x), atol=1e-5, rtol=1e-4)
    with pytest.raises(ferry.InputError, match="<=16"):
        module.run_method("forward", [torch.randn(17, 8)])


class DynView(nn.Module):
    def forward(self, x):
        return (x * 2).t() + 0


@pytest.mark.filterwarnings(RESIZE_WARNING)
def test_view_of_dynamic_value_follows_the_call_shape():
    ep = torch.export.export(DynView(), (torch.randn(4, 8),), dynamic_shapes=({0: torch.export.Dim("b", max=16)},))
    module = ferry.Module(compile_checked(ep))
    x = torch.randn(3, 8)
    (got,) = module.run_method("forward", [x])
    torch.testing.assert_close(got, DynView()(x))


def test_unbounded_dynamic_dim_is_a_compile_error():
    ep = torch.export.export(Dyn(), (torch.randn(4, 8),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    with pytest.raises(ferry.CompileError) as info:
        ferry.compile(ep)
    msg = str(info.value)
    assert "no upper bound" in msg and "torch.export.Dim(" in msg and "max=" in msg


# ------------------------------------------------------------------ compile report


@pytest.mark.parametrize("name,device", [("transformer", None), ("transformer", "cuda:0"), ("multi_output", "cuda:1")])
def test_report_shows_planned_bytes_next_to_lower_bound(name, device):
    program = compile_checked(exported(name), None if device is None else ferry.OpSupportPartitioner(device))
    m = program.methods["forward"]
    text = program_summary(program)
    for dev in {str(b.device) for b in m.buffers[1:]}:
        planned = sum(b.size for b in m.buffers[1:] if str(b.device) == dev)
        lb = m.lower_bounds[dev]
        assert 0 < lb <= planned
        assert f"{dev}: planned {planned:,} B, lower bound (peak live) {lb:,} B" in text
    if device is not None:
        assert set(m.lower_bounds) == {"cpu:0", device}


# ------------------------------------------------------------------ round trip and real models


ROUNDTRIP_MODELS = ["add", "add_chain", "fan_out", "shared_output", "input_to_cpu_and_delegate", "multi_output",
                    "with_params", "two_linears", "cnn", "transformer"]


@pytest.mark.parametrize("name", ROUNDTRIP_MODELS)
def test_models_compile_for_cuda_and_round_trip(name):
    program = compile_checked(exported(name), ferry.OpSupportPartitioner("cuda:0"))
    m = program.methods["forward"]
    assert program.delegates and all(d.spec("target_device") == b"cuda:0" for d in program.delegates)
    assert any(v.device == CUDA0 for v in m.values if isinstance(v, TensorValue))


@pytest.mark.parametrize("name", ROUNDTRIP_MODELS + ["example_cnn", "example_transformer"])
def test_models_run_on_the_emulated_device(emu, name):
    model, inputs = BUILDERS[name]()
    program = compile_checked(exported(name), ferry.OpSupportPartitioner("emu:0"))
    assert any(b.device == EMU0 for b in program.methods["forward"].buffers)
    loaded = ferry.load_program(program.to_bytes())
    run_vs_eager(loaded, model, inputs)
    assert emu.copy_counts["h2d"] > 0 and emu.copy_counts["d2h"] > 0


@pytest.mark.parametrize("name", ["transformer", "example_cnn"])
def test_models_with_some_ops_kept_on_the_cpu(emu, name):
    model, inputs = BUILDERS[name]()
    exclude = ["aten.softmax", "aten.gelu"] if "transformer" in name else ["aten.relu", "aten.max_pool2d"]
    program = compile_checked(exported(name), ferry.OpSupportPartitioner("emu:0", exclude=exclude))
    assert len(program.delegates) >= 2
    run_vs_eager(program, model, inputs)


def test_saved_file_round_trip(emu, tmp_path):
    model, inputs = BUILDERS["two_linears"]()
    program = compile_checked(exported("two_linears"), ferry.OpSupportPartitioner("emu:0", exclude=["aten.relu"]))
    path = tmp_path / "two_linears.ferry"
    program.save(path)
    back = ferry.load_program(path)
    assert back.methods == program.methods and back.delegates == program.delegates
    assert [bytes(s) for s in back.segments] == [bytes(s) for s in program.segments]
    assert path.read_bytes() == program.to_bytes()
    run_vs_eager(ferry.Module(str(path)).program, model, inputs)


def test_multi_gpu_program_keeps_devices_through_a_file(tmp_path):
    program = compile_checked(exported("fan_out"), PerAdd("cuda:1", "cuda:0"))
    path = tmp_path / "p.ferry"
    program.save(str(path))
    back = ferry.load_program(str(path))
    m, b = program.methods["forward"], back.methods["forward"]
    assert [v.device for v in b.values if isinstance(v, TensorValue)] == [
        v.device for v in m.values if isinstance(v, TensorValue)]
    assert [x.device for x in b.buffers] == [CPU, CPU, CUDA0, CUDA1]
    assert [d.spec("target_device") for d in back.delegates] == [b"cuda:1", b"cuda:0", b"cuda:0", b"cuda:0"]


def test_several_methods_in_one_program(emu):
    methods = {"forward": exported("add"), "chain": exported("add_chain")}
    program = ferry.compile(methods, ferry.OpSupportPartitioner("emu:0"))
    check(program)
    assert list(program.methods) == ["forward", "chain"]
    used = [i.delegate for m in program.methods.values() for i in m.instructions if not isinstance(i, KernelCall)]
    assert sorted(used) == list(range(len(program.delegates))), "each delegate belongs to one call"
    module = ferry.Module(program)
    x, y = small()
    torch.testing.assert_close(module.run_method("chain", [x, y])[0], AddChain()(x, y))
    with pytest.raises(ferry.CompileError, match="identifier"):
        ferry.compile({"not a name": exported("add")})


class _Tanh(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x) + 1


class _Scale(torch.nn.Module):
    def forward(self, x):
        return x * 3


def test_an_exclude_matching_one_method_of_several_is_not_a_mistake(emu):
    x = torch.randn(2, 4)
    eps = {"a": torch.export.export(_Tanh(), (x,)), "b": torch.export.export(_Scale(), (x,))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ferry.compile(eps, ferry.OpSupportPartitioner("emu:0", exclude=["aten.tanh"]))
    with pytest.warns(UserWarning, match="exclude='aten.sinh' matches no op") as record:
        ferry.compile(eps, ferry.OpSupportPartitioner("emu:0", exclude=["aten.sinh"]))
    assert sum("matches no op" in str(w.message) for w in record) == 1  # once, not once per method

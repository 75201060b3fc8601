"""End to end on the emulated device: compile -> save -> load -> Module -> run, against eager.

For every model of the compile tests (tests/models.py and the graphs of test_place), placed on
emu:0 / emu:1 instead of CUDA: the results equal eager PyTorch on fresh random inputs, and the
allocator counters during a call show exactly the copies of ``ferry.copy_report`` (count, bytes,
direction, device indices, in instruction order) and no allocation except the per-call
caller-owned device outputs of skip_d2h.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import ferry
from ferry.device import Device
from ferry.program.schema import DelegateCall, TensorValue
from ferry.runtime import clone_to, device_of, emulated_device
from models import (
    Add,
    AddChain,
    ByModulePath,
    FanOut,
    InputToCpuAndDelegate,
    MultiOutput,
    PerAdd,
    RunningSum,
    SharedOutput,
    TwoLinears,
    WithParams,
    fresh_inputs,
    one_per_device,
    skip_config,
    small,
    small_cnn,
    transformer_block,
)

EMU0 = Device("emu", 0)


class Twice(nn.Module):
    def forward(self, x, y):
        s = x + y
        return s, s


class TwoDevices(nn.Module):
    """x read by an add on emu:0 and an add on emu:1 (PerAdd('emu:0', 'emu:1'))."""

    def forward(self, x, y, z):
        return x + y, x + z


class PassThrough(nn.Module):
    """Hands an input straight back as an output."""

    def forward(self, x, y):
        return x + y, x


def emu_all(**kw):
    return lambda: ferry.OpSupportPartitioner("emu:0", **kw)


@dataclass(frozen=True)
class Case:
    build: object  # () -> (model, example inputs)
    partitioner: object  # () -> partitioner or None
    config: object = None
    totals: dict | None = None  # expected {direction: count}, independent of the copy report


def _pair(model_cls, n=2, shape=(2, 3)):
    return lambda: (model_cls(), small(shape=shape, n=n))


CASES = {
    "add": Case(_pair(Add), emu_all(), None, {"h2d": 2, "d2h": 1, "d2d": 0}),
    "add-on-emu1": Case(_pair(Add), lambda: ferry.OpSupportPartitioner("emu:1"), None, {"h2d": 2, "d2h": 1, "d2d": 0}),
    "chain-one-delegate": Case(_pair(AddChain), emu_all(), None, {"h2d": 2, "d2h": 1, "d2d": 0}),
    "chain-same-device": Case(_pair(AddChain), lambda: PerAdd("emu:0"), None, {"h2d": 2, "d2h": 1, "d2d": 0}),
    "chain-cross-device": Case(_pair(AddChain), lambda: PerAdd("emu:0", "emu:1"), None, {"h2d": 3, "d2h": 1, "d2d": 1}),
    "fan-out": Case(_pair(FanOut), lambda: PerAdd("emu:0"), None, {"h2d": 2, "d2h": 1, "d2d": 0}),
    "fan-out-two-devices": Case(_pair(FanOut), lambda: PerAdd("emu:0", "emu:1"), None),
    "output-feeds-delegate-and-cpu-op": Case(_pair(SharedOutput), lambda: PerAdd("emu:0"), None, {"h2d": 2, "d2h": 2, "d2d": 0}),
    "output-feeds-other-device": Case(_pair(SharedOutput), lambda: PerAdd("emu:1", "emu:0"), None, {"h2d": 3, "d2h": 2, "d2d": 1}),
    "returned-twice": Case(_pair(Twice), emu_all(), None, {"h2d": 2, "d2h": 1, "d2d": 0}),
    "multi-output": Case(_pair(MultiOutput), emu_all(exclude=["aten.relu"]), None),
    "params-and-buffer": Case(lambda: (WithParams(), (torch.randn(3, 8),)), emu_all(exclude=["aten.relu"]), None),
    "two-linears-two-devices": Case(lambda: (TwoLinears(), (torch.randn(3, 4),)), lambda: ByModulePath({"a": "emu:0", "b": "emu:1"}), None),
    "mutable-buffer": Case(lambda: (RunningSum(), small(n=1)), emu_all(), None, {"h2d": 1, "d2h": 1, "d2d": 0}),
    "skip-h2d": Case(_pair(Add), emu_all(), skip_config(h2d=True), {"h2d": 0, "d2h": 1, "d2d": 0}),
    "skip-d2h": Case(_pair(Add), emu_all(), skip_config(d2h=True), {"h2d": 2, "d2h": 0, "d2d": 0}),
    "skip-both": Case(_pair(AddChain), lambda: PerAdd("emu:0"), skip_config(True, True), {"h2d": 0, "d2h": 0, "d2d": 0}),
    "skip-both-two-devices": Case(_pair(AddChain), lambda: PerAdd("emu:0", "emu:1"), skip_config(True, True), {"h2d": 0, "d2h": 0, "d2d": 2}),
    "skip-both-input-returned": Case(_pair(PassThrough), emu_all(), skip_config(True, True), {"h2d": 0, "d2h": 0, "d2d": 0}),
    "input-returned": Case(_pair(PassThrough), emu_all(), None, {"h2d": 2, "d2h": 1, "d2d": 0}),
    "skip-h2d-input-read-on-cpu": Case(_pair(InputToCpuAndDelegate), lambda: PerAdd("emu:0"), skip_config(h2d=True), {"h2d": 0, "d2h": 2, "d2d": 0}),
    "skip-h2d-input-on-two-devices": Case(_pair(TwoDevices, n=3), lambda: PerAdd("emu:0", "emu:1"), skip_config(h2d=True), {"h2d": 0, "d2h": 2, "d2d": 1}),
    "skip-d2h-output-read-on-cpu": Case(_pair(SharedOutput), lambda: PerAdd("emu:0"), skip_config(d2h=True), {"h2d": 2, "d2h": 1, "d2d": 0}),
    "skip-h2d-params-absorbed": Case(lambda: (WithParams(), (torch.randn(3, 8),)), emu_all(), skip_config(h2d=True), {"h2d": 0, "d2h": 1, "d2d": 0}),
    "skip-both-mutable-buffer": Case(lambda: (RunningSum(), small(n=1)), emu_all(), skip_config(True, True), {"h2d": 0, "d2h": 0, "d2d": 0}),
    "cnn-relu-on-cpu": Case(small_cnn, emu_all(exclude=["aten.relu"]), None),
    "cnn-all-delegated": Case(small_cnn, emu_all(), None, {"h2d": 1, "d2h": 1, "d2d": 0}),
    "cnn-cpu-only": Case(small_cnn, lambda: None, None, {"h2d": 0, "d2h": 0, "d2d": 0}),
    "transformer-gelu-on-cpu": Case(transformer_block, emu_all(exclude=["aten.gelu"]), None),
    "transformer-all-on-emu1": Case(transformer_block, lambda: ferry.OpSupportPartitioner("emu:1"), None, {"h2d": 1, "d2h": 1, "d2d": 0}),
    "transformer-softmax-on-cpu-skip-both": Case(transformer_block, emu_all(exclude=["aten.softmax"]), skip_config(True, True)),
    "transformer-cpu-only": Case(transformer_block, lambda: None, None, {"h2d": 0, "d2h": 0, "d2d": 0}),
}


_compiled: dict = {}


def compiled(name):
    """(initial eager model, example inputs, program bytes), compiled once per session."""
    if name not in _compiled:
        case = CASES[name]
        model, example = case.build()
        model.eval()
        initial = copy.deepcopy(model)
        registered = ferry.runtime.get_allocator("emu") is not None
        with contextlib.nullcontext() if registered else emulated_device(num_devices=2):  # partitioners name emu devices
            ep = torch.export.export(model, tuple(example))
            program = ferry.compile(ep, case.partitioner(), case.config)
        _compiled[name] = (initial, example, program.to_bytes())
    return _compiled[name]



# ---------------------------------------------------------------------------------------
# helpers


def load_allocations(program, method="forward", buffers=True):
    """(nbytes, index) of every device allocation loading `method` must make, sorted (with
    `buffers` False: the method works in memory its caller planned, only constants)."""
    m = program.method(method)
    recs = [(b.size, b.device.index) for b in m.buffers[1:] if not b.device.is_cpu] if buffers else []
    recs += [
        (v.nbytes, v.device.index)
        for v in m.values
        if isinstance(v, TensorValue) and v.plan is None and v.constant is not None and not v.device.is_cpu
    ]
    for ins in m.instructions:  # a delegate's weights; its working memory is in the method's arena
        if isinstance(ins, DelegateCall):
            nested = ferry.load_program(program.segments[program.delegates[ins.delegate].payload], segments=program.segments)
            recs += load_allocations(nested, buffers=not ins.scratch)
    return sorted(recs)


def per_call_allocations(program, method="forward"):
    """(nbytes, index) of the device outputs a call hands to the caller (skip_d2h), sorted."""
    m = program.method(method)
    vids = {v for v in m.outputs if v not in m.inputs}
    return sorted(
        (m.tensor(v).nbytes, m.tensor(v).device.index) for v in vids if not m.tensor(v).device.is_cpu
    )


def report_records(report):
    """The allocator copy records a call must produce: one per report row, in order."""
    out = []
    for r in report.rows:
        src, dst = Device.parse(r.src), Device.parse(r.dst)
        if r.direction == "h2d":
            out.append(("h2d", r.nbytes, dst.index, None))
        elif r.direction == "d2h":
            out.append(("d2h", r.nbytes, src.index, None))
        else:
            out.append(("d2d", r.nbytes, dst.index, src.index))
    return out


def place_inputs(program, inputs, method="forward"):
    """Caller tensors where the method wants them (skip_h2d inputs go to their device)."""
    meta = program.method_meta(method)
    return [x if meta.input_meta(i).device.is_cpu else clone_to(x, meta.input_meta(i).device) for i, x in enumerate(inputs)]


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def assert_matches(got, want, program, method="forward"):
    got, want = as_tuple(got), as_tuple(want)
    assert len(got) == len(want)
    meta = program.method_meta(method)
    for i, (g, w) in enumerate(zip(got, want)):
        assert device_of(g) == meta.output_meta(i).device, i
        host = g if device_of(g).is_cpu else clone_to(g, "cpu")
        torch.testing.assert_close(host, w, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# every model


@pytest.mark.parametrize("name", list(CASES))
def test_model_runs_like_eager_with_exactly_the_reported_copies(name, emu, tmp_path):
    initial, example, data = compiled(name)
    path = tmp_path / f"{name}.ferry"
    path.write_bytes(data)
    program = ferry.load_program(path)
    report = ferry.copy_report(program, "forward")
    if CASES[name].totals is not None:
        assert {d: n for d, (n, _) in report.totals().items()} == CASES[name].totals
    expected_copies = report_records(report)
    expected_allocs = per_call_allocations(program)
    uses_device = bool(load_allocations(program) or expected_copies or expected_allocs)

    for mode in ("copy", "view"):
        eager = copy.deepcopy(initial)
        mod = ferry.Module(str(path), outputs=mode)
        emu.reset_counters()
        mod.load_method("forward")
        assert sorted((r.nbytes, r.index) for r in emu.allocated) == one_per_device(load_allocations(program))
        after_load = emu.live_bytes
        kept = []
        for seed in range(3):
            inputs = fresh_inputs(example, 1000 * seed + len(name))
            args = place_inputs(program, inputs)
            emu.reset_counters()
            out = mod(*args)
            # exactly the reported copies, in instruction order, with their device indices
            assert emu.copy_summary() == report.totals(), (mode, seed)
            assert [(c.direction, c.nbytes, c.index, c.src_index) for c in emu.copies] == expected_copies
            # no device allocation during execution but the caller-owned device outputs
            assert sorted((r.nbytes, r.index) for r in emu.allocated) == expected_allocs
            assert emu.deallocations == 0 and emu.failed_allocations == 0
            assert_matches(out, eager(*inputs), program)
            kept.append(out)
        if not uses_device:
            assert emu.allocations == 0 and emu.copies == []
        # the module holds none of the caller's device tensors
        del kept, out, args  # plain reference counting frees them: no gc.collect() needed
        assert emu.live_bytes == after_load
        mod.close()
        assert emu.live_bytes == 0


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_model_runs_like_eager_on_an_asynchronous_device(name, graphs, emu_async):
    """The same models on the simulated asynchronous device: device work runs only when the
    host waits, so every result here depends on the host waits being where they must be."""
    initial, example, data = compiled(name)
    program = ferry.load_program(data)
    totals = ferry.copy_report(program, "forward").totals()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # notes about segments run without a graph
        mod = ferry.Module(data, cuda_graphs=graphs)
        mod.load_method("forward")
    after_load, eager = emu_async.live_bytes, copy.deepcopy(initial)
    for seed in range(4):
        inputs = fresh_inputs(example, 1000 * seed + len(name))
        args = place_inputs(program, inputs)
        emu_async.reset_counters()
        out = mod(*args)
        assert emu_async.copy_summary() == totals, seed  # replayed graphs too: exactly the reported copies
        assert_matches(out, eager(*inputs), program)
    del out, args
    assert emu_async.live_bytes == after_load
    mod.close()
    assert emu_async.live_bytes == 0


@pytest.mark.parametrize("name", ["cnn-relu-on-cpu", "transformer-gelu-on-cpu", "chain-cross-device"])
def test_caller_owned_outputs_survive_later_calls(name, emu):
    initial, example, data = compiled(name)
    mod = ferry.Module(data)
    inputs = [fresh_inputs(example, s) for s in range(4)]
    outs = [mod(*x) for x in inputs]
    for x, o in zip(inputs, outs):
        torch.testing.assert_close(o, initial(*x), rtol=1e-5, atol=1e-5)


def test_no_allocation_across_many_calls_after_load(emu):
    initial, example, data = compiled("transformer-gelu-on-cpu")
    mod = ferry.Module(data)
    mod.load_method()
    allocations, live = emu.allocations, emu.live_bytes
    for seed in range(10):
        x = fresh_inputs(example, seed)
        torch.testing.assert_close(mod(*x), initial(*x), rtol=1e-5, atol=1e-5)
    assert emu.allocations == allocations and emu.deallocations == 0 and emu.live_bytes == live


def test_skip_d2h_allocates_exactly_the_outputs_per_call(emu):
    initial, example, data = compiled("skip-d2h-output-read-on-cpu")
    program = ferry.load_program(data)
    per_call = per_call_allocations(program)
    assert per_call == [(24, 0), (24, 0)]  # a and b stay on emu:0; c (relu) is a CPU output
    mod = ferry.Module(program)
    mod.load_method()
    emu.reset_counters()
    outs = []
    for seed in range(4):
        x = fresh_inputs(example, seed)
        outs.append((mod(*x), initial(*x)))
    assert [(r.nbytes, r.index) for r in emu.allocated] == per_call * 4
    assert emu.deallocations == 0
    for got, want in outs:  # all four results intact and distinct
        assert_matches(got, want, program)
    assert len({o[0].data_ptr() for o, _ in outs}) == 4


# ---------------------------------------------------------------------------------------
# two methods: a device hand-off with no host copy


class Projected(nn.Module):
    """`then(h, x)` of h, a Linear(8, 8) of x whose weights come from `seed`."""

    def __init__(self, seed, then):
        super().__init__()
        torch.manual_seed(seed)
        self.proj, self.then = nn.Linear(8, 8), then

    def forward(self, x):
        return self.then(self.proj(x), x)


def prefill_and_decode():
    """The models of two methods: prefill is tanh(W x) + x, decode is (V h) * h."""
    return Projected(1, lambda h, x: torch.tanh(h) + x).eval(), Projected(2, lambda h, x: h * x).eval()


def test_prefill_output_feeds_decode_on_the_device_without_host_copies(emu):
    prefill, decode = prefill_and_decode()
    x0 = torch.randn(2, 8)
    eps = {"prefill": torch.export.export(prefill, (x0,)), "decode": torch.export.export(decode, (prefill(x0),))}
    config = ferry.CompileConfig(
        propagate_device={
            "prefill": ferry.PropagateDeviceConfig(skip_d2h_for_method_outputs=True),
            "decode": ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True),
        }
    )
    program = ferry.load_program(ferry.compile(eps, ferry.OpSupportPartitioner("emu:0"), config).to_bytes())
    pre_report, dec_report = ferry.copy_report(program, "prefill"), ferry.copy_report(program, "decode")
    assert pre_report.totals() == {"h2d": (1, 64), "d2h": (0, 0), "d2d": (0, 0)}  # x in, h stays
    assert dec_report.totals() == {"h2d": (0, 0), "d2h": (1, 64), "d2d": (0, 0)}  # h already there
    assert program.method_meta("prefill").output_meta(0).device == EMU0
    assert program.method_meta("decode").input_meta(0).device == EMU0

    mod = ferry.Module(program)
    mod.load_method("prefill")
    mod.load_method("decode")
    after_load = emu.live_bytes
    results = []
    for seed in range(3):
        (x,) = fresh_inputs((x0,), seed)
        emu.reset_counters()
        (h,) = mod.run_method("prefill", [x])
        assert device_of(h) == EMU0
        assert emu.copies == [ferry.runtime.CopyRecord("h2d", 64, 0)]  # no d2h of h
        assert [(r.nbytes, r.index) for r in emu.allocated] == [(64, 0)]  # h itself, owned by the caller
        emu.reset_counters()
        (y,) = mod.run_method("decode", [h])
        assert emu.copies == [ferry.runtime.CopyRecord("d2h", 64, 0)]  # no h2d of h: only y comes back
        assert emu.allocations == 0
        assert device_of(y) == Device("cpu", 0)
        want_h = prefill(x)
        torch.testing.assert_close(clone_to(h, "cpu"), want_h, rtol=1e-5, atol=1e-5)
        results.append((y, decode(want_h)))
    for y, want in results:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    del h
    gc.collect()
    assert emu.live_bytes == after_load  # the hand-off tensors are gone with the caller's references


def test_two_methods_share_nothing_at_run_time(emu):
    """Running one method does not disturb the other's planned memory."""
    prefill, decode = prefill_and_decode()
    x0 = torch.randn(2, 8)
    program = ferry.compile(
        {"prefill": torch.export.export(prefill, (x0,)), "decode": torch.export.export(decode, (x0.clone(),))},
        ferry.OpSupportPartitioner("emu:0", exclude=["aten.tanh"]),
    )
    mod = ferry.Module(program, outputs="view")
    (a,) = fresh_inputs((x0,), 1)
    (b,) = fresh_inputs((x0,), 2)
    (p,) = mod.run_method("prefill", [a])
    (d,) = mod.run_method("decode", [b])
    torch.testing.assert_close(p, prefill(a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d, decode(b), rtol=1e-5, atol=1e-5)


def test_a_zero_size_input_copies_nothing_and_equals_eager(emu):
    """An empty tensor copied to a device (a review found its h2d copy refused at load: the strides
    of an empty tensor need not look dense)."""
    model = nn.Linear(0, 8).eval()
    module = ferry.Module(ferry.compile(torch.export.export(model, (torch.randn(2, 5, 0),)),
                                        ferry.OpSupportPartitioner("emu:0")))
    for _ in range(2):
        x = torch.randn(2, 5, 0)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x))


class TokenEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(10, 4)

    def forward(self, ids):
        return self.e(ids) * 2


@pytest.mark.parametrize("placement", ["cpu", "emu"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_kernel_refusing_a_later_calls_values_is_a_program_error_and_the_module_stays_usable(emu, placement,
                                                                                              dynamic):
    """A token id out of range: on the first call at a shape the labelled first run said so as a
    ProgramError; a later call ran the bare steps and let the kernel's IndexError out."""
    torch.manual_seed(0)
    model = TokenEmbedding().eval()
    dims = ({0: torch.export.Dim("b", max=8)},) if dynamic else None
    ep = torch.export.export(model, (torch.randint(0, 10, (4, 3)),), dynamic_shapes=dims)
    module = ferry.Module(ferry.compile(ep, None if placement == "cpu" else ferry.OpSupportPartitioner("emu:0")))
    for k in range(5):
        ids = torch.randint(0, 10, (4, 3))
        if k % 2:
            ids[1, 1] = 12
            with pytest.raises(ferry.ProgramError, match=r"aten::embedding.* refused the program's values: IndexError"):
                module(ids)
        else:
            torch.testing.assert_close(module(ids), model(ids))


@pytest.mark.parametrize("options", [{}, {"cuda_graphs": True}, {"shape_buckets": [2, 8]}])
def test_a_kernel_refusing_its_values_on_an_asynchronous_device_leaves_no_work_queued(emu_async, options):
    """There the kernel raises when the host waits for it, mid-queue: the rest of the failed call's
    work is dropped, so the next call does not run behind it (with buckets every later call failed)."""
    torch.manual_seed(0)
    model = TokenEmbedding().eval()
    ep = torch.export.export(model, (torch.randint(0, 10, (4, 3)),),
                             dynamic_shapes=({0: torch.export.Dim("b", max=8)},))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0")), **options)
    for k, (n, bad) in enumerate([(3, False), (3, False), (5, True), (5, False), (3, False), (3, False)]):
        ids = torch.randint(0, 10, (n, 3))
        if bad:
            ids[1, 1] = 12
            with pytest.raises(ferry.ProgramError, match="refused the program's values: IndexError"):
                module(ids)
        else:
            torch.testing.assert_close(module(ids), model(ids), msg=f"call {k}")
        assert not [item for s in emu_async.streams_api()._streams for item in s.queue if item[0] == "run"]

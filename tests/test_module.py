"""ferry.Module: load (planned buffers per device, all or nothing), run, inputs, outputs, state.

Everything runs on the emulated device, whose counters show exactly what the runtime asked
the allocator for. Results are always compared with eager PyTorch on fresh random inputs.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import ferry
from ferry.device import CPU, Device
from ferry.errors import AllocationError, DeviceError, FerryError, InputError
from ferry.program.schema import DelegateCall, TensorValue
from ferry.runtime import clone_to, device_of, emulated_device
from ferry.runtime.stages import module as module_stage
from models import Add, WithParams, export, fresh_inputs, one_per_device, small_cnn

EMU0 = Device("emu", 0)
SKIP_H2D = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True))
SKIP_D2H = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(skip_d2h_for_method_outputs=True))



def device_buffers_and_constants(program, method="forward"):
    """(buffers, constants): (nbytes, index) of the non-CPU planned buffers and of the device
    constants of `method`, its delegate payloads included (the torch backend's payload is
    itself a ferry program, loaded as a nested method)."""
    m = program.method(method)
    buffers = [(b.size, b.device.index) for b in m.buffers[1:] if not b.device.is_cpu]
    constants = [
        (v.nbytes, v.device.index)
        for v in m.values
        if isinstance(v, TensorValue) and v.plan is None and v.constant is not None and not v.device.is_cpu
    ]
    for d in sorted({i.delegate for i in m.instructions if isinstance(i, DelegateCall)}):
        b, c = device_buffers_and_constants(ferry.load_program(program.segments[program.delegates[d].payload],
                                                                   segments=program.segments))
        buffers += b
        constants += c
    return buffers, constants


def load_allocations(program, method="forward"):
    """(nbytes, index) of every device allocation loading `method` must make, sorted: one per
    non-CPU planned buffer and one per device constant."""
    buffers, constants = device_buffers_and_constants(program, method)
    return sorted(buffers + constants)


def roundtrip(program):
    return ferry.load_program(program.to_bytes())


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def cnn():
    model, example = small_cnn()
    return model, example, export(model, example)


# ---------------------------------------------------------------------------------------
# constructing a Module


def test_module_from_program_path_str_and_bytes(emu, tmp_path):
    x, y = fresh_inputs((torch.empty(2, 3), torch.empty(2, 3)), 1)
    program = ferry.compile(export(Add(), (x, y)), ferry.OpSupportPartitioner("emu:0"))
    path = tmp_path / "add.ferry"
    program.save(path)
    for seed, source in enumerate((program, path, str(path), path.read_bytes())):
        mod = ferry.Module(source)
        assert mod.method_names() == ["forward"]
        a, b = fresh_inputs((x, y), 10 + seed)
        assert torch.equal(mod(a, b), a + b)
        mod.close()


def test_bad_outputs_mode_is_rejected(emu):
    program = ferry.compile(export(Add(), fresh_inputs((torch.empty(2),) * 2)))
    with pytest.raises(ValueError, match="outputs"):
        ferry.Module(program, outputs="borrow")


def test_constructing_does_not_allocate_load_does(emu):
    program = roundtrip(ferry.compile(export(Add(), fresh_inputs((torch.empty(2, 2),) * 2)), ferry.OpSupportPartitioner("emu:0")))
    mod = ferry.Module(program)
    assert emu.allocations == 0
    mod.load_method("forward")
    assert emu.allocations == 1
    mod.load_method("forward")  # already loaded: nothing more
    assert emu.allocations == 1


# ---------------------------------------------------------------------------------------
# load_method: planned buffers on their device


def test_add_program_allocates_its_one_device_buffer_at_load(emu):
    """Reference M: the device buffer is allocated once, at load, with the planned size and index."""
    program = roundtrip(ferry.compile(export(Add(), fresh_inputs((torch.empty(2, 2),) * 2)), ferry.OpSupportPartitioner("emu:0")))
    meta = program.method_meta("forward")
    assert meta.num_memory_planned_buffers() == 2
    assert meta.memory_planned_buffer_device(0) == CPU
    assert meta.memory_planned_buffer_device(1) == EMU0
    mod = ferry.Module(program)
    mod.load_method()
    assert [(r.nbytes, r.index) for r in emu.allocated] == [(meta.memory_planned_buffer_size(1), 0)]
    assert emu.live_bytes == meta.memory_planned_buffer_size(1)
    assert emu.copies == []  # no constants to upload


@pytest.mark.parametrize("exclude", [[], ["aten.relu"]])
def test_load_allocates_every_device_buffer_and_device_constant(emu, cnn, exclude):
    model, example, ep = cnn
    program = roundtrip(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0", exclude=exclude)))
    expected = load_allocations(program)
    assert len(expected) > 1
    mod = ferry.Module(program)
    mod.load_method()
    # one allocation per device, each piece in it aligned (runtime/devices/slab.py)
    assert sorted((r.nbytes, r.index) for r in emu.allocated) == one_per_device(expected)
    assert emu.live_bytes == sum(n for n, _ in one_per_device(expected))
    # constants are uploaded once, at load, one host-to-device copy each (no other copy)
    _, constants = device_buffers_and_constants(program)
    uploaded = [n for n, _ in constants if n]
    assert len(uploaded) > 0
    assert emu.copy_summary() == {"h2d": (len(uploaded), sum(uploaded)), "d2h": (0, 0), "d2d": (0, 0)}
    x = fresh_inputs(example, 5)
    assert close(mod(*x), model(*x))


def test_cpu_only_program_never_touches_the_device_allocator(emu, cnn):
    model, example, ep = cnn
    program = roundtrip(ferry.compile(ep))  # no partitioner
    meta = program.method_meta("forward")
    assert all(meta.memory_planned_buffer_device(i) == CPU for i in range(meta.num_memory_planned_buffers()))
    mod = ferry.Module(program)
    for seed in range(3):
        x = fresh_inputs(example, seed)
        assert close(mod(*x), model(*x))
    mod.close()
    assert emu.allocations == emu.deallocations == 0
    assert emu.copies == [] and emu.failed_allocations == 0


def test_cpu_delegate_without_target_device_never_touches_the_device_allocator(emu):
    """A partition with no target_device compile spec runs on the CPU: no copies, no device memory."""

    class Everything:
        def partition(self, ep):
            return [ferry.Partition([n.name for n in ep.graph.nodes if n.op == "call_function"])]

    model = WithParams().eval()
    x0 = torch.randn(3, 8)
    program = roundtrip(ferry.compile(export(model, (x0,)), Everything()))
    assert len(program.delegates) == 1
    mod = ferry.Module(program)
    for seed in range(2):
        (x,) = fresh_inputs((x0,), seed)
        assert close(mod(x), model(x))
    assert emu.allocations == 0 and emu.copies == []


def test_cpu_only_program_runs_with_no_allocator_registered(cnn):
    model, example, ep = cnn
    assert ferry.runtime.get_allocator("emu") is None
    mod = ferry.Module(roundtrip(ferry.compile(ep)))
    x = fresh_inputs(example, 11)
    assert close(mod(*x), model(*x))


def test_device_program_without_its_allocator_is_a_device_error():
    with emulated_device():
        data = ferry.compile(export(Add(), fresh_inputs((torch.empty(2),) * 2)), ferry.OpSupportPartitioner("emu:0")).to_bytes()
    mod = ferry.Module(data)
    with pytest.raises(DeviceError, match="'emu'"):
        mod.load_method()
    with emulated_device() as emu:  # once it is registered, the same module loads and runs
        x, y = fresh_inputs((torch.empty(2),) * 2, 3)
        assert torch.equal(mod(x, y), x + y)
        assert emu.allocations == 1


def test_a_failed_reservation_loads_piece_by_piece(emu, cnn):
    """The load's one allocation per device failing (fragmented memory) is no error: each piece
    is then allocated on its own."""
    model, example, ep = cnn
    program = roundtrip(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0", exclude=["aten.relu"])))
    pieces = load_allocations(program)
    assert len(one_per_device(pieces)) == 1 and len(pieces) >= 3
    mod = ferry.Module(program)
    emu.fail_allocation(1)
    mod.load_method()
    assert emu.failed_allocations == 1 and emu.live_allocations == len(pieces)
    x = fresh_inputs(example, 1)
    assert close(mod(*x), model(*x))
    mod.close()
    assert emu.live_bytes == 0


def test_every_failed_allocation_during_load_frees_everything(emu, cnn, monkeypatch):
    """With nothing reserved (every piece an allocation of its own, as those past a short
    prediction, or all of them when the reservation failed), each of them."""
    model, example, ep = cnn
    program = roundtrip(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0", exclude=["aten.relu"])))
    monkeypatch.setattr(module_stage, "load_pieces", lambda *args: [])
    n = len(load_allocations(program))
    assert n >= 3
    for k in range(1, n + 1):
        mod = ferry.Module(program)
        emu.reset_counters()
        emu.fail_allocation(k)
        with pytest.raises(AllocationError, match="emu:0") as info:
            mod.load_method()
        assert isinstance(info.value, FerryError)
        assert emu.failed_allocations == 1
        assert emu.allocations == k - 1 == emu.deallocations, k
        assert emu.live_bytes == 0 and emu.live_allocations == 0, k
        # the failures have stopped: the same module loads and runs
        x = fresh_inputs(example, k)
        assert close(mod(*x), model(*x)), k
        assert emu.allocations == k - 1 + n
        mod.close()
        assert emu.live_bytes == 0


def test_failed_constant_upload_during_load_frees_everything(emu):
    model = WithParams().eval()
    x0 = torch.randn(2, 8)
    program = roundtrip(ferry.compile(export(model, (x0,)), ferry.OpSupportPartitioner("emu:0")))
    mod = ferry.Module(program)
    emu.fail_copy(1)
    with pytest.raises(DeviceError):
        mod.load_method()
    assert emu.live_bytes == 0 and emu.allocations == emu.deallocations > 0
    (x,) = fresh_inputs((x0,), 4)
    assert close(mod(x), model(x))


def test_failed_load_of_a_second_method_keeps_the_first(emu):
    x0 = torch.randn(2, 3)
    program = roundtrip(
        ferry.compile({"a": export(Add(), (x0, x0.clone())), "b": export(Add(), (x0, x0.clone()))}, ferry.OpSupportPartitioner("emu:0"))
    )
    mod = ferry.Module(program)
    mod.load_method("a")
    live = emu.live_bytes
    emu.capacity = live  # the device is full
    with pytest.raises(AllocationError):
        mod.load_method("b")
    assert emu.live_bytes == live
    emu.capacity = None
    x, y = fresh_inputs((x0, x0), 8)
    assert torch.equal(mod.run_method("a", [x, y])[0], x + y)
    assert torch.equal(mod.run_method("b", [y, x])[0], x + y)


def test_unknown_backend_at_load_frees_everything(emu):
    import dataclasses

    x0 = torch.randn(2, 3)
    program = roundtrip(ferry.compile(export(Add(), (x0, x0.clone())), ferry.OpSupportPartitioner("emu:0")))
    good = program.delegates[0]
    program.delegates[0] = dataclasses.replace(good, backend_id="no-such-backend")
    mod = ferry.Module(program)
    with pytest.raises(ferry.BackendError, match="no-such-backend"):
        mod.load_method()
    # refused while checking the delegate calls, before anything was allocated
    assert emu.allocations == emu.deallocations and emu.live_bytes == 0
    program.delegates[0] = good  # fixed: the same module loads and runs
    x, y = fresh_inputs((x0, x0), 3)
    assert torch.equal(mod(x, y), x + y)


def test_only_a_declared_backend_is_registered(monkeypatch):
    """A backend says what it can do by subclassing ferry.backends.Backend (its defaults say "no");
    an object that merely has the methods is refused."""
    from ferry import backend_registry
    from ferry.backends import Backend, register_backend, registered_backends

    monkeypatch.setattr(backend_registry, "_backends", dict(backend_registry._backends))

    class Undeclared:
        backend_id = "undeclared"

        def preprocess(self, lowered, options, range_constraints=None):
            return b""

        def init(self, payload, compile_specs, **kwargs):
            raise AssertionError("never loaded")

    with pytest.raises(TypeError, match="not a ferry backend"):
        register_backend(Undeclared())
    assert "undeclared" not in registered_backends()

    class Declared(Backend):
        backend_id = "declared"

    register_backend(Declared())
    assert "declared" in registered_backends()
    assert not Declared.returns_outputs and Declared().memory_needs(b"") == [] and Declared().load_bytes(b"", True) == {}


def test_a_backend_whose_init_returns_no_delegate_handle_is_a_backend_error(emu, monkeypatch):
    """What init returns must declare what a handle can do (ferry.backends.DelegateHandle): an
    object with an execute of its own is refused at load with a ferry error, not called."""
    import dataclasses

    from ferry import backend_registry
    from ferry.backends import Backend, register_backend

    monkeypatch.setattr(backend_registry, "_backends", dict(backend_registry._backends))
    executed = []

    class Undeclared:
        def execute(self, inputs, outputs):
            executed.append(1)

        def close(self):
            pass

    class Bare(Backend):
        backend_id = "bare"

        def init(self, payload, compile_specs, **kwargs):
            return Undeclared()

    register_backend(Bare())
    x0 = torch.randn(2, 3)
    program = roundtrip(ferry.compile(export(Add(), (x0, x0.clone())), ferry.OpSupportPartitioner("emu:0")))
    program.delegates[0] = dataclasses.replace(program.delegates[0], backend_id="bare")
    mod = ferry.Module(program)
    with pytest.raises(ferry.BackendError, match="not a ferry.backends.DelegateHandle"):
        mod.load_method()
    assert executed == [] and emu.live_bytes == 0


def test_failure_during_execute_frees_the_call_and_the_module_stays_usable(emu):
    """A copy fails mid-call: a ferry error, this call's device outputs are freed, the next call works."""
    x0 = torch.randn(2, 3)

    class Two(nn.Module):
        def forward(self, x, y):
            a = x + y
            return a, torch.relu(a)

    program = roundtrip(ferry.compile(export(Two(), (x0, x0.clone())), ferry.OpSupportPartitioner("emu:0", exclude=["aten.relu"]), SKIP_D2H))
    mod = ferry.Module(program)
    mod.load_method()
    live = emu.live_bytes
    x, y = fresh_inputs((x0, x0), 1)
    emu.fail_copy(2)  # the second h2d of the call
    with pytest.raises(DeviceError, match="injected"):
        mod(x, y)
    assert emu.live_bytes == live  # the per-call device output of the failed call is gone
    x, y = fresh_inputs((x0, x0), 2)
    a, r = mod(x, y)
    assert device_of(a) == EMU0 and device_of(r) == CPU
    assert torch.equal(clone_to(a, "cpu"), x + y) and torch.equal(r, torch.relu(x + y))


def test_close_frees_device_memory_and_the_module_reloads(emu):
    x0 = torch.randn(4)
    program = roundtrip(ferry.compile(export(Add(), (x0, x0.clone())), ferry.OpSupportPartitioner("emu:0")))
    mod = ferry.Module(program)
    mod.load_method()
    assert emu.live_bytes > 0
    mod.close()
    assert emu.live_bytes == 0 and emu.allocations == emu.deallocations == 1
    x, y = fresh_inputs((x0, x0), 2)
    assert torch.equal(mod(x, y), x + y)
    assert emu.allocations == 2
    del mod
    gc.collect()
    assert emu.live_bytes == 0 and emu.deallocations == 2


# ---------------------------------------------------------------------------------------
# forward / run_method / method_meta


def test_forward_and_run_method_agree(emu):
    class TwoOut(nn.Module):
        def forward(self, x, y):
            s = x + y
            return s, torch.relu(s) * y

    x0 = torch.randn(3, 4)
    model = TwoOut()
    program = roundtrip(ferry.compile(export(model, (x0, x0.clone())), ferry.OpSupportPartitioner("emu:0", exclude=["aten.relu"])))
    mod = ferry.Module(program)
    x, y = fresh_inputs((x0, x0), 21)
    got = mod(x, y)
    assert isinstance(got, tuple) and len(got) == 2
    listed = mod.run_method("forward", (x, y))
    assert isinstance(listed, list) and len(listed) == 2
    for a, b, r in zip(got, listed, model(x, y)):
        assert close(a, r) and torch.equal(a, b)
    with pytest.raises(ferry.UnknownMethodError, match="nope"):
        mod.run_method("nope", [x, y])


def test_method_meta(emu, cnn):
    model, example, ep = cnn
    program = roundtrip(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0", exclude=["aten.relu"])))
    mod = ferry.Module(program)
    meta = mod.method_meta("forward")
    method = program.method("forward")
    n = meta.num_memory_planned_buffers()
    assert n == len(method.buffers) - 1 == 2
    assert [meta.memory_planned_buffer_device(i) for i in range(n)] == [CPU, EMU0]
    assert all(meta.memory_planned_buffer_size(i) > 0 for i in range(n))
    assert meta.num_inputs() == 1 and meta.num_outputs() == 1
    inp, out = meta.input_meta(0), meta.output_meta(0)
    assert (inp.dtype, inp.shape, inp.device, inp.nbytes) == (torch.float32, tuple(example[0].shape), CPU, example[0].numel() * 4)
    y = model(*example)
    assert (out.dtype, out.shape, out.device, out.nbytes) == (torch.float32, tuple(y.shape), CPU, y.numel() * 4)
    assert inp.planned and out.planned
    for bad in (n, -1, 99):
        with pytest.raises(IndexError):
            meta.memory_planned_buffer_size(bad)
        with pytest.raises(IndexError):
            meta.memory_planned_buffer_device(bad)
    with pytest.raises(IndexError):
        meta.input_meta(1)
    with pytest.raises(IndexError):
        meta.output_meta(1)
    # method_meta needs no load, and the planned sizes are what load allocates (in one allocation)
    assert emu.allocations == 0
    mod.load_method()
    assert (meta.memory_planned_buffer_size(1), 0) in load_allocations(program)
    assert [(r.nbytes, r.index) for r in emu.allocated] == one_per_device(load_allocations(program))


def test_method_meta_of_skip_flags_places_inputs_and_outputs_on_the_device(emu):
    x0 = torch.randn(2, 3)
    cfg = ferry.CompileConfig(
        propagate_device=ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)
    )
    meta = ferry.compile(export(Add(), (x0, x0.clone())), ferry.OpSupportPartitioner("emu:0"), cfg).method_meta("forward")
    for m in (meta.input_meta(0), meta.input_meta(1), meta.output_meta(0)):
        assert m.device == EMU0 and not m.planned and m.shape == (2, 3)


# ---------------------------------------------------------------------------------------
# input checks


@pytest.fixture
def add_module(emu):
    x0 = torch.randn(2, 3)
    program = roundtrip(ferry.compile(export(Add(), (x0, x0.clone())), ferry.OpSupportPartitioner("emu:0")))
    mod = ferry.Module(program)
    mod.load_method()
    return mod


def assert_usable(mod, emu, seed, on=None):
    x, y = fresh_inputs((torch.empty(2, 3),) * 2, seed)
    args = (x, y) if on is None else (clone_to(x, on), clone_to(y, on))
    out = mod(*args)
    assert torch.equal(out, x + y)


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda x, y: (x,), "takes 2 inputs, got 1"),
        (lambda x, y: (x, y, x), "takes 2 inputs, got 3"),
        (lambda x, y: (x, y.double()), "float32"),
        (lambda x, y: (x.to(torch.int64), y), "float32"),
        (lambda x, y: (x, y[:1]), "shape"),
        (lambda x, y: (x.reshape(3, 2), y), "shape"),
        (lambda x, y: (x.reshape(-1), y), "shape"),
        (lambda x, y: (x, y.numpy()), "torch.Tensor"),
        (lambda x, y: (x, 1.0), "torch.Tensor"),
        (lambda x, y: (x, clone_to(y, "emu:0")), "cpu:0"),
    ],
    ids=["too-few", "too-many", "dtype-f64", "dtype-i64", "shape-rows", "shape-transposed", "shape-rank", "numpy",
         "scalar", "device"],
)
def test_bad_inputs_raise_input_error_and_the_module_stays_usable(emu, add_module, make_args, message):
    x, y = fresh_inputs((torch.empty(2, 3),) * 2, 30)
    args = make_args(x, y)
    emu.reset_counters()
    with pytest.raises(InputError, match=message):
        add_module(*args)
    assert emu.copies == []  # checked before anything ran
    assert_usable(add_module, emu, 31)


def test_skip_h2d_input_must_be_on_its_device(emu):
    x0 = torch.randn(2, 3)
    program = roundtrip(ferry.compile(export(Add(), (x0, x0.clone())), ferry.OpSupportPartitioner("emu:0"), SKIP_H2D))
    assert program.method_meta("forward").input_meta(0).device == EMU0
    mod = ferry.Module(program)
    x, y = fresh_inputs((x0, x0), 40)
    bad_calls = [
        (x, clone_to(y, "emu:0")),  # a CPU tensor where emu:0 is planned
        (clone_to(x, "emu:0"), clone_to(y, "emu:1")),  # the right type, the wrong index
        (clone_to(x, "emu:0"), clone_to(y, "emu:0").double()),  # .double() of host-backed memory is host memory
    ]
    for args in bad_calls:
        emu.reset_counters()
        with pytest.raises(InputError):
            mod(*args)
        assert emu.copies == []
        assert_usable(mod, emu, 41, on="emu:0")
    with pytest.raises(InputError, match="skip_h2d"):
        mod(x, y)
    # a correct call after the errors: no host-to-device copy of the caller's tensors
    a, b = fresh_inputs((x0, x0), 42)
    da, db = clone_to(a, "emu:0"), clone_to(b, "emu:0")
    emu.reset_counters()
    assert torch.equal(mod(da, db), a + b)
    assert emu.copy_summary() == {"h2d": (0, 0), "d2h": (1, 24), "d2d": (0, 0)}


# ---------------------------------------------------------------------------------------
# outputs: caller-owned copies, views, device outputs


@pytest.mark.parametrize("partitioned", [False, True])
def test_outputs_are_caller_owned_by_default(emu, cnn, partitioned):
    model, example, ep = cnn
    part = ferry.OpSupportPartitioner("emu:0", exclude=["aten.relu"]) if partitioned else None
    mod = ferry.Module(roundtrip(ferry.compile(ep, part)))
    xs = [fresh_inputs(example, s) for s in range(3)]
    outs = [mod(*x) for x in xs]
    assert len({o.data_ptr() for o in outs}) == 3
    for x, o in zip(xs, outs):  # none was overwritten by a later call
        assert close(o, model(*x))
        assert device_of(o) == CPU


@pytest.mark.parametrize("partitioned", [False, True])
def test_view_outputs_are_zero_copy_views_valid_until_the_next_call(emu, cnn, partitioned):
    model, example, ep = cnn
    part = ferry.OpSupportPartitioner("emu:0", exclude=["aten.relu"]) if partitioned else None
    mod = ferry.Module(roundtrip(ferry.compile(ep, part)), outputs="view")
    x1, x2 = fresh_inputs(example, 1), fresh_inputs(example, 2)
    y1 = mod(*x1)
    assert close(y1, model(*x1))
    y2 = mod(*x2)
    assert close(y2, model(*x2))
    assert y1.data_ptr() == y2.data_ptr()  # the same planned memory each call
    assert torch.equal(y1, y2)  # so the first view now shows the second result


class ReturnsConstant(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.register_buffer("w", torch.randn(2, 3))

    def forward(self, x):
        return x + self.w, self.w, self.w.t()


@pytest.mark.parametrize("mode", ["copy", "view"])
def test_outputs_that_are_constants_never_expose_the_program_file(emu, tmp_path, mode):
    """The program's constants live in a read-only file mapping: returning them as views would let
    the caller write into it (a crash) or change the program for every later call."""
    model = ReturnsConstant()
    x0 = torch.randn(2, 3)
    path = tmp_path / "const.ferry"
    ferry.compile(export(model, (x0,))).save(path)
    mod = ferry.Module(path, outputs=mode)
    x1, x2 = fresh_inputs((x0,), 1), fresh_inputs((x0,), 2)
    first = mod(*x1)
    second = mod(*x2)
    if mode == "view":
        assert first[0].data_ptr() == second[0].data_ptr()  # planned memory: a view
    for i in (1, 2):  # constants: a fresh tensor each call (checked before writing into one)
        assert first[i].data_ptr() != second[i].data_ptr()
    first[1].add_(100.0)
    first[2].mul_(-1.0)
    for got, want in zip(mod(*x1), model(*x1)):
        assert torch.equal(got, want)


def test_skip_d2h_outputs_are_caller_owned_device_tensors(emu):
    x0 = torch.randn(2, 3)
    program = roundtrip(ferry.compile(export(Add(), (x0, x0.clone())), ferry.OpSupportPartitioner("emu:0"), SKIP_D2H))
    assert program.method_meta("forward").output_meta(0).device == EMU0
    for mode in ("copy", "view"):
        mod = ferry.Module(program, outputs=mode)
        mod.load_method()
        base_allocs, base_live = emu.allocations, emu.live_bytes
        emu.reset_counters()
        results = []
        for seed in range(3):
            x, y = fresh_inputs((x0, x0), seed)
            out = mod(x, y)
            assert device_of(out) == EMU0
            results.append((out, x + y))
        assert emu.copy_summary() == {"h2d": (6, 144), "d2h": (0, 0), "d2d": (0, 0)}
        assert [(r.nbytes, r.index) for r in emu.allocated] == [(24, 0)] * 3  # one per call: the output
        assert len({o.data_ptr() for o, _ in results}) == 3
        emu.reset_counters()
        for out, ref in results:  # still intact: the caller owns them
            assert torch.equal(clone_to(out, "cpu"), ref)
        assert emu.copy_summary()["d2h"] == (3, 72)
        # dropping them frees their device memory: the module keeps no reference
        del results, out
        gc.collect()
        assert emu.live_bytes == base_live
        mod.close()
        assert base_allocs == 1


# ---------------------------------------------------------------------------------------
# mutable buffers


class Counter(nn.Module):
    """A buffer updated in forward: a call counter and a running sum of the inputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(1))
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.calls.add_(1)
        self.total.add_(x.sum(0))
        return self.lin(x) * self.calls + self.total


@pytest.mark.parametrize("partitioned", [False, True])
def test_mutable_buffers_persist_between_calls_and_match_eager(emu, partitioned):
    model = Counter()
    x0 = torch.randn(3, 4)
    ep = export(copy.deepcopy(model), (x0,))
    part = ferry.OpSupportPartitioner("emu:0") if partitioned else None
    program = roundtrip(ferry.compile(ep, part))
    assert {mb.name for mb in program.method("forward").mutable_buffers} == {"calls", "total"}
    mod = ferry.Module(program)
    eager = copy.deepcopy(model)
    for seed in range(5):
        (x,) = fresh_inputs((x0,), 100 + seed)
        assert close(mod(x), eager(x)), seed
    assert eager.calls.item() == 5
    # a second module of the same program starts from the initial state
    other = ferry.Module(program)
    fresh = copy.deepcopy(model)
    (x,) = fresh_inputs((x0,), 200)
    assert close(other(x), fresh(x))
    (x,) = fresh_inputs((x0,), 201)
    assert close(mod(x), eager(x))
    if partitioned:
        assert emu.allocations > 0
    else:
        assert emu.allocations == 0 and emu.copies == []


def test_mutable_buffers_survive_a_rejected_call(emu):
    model = Counter()
    x0 = torch.randn(3, 4)
    mod = ferry.Module(roundtrip(ferry.compile(export(copy.deepcopy(model), (x0,)), ferry.OpSupportPartitioner("emu:0"))))
    eager = copy.deepcopy(model)
    (x,) = fresh_inputs((x0,), 1)
    assert close(mod(x), eager(x))
    with pytest.raises(InputError):
        mod(x.double())
    (x,) = fresh_inputs((x0,), 2)
    assert close(mod(x), eager(x))


class _InputViewAndProduct(torch.nn.Module):
    def forward(self, x, w):
        return x, x * w, w.t()


class _OneDelegate:
    def partition(self, ep):
        nodes = [n.name for n in ep.graph.nodes if n.op == "call_function"]
        return [ferry.Partition(nodes, ferry.target_device("emu:0"))]


def test_delegate_outputs_that_are_inputs_or_views_reach_the_caller():
    """A delegate bound once to planned tensors still hands back outputs it does not compute."""
    with emulated_device():
        x0, w0 = torch.randn(3, 3), torch.randn(3, 3)
        program = ferry.compile(torch.export.export(_InputViewAndProduct(), (x0, w0)), _OneDelegate())
        module = ferry.Module(program)
        for _ in range(3):
            x, w = torch.randn(3, 3), torch.randn(3, 3)
            for got, want in zip(module(x, w), _InputViewAndProduct()(x, w)):
                assert torch.equal(got, want)


def _bad_inputs():
    yield "meta", torch.empty(2, 3, device="meta"), "meta tensor"
    yield "sparse", torch.randn(2, 3).to_sparse(), "sparse_coo tensor"
    yield "neg", torch.randn(2, 3)._neg_view(), "negated view"
    yield "conj", torch.randn(2, 3, dtype=torch.complex64).conj(), "conjugate"
    yield "grad", torch.randn(2, 3, requires_grad=True), "requires grad"
    yield "complex", torch.randn(2, 3, dtype=torch.complex64), "must be float32"
    yield "int", torch.ones(2, 3, dtype=torch.int64), "must be float32"


@pytest.mark.parametrize("name, bad, message", list(_bad_inputs()), ids=[n for n, *_ in _bad_inputs()])
def test_every_input_mistake_is_an_input_error(name, bad, message):
    class AddPair(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    module = ferry.Module(ferry.compile(torch.export.export(AddPair(), (torch.randn(2, 3), torch.randn(2, 3)))))
    with pytest.raises(ferry.InputError, match=message):
        module(bad, torch.randn(2, 3))
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(module(x, y), x + y)  # the module is still usable


def test_nested_and_quantized_inputs_are_input_errors():
    class Twice(torch.nn.Module):
        def forward(self, x):
            return x * 2

    module = ferry.Module(ferry.compile(torch.export.export(Twice(), (torch.randn(3),))))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prototype and deprecation notices of these tensor kinds
        nested = torch.nested.nested_tensor([torch.randn(3), torch.randn(3)])
        quantized = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)
    for bad, message in ((nested, "nested"), (quantized, "quantized")):
        with pytest.raises(ferry.InputError, match=message):
            module(bad)


def test_the_fast_input_check_accepts_only_what_the_full_check_accepts():
    """Fixed-shape CUDA inputs are checked by a few comparisons per call (runtime/stages/method.py);
    anything unusual falls through to the full check and its clear errors."""
    from ferry.runtime.stages.method import _is_expected  # internal: the fast check is what this compares with the full one

    where, shape = torch.device("cpu"), torch.Size([2, 3])
    t = torch.randn(2, 3)
    assert _is_expected(t, where, torch.float32, shape)
    complex_t = torch.randn(2, 3, dtype=torch.complex64)
    nested = torch.nested.nested_tensor([torch.randn(3), torch.randn(3)])
    for bad, dtype in ((t.double(), torch.float32), (torch.randn(3, 2), torch.float32),
                       (torch.randn(2, 3, requires_grad=True), torch.float32),
                       (torch.nn.Parameter(torch.randn(2, 3)), torch.float32),
                       (complex_t.conj(), torch.complex64), (nested, torch.float32),
                       (t.to_sparse(), torch.float32), (t.to("meta"), torch.float32),
                       (torch.quantize_per_tensor(t, 0.1, 0, torch.qint8), torch.qint8)):
        assert not _is_expected(bad, where, dtype, shape), bad


def test_closing_while_other_threads_call_never_fails_a_call():
    """A call that starts as another thread closes the module loads the method again (a call
    found the method gone: KeyError); close and load never deadlock with concurrency=2."""
    import threading

    model, example = ferry.examples.transformer_block()
    module = ferry.Module(ferry.compile(torch.export.export(model, example)), concurrency=2)
    x = example[0]
    want = model(x)
    errors: list = []
    stop = threading.Event()

    def calls():
        while not stop.is_set():
            try:
                torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-5)
            except Exception as e:  # noqa: BLE001 - any failure is the test's finding
                errors.append(repr(e))

    workers = [threading.Thread(target=calls) for _ in range(2)]
    loader = threading.Thread(target=lambda: [module.load_method() for _ in range(200)])
    for w in workers:
        w.start()
    loader.start()
    for _ in range(100):
        module.close()
    stop.set()
    for w in (*workers, loader):
        w.join(timeout=60)
        assert not w.is_alive(), "a thread is stuck: close and load deadlocked"
    assert errors == []

"""A load's one allocation per device (runtime/devices/slab.py): a slab sized from the pieces the
load predicts (program/footprint.py `load_pieces`), each aligned, handed out front to back and
freed with its last piece; what a short prediction left out gets an allocation of its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ferry
from ferry.backends import TorchBackend
from ferry.device import CPU, Device
from ferry.errors import AllocationError
from ferry.program import TensorValue
from ferry.runtime import device_of
from ferry.runtime.devices import slab as slab_module
from ferry.runtime.devices.allocator import DeviceMemoryBuffer
from ferry.runtime.devices.slab import MemoryReservation, SlabPiece
from ferry.runtime.stages import module as module_stage
from models import export, fresh_inputs, loaded_method, one_per_device
from test_runtime_e2e import load_allocations
from test_shared_state import CALLS, DIM, _call, _seeded, compiled

EMU0, EMU1 = Device("emu", 0), Device("emu", 1)


def aligned(n: int) -> int:
    return -(-n // 256) * 256


class Weights(nn.Module):
    """Weights of sizes that are no multiple of the device's alignment (256 bytes)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 5), nn.Linear(5, 3)
        self.register_buffer("scale", torch.tensor([2.0, 0.5, 1.0]))

    def forward(self, x):
        return self.b(self.a(x).relu()).relu() * self.scale


def weights_program(exclude=()):
    return ferry.compile(export(Weights().eval(), (torch.randn(4, 8),)),
                         ferry.OpSupportPartitioner("emu:0", exclude=list(exclude)))


# ---------------------------------------------------------------------------------------
# the slab


def test_a_reservation_is_one_allocation_per_device_of_its_aligned_pieces(emu):
    r = MemoryReservation([(EMU0, 100), (EMU0, 300), (EMU0, 0), (CPU, 1000), (EMU1, 10)])
    assert sorted((a.nbytes, a.index) for a in emu.allocated) == [(256, 1), (256 + 512, 0)]  # host memory: none
    pieces = [r.take(n, EMU0) for n in (100, 300, 0)]
    host = r.take(1000, CPU)
    assert emu.allocations == 2 and isinstance(host, DeviceMemoryBuffer) and host.device.is_cpu
    for p, n in zip(pieces, (100, 300, 0)):
        assert isinstance(p, SlabPiece) and p.nbytes == n == p.memory.numel() and p.memory.dtype == torch.uint8
        assert p.memory.data_ptr() % 256 == 0 and p.device == EMU0
    assert pieces[1].memory.data_ptr() - pieces[0].memory.data_ptr() == 256  # front to back, each aligned
    assert device_of(pieces[1].memory) == EMU0
    r.seal()  # emu:1's slab, none of it taken, goes now; emu:0's with its last piece
    assert emu.live_bytes == 768 and r.slabs[EMU1].closed
    for p in (*pieces, host):
        p.close()
    assert emu.live_bytes == 0 and emu.deallocations == 2


def test_a_slab_is_freed_once_sealed_and_every_piece_closed(emu):
    r = MemoryReservation([(EMU0, 256), (EMU0, 256), (EMU1, 8)])
    a, b = r.take(256, EMU0), r.take(256, EMU0)
    a.close()
    a.close()  # once only
    assert emu.live_bytes == 512 + 256 and emu.deallocations == 0
    r.seal()  # emu:1's slab, which no piece holds, goes now; emu:0's with its last piece
    assert emu.live_bytes == 512 and emu.deallocations == 1
    b.close()
    assert emu.live_bytes == 0 and emu.deallocations == 2
    with pytest.raises(ValueError, match="closed"):
        a.memory  # noqa: B018


def test_a_piece_dropped_without_closing_gives_its_bytes_back(emu):
    r = MemoryReservation([(EMU0, 64)])
    p = r.take(64, EMU0)
    r.seal()
    assert emu.live_bytes == 256
    del p
    assert emu.live_bytes == 0


def test_what_the_slab_has_no_room_for_is_an_allocation_of_its_own(emu):
    r = MemoryReservation([(EMU0, 256)])
    a = r.take(200, EMU0)
    b = r.take(100, EMU0)  # past the prediction
    c = r.take(10, EMU1)  # a device nothing was predicted for
    r.seal()
    d = r.take(1, EMU0)  # after the load
    assert isinstance(a, SlabPiece) and all(isinstance(x, DeviceMemoryBuffer) for x in (b, c, d))
    assert [(x.nbytes, x.index) for x in emu.allocated] == [(256, 0), (100, 0), (10, 1), (1, 0)]
    for x in (a, b, c, d):
        x.close()
    assert emu.live_bytes == 0 and emu.deallocations == 4


def test_a_piece_asking_for_a_larger_alignment_starts_at_it(emu):
    r = MemoryReservation([(EMU0, 8), (EMU0, 4096, 4096)])  # room for its padding, wherever it lands
    assert [x.nbytes for x in emu.allocated] == [256 + 4096 + 4096 - 256]
    a, b = r.take(8, EMU0), r.take(4096, EMU0, 4096)
    assert isinstance(b, SlabPiece) and b.memory.data_ptr() % 4096 == 0
    assert b.memory.data_ptr() >= a.memory.data_ptr() + 8 and emu.allocations == 1
    r.seal()
    a.close(), b.close()
    assert emu.live_bytes == 0


# ---------------------------------------------------------------------------------------
# a module's loads


def test_a_program_with_several_weights_loads_in_one_allocation(emu):
    model, program = Weights().eval(), weights_program()
    pieces = load_allocations(program)
    assert len(pieces) >= 6 and any(n % 256 for n, _ in pieces)
    module = ferry.Module(program)
    module.load_method()
    assert [(r.nbytes, r.index, r.alignment) for r in emu.allocated] == [(sum(aligned(n) for n, _ in pieces), 0, 256)]
    uploaded = list(module.uploads._made.values())
    assert len(uploaded) >= 5 and all(t.data_ptr() % 256 == 0 and device_of(t) == EMU0 for t in uploaded)
    for seed in range(2):
        (x,) = fresh_inputs((torch.randn(4, 8),), seed)
        torch.testing.assert_close(module(x), model(x))
    module.close()
    assert emu.live_bytes == 0 and emu.deallocations == 1


def test_an_inductor_delegates_weights_are_in_the_one_allocation(emu):
    """Inductor's own results are its allocations; the weights it reads are the load's pieces."""
    model = Weights().eval()
    program = ferry.compile(export(model, (torch.randn(4, 8),)), ferry.OpSupportPartitioner("emu:0", backend_id="inductor"))
    module = ferry.Module(program)
    module.load_method()
    uploaded = list(module.uploads._made.values())
    pieces = load_allocations(program)  # the weights, and the planned copy of the input
    assert len(uploaded) >= 5 and len(emu.allocated) == 1 and len(pieces) == len(uploaded) + 1
    assert emu.allocated[0].nbytes == sum(aligned(n) for n, _ in pieces)
    slab = emu.allocated[0].data_ptr
    assert all(slab <= t.data_ptr() < slab + emu.allocated[0].nbytes for t in uploaded)
    for seed in range(2):
        (x,) = fresh_inputs((torch.randn(4, 8),), seed)
        torch.testing.assert_close(module(x), model(x))
    module.close()
    assert emu.live_bytes == 0


def test_buffers_compiled_with_a_larger_alignment_are_in_the_one_allocation_too(emu):
    model = Weights().eval()
    program = ferry.compile(export(model, (torch.randn(4, 8),)), ferry.OpSupportPartitioner("emu:0"),
                            ferry.CompileConfig(alignment=4096))
    assert {b.alignment for b in program.method("forward").buffers[1:]} == {4096}
    module = ferry.Module(program)
    module.load_method()
    assert emu.allocations == 1
    m = program.method("forward")
    planned = [t for vid, t in enumerate(loaded_method(module).memory.slots)
               if isinstance(v := m.values[vid], TensorValue) and v.storage == "planned" and v.device == EMU0 and v.nbytes]
    assert planned and all(t.data_ptr() % 4096 == 0 for t in planned)  # in real addresses
    (x,) = fresh_inputs((torch.randn(4, 8),), 7)
    torch.testing.assert_close(module(x), model(x))


def test_a_second_method_reserves_only_what_it_adds(emu):
    """prefill and decode share the weights and the cache: decode's load allocates its own
    arena, nothing more, and both read one cache as eager does."""
    program = compiled("emu")
    module = ferry.Module(program)
    module.load_method("prefill")
    prefill = [(r.nbytes, r.index) for r in emu.allocated]
    assert len(prefill) == 1
    emu.reset_counters()
    module.load_method("decode")
    arena = [(b.size, b.device.index) for b in program.method("decode").buffers[1:] if b.device == EMU0]
    assert [(r.nbytes, r.index) for r in emu.allocated] == one_per_device(arena)
    eager = _seeded()
    for k, (name, rows, pos) in enumerate(CALLS):
        x, pos = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(k)), torch.tensor(pos)
        with torch.no_grad():
            want = eager.step(x, pos)
        torch.testing.assert_close(_call(module, "emu", name, x, pos), want)
    module.close()
    assert emu.live_bytes == 0


def test_each_set_of_memory_reserves_its_own_and_close_frees_all(emu):
    model, program = Weights().eval(), weights_program()
    module = ferry.Module(program, concurrency=2)
    module.load_method()
    arena = [(b.size, b.device.index) for b in program.method("forward").buffers[1:] if b.device == EMU0]
    # the first set's load holds the weights as well; the second's, its arena only
    assert [(r.nbytes, r.index) for r in emu.allocated] == one_per_device(load_allocations(program)) + one_per_device(arena)
    (x,) = fresh_inputs((torch.randn(4, 8),), 3)
    torch.testing.assert_close(module(x), model(x))
    module.close()
    assert emu.live_bytes == 0 and emu.deallocations == 2


def test_a_failed_allocation_leaves_nothing_and_the_module_loads_again(emu, monkeypatch):
    """A piece past a short prediction, made on its own, fails."""
    k = 2
    model, program = Weights().eval(), weights_program()
    real = module_stage.load_pieces
    monkeypatch.setattr(module_stage, "load_pieces", lambda *args: real(*args)[:-1])  # the last piece left out
    module = ferry.Module(program)
    emu.fail_allocation(k)
    with pytest.raises(AllocationError, match="emu:0"):
        module.load_method()
    assert emu.live_bytes == 0 and emu.live_allocations == 0 and emu.allocations == k - 1 == emu.deallocations
    (x,) = fresh_inputs((torch.randn(4, 8),), k)
    torch.testing.assert_close(module(x), model(x))
    module.close()
    assert emu.live_bytes == 0


def test_a_slab_that_cannot_be_allocated_whole_falls_back_to_an_allocation_per_piece(emu):
    """Fragmented device memory may hold every piece but not their sum in one range."""
    model, program = Weights().eval(), weights_program()
    pieces = load_allocations(program)
    module = ferry.Module(program)
    emu.fail_allocation(1)  # the slab
    module.load_method()
    assert emu.failed_allocations == 1 and emu.live_allocations == len(pieces)
    assert sorted(r.nbytes for r in emu.allocated) == sorted(n for n, _ in pieces)
    for seed in range(2):
        (x,) = fresh_inputs((torch.randn(4, 8),), seed)
        torch.testing.assert_close(module(x), model(x))
    module.close()
    assert emu.live_bytes == 0 and emu.live_allocations == 0


def no_slab(device, nbytes):
    """In place of Slab: its one allocation fails."""
    raise AllocationError(f"allocation of {nbytes} bytes on {device} failed: injected")


def test_a_piece_failing_after_the_slab_did_leaves_nothing(emu, monkeypatch):
    model, program = Weights().eval(), weights_program()
    monkeypatch.setattr(slab_module, "Slab", no_slab)
    module = ferry.Module(program)
    emu.fail_allocation(2)  # the second piece
    with pytest.raises(AllocationError, match="emu:0"):
        module.load_method()
    assert emu.live_bytes == 0 and emu.live_allocations == 0 and emu.allocations == 1 == emu.deallocations
    monkeypatch.undo()
    (x,) = fresh_inputs((torch.randn(4, 8),), 3)
    torch.testing.assert_close(module(x), model(x))
    module.close()
    assert emu.live_bytes == 0


def test_a_backend_failing_to_load_a_delegate_leaves_what_was_there(emu, monkeypatch):
    x0 = torch.randn(4, 8)
    program = ferry.compile({"a": export(Weights().eval(), (x0,)), "b": export(Weights().eval(), (x0,))},
                            ferry.OpSupportPartitioner("emu:0", exclude=["aten.relu"]))
    assert len([d for d in program.delegates]) >= 4  # two a method
    module = ferry.Module(program)
    module.load_method("a")
    live, real, inits = emu.live_bytes, TorchBackend.init, []

    def second_fails(self, *args, **kwargs):
        inits.append(1)
        if len(inits) == 2:
            raise RuntimeError("no")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TorchBackend, "init", second_fails)
    with pytest.raises(ferry.BackendError, match="no"):
        module.load_method("b")  # after its own slab and its first delegate's pieces
    assert emu.live_bytes == live and emu.allocations == 2
    monkeypatch.setattr(TorchBackend, "init", real)
    torch.testing.assert_close(module.run_method("b", [x0])[0], Weights().eval()(x0))
    module.close()
    assert emu.live_bytes == 0


@pytest.mark.parametrize("keep", [0.0, 0.5])
def test_a_short_prediction_still_loads_with_allocations_of_their_own(emu, monkeypatch, keep):
    model, program = Weights().eval(), weights_program(exclude=["aten.relu"])
    real = module_stage.load_pieces

    def short(*args):
        pieces = real(*args)
        return pieces[:int(len(pieces) * keep)]

    monkeypatch.setattr(module_stage, "load_pieces", short)
    module = ferry.Module(program)
    module.load_method()
    assert emu.allocations > 2
    for seed in range(2):
        (x,) = fresh_inputs((torch.randn(4, 8),), seed)
        torch.testing.assert_close(module(x), model(x))
    module.close()
    assert emu.live_bytes == 0 and emu.allocations == emu.deallocations

"""The load's timing carves its stand-ins from the loading method's arena (choices/scratch_space.py):
pieces of the layout asked for, apart while alive, lent again once garbage; nothing carved after the
load, from a space withdrawn, or from an arena the load wrote. On the CPU the timing is faked; the
carving, the load's wiring and the results are real, checked against eager."""

import dataclasses
import gc

import pytest
import torch

import ferry
from ferry.choices import gemm as gemm_choice
from ferry.choices import scratch_space
from ferry.choices import timing as kernel_timing
from ferry.program.schema import PlanEntry
from test_gemm_choice import Mlp, Wide, gemms

CPU0 = torch.device("cpu", 0)


def arena(nbytes=4096):
    return torch.full((nbytes,), 7, dtype=torch.uint8)


def inside(t: torch.Tensor, memory: torch.Tensor) -> bool:
    start, end = t.data_ptr(), t.data_ptr() + scratch_space.extent(t.shape, t.stride()) * t.element_size()
    return memory.data_ptr() <= start and end <= memory.data_ptr() + memory.numel()


# ---------------------------------------------------------------------------------------
# the space


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "broadcast"])
def test_a_piece_has_the_layout_asked_for_aligned_inside_the_space(layout):
    memory = arena()
    meta = {"contiguous": torch.empty(5, 7, device="meta"), "transposed": torch.empty(7, 5, device="meta").t(),
            "broadcast": torch.empty(7, device="meta").expand(5, 7)}[layout]
    space = scratch_space.ScratchSpace(memory)
    first = space.take((3,), (1,), torch.float16)
    piece = space.take(meta.shape, meta.stride(), meta.dtype)
    assert piece.shape == meta.shape and piece.stride() == meta.stride() and piece.dtype == meta.dtype
    assert inside(piece, memory) and piece.data_ptr() % scratch_space.ALIGNMENT == 0
    assert piece.data_ptr() >= first.data_ptr() + 6  # after the first piece, not over it
    piece.zero_() if layout != "broadcast" else piece[0].zero_()
    assert bool((first.view(torch.uint8) == 7).all())  # writing one piece leaves the other


def test_live_pieces_never_overlap_and_the_front_is_lent_again_once_all_are_back():
    memory = arena(8192)
    space = scratch_space.ScratchSpace(memory)
    pieces = [space.take((100,), (1,), torch.float32) for _ in range(4)]
    spans = sorted((p.data_ptr(), p.data_ptr() + 400) for p in pieces)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    front = spans[0][0]
    del pieces[1:]
    gc.collect()
    assert space.take((10,), (1,), torch.float32).data_ptr() > front  # the first piece still lent
    del pieces
    gc.collect()
    assert space.take((10,), (1,), torch.float32).data_ptr() == front


def test_no_room_an_empty_layout_or_a_withdrawn_space_lends_nothing():
    space = scratch_space.ScratchSpace(arena(1024))
    assert space.take((300,), (1,), torch.float32) is None  # 1,200 bytes
    assert space.take((0, 4), (4, 1), torch.float32) is None
    kept = space.take((200,), (1,), torch.float32)
    assert kept is not None and space.take((100,), (1,), torch.float32) is None  # 800 + 256-aligned 400 > 1,024
    space.withdrawn = True
    del kept
    assert space.take((4,), (1,), torch.float32) is None


def test_stand_ins_come_from_the_space_only_inside_the_block_and_never_for_an_unnamed_cuda_device():
    memory = arena()
    meta = torch.empty(4, 4, device="meta")
    with scratch_space.carved_from({CPU0: memory, torch.device("cuda"): arena()}):
        carved = kernel_timing.scratch(meta, CPU0)
        assert inside(carved, memory) and bool((carved == 0.5).all())
        assert scratch_space.take(torch.device("cuda"), (4,), (1,), torch.float32) is None  # which GPU is "cuda"?
        with scratch_space.carved_from({CPU0: arena()}):  # a delegate inside its caller's load keeps the caller's
            assert inside(kernel_timing.scratch(meta, CPU0), memory)
        scratch_space.withdraw()
        assert not inside(kernel_timing.scratch(meta, CPU0), memory)
    assert not inside(kernel_timing.scratch(meta, CPU0), memory)
    weight = torch.randn(4, 4)
    assert kernel_timing.scratch(weight, CPU0) is weight  # a real operand only read is itself


# ---------------------------------------------------------------------------------------
# the load


def _offered(monkeypatch) -> list:
    """The arenas each load offered its timing (scratch_space.carved_from's argument)."""
    offered, real = [], scratch_space.carved_from
    monkeypatch.setattr(scratch_space, "carved_from", lambda arenas: offered.append(dict(arenas)) or real(arenas))
    return offered


def _spied(monkeypatch) -> list:
    made, real = [], kernel_timing.scratch

    def spy(t, device, written=False):
        out = real(t, device, written)
        if out is not t:
            made.append((out.data_ptr(), out.shape, out.stride(), out.element_size()))
        return out

    monkeypatch.setattr(kernel_timing, "scratch", spy)
    return made


def test_a_load_times_on_stand_ins_carved_from_its_arena_and_calls_equal_eager(timed, emu, monkeypatch):
    made, offered = _spied(monkeypatch), _offered(monkeypatch)
    model = Mlp().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(3, 5, 16),)), ferry.OpSupportPartitioner("emu:0"))
    module = ferry.Module(program)
    module.load_method()
    assert timed.calls == 2 and len(gemms()) == 2
    assert module._methods["forward"].memory.arenas == {}  # held no longer than the load
    (arena_memory,) = offered[0].values()
    largest = max(b.size for b in program.method("forward").buffers[1:])
    assert arena_memory.numel() == largest and len(made) >= 4  # each GEMM: its rows and its result
    for ptr, shape, stride, size in made:
        end = ptr + scratch_space.extent(shape, stride) * size
        assert arena_memory.data_ptr() <= ptr and end <= arena_memory.data_ptr() + arena_memory.numel()
    for _ in range(3):
        x = torch.randn(3, 5, 16)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-6)
    assert any(d.taken for d in gemms()) and gemm_choice.mm_then_add is not None


class Remembers(torch.nn.Module):
    """A mutable buffer with a first value, overwritten each call, and a product timed at load."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("last", torch.full((16,), 3.0))

    def forward(self, x):
        out = self.lin(x) + self.last  # the first call reads the first value
        self.last.copy_(x.mean(0))
        return out


def _state_made_planned(program):
    """The program as a file from before states wrote it: the mutable buffer and its update in
    planned memory (a buffer of their own, the method's largest), its first value uploaded there
    by the load."""
    m = program.method("forward")
    (mb,) = m.mutable_buffers
    value, update = m.tensor(mb.value), m.tensor(mb.update)
    m.buffers.append(dataclasses.replace(next(b for b in m.buffers[1:] if b.device == value.device), size=1 << 16))
    m.values[mb.value] = dataclasses.replace(value, storage="planned", plan=PlanEntry(len(m.buffers) - 1, 0))
    m.values[mb.update] = dataclasses.replace(update, storage="planned", plan=PlanEntry(len(m.buffers) - 1, 512))
    return program


def test_a_load_that_writes_planned_memory_carves_nothing(timed, emu, monkeypatch):
    made, offered = _spied(monkeypatch), _offered(monkeypatch)
    model = Remembers().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(4, 16),)), ferry.OpSupportPartitioner("emu:0"))
    program = _state_made_planned(program)
    module = ferry.Module(program)
    module.load_method()
    memory = module._methods["forward"].memory
    assert memory.wrote_planned and offered[0] == {}  # the method's own load offers nothing
    first = memory.slots[program.method("forward").mutable_buffers[0].value]
    assert made and not any(first.data_ptr() <= ptr < first.data_ptr() + 64 for ptr, *_ in made)
    eager = Remembers().eval()
    for _ in range(3):
        x = torch.randn(4, 16)
        with torch.no_grad():
            torch.testing.assert_close(module(x), eager(x), rtol=1e-5, atol=1e-6)



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_on_cuda_every_stand_in_is_carved_from_the_arena_and_calls_equal_eager(graphs, fresh, full_fp32, monkeypatch):
    """BERT's feed-forward at 128 rows: each GEMM's rows and result (1.5 MiB: a 20 MiB segment of
    the caching allocator's otherwise) lie in the method's arena while it loads."""
    made, offered = _spied(monkeypatch), _offered(monkeypatch)
    model = Wide().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(1, 128, 768),)), ferry.OpSupportPartitioner("cuda:0"))
    module = ferry.Module(program, cuda_graphs=graphs)
    module.load_method()
    arenas = {k: v for a in offered for k, v in a.items()}
    assert len(gemms()) == 2 and len(made) >= 3  # the second's rows are planned: read as they are
    assert all(inside_one(ptr, arenas.values()) for ptr, *_ in made)
    cuda_model = model.cuda()
    for _ in range(3):
        x = torch.randn(1, 128, 768)
        with torch.no_grad():
            torch.testing.assert_close(module(x), cuda_model(x.cuda()).cpu(), rtol=1e-4, atol=1e-4)


def inside_one(ptr: int, memories) -> bool:
    return any(m.data_ptr() <= ptr < m.data_ptr() + m.numel() for m in memories)

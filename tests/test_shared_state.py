"""Methods compiled together share the model's state and weights, as in eager.

A model with a cache (a buffer its methods update in place) is exported twice, as `prefill`
(several positions at once) and `decode` (one position), from one model object, and compiled
into one program. Eager runs the same model object through the same calls in the same order;
ferry must give the same results at every call (so both methods read and write one cache), hold
that cache once, and hold the weights once (in the file and on the device).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import ferry
from ferry.device import Device
from ferry.errors import CompileError, ConfigError, ProgramError
from ferry.runtime import clone_to
from ferry.views.text import program_json, program_summary
from models import loaded_method

EMU0 = Device("emu", 0)
DIM, SLOTS = 64, 16
KEEP_ON_DEVICE = ferry.CompileConfig(
    propagate_device=ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True))
PLACEMENTS = ["cpu", "emu", "emu-io"]


class Cached(nn.Module):
    """Writes keys for positions `pos` into its cache, then attends over every slot written."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)
        self.register_buffer("cache", torch.zeros(SLOTS, DIM))
        self.register_buffer("seen", torch.zeros(SLOTS))

    def step(self, x, pos):
        self.cache.index_copy_(0, pos, self.proj(x))
        self.seen.index_fill_(0, pos, 1.0)
        scores = (x @ self.cache.T).masked_fill(self.seen == 0, float("-inf")).softmax(-1)
        return self.out(scores @ self.cache)


class Prefill(nn.Module):
    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, x, pos):
        return self.core.step(x, pos)


class Decode(Prefill):
    pass


def exported(core, prompt: int = 4):
    """(prefill, decode) exported from one model object (its buffers as they are now)."""
    x, pos = torch.randn(prompt, DIM), torch.arange(prompt)
    return (torch.export.export(Prefill(core), (x, pos)),
            torch.export.export(Decode(core), (torch.randn(1, DIM), torch.tensor([prompt]))))


def compiled(placement: str, core=None, backend: str = "torch"):
    core = core if core is not None else _seeded()
    prefill, decode = exported(core)
    part = None if placement == "cpu" else ferry.OpSupportPartitioner("emu:0", backend_id=backend)
    return ferry.compile({"prefill": prefill, "decode": decode}, part, KEEP_ON_DEVICE if placement == "emu-io" else None)


def _seeded(seed: int = 0) -> Cached:
    torch.manual_seed(seed)
    return Cached().eval()


def _call(module, placement, name, x, pos):
    if placement == "emu-io":
        x, pos = clone_to(x, EMU0), clone_to(pos, EMU0)
    (out,) = module.run_method(name, [x, pos])
    return clone_to(out, Device("cpu", 0)) if out.device.type != "cpu" else out


CALLS = [("prefill", 4, [0, 1, 2, 3]), ("decode", 1, [4]), ("decode", 1, [5]), ("prefill", 4, [6, 7, 8, 9]),
         ("decode", 1, [10]), ("decode", 1, [2])]  # the last one rewrites a slot prefill wrote


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_two_methods_share_one_cache_as_eager(emu, tmp_path, placement):
    program = compiled(placement)
    program.save(tmp_path / "cached.ferry")
    module = ferry.Module(tmp_path / "cached.ferry")
    eager = _seeded()  # the same weights, its own zero cache, called in the same order
    for k, (name, rows, pos) in enumerate(CALLS):
        x, pos = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(k)), torch.tensor(pos)
        with torch.no_grad():
            want = eager.step(x, pos)
        got = _call(module, placement, name, x, pos)
        torch.testing.assert_close(got, want, msg=lambda m, k=k, name=name: f"call {k} ({name}): {m}")
    assert sorted(module.state_names()) == ["core.cache", "core.seen"]
    assert [s for s in module._instances[0].state.tensors] == module.state_names()  # one tensor per buffer


@pytest.mark.parametrize("backend", ["torch", "inductor"])
def test_the_cache_and_the_weights_are_held_once(emu, backend):
    """Either backend's delegates keep their weights in the program's segments: stored once, uploaded once."""
    program = compiled("emu", backend=backend)
    one_method = ferry.compile({"prefill": exported(_seeded())[0]}, ferry.OpSupportPartitioner("emu:0",
                                                                                               backend_id=backend))
    # the file: the weights (33 KB) once; the second method adds its instructions, not its weights
    weights = sum(p.numel() * 4 for p in _seeded().parameters())
    assert len(program.to_bytes()) - len(one_method.to_bytes()) < weights / 2
    module = ferry.Module(one_method)
    module.load_method("prefill")
    alone = emu.live_bytes
    module.close()
    both = ferry.Module(program)
    both.load_method("prefill")
    assert emu.live_bytes == alone
    both.load_method("decode")  # only its planned working memory is new: no weights, no cache
    decode_arena = sum(b.size for b in program.method("decode").buffers[1:] if b.device == EMU0)
    assert emu.live_bytes == alone + decode_arena
    if backend == "inductor":
        assert {d.backend_id for d in program.delegates} == {"inductor"}
    both.close()
    assert emu.live_bytes == 0


@pytest.mark.parametrize("placement", ["cpu", "emu"])
def test_reset_state_starts_again_from_the_initial_value(emu, placement):
    module = ferry.Module(compiled(placement))
    x, pos = torch.randn(4, DIM), torch.arange(4)
    first = _call(module, placement, "prefill", x, pos)
    _call(module, placement, "decode", torch.randn(1, DIM), torch.tensor([9]))
    again = _call(module, placement, "prefill", x, pos)
    assert not torch.allclose(again, first)  # slot 9 is seen now: the cache carried over
    module.reset_state()
    torch.testing.assert_close(_call(module, placement, "prefill", x, pos), first)
    with pytest.raises(ConfigError, match="no state named 'kv'.*core.cache"):
        module.reset_state(["kv"])


def test_methods_that_disagree_on_a_buffer_are_refused():
    a, b = _seeded(), _seeded()
    b.cache, b.seen = torch.zeros(SLOTS * 2, DIM), torch.zeros(SLOTS * 2)  # the same names, other shapes
    with pytest.raises(CompileError, match="disagree on mutable buffer 'core.(cache|seen)'"):
        ferry.compile({"prefill": exported(a)[0], "decode": exported(b)[1]})
    c = _seeded()
    c.cache.fill_(1.0)  # same shape, another initial value
    with pytest.raises(CompileError, match="disagree on mutable buffer 'core.cache'"):
        ferry.compile({"prefill": exported(a)[0], "decode": exported(c)[1]})


class Reader(Prefill):
    def forward(self, x):
        return x @ self.core.cache.T  # reads the cache, never writes it


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_method_that_only_reads_another_methods_cache_reads_what_it_wrote(emu, placement):
    """An `encode` fills a cache a `decode` only reads (Whisper's cross-attention): the reader holds
    it as the program's state too, so it sees every write, in any order of calls, as eager does."""
    core, eager = _seeded(), _seeded()
    prefill, _ = exported(core)
    reader = torch.export.export(Reader(core), (torch.randn(1, DIM),))
    part = None if placement == "cpu" else ferry.OpSupportPartitioner("emu:0")
    program = ferry.compile({"prefill": prefill, "read": reader}, part,
                            KEEP_ON_DEVICE if placement == "emu-io" else None)
    read_only = program.method("read").mutable_buffers
    assert "core.cache" in {mb.name for mb in read_only} and all(mb.update == mb.value for mb in read_only)
    states = program_json(ferry.load_program(program.to_bytes()))["state"]
    assert set(states["core.cache"]["methods"]) == {"prefill", "read"}
    assert states["core.cache"]["updated_by"] == ["prefill"]
    assert "core.cache: float32[16, 64]" in program_summary(program) and "updated by prefill; read by read" in \
        program_summary(program)
    module = ferry.Module(program)
    torch.manual_seed(1)
    for name, n, pos in [("read", 1, [0]), ("prefill", 4, [0, 1, 2, 3]), ("read", 1, [0]), ("prefill", 4, [5, 6, 7, 8]),
                         ("read", 1, [0]), ("read", 1, [0])]:
        x, p = torch.randn(n, DIM), torch.tensor(pos)
        if name == "prefill":
            got, want = _call(module, placement, name, x, p), eager.step(x, p)
        else:
            (got,) = module.run_method("read", [clone_to(x, EMU0) if placement == "emu-io" else x])
            got, want = (got if got.device.type == "cpu" and placement != "emu-io" else clone_to(got, Device("cpu", 0))), x @ eager.cache.T
        torch.testing.assert_close(got, want, msg=f"{name} at {pos}")


def test_a_file_whose_methods_disagree_on_a_state_is_refused(emu):
    program = compiled("emu")
    m = program.method("decode")
    (mb,) = [mb for mb in m.mutable_buffers if mb.name == "core.seen"]
    values = list(m.values)
    for vid in (mb.value, mb.update):  # (the update is the state's memory: it moves with it)
        values[vid] = dataclasses.replace(values[vid], device=Device("emu", 1))
    bad = dataclasses.replace(program, methods={**program.methods, "decode": dataclasses.replace(m, values=values)})
    with pytest.raises(ProgramError, match="state 'core.seen' is a float32\\[16\\] tensor on emu:0 .* on emu:1"):
        ferry.load_program(bad.to_bytes())


def test_inspect_shows_the_state_and_which_methods_update_it(emu):
    program = compiled("emu")
    text = program_summary(program, instructions=False)
    assert "state: 2 buffers, 4,160 bytes, held once for every method" in text
    assert "core.cache: float32[16, 64] on emu:0, 4,096 bytes, updated by prefill, decode" in text
    state = program_json(program)["state"]
    assert state["core.seen"] == {"dtype": "float32", "shape": [SLOTS], "device": "emu:0", "bytes": 64,
                                  "methods": ["prefill", "decode"], "updated_by": ["prefill", "decode"]}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_two_methods_share_one_cache_on_the_gpu(full_fp32, graphs):
    core = _seeded()
    prefill, decode = exported(core)
    program = ferry.compile({"prefill": prefill, "decode": decode}, ferry.OpSupportPartitioner("cuda:0"), KEEP_ON_DEVICE)
    module = ferry.Module(ferry.load_program(program.to_bytes()), cuda_graphs=graphs)
    eager = _seeded()
    for _ in range(2):  # twice through: graphs captured on the way are replayed on the second pass
        for k, (name, rows, pos) in enumerate(CALLS):
            x, pos = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(k)), torch.tensor(pos)
            with torch.no_grad():
                want = eager.step(x, pos)
            (got,) = module.run_method(name, [x.cuda(), pos.cuda()])
            torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=k, name=name: f"call {k} ({name}): {m}")
    assert all(t.is_cuda for t in module._instances[0].state.tensors.values())
    if graphs:
        assert any(g.graph is not None for m in module._methods.values() for g in m.graphs)


def test_a_stateful_program_is_refused_with_several_sets_of_memory():
    """concurrency=2 would give each set a cache of its own and hand calls to either: refused."""
    program = compiled("cpu")
    with pytest.raises(ConfigError, match="keeps state between calls .*core.cache.*concurrency=1"):
        ferry.Module(program, concurrency=2)
    ferry.Module(program, concurrency=1)  # one set: accepted


def _updates(program, name: str) -> dict[str, str]:
    m = program.method(name)
    return {mb.name: m.tensor(mb.update).storage for mb in m.mutable_buffers}


@pytest.mark.parametrize("placement", ["emu", "emu-io"])
def test_a_delegate_writes_each_update_over_its_state_in_place(emu, placement):
    """The new cache is written into the cache itself: no planned copy of it, no copy back."""
    program = compiled(placement)
    for name in ("prefill", "decode"):
        assert _updates(program, name) == {"core.cache": "state", "core.seen": "state"}
        planned = sum(b.size for b in program.method(name).buffers[1:] if b.device == EMU0)
        assert planned < SLOTS * DIM * 4  # smaller than the cache: no room for a second one
    module = ferry.Module(program)
    module.load_method("decode")
    kinds = [s.kind for s in loaded_method(module, "decode").plan.bound.steps if s is not None]
    assert "delegate" in kinds and "writeback" not in kinds


class ReadsTheOldCache(Cached):
    """Keeps the cache as it was before this call's write, and reads it after the write."""

    def step(self, x, pos):
        old = self.cache.clone()
        self.cache.index_copy_(0, pos, self.proj(x))
        return self.out(x @ self.cache.T @ old)


@pytest.mark.parametrize("placement", ["emu", "emu-io"])
def test_an_update_is_kept_apart_from_its_state_while_the_old_value_is_read(emu, placement):
    torch.manual_seed(0)
    program = compiled(placement, ReadsTheOldCache().eval())
    assert _updates(program, "decode")["core.cache"] == "planned"
    module = ferry.Module(ferry.load_program(program.to_bytes()))
    torch.manual_seed(0)
    eager = ReadsTheOldCache().eval()
    for k, (name, rows, pos) in enumerate(CALLS):
        x, pos = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(k)), torch.tensor(pos)
        with torch.no_grad():
            want = eager.step(x, pos)
        torch.testing.assert_close(_call(module, placement, name, x, pos), want)


def _stored_as_state(m, update: int):
    """`m` with value `update` made the state's own memory, its planned bytes given back."""
    values = list(m.values)
    values[update] = dataclasses.replace(values[update], storage="state", plan=None)
    need: dict = {}
    for v in values:
        if getattr(v, "plan", None) is not None:
            need[v.plan.buffer] = max(need.get(v.plan.buffer, 0), v.plan.offset + v.nbytes)
    buffers = [b if i == 0 else dataclasses.replace(b, size=-(-need.get(i, 0) // b.alignment) * b.alignment)
               for i, b in enumerate(m.buffers)]
    return dataclasses.replace(m, values=values, buffers=buffers)


def test_a_file_that_writes_an_update_over_a_state_its_payload_still_reads_is_refused(emu):
    torch.manual_seed(0)
    program = compiled("emu", ReadsTheOldCache().eval())
    m = program.method("decode")
    (mb,) = [mb for mb in m.mutable_buffers if mb.name == "core.cache"]
    bad = dataclasses.replace(program, methods={**program.methods, "decode": _stored_as_state(m, mb.update)})
    module = ferry.Module(ferry.load_program(bad.to_bytes()))
    with pytest.raises(ProgramError, match="written over the state 'core.cache' in place, which the delegate's "
                                           "payload does not allow"):
        module.load_method("decode")
    assert emu.live_bytes == 0 or module.load_method("prefill") is None  # nothing half-loaded; the rest loads


def _inductor_writes_the_state(device: str, graphs: bool = False) -> None:
    core = _seeded()
    prefill, decode = exported(core)
    program = ferry.compile({"prefill": prefill, "decode": decode},
                            ferry.OpSupportPartitioner(device, backend_id="inductor"),
                            KEEP_ON_DEVICE if device != "cpu" else None)
    for name in ("prefill", "decode"):
        assert _updates(program, name) == {"core.cache": "state", "core.seen": "state"}
    module = ferry.Module(ferry.load_program(program.to_bytes()), cuda_graphs=graphs)
    eager = _seeded()
    for k, (name, rows, pos) in enumerate(CALLS * 2):  # twice: graphs captured on the way are replayed
        x, pos = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(k)), torch.tensor(pos)
        with torch.no_grad():
            want = eager.step(x, pos)
        (got,) = module.run_method(name, [x.to(device), pos.to(device)])
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"call {k}: {m}")
    kinds = [s.kind for s in loaded_method(module, "decode").plan.bound.steps if s is not None]
    assert "writeback" not in kinds


def test_an_inductor_delegate_writes_the_updates_over_the_state_in_its_compiled_graph():
    """Compiled code returns results of its own; an update kept as the state is copied over the
    state as the graph's last step, so the program holds no second cache and copies none back."""
    _inductor_writes_the_state("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_an_inductor_delegate_on_the_gpu_writes_the_updates_over_the_state(full_fp32, graphs):
    _inductor_writes_the_state("cuda:0", graphs)


class PartReader(nn.Module):
    """Reads the first rows of the cache through a view held by a plain Python object: non-strict
    export captures that view as a constant with its value at export time."""

    def __init__(self, core):
        super().__init__()
        self.core = core
        self.held = [core.cache[:4]]

    def forward(self, x):
        return x @ self.held[0].T


def test_a_constant_that_is_part_of_a_buffer_another_method_updates_is_refused():
    core = _seeded()
    prefill, _ = exported(core)
    reader = torch.export.export(PartReader(core), (torch.randn(1, DIM),), strict=False)
    assert any(s.kind.name == "CONSTANT_TENSOR" for s in reader.graph_signature.input_specs)
    with pytest.raises(CompileError, match="method 'read' reads part of buffer 'core.cache', which a method updates, "
                                           "through the constant"):
        ferry.compile({"prefill": prefill, "read": reader})


def _reader_program():
    core = _seeded()
    prefill, _ = exported(core)
    reader = torch.export.export(Reader(core), (torch.randn(1, DIM),))
    return ferry.compile({"prefill": prefill, "read": reader})


def _with_read(program, **changes):
    read = dataclasses.replace(program.method("read"), **changes)
    return dataclasses.replace(program, methods={**program.methods, "read": read})


def test_a_file_that_writes_a_state_it_only_reads_is_refused():
    from ferry.program.schema import ConstValue, KernelCall

    program = _reader_program()
    m = program.method("read")
    (mb,) = [mb for mb in m.mutable_buffers if mb.name == "core.cache"]
    values = [*m.values, ConstValue("float", 64.0)]
    write = KernelCall("aten::fill.Scalar_out", (mb.value, len(values) - 1, mb.value), (mb.value,))
    bad = _with_read(program, values=values, instructions=[write, *m.instructions])
    with pytest.raises(ProgramError, match="writes a mutable buffer's value .* directly"):
        ferry.load_program(_unchecked_bytes(bad))


def test_a_file_that_holds_one_state_under_two_names_is_refused():
    from ferry.program.schema import MutableBuffer

    program = _reader_program()
    m = program.method("read")
    (mb,) = [mb for mb in m.mutable_buffers if mb.name == "core.cache"]
    bad = _with_read(program, mutable_buffers=[*m.mutable_buffers, MutableBuffer(mb.value, mb.value, "detached")])
    with pytest.raises(ProgramError, match="two mutable buffers share one value"):
        ferry.load_program(_unchecked_bytes(bad))


def _unchecked_bytes(program) -> bytes:
    """The file image of a program that saving would refuse (a hostile file's bytes)."""
    from ferry.program import format as fmt

    return b"".join(fmt.file_chunks(program.methods.values(), program.delegates, program.segments))


class MmReader(Prefill):
    def forward(self, x):
        return torch.mm(x, self.core.cache.T)


def test_a_reader_on_another_device_than_the_writer_gets_a_copy_of_the_state(emu):
    """The cache lives where prefill updates it (emu:0); a reader whose matmul stays on the CPU
    reads it through a copy, and still sees every write."""
    core, eager = _seeded(), _seeded()
    prefill, _ = exported(core)
    reader = torch.export.export(MmReader(core), (torch.randn(1, DIM),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # `aten.mm` is the reader's alone: no "matches no op" warning
        program = ferry.compile({"prefill": prefill, "read": reader},
                                ferry.OpSupportPartitioner("emu:0", exclude=["aten.mm"]))
    read = program.method("read")
    (mb,) = [mb for mb in read.mutable_buffers if mb.name == "core.cache"]
    assert mb.read_only and read.tensor(mb.value).device == EMU0
    assert ferry.copy_report(program, "read").count("d2h") >= 1
    module = ferry.Module(program)
    for name, pos in [("read", None), ("prefill", [0, 1, 2, 3]), ("read", None), ("prefill", [4, 5, 6, 7]),
                      ("read", None)]:
        if name == "prefill":
            x, p = torch.randn(4, DIM), torch.tensor(pos)
            torch.testing.assert_close(_call(module, "emu", name, x, p), eager.step(x, p))
        else:
            x = torch.randn(1, DIM)
            (got,) = module.run_method("read", [x])
            torch.testing.assert_close(got, x @ eager.cache.T)


class ReaderOfCore(nn.Module):
    """Reads the cache through a wrapper that names the model `model`, not `core`."""

    def __init__(self, core):
        super().__init__()
        self.model = core

    def forward(self, x):
        return x @ self.model.cache.T


class ReaderOfTensor(nn.Module):
    """Holds the cache's tensor as a plain attribute: export lifts it as a constant."""

    def __init__(self, core):
        super().__init__()
        self.keys = core.cache

    def forward(self, x):
        return x @ self.keys.T


class DecodeOfCore(nn.Module):
    def __init__(self, core):
        super().__init__()
        self.model = core

    def forward(self, x, pos):
        return self.model.step(x, pos)


@pytest.mark.parametrize("reader", [ReaderOfCore, ReaderOfTensor])
@pytest.mark.parametrize("order", ["writer first", "reader first"])
@pytest.mark.parametrize("placement", ["cpu", "emu"])
def test_methods_that_name_one_buffer_differently_share_it_as_eager(emu, reader, order, placement):
    """prefill exported from a wrapper calling the model `core`, a reader from one calling it
    `model` (or holding the tensor itself): eager's methods read one tensor, and so do ferry's,
    in either order of the methods (before, the reader kept the cache's value at export)."""
    core, eager = _seeded(), _seeded()
    prefill, _ = exported(core)
    read = torch.export.export(reader(core), (torch.randn(1, DIM),))
    methods = {"prefill": prefill, "read": read} if order == "writer first" else {"read": read, "prefill": prefill}
    program = ferry.compile(methods, None if placement == "cpu" else ferry.OpSupportPartitioner("emu:0"))
    module = ferry.Module(ferry.load_program(program.to_bytes()))
    assert len([s for s in module.state_names() if s.endswith("cache") or s == "keys"]) == 1
    torch.manual_seed(1)
    for name, pos in [("read", None), ("prefill", [0, 1, 2, 3]), ("read", None), ("prefill", [4, 5, 6, 7]),
                      ("read", None)]:
        if name == "prefill":
            x, p = torch.randn(4, DIM), torch.tensor(pos)
            torch.testing.assert_close(module.run_method("prefill", [x, p])[0], eager.step(x, p))
        else:
            x = torch.randn(1, DIM)
            torch.testing.assert_close(module.run_method("read", [x])[0], x @ eager.cache.T, msg=f"after {pos}")


def test_two_methods_writing_one_buffer_under_two_names_share_it_as_eager(emu):
    core, eager = _seeded(), _seeded()
    prefill, _ = exported(core)  # names it core.cache
    decode = torch.export.export(DecodeOfCore(core), (torch.randn(1, DIM), torch.tensor([4])))  # model.cache
    module = ferry.Module(ferry.compile({"prefill": prefill, "decode": decode}, ferry.OpSupportPartitioner("emu:0")))
    assert sorted(module.state_names()) == ["core.cache", "core.seen"]
    for k, (name, rows, pos) in enumerate(CALLS):
        x, p = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(k)), torch.tensor(pos)
        with torch.no_grad():
            want = eager.step(x, p)
        torch.testing.assert_close(module.run_method(name, [x, p])[0], want, msg=f"call {k} ({name})")


class Clash(nn.Module):
    """Holds the cache as `model.cache` and another tensor under the writer's name `core.cache`."""

    def __init__(self, core):
        super().__init__()
        self.model = core
        self.core = nn.Module()
        self.core.register_buffer("cache", torch.ones(SLOTS, DIM))

    def forward(self, x):
        return x @ self.model.cache.T + x @ self.core.cache.T


def test_a_method_holding_the_shared_buffer_and_another_under_its_name_is_refused():
    core = _seeded()
    prefill, _ = exported(core)
    clash = torch.export.export(Clash(core), (torch.randn(1, DIM),))
    with pytest.raises(CompileError, match="ferry shares state between methods by name"):
        ferry.compile({"prefill": prefill, "read": clash})

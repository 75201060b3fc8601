"""Pipelined micro-batches (Module(program, microbatches=k)) on emulated devices.

The asynchronous emulated device runs device work only when the host waits, so a part that
overwrote memory the previous part's copies still read, or a host read of a result still in
flight, gives a wrong answer here (runtime/devices/simulated.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import ferry
from ferry import ConfigError, InputError
from ferry.runtime import emulated_device
from models import gpt2_lm, loaded_method
from test_device_map import DAG_EXAMPLES, RandomDag, TinyLM, ids, split_map


@pytest.fixture(params=["sync", "async"])
def emu8(request):
    with emulated_device(num_devices=8, asynchronous=request.param == "async", capacity=1 << 24) as allocator:
        yield allocator


def tiny_program(devices: list[str], batch: int = 2, layers: int = 4, dynamic: bool = False):
    model = TinyLM(layers=layers).eval()
    shapes = ({0: torch.export.Dim("batch", max=8)},) if dynamic else None
    ep = torch.export.export(model, (ids(0, (batch, 10)),), dynamic_shapes=shapes)
    return model, ferry.compile(ep, device_map=split_map(layers, devices))


@pytest.mark.parametrize("devices", [2, 4, 8])
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_parts_equal_eager_for_any_number_of_devices(emu8, devices, parts):
    model, program = tiny_program([f"emu:{i}" for i in range(devices)], layers=8)
    module = ferry.Module(program, microbatches=parts)
    for rows in (2 * parts, 2 * parts - 1, 1):  # even, one short (a padded last part), one row
        for seed in range(2):
            x = ids(100 * rows + seed, (rows, 10))
            got = module(x)
            assert got.shape == (rows, 10, 32)
            torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("graphs", [False, True])
def test_graphs_are_captured_per_stage_and_replayed_for_every_part(emu_async, graphs):
    model, program = tiny_program(["emu:0", "emu:1"])
    module = ferry.Module(program, microbatches=3, cuda_graphs=graphs)
    for seed in range(4):
        x = ids(seed, (5, 10))  # 2 + 2 + 1 (padded to the program's 2 rows)
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    captured = [g for g in loaded_method(module).graphs if g.graph is not None]
    if graphs:  # one graph per stage (the delegate on each device); the copies run eagerly
        assert len(captured) == 2 and all("delegate" in g.label for g in captured)
    else:
        assert captured == []


def test_the_host_waits_once_per_call_not_once_per_part(emu_async, monkeypatch):
    """Between parts nothing blocks the host: part m+1 is issued while part m is in flight,
    which is what lets device s run part m+1 while device s+1 runs part m."""
    model, program = tiny_program(["emu:0", "emu:1"])
    module = ferry.Module(program, microbatches=4)
    module(ids(1, (8, 10)))  # the first call runs its first part with the checks
    api = emu_async.streams_api()
    # internal: the simulated device's one host-wait entry point counts the work queued before each wait
    start, queued_at_waits, real = api.launched, [], api._host_wait
    monkeypatch.setattr(api, "_host_wait", lambda done: (queued_at_waits.append(api.launched - start), real(done))[1])
    x = ids(2, (8, 10))
    torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    # each part is 5 pieces of device work (h2d, delegate, d2d, delegate, d2h): all 4 parts
    # were queued before the host first waited
    assert queued_at_waits and queued_at_waits[0] == 4 * 5


@pytest.mark.filterwarnings("error::UserWarning")  # an out= tensor resized from another part's size
def test_a_dynamic_batch_splits_evenly_without_padding(emu_any):
    model, program = tiny_program(["emu:0", "emu:1"], batch=4, dynamic=True)
    module = ferry.Module(program, microbatches=2)
    for rows in (16, 7, 3, 2, 7):
        x = ids(rows, (rows, 10))
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    # parts of 8, 4 + 3, 2 + 1 and 1 + 1 rows: each part shape is bound once, as a call's is
    assert loaded_method(module).shape_plans() == 5
    with pytest.raises(InputError, match="at most 16 rows"):
        module(ids(0, (17, 10)))


def test_transformers_gpt2_split_over_two_devices(emu_async):
    model, (example,) = gpt2_lm(layers=4)
    example = example.expand(2, -1).contiguous()
    ep = torch.export.export(model, (example,))
    dmap = {"m.transformer.wte": "emu:0", "m.transformer.wpe": "emu:0", "m.transformer.h.0": "emu:0",
            "m.transformer.h.1": "emu:0", "m.transformer.h.2": "emu:1", "m.transformer.h.3": "emu:1",
            "m.transformer.ln_f": "emu:1", "m.lm_head": "emu:1"}
    module = ferry.Module(ferry.compile(ep, device_map=dmap), microbatches=4)
    for seed in range(2):
        x = torch.randint(0, 256, (7, 16), generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(module(x), model(x), atol=1e-4, rtol=1e-4)


class TwoOutputs(nn.Module):
    """A second output the program lays out transposed (eager keeps the permuted layout)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x, y):
        h = self.b(torch.relu(self.a(x)) + y)
        return h, torch.relu(h.permute(0, 2, 1))


def test_several_inputs_and_outputs_in_any_layout(emu_any):
    model = TwoOutputs().eval()
    example = (torch.randn(2, 5, 6), torch.randn(2, 5, 6))
    ep = torch.export.export(model, example)
    program = ferry.compile(ep, device_map={"a": "emu:0", "b": "emu:1"})
    module = ferry.Module(program, microbatches=3)
    for rows in (6, 5):
        x, y = torch.randn(rows, 5, 6), torch.randn(rows, 5, 6)
        got, want = module(x, y), model(x, y)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


class Pooled(nn.Module):
    def forward(self, x):
        return x.sum()


def test_a_program_without_a_batch_dimension_is_refused_at_load(emu):
    ep = torch.export.export(Pooled(), (torch.randn(4, 3),))
    module = ferry.Module(ferry.compile(ep), microbatches=2)
    with pytest.raises(ConfigError, match="output 0 has no batch dimension.*microbatches"):
        module.load_method()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_microbatches_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match="microbatches must be an int"):
        ferry.Module(ferry.compile(torch.export.export(Pooled(), (torch.randn(2),))), microbatches=bad)


def test_bad_calls_are_input_errors_and_leave_the_module_usable(emu_async):
    model, program = tiny_program(["emu:0", "emu:1"])
    module = ferry.Module(program, microbatches=2)
    with pytest.raises(InputError, match=r"at most 4 rows \(2 micro-batches of 2\), got 5"):
        module(ids(0, (5, 10)))
    with pytest.raises(InputError, match="empty batch"):
        module(ids(0, (0, 10)))
    with pytest.raises(InputError, match="must have shape"):
        module(ids(0, (4, 11)))
    with pytest.raises(InputError, match="must be int64"):
        module(torch.zeros(4, 10))
    with pytest.raises(InputError, match="takes 1 inputs"):
        module(ids(0, (4, 10)), ids(0, (4, 10)))
    x = ids(3, (4, 10))
    torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)


def test_ferry_run_pipelines_parts_from_the_command_line(emu_async, tmp_path, capsys):
    from ferry.cli import main

    _, program = tiny_program(["emu:0", "emu:1"])
    path = tmp_path / "tiny.ferry"
    program.save(path)
    assert main(["run", str(path), "--microbatches", "3", "--cuda-graphs", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "output 0: float32[6, 10, 32]" in out  # 3 parts of the program's 2 rows, joined
    assert main(["run", str(path), "--microbatches", "0"]) == 2


@pytest.mark.parametrize("parts", [2, 4])
def test_a_first_stage_on_the_cpu_waits_for_the_previous_parts_copy(emu_async, parts):
    """Part m+1's CPU kernels write the host memory part m's copy to the device reads: the part
    waits for that copy before its first host step (found by review: wrong rows before)."""
    model = TinyLM(layers=4).eval()
    ep = torch.export.export(model, (ids(0, (2, 10)),))
    module = ferry.Module(ferry.compile(ep, device_map=split_map(4, ["cpu", "emu:0"])), microbatches=parts)
    for seed in range(3):
        x = ids(seed, (2 * parts, 10))
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n.add_(1)
        return x + self.n


def test_a_method_with_state_is_refused(emu):
    program = ferry.compile(torch.export.export(Counter(), (torch.zeros(2, 4),)))
    with pytest.raises(ConfigError, match="holds the program's state"):
        ferry.Module(program, microbatches=2).load_method()


# ------------------------------------------------------------------ any map, any split



@st.composite
def pipelines(draw):
    k = draw(st.integers(2, 6))
    reads = [(draw(st.integers(0, i)), draw(st.integers(0, i))) for i in range(k)]
    glue = [draw(st.booleans()) for _ in range(k)]
    devices = [draw(st.sampled_from(["emu:0", "emu:1", "emu:2", "cpu"])) for _ in range(k)]
    parts = draw(st.integers(1, 4))
    calls = draw(st.lists(st.integers(1, 2 * parts), min_size=1, max_size=3))
    return reads, glue, devices, parts, calls, draw(st.booleans()), draw(st.booleans())


@settings(max_examples=DAG_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_any_map_split_into_any_parts_equals_eager_on_an_asynchronous_device(case):
    """Random graphs, random maps over three simulated GPUs and the CPU (host stages anywhere),
    random part counts and batch sizes, graphs or not: every part's hazards are covered."""
    reads, glue, devices, parts, calls, graphs, dynamic = case
    model = RandomDag(reads, glue).eval()
    with emulated_device(num_devices=3, asynchronous=True):
        shapes = ({0: torch.export.Dim("batch", max=8)},) if dynamic else None  # parts bound per shape
        ep = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes=shapes)
        program = ferry.compile(ep, device_map={f"ms.{i}": d for i, d in enumerate(devices)})
        module = ferry.Module(program, microbatches=parts, cuda_graphs=graphs)
        for i, rows in enumerate(calls * 2):  # each size twice: graphs capture on later calls
            x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(i))
            for got, want in zip(module(x), model(x)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


class Double(nn.Module):
    def forward(self, x):
        return x * 2


def test_a_dynamic_size_beyond_the_batch_is_refused(emu):
    """Joined outputs are made at the program's other sizes: a dynamic sequence would come back
    at its bound (found by review). One program per sequence length, or no micro-batches."""
    dims = {0: torch.export.Dim("b", max=8), 1: torch.export.Dim("s", max=16)}
    ep = torch.export.export(Double(), (torch.randn(4, 5, 3),), dynamic_shapes=(dims,))
    with pytest.raises(ConfigError, match="dynamic size beyond the batch"):
        ferry.Module(ferry.compile(ep), microbatches=2).load_method()

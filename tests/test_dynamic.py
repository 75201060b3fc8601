"""Dynamic sizes at static speed: a plan bound per shape, cached; shape buckets for graphs."""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import ferry
from ferry import ConfigError, InputError
from ferry.program.footprint import load_pieces
from ferry.runtime import clone_to, emulated_device
from ferry.runtime.stages import method as method_module
from models import launched_streams, loaded_method, one_per_device
from test_device_map import DAG_EXAMPLES, RandomDag, TinyLM

BATCH, SEQ = torch.export.Dim("batch", max=8), torch.export.Dim("seq", max=32)

# PyTorch reports an out= tensor resized from a non-empty shape either on stderr (checked at the
# file-descriptor level below) or as a Python UserWarning: both fail these tests
pytestmark = pytest.mark.filterwarnings("error::UserWarning")


def encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


def compiled(model, example, dims, device="emu:0"):
    ep = torch.export.export(model, example, dynamic_shapes=(dims,))
    return ferry.compile(ep, ferry.OpSupportPartitioner(device) if device != "cpu" else None)


@contextlib.contextmanager
def stderr_at_fd():
    """What C++ code writes to file descriptor 2 (PyTorch's warnings), which Python cannot filter."""
    captured: list[str] = []
    with tempfile.TemporaryFile(mode="w+") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            captured.append(f.read())


def sizes(n: int, seed: int, seq: bool):
    rng = random.Random(seed)
    return [(rng.randint(1, 8), rng.randint(2, 32) if seq else 16) for _ in range(n)]


@pytest.mark.parametrize("device", ["cpu", "emu:0"])
@pytest.mark.parametrize("seq", [False, True], ids=["batch", "batch-x-seq"])
def test_an_encoder_at_many_sizes_in_random_order_equals_eager(emu_any, device, seq):
    model = encoder()
    program = compiled(model, (torch.randn(4, 16, 32),), {0: BATCH, 1: SEQ} if seq else {0: BATCH}, device)
    module = ferry.Module(program)
    calls = sizes(30, 1, seq)
    with stderr_at_fd() as err:
        for i, (b, s) in enumerate(calls):
            x = torch.randn(b, s, 32, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    assert "Resize" not in err[0] and "resized" not in err[0], err[0]
    assert loaded_method(module).shape_plans() == len(set(calls))  # one plan per shape, built once


class _EmbedProject(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.proj = nn.Embedding(128, 64), nn.Linear(64, 128)

    def forward(self, ids):
        return self.proj(torch.relu(self.embed(ids)))


def test_a_shape_met_again_with_other_strides_after_another_shape_equals_eager_without_resizing(emu):
    """A view of a shape already called (a new key: strides differ) runs the generic plan, whose
    delegate then runs its plan bound at that shape: the delegate's outputs, left at the previous
    call's size, are emptied first instead of resized by the kernels (ATen's warning on stderr)."""
    torch.manual_seed(0)
    model = _EmbedProject().eval()
    program = compiled(model, (torch.randint(0, 128, (2, 8)),), {0: torch.export.Dim("b", max=4), 1: SEQ})
    module = ferry.Module(program)
    calls = [torch.randint(0, 128, (1, 6)), torch.randint(0, 128, (2, 29)), torch.randint(0, 128, (1, 9))[:, 2:8],
             torch.randint(0, 128, (3, 30))[1:2, ::5], torch.randint(0, 128, (1, 6))]
    with stderr_at_fd() as err:
        for ids in calls:
            with torch.no_grad():
                torch.testing.assert_close(module(ids), model(ids), atol=1e-5, rtol=1e-4)
    assert "Resize" not in err[0] and "resized" not in err[0], err[0]


class Scale(nn.Module):
    def forward(self, x):
        return x * 2 + 1  # the delegate's last kernel writes its output with out=


@pytest.mark.parametrize("graphs", [False, True])
def test_no_resize_warning_when_a_delegate_writes_its_output_at_a_new_size(emu_async, graphs):
    program = compiled(Scale(), (torch.randn(8, 16),), {0: torch.export.Dim("batch", max=64)})
    module = ferry.Module(program, cuda_graphs=graphs)
    with stderr_at_fd() as err, warnings.catch_warnings():
        warnings.simplefilter("error")  # and no Python warning either: a new shape gets its own graphs
        for n in (8, 8, 8, 5, 5, 5, 64, 8, 5, 1):
            x = torch.randn(n, 16)
            torch.testing.assert_close(module(x), Scale()(x))
    assert "Resize" not in err[0], err[0]
    m = loaded_method(module)
    assert m.shape_plans() == 4
    if graphs:
        assert sum(g.graph is not None for g in m.graphs) == 2  # the shapes called three times


KEEP_ON_DEVICE = ferry.CompileConfig(
    propagate_device=ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True))


@pytest.mark.parametrize("outputs", ["copy", "view"])
def test_a_dynamic_program_with_device_inputs_and_outputs_is_captured_per_shape(emu_async, outputs):
    """Inputs and outputs kept on the device (the skip flags) are staged at the bound when graphs
    are asked for: each shape's own plan views them at its size and is captured; a caller's
    input laid out otherwise (a slice of a wider tensor) is taken as it is, without graphs."""
    model = TinyLM(layers=2).eval()
    ep = torch.export.export(model, (torch.randint(0, 32, (4, 16)),), dynamic_shapes=({0: BATCH, 1: SEQ},))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"), KEEP_ON_DEVICE)
    module = ferry.Module(program, cuda_graphs=True, outputs=outputs)
    module.load_method()  # staging at the bound is memory counted before loading allocates it: in its one allocation
    pieces = load_pieces(program, program.method("forward"), stage_io=True)
    assert emu_async.live_allocations == 1
    assert emu_async.live_bytes == one_per_device((p.nbytes, p.device.index) for p in pieces if p.device.type == "emu")[0][0]
    wide = torch.randint(0, 32, (8, 32), generator=torch.Generator().manual_seed(9))
    calls = [(2, 16)] * 3 + [(4, 5)] * 3 + [(2, 16), (1, 32), (4, 5), "slice", "slice", "slice"]
    for i, shape in enumerate(calls):
        x = wide[:3, :7] if shape == "slice" else torch.randint(0, 32, shape, generator=torch.Generator().manual_seed(i))
        got = module(clone_to(wide, "emu:0")[:3, :7] if shape == "slice" else clone_to(x, "emu:0"))
        torch.testing.assert_close(clone_to(got, "cpu"), model(x), atol=1e-5, rtol=1e-4)
    m = loaded_method(module)
    assert sum(g.graph is not None for g in m.graphs) >= 2  # the two shapes called three times


def test_the_graph_report_says_what_each_shape_captured(emu_async):
    model = TinyLM(layers=2).eval()
    ep = torch.export.export(model, (torch.randint(0, 32, (4, 16)),), dynamic_shapes=({0: BATCH, 1: SEQ},))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"), KEEP_ON_DEVICE), cuda_graphs=True)
    assert module.graph_report() == []  # no shape seen yet
    for shape in [(2, 16)] * 4 + [(4, 5)] * 2:  # a shape gets its own plan after its first call, captured on a later one
        module(clone_to(torch.randint(0, 32, shape), "emu:0"))
    by_shape = {r.shapes: r for r in module.graph_report()}
    assert set(by_shape) == {((2, 16),), ((4, 5),)}
    assert by_shape[((2, 16),)].captured >= 1 and by_shape[((2, 16),)].waiting == 0
    assert by_shape[((4, 5),)].captured == 0 and by_shape[((4, 5),)].waiting >= 1  # captured on its next call
    assert not any(r.eager for r in by_shape.values())


def test_with_graphs_a_dynamic_methods_first_call_at_each_shape_runs_on_the_capture_stream(emu_async, monkeypatch):
    """Each new shape's first call runs through the plan bound without graphs (it records the
    sizes); with graphs that plan launches its device work on the capture stream as the captured
    plans do, so on CUDA the caller's stream makes no cuBLAS workspace of its own (32 MiB). Results
    equal eager's in any order of shapes."""
    launched_on = launched_streams(emu_async.streams_api(), monkeypatch)
    model = TinyLM(layers=2).eval()
    ep = torch.export.export(model, (torch.randint(0, 32, (4, 16)),), dynamic_shapes=({0: BATCH, 1: SEQ},))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"), KEEP_ON_DEVICE), cuda_graphs=True,
                          outputs="view")
    per_call = []
    for shape in [(2, 16), (4, 5), (2, 16), (2, 16), (3, 7), (4, 5), (4, 5), (2, 16)]:
        ids = torch.randint(0, 32, shape)
        launched_on.clear()
        got = module(clone_to(ids, "emu:0"))
        per_call.append((shape, list(launched_on)))
        torch.testing.assert_close(clone_to(got, "cpu"), model(ids), atol=1e-5, rtol=1e-4)
    (capture,) = {g.streams.capture_stream(g.index).name for g in loaded_method(module).graphs}
    firsts = [names for i, (shape, names) in enumerate(per_call) if shape not in [s for s, _ in per_call[:i]]]
    assert len(firsts) == 3 and all(capture in names and "default" not in names for names in firsts)
    # later calls at a shape (its own plan): at most the input staged into its fixed memory
    assert all(names.count("default") <= 1 for _, names in per_call)


def test_graphs_asked_of_a_program_with_no_device_work_say_so_once(emu):
    model = TinyLM(layers=1).eval()
    program = ferry.compile(torch.export.export(model, (torch.randint(0, 32, (2, 8)),)))  # all on the CPU
    with pytest.warns(RuntimeWarning, match="captures no graph: none of its work runs on a GPU"):
        module = ferry.Module(program, cuda_graphs=True)
        module.load_method()
    (report,) = module.graph_report()
    assert (report.shapes, report.captured, report.waiting) == (None, 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = torch.randint(0, 32, (2, 8))
        torch.testing.assert_close(module(x), model(x))


def test_a_decoder_with_a_dynamic_batch_and_sequence_equals_eager(emu_async):
    model = TinyLM(layers=2).eval()
    program = compiled(model, (torch.randint(0, 32, (4, 16)),), {0: BATCH, 1: SEQ})
    module = ferry.Module(program)
    for i, (b, s) in enumerate(sizes(12, 2, True) * 2):  # each shape twice: its own plan the second time
        x = torch.randint(0, 32, (b, s), generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)


def test_later_calls_at_a_shape_run_the_plan_bound_for_it(emu):
    model = encoder()
    module = ferry.Module(compiled(model, (torch.randn(4, 16, 32),), {0: BATCH}))
    loaded_first = module(torch.randn(3, 16, 32))  # noqa: F841 - the first call at 3 rows
    m = loaded_method(module)
    generic = m.plan
    x = torch.randn(3, 16, 32)
    torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    assert m.last_plan is not generic
    steps = [s for s in m.last_plan.bound.steps if s is not None]
    # bound at one shape: no size is computed per call, and the delegate is bound to fixed tensors
    assert not any(s.kind == "size" for s in steps)
    assert all(not s.reads for s in steps if s.kind == "delegate")


def test_fresh_outputs_are_made_at_their_real_size(emu):
    """An output made for the caller each call (not planned) is allocated at the call's size on
    the plan bound for it, not at the bound and shrunk."""
    model = Scale()
    ep = torch.export.export(model, (torch.randn(8, 16),), dynamic_shapes=({0: BATCH},))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"), ferry.CompileConfig(alloc_graph_output=False))
    vid = program.method("forward").outputs[0]
    assert program.method("forward").tensor(vid).storage == "output"
    module = ferry.Module(program)
    for _ in range(3):  # the first call at the size, then its own plan
        x = torch.randn(2, 16)
        out = module(x)
        torch.testing.assert_close(out, model(x))
    assert out.untyped_storage().nbytes() == out.nbytes


def test_only_the_last_shapes_keep_a_plan(emu, monkeypatch):
    monkeypatch.setattr(method_module, "SHAPES_KEPT", 2)
    model = encoder()
    module = ferry.Module(compiled(model, (torch.randn(4, 16, 32),), {0: BATCH}))
    for i, b in enumerate([1, 2, 3, 1, 2, 3, 3, 1]):
        x = torch.randn(b, 16, 32, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    assert loaded_method(module).shape_plans() == 2


def test_a_call_beyond_the_bound_is_refused_and_the_module_stays_usable(emu):
    model = encoder()
    module = ferry.Module(compiled(model, (torch.randn(4, 16, 32),), {0: BATCH}))
    with pytest.raises(InputError, match="<=8"):
        module(torch.randn(9, 16, 32))
    x = torch.randn(5, 16, 32)
    torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)


def test_the_copy_report_says_which_bytes_are_at_the_bound(emu):
    program = compiled(encoder(), (torch.randn(4, 16, 32),), {0: BATCH, 1: SEQ})
    text = str(program.copy_report("forward"))
    assert "[<=8, <=32, 32]" in text and "at the bound" in text and "at most" in text
    static = ferry.compile(torch.export.export(encoder(), (torch.randn(4, 16, 32),)),
                           ferry.OpSupportPartitioner("emu:0"))
    assert "at the bound" not in str(static.copy_report("forward"))


# ---- shape buckets


def test_buckets_capture_one_graph_set_per_bucket_and_slice_results(emu_async):
    model = encoder()
    program = compiled(model, (torch.randn(4, 16, 32),), {0: BATCH})
    module = ferry.Module(program, cuda_graphs=True, shape_buckets=[2, 4, 8])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning storm: not one
        for i, b in enumerate([1, 3, 8, 2, 5, 7, 1, 4, 6, 3, 8, 2] * 2):
            x = torch.randn(b, 16, 32, generator=torch.Generator().manual_seed(i))
            got = module(x)
            assert got.shape == (b, 16, 32)
            torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)
    m = loaded_method(module)
    assert m.shape_plans() == 3
    assert m.graphs and all(g.graph is not None for g in m.graphs)


def test_a_call_beyond_the_buckets_runs_without_graphs_and_warns_once(emu_async):
    model = encoder()
    module = ferry.Module(compiled(model, (torch.randn(4, 16, 32),), {0: BATCH}), cuda_graphs=True,
                          shape_buckets=[1, 2, 4])
    with pytest.warns(RuntimeWarning, match="beyond the largest shape bucket") as record:
        for i, b in enumerate([6, 7, 6, 6, 7]):
            x = torch.randn(b, 16, 32, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    assert len([w for w in record if "bucket" in str(w.message)]) == 1
    assert loaded_method(module).graphs == []


@pytest.mark.parametrize("buckets", [[0, 2], "1,2", [], 4, [2.0], [True]])
def test_buckets_that_are_not_batch_sizes_are_refused_at_once(buckets):
    with pytest.raises(ConfigError, match="ints >= 1"):
        ferry.Module(ferry.compile(torch.export.export(Scale(), (torch.randn(2, 3),))), shape_buckets=buckets)


def test_a_bucket_beyond_the_planned_batch_is_refused_at_load(emu):
    module = ferry.Module(compiled(encoder(), (torch.randn(4, 16, 32),), {0: BATCH}), shape_buckets=[16])
    with pytest.raises(ConfigError, match="larger than the batch the program was planned for"):
        module.load_method()


def test_buckets_need_a_dynamic_batch(emu):
    static = ferry.compile(torch.export.export(encoder(), (torch.randn(4, 16, 32),)))
    with pytest.raises(ConfigError, match="dim 0 of its inputs is static"):
        ferry.Module(static, shape_buckets=[2, 4]).load_method()
    with pytest.raises(ConfigError, match="pick one"):
        ferry.Module(static, shape_buckets=[2, 4], microbatches=2)


# ---- on a GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_dynamic_sizes_on_a_gpu_equal_eager(full_fp32, graphs):
    """Without graphs: batch and sequence both dynamic. With graphs: a dynamic batch in buckets."""
    model = encoder()
    dims = {0: BATCH} if graphs else {0: BATCH, 1: SEQ}
    program = compiled(model, (torch.randn(4, 16, 32),), dims, "cuda:0")
    module = ferry.Module(program, cuda_graphs=graphs, shape_buckets=[1, 2, 4, 8] if graphs else None)
    with stderr_at_fd() as err, warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (b, s) in enumerate(sizes(24, 3, not graphs)):
            x = torch.randn(b, s, 32, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    assert "Resize" not in err[0], err[0]
    m = loaded_method(module)
    if graphs:
        assert m.shape_plans() <= 4 and any(g.graph is not None for g in m.graphs)


class Echo(nn.Module):
    def forward(self, x):
        return x * 2, x, x.sum(0)


def test_buckets_refuse_an_output_without_the_batch(emu):
    ep = torch.export.export(Echo(), (torch.randn(4, 16),), dynamic_shapes=({0: BATCH},))
    with pytest.raises(ConfigError, match="output 2 does not carry the batch"):
        ferry.Module(ferry.compile(ep), shape_buckets=[4, 8]).load_method()


class EchoRows(nn.Module):
    def forward(self, x):
        return x * 2, x


def test_a_padded_call_returns_tensors_the_caller_owns(emu):
    """An output that is the input itself is a view of the padded tensor the buckets reuse: the
    caller gets a copy, which the next call does not overwrite (found by review)."""
    ep = torch.export.export(EchoRows(), (torch.randn(4, 16),), dynamic_shapes=({0: BATCH},))
    cfg = ferry.CompileConfig(alloc_graph_input=False, alloc_graph_output=False)
    module = ferry.Module(ferry.compile(ep, None, cfg), shape_buckets=[4, 8])
    x1, x2 = torch.randn(3, 16), torch.randn(3, 16)
    doubled, echo = module(x1)
    module(x2)
    assert torch.equal(echo, x1) and torch.equal(doubled, x1 * 2)


def test_a_padded_call_hands_back_its_rows_of_a_fresh_output_without_a_copy(emu):
    """A fresh output is the caller's already: the call's rows are a view of it, which later
    calls leave alone; padding rows are real rows (copies of the call's first)."""
    ep = torch.export.export(EchoRows(), (torch.randn(4, 16),), dynamic_shapes=({0: BATCH},))
    cfg = ferry.CompileConfig(alloc_graph_output=False)  # outputs fresh per call
    module = ferry.Module(ferry.compile(ep, None, cfg), shape_buckets=[4, 8])
    x1, x2 = torch.randn(7, 16), torch.randn(5, 16)
    doubled, echo = module(x1)
    assert doubled._base is not None and doubled._base.shape[0] == 8  # rows of the padded result, not a copy
    assert echo._base is None or echo.untyped_storage().data_ptr() != x1.untyped_storage().data_ptr()
    again, _ = module(x2)
    torch.testing.assert_close(doubled, x1 * 2)
    torch.testing.assert_close(again, x2 * 2)
    # internal: the bucket's padded copy of the inputs is where the first call at the bucket pads them
    padded = next(iter(module._instances[0].buckets["forward"]._padded.values()))  # the first call at the bucket
    assert torch.equal(padded[:7], x1) and torch.equal(padded[7], x1[0])
    m = loaded_method(module)  # later ones: padded as they are copied into planned memory, one copy
    planned = m.last_plan.bound.slots[m.method.inputs[0]]
    assert m.last_plan is not m.plan and planned.shape == (8, 16)
    assert torch.equal(planned[:5], x2) and torch.equal(planned[5:], x2[:3])


class Total(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("t", torch.zeros(()))

    def forward(self, x):
        self.t.add_(x.sum())
        return x * self.t


def test_buckets_refuse_a_method_with_state_but_shapes_alone_keep_it_right(emu):
    ep = torch.export.export(Total(), (torch.ones(2, 4),), dynamic_shapes=({0: BATCH},))
    program = ferry.compile(ep)
    with pytest.raises(ConfigError, match="holds the program.s state"):
        ferry.Module(program, shape_buckets=[4, 8]).load_method()
    module, eager = ferry.Module(program), Total()
    for i, b in enumerate([3, 3, 5, 3, 5, 5]):  # per-shape plans share the buffer's memory
        x = torch.randn(b, 4, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(module(x), eager(x), atol=1e-5, rtol=1e-5)


class Flatten(nn.Module):
    def forward(self, x):
        return (x * 2).reshape(x.shape[0] * 4, 8) + 1  # exported as aten.view


def test_a_caller_layout_a_kernel_follows_is_laid_out_as_planned(emu):
    """Bound per call, a transposed input makes `x * 2` follow its layout; planned memory of a
    dynamic size is laid out contiguously after the kernel, so the traced view fits and that shape
    gets a plan of its own (before: it kept the generic plan, with a warning)."""
    ep = torch.export.export(Flatten(), (torch.randn(4, 4, 8),), dynamic_shapes=({0: BATCH},))
    module = ferry.Module(ferry.compile(ep, None, ferry.CompileConfig(alloc_graph_input=False)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "without a plan of their own"
        for i in range(3):
            x = torch.randn(3, 8, 4, generator=torch.Generator().manual_seed(i)).transpose(1, 2)
            torch.testing.assert_close(module(x), Flatten()(x))
    x = torch.randn(3, 4, 8)  # contiguous: the same shape with another layout gets its own plan
    for _ in range(2):
        torch.testing.assert_close(module(x), Flatten()(x))


def test_bad_calls_with_buckets_are_input_errors_and_leave_the_module_usable(emu_async):
    model = encoder()
    module = ferry.Module(compiled(model, (torch.randn(4, 16, 32),), {0: BATCH}), cuda_graphs=True,
                          shape_buckets=[2, 4, 8])
    with pytest.raises(InputError, match="batched tensors"):
        module(3.0)
    with pytest.raises(InputError, match="must be float32"):
        module(torch.zeros(3, 16, 32, dtype=torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not "beyond the largest bucket": beyond what the program takes
        with pytest.raises(InputError, match="<=8"):
            module(torch.randn(9, 16, 32))
    for i, b in enumerate([3, 3, 3, 8]):
        x = torch.randn(b, 16, 32, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)


# ---- any map, any sizes



@st.composite
def dynamic_cases(draw):
    k = draw(st.integers(2, 6))
    reads = [(draw(st.integers(0, i)), draw(st.integers(0, i))) for i in range(k)]
    glue = [draw(st.booleans()) for _ in range(k)]
    devices = [draw(st.sampled_from(["emu:0", "emu:1", "cpu"])) for _ in range(k)]
    sizes_ = draw(st.lists(st.integers(1, 8), min_size=2, max_size=8))
    buckets = draw(st.sampled_from([None, [2, 4, 8], [1, 3], [8]]))
    return reads, glue, devices, sizes_, buckets, draw(st.booleans())


@settings(max_examples=DAG_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dynamic_cases())
def test_any_map_at_any_sizes_equals_eager_on_an_asynchronous_device(case):
    """Random graphs over two simulated GPUs and the CPU, exported with a dynamic batch, called
    at random sizes (each twice, so per-shape plans and their graphs run), with or without
    buckets and graphs."""
    reads, glue, devices, calls, buckets, graphs = case
    model = RandomDag(reads, glue).eval()
    with emulated_device(num_devices=2, asynchronous=True), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # calls beyond the buckets say so, once
        ep = torch.export.export(model, (torch.randn(4, 4),), dynamic_shapes=({0: BATCH},))
        program = ferry.compile(ep, device_map={f"ms.{i}": d for i, d in enumerate(devices)})
        module = ferry.Module(program, cuda_graphs=graphs, shape_buckets=buckets)
        for i, rows in enumerate(calls * 2):
            x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(i))
            for got, want in zip(module(x), model(x)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


class SeqFirst(nn.Module):
    def forward(self, x):
        return (x * 2).transpose(0, 1).contiguous()  # [seq, batch, d]: dim 0 is not the batch


def test_buckets_refuse_a_program_whose_batch_bound_another_dim_shares(emu):
    """ferry knows which dims are dynamic, not which symbol each is: an output [seq, batch, ...]
    with both bounds 8 would be sliced on its sequence (found by review)."""
    same = torch.export.Dim("seq8", max=8)
    ep = torch.export.export(SeqFirst(), (torch.randn(4, 5, 3),), dynamic_shapes=({0: BATCH, 1: same},))
    with pytest.raises(ConfigError, match="another dynamic dim with the batch's bound"):
        ferry.Module(ferry.compile(ep), shape_buckets=[4, 8]).load_method()
    ep = torch.export.export(SeqFirst(), (torch.randn(4, 5, 3),), dynamic_shapes=({0: BATCH, 1: SEQ},))
    with pytest.raises(ConfigError, match="output 0 does not carry the batch"):  # bounds differ: told apart
        ferry.Module(ferry.compile(ep), shape_buckets=[4, 8]).load_method()


def test_buckets_pad_the_batch_of_a_program_with_a_dynamic_sequence(emu_async):
    model = encoder()
    module = ferry.Module(compiled(model, (torch.randn(4, 16, 32),), {0: BATCH, 1: SEQ}), cuda_graphs=True,
                          shape_buckets=[4, 8])
    for i, (b, s) in enumerate(sizes(10, 5, True) * 2):
        x = torch.randn(b, s, 32, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)


def test_buckets_pad_inputs_the_caller_passes_on_the_device(emu_async):
    """skip_h2d: the caller's tensors are on the device, and so is their padding."""
    model = encoder()
    cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(True, False))
    ep = torch.export.export(model, (torch.randn(4, 16, 32),), dynamic_shapes=({0: BATCH},))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"), cfg), shape_buckets=[4, 8])
    from ferry.runtime import clone_to

    for i, b in enumerate([3, 5, 3, 8]):
        x = torch.randn(b, 16, 32, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(module(clone_to(x, "emu:0")), model(x), atol=1e-5, rtol=1e-4)


class Joins(nn.Module):
    """cat and stack along every kind of dim, and views of a dynamic tensor (dim 0 is the batch)."""

    def __init__(self, kind: int):
        super().__init__()
        self.kind = kind

    def forward(self, x, y):
        h = x * 2
        if self.kind == 0:
            return torch.cat([h, h], 1)
        if self.kind == 1:
            return torch.cat([h, y], 0)
        if self.kind == 2:
            return torch.cat([h, h], -1) + 1
        if self.kind == 3:
            return torch.stack([h, h]).sum(0), torch.stack([h, x], 1)
        return h[:, 1:], h.transpose(0, 1)[1]


@pytest.mark.parametrize("kind", range(5))
@pytest.mark.parametrize("device", ["cpu", "emu:0"])
def test_a_call_after_a_smaller_one_takes_its_own_size(emu, kind, device):
    """Every output and intermediate takes this call's size whatever sizes came before (the
    issue: cat at batch 4, 2, 4 returned the second call's shape on the third)."""
    b, c = torch.export.Dim("b", max=16), torch.export.Dim("c", max=16)
    ep = torch.export.export(Joins(kind), (torch.randn(4, 4), torch.randn(5 if kind == 1 else 4, 4)),
                             dynamic_shapes=({0: b}, {0: c if kind == 1 else b}))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner(device) if device != "cpu" else None))
    for n in (4, 2, 4, 15, 1, 3, 15, 2):
        x, y = torch.randn(n, 4), torch.randn(n + 1 if kind == 1 else n, 4)
        got, want = module(x, y), Joins(kind)(x, y)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=0, atol=0)


class _TwoBatches(torch.nn.Module):
    def forward(self, a, b, c):
        return a * 2 + b, c.sum(0)


def _two_batches_program():
    batch, other = torch.export.Dim("batch", max=16), torch.export.Dim("other", max=16)
    example = (torch.randn(4, 3), torch.randn(4, 3), torch.randn(6, 2))
    ep = torch.export.export(_TwoBatches(), example, dynamic_shapes=({0: batch}, {0: batch}, {0: other}))
    return ferry.compile(ep)


def test_inputs_that_disagree_on_one_dynamic_size_are_an_input_error():
    """Two inputs exported with one Dim: sizes that disagree are an InputError naming both, on a
    first call and after a call at another shape; the module stays usable and equal to eager."""
    program = ferry.load_program(_two_batches_program().to_bytes())  # the groups survive the file
    assert program.method("forward").equal_sizes == [[[0, 0], [1, 0]]]  # c's own Dim is not grouped
    module = ferry.Module(program)
    with pytest.raises(ferry.InputError, match=r"input 0 \('a'\) dim 0 is 4, input 1 \('b'\) dim 0 is 5"):
        module(torch.randn(4, 3), torch.randn(5, 3), torch.randn(6, 2))
    for n in (3, 7):
        a, b, c = torch.randn(n, 3), torch.randn(n, 3), torch.randn(n + 2, 2)
        got = module(a, b, c)
        want = _TwoBatches()(a, b, c)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    with pytest.raises(ferry.InputError, match=r"input 0 \('a'\) dim 0 is 7, input 1 \('b'\) dim 0 is 3"):
        module(torch.randn(7, 3), torch.randn(3, 3), torch.randn(2, 2))


def test_a_file_naming_a_static_dim_as_one_dynamic_size_is_refused():
    program = _two_batches_program()
    program.method("forward").equal_sizes = [[[0, 1], [1, 0]]]  # dim 1 of input 0 is static
    with pytest.raises(ferry.ProgramError, match=r"equal_sizes names \[0, 1\], not a dynamic dim"):
        ferry.load_program(program.to_bytes())


class _LongOnly(torch.nn.Module):
    """A graph traced at t >= 5 took the branch of long inputs: wrong at t = 3."""

    def forward(self, x):
        return x.cumsum(1) if x.shape[1] > 4 else x * 2


def test_a_size_below_the_exported_minimum_is_an_input_error_as_in_export():
    """export's module checks a minimum above 2 (none of 2 or less, which its 0/1 specialisation
    assumes away); ferry checks the same, from the file, and stays usable."""
    t = torch.export.Dim("t", min=5, max=16)
    ep = torch.export.export(_LongOnly(), (torch.randn(2, 8),), dynamic_shapes=({1: t},))
    program = ferry.load_program(ferry.compile(ep).to_bytes())
    assert program.method("forward").size_minimums == [[0, 1, 5]]
    module = ferry.Module(program)
    for n in (3, 4):
        with pytest.raises(ferry.InputError, match=rf"input 0 \('x'\) dim 1 of 'forward' is {n}, below 5"):
            module(torch.randn(2, n))
        with pytest.raises(AssertionError, match="Guard failed"):
            ep.module()(torch.randn(2, n))  # export refuses it too
    for n in (5, 16, 9):
        x = torch.randn(2, n)
        torch.testing.assert_close(module(x), _LongOnly()(x))


class _Ramp(nn.Module):
    def forward(self, x, n: int):
        torch._check(n >= 4)
        torch._check(n <= 6)
        return torch.arange(n, dtype=x.dtype) * x.sum()


def test_an_int_input_outside_its_exported_range_is_an_input_error():
    """An int input is checked each call against the bound its memory is planned for and a minimum
    above 2, as export's module checks them; within them the result equals eager."""
    ep = torch.export.export(_Ramp(), (torch.randn(3), 5), dynamic_shapes=(None, torch.export.Dim.DYNAMIC))
    program = ferry.load_program(ferry.compile(ep).to_bytes())
    module = ferry.Module(program)
    with pytest.raises(ferry.InputError, match=r"input 1 of 'forward' is 7, above 6"):
        module(torch.randn(3), 7)
    with pytest.raises(ferry.InputError, match=r"input 1 of 'forward' is 3, below 4"):
        module(torch.randn(3), 3)
    with pytest.raises(ferry.InputError, match=r"input 1 of 'forward' must be an int, got float"):
        module(torch.randn(3), 5.0)
    for n in (4, 6, 5):
        x = torch.randn(3)
        torch.testing.assert_close(module(x, n), _Ramp()(x, n))


class _Rows(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        return self.proj(x).relu()


def _rows_from_four():
    torch.manual_seed(0)
    model = _Rows().eval()
    ep = torch.export.export(model, (torch.randn(6, 8),), dynamic_shapes=({0: torch.export.Dim("b", min=4, max=16)},))
    return model, ferry.compile(ep)


def test_a_minimum_is_checked_at_the_callers_batch_and_at_the_batch_the_call_runs_at():
    """A call below the minimum is refused as ep.module() refuses it, even where a shape bucket
    would pad it above (the model may branch on the batch: eager would answer it otherwise);
    split into micro-batches, no part is below it (10 rows in 3 parts: 5 + 5, not 4 + 4 + 2)."""
    model, program = _rows_from_four()
    module = ferry.Module(program, shape_buckets=[4, 8, 16])
    for b in (3, 1):
        with pytest.raises(ferry.InputError, match=f"is {b}, below 4"):
            module(torch.randn(b, 8))
    for b in (8, 5, 4):
        x = torch.randn(b, 8)
        torch.testing.assert_close(module(x), model(x))
    split = ferry.Module(program, microbatches=3)
    assert split.parts("forward", [torch.randn(10, 8)]) == 2  # parts of 5 and 5
    for b in (10, 16):
        x = torch.randn(b, 8)
        torch.testing.assert_close(split(x), model(x))
    with pytest.raises(ferry.InputError, match="is 3, below 4"):
        split(torch.randn(3, 8))


def test_an_int_input_may_be_any_integer_and_must_equal_the_size_it_was_traced_as():
    """NumPy and 0-dim tensor integers pass for an int input as they do in eager; an int input
    export traced as one size with a tensor's dim is checked equal to it, as export's module
    checks it (before, a branch taken at n == t ran at n != t)."""

    class Pick(nn.Module):
        def forward(self, x, n: int):
            return x * 2 if n == x.shape[1] else x * 3

    ep = torch.export.export(Pick(), (torch.randn(2, 5), 5),
                             dynamic_shapes=({1: torch.export.Dim("t", max=8)}, torch.export.Dim.DYNAMIC))
    module = ferry.Module(ferry.load_program(ferry.compile(ep).to_bytes()))
    with pytest.raises(ferry.InputError, match=r"input 0 \('x'\) dim 1 is 5, input 1 is 4"):
        module(torch.randn(2, 5), 4)
    for n in (5, np.int64(5), torch.tensor(5)):
        x = torch.randn(2, 5)
        torch.testing.assert_close(module(x, n), Pick()(x, 5))


class _Pairs(nn.Module):
    def forward(self, x, y):
        return x.repeat(2, 1) + y


def test_a_size_exported_as_an_expression_of_another_inputs_size_is_checked_against_it():
    """y's rows exported as 2 * x's: a call where they are not is an InputError naming both, as
    export's module refuses it; the file keeps the relation."""
    b = torch.export.Dim("b", max=8)
    ep = torch.export.export(_Pairs(), (torch.randn(3, 4), torch.randn(6, 4)), dynamic_shapes=({0: b}, {0: 2 * b}))
    program = ferry.load_program(ferry.compile(ep).to_bytes())
    assert program.method("forward").derived_sizes == [[1, 0, 2, 0, 0, 0]]
    module = ferry.Module(program)
    with pytest.raises(ferry.InputError, match=r"input 1 \('y'\) dim 0 of 'forward' is 5; .* 2 \* \(input 0 \('x'\) dim 0\)"):
        module(torch.randn(3, 4), torch.randn(5, 4))
    for n in (3, 1, 8):
        x, y = torch.randn(n, 4), torch.randn(2 * n, 4)
        torch.testing.assert_close(module(x, y), _Pairs()(x, y))


@pytest.mark.parametrize("entry", [[0, 1, 2, 0, -1, 0], [1, 0, 0, 0, -1, 0], [1, 0, 2, 0, 0, 1], [1, 0, 2, 0]])
def test_a_file_with_a_derived_size_that_names_no_dynamic_size_is_refused(entry):
    b = torch.export.Dim("b", max=8)
    program = ferry.compile(torch.export.export(_Pairs(), (torch.randn(3, 4), torch.randn(6, 4)),
                                                dynamic_shapes=({0: b}, {0: 2 * b})))
    program.method("forward").derived_sizes = [entry]
    with pytest.raises(ferry.ProgramError, match="derived_sizes names"):
        ferry.load_program(program.to_bytes())


@pytest.mark.parametrize("entry, why", [([0, 0, 5], "not a dynamic size"), ([0, 1, 17], "outside 0..16"),
                                        ([1, 1, 5], "not a dynamic size"), ([0, 1], "not a dynamic size")])
def test_a_file_with_a_minimum_that_names_no_dynamic_size_or_exceeds_its_bound_is_refused(entry, why):
    t = torch.export.Dim("t", min=5, max=16)
    program = ferry.compile(torch.export.export(_LongOnly(), (torch.randn(2, 8),), dynamic_shapes=({1: t},)))
    program.method("forward").size_minimums = [entry]
    with pytest.raises(ferry.ProgramError, match=why):
        ferry.load_program(program.to_bytes())


def test_every_graph_of_a_set_shares_its_pool_and_capture_stream(emu_async):
    """One graph pool and one capture stream per device for all graphs of a set of planned
    memory (every shape's plan), another for each other set; shapes called in any order stay
    equal to eager."""
    model = TinyLM(layers=2).eval()
    ep = torch.export.export(model, (torch.randint(0, 32, (4, 16)),), dynamic_shapes=({0: BATCH, 1: SEQ},))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"), KEEP_ON_DEVICE), cuda_graphs=True,
                          concurrency=2)
    shapes = [(2, 16), (4, 5), (1, 9)]
    order = shapes * 10 + random.Random(0).choices(shapes, k=12)  # calls alternate between the sets
    for i, shape in enumerate(order):
        x = torch.randint(0, 32, shape, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(clone_to(module(clone_to(x, "emu:0")), "cpu"), model(x), atol=1e-5, rtol=1e-4)
    # internal: the sets' loaded methods hold the graphs they captured
    sets = [inst.methods["forward"] for inst in module._instances]
    for m in sets:
        graphs = [g.graph for g in m.graphs if g.graph is not None]
        assert len({id(g.pool) for g in graphs}) == 1 and len(graphs) >= len(shapes)
    pools = [next(g.graph.pool for g in m.graphs if g.graph is not None) for m in sets]
    assert pools[0] is not pools[1]
    assert [m.streams.capture_stream(0) for m in sets] == [m.streams.graph_memory.stream(m.streams.api, 0) for m in sets]
    assert sets[0].streams.capture_stream(0) is not sets[1].streams.capture_stream(0)

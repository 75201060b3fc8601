"""Real-GPU tests: the CUDA allocator, GPU delegates, async copies, CUDA graphs, ATen-mode
kernels, skip flags with device tensors. Skipped without a GPU (marker `cuda`)."""

from __future__ import annotations

import warnings

import pytest
import torch

import ferry
from ferry import Device
from ferry.errors import AllocationError, InputError
from ferry.examples import small_cnn, transformer_block
from ferry.runtime import DeviceMemoryBuffer, get_allocator
from models import loaded_method

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.usefixtures("full_fp32"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


class _Counting:
    """Counts copy calls of the registered CUDA allocator by direction, with bytes. Install it
    before loading (copies between planned tensors are bound at load) and `reset()` after, so
    the constants uploaded at load are not counted."""

    def __init__(self, monkeypatch):
        self.calls = []
        alloc = get_allocator("cuda")
        for name, direction in (("_copy_h2d", "h2d"), ("_copy_d2h", "d2h"), ("_copy_d2d", "d2d")):
            orig = getattr(alloc, name)

            def wrapped(*a, _orig=orig, _d=direction):
                self.calls.append((_d, a[2]))
                return _orig(*a)

            monkeypatch.setattr(alloc, name, wrapped)
        # internal: a bound copy skips the _copy_* hooks, so the binding is wrapped to count it too
        orig_bind = alloc._bind_copy

        def bind(direction, dst, src, nbytes, *indices):
            copy = orig_bind(direction, dst, src, nbytes, *indices)

            def counted():
                self.calls.append((direction, nbytes))
                return copy()

            return counted

        monkeypatch.setattr(alloc, "_bind_copy", bind)

    def reset(self):
        self.calls.clear()

    def totals(self):
        out = {"h2d": (0, 0), "d2h": (0, 0), "d2d": (0, 0)}
        for d, n in self.calls:
            c, b = out[d]
            out[d] = (c + 1, b + n)
        return out


def _compile(model, inputs, device="cuda:0", exclude=(), config=None):
    ep = torch.export.export(model, inputs)
    return ferry.compile(ep, ferry.OpSupportPartitioner(device, exclude=exclude), config)


# ---------------------------------------------------------------- allocator


def test_cuda_allocator_is_registered():
    assert type(get_allocator("cuda")).__name__ == "CudaAllocator"


def test_allocate_copy_both_ways_free():
    alloc = get_allocator("cuda")
    n = 1024
    mem = alloc.allocate(n, 0)
    assert mem.is_cuda and mem.numel() == n and mem.data_ptr() % 256 == 0
    src = torch.randint(0, 255, (n,), dtype=torch.uint8)
    alloc.copy_host_to_device(mem, src, n, 0)
    back = torch.empty(n, dtype=torch.uint8)
    alloc.copy_device_to_host(back, mem, n, 0)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    alloc.deallocate(mem, 0)


def test_current_device_index_and_errors():
    alloc = get_allocator("cuda")
    mem = alloc.allocate(64, -1)
    assert mem.device.index == torch.cuda.current_device()
    with pytest.raises(ValueError, match="-1 for the current device"):
        alloc.allocate(64, -2)
    with pytest.raises(Exception, match="out of range|GPU"):
        alloc.allocate(64, torch.cuda.device_count())
    for align in (256, 4096):
        assert alloc.allocate(100, 0, align).data_ptr() % align == 0
    with pytest.raises((ValueError, AllocationError)):
        alloc.allocate(64, 0, 300)


def test_out_of_memory_names_size_and_device():
    with pytest.raises(AllocationError) as e:
        DeviceMemoryBuffer.create(1 << 50, Device("cuda", 0))
    msg = str(e.value)
    assert str(1 << 50) in msg and "cuda:0" in msg


def test_zero_byte_copy_is_a_no_op():
    alloc = get_allocator("cuda")
    mem = alloc.allocate(0, 0)
    alloc.copy_host_to_device(mem, torch.empty(0, dtype=torch.uint8), 0, 0)


# ---------------------------------------------------------------- end to end


class Add(torch.nn.Module):
    def forward(self, a, b):
        return a + b


class Chain(torch.nn.Module):
    def forward(self, a, b):
        t = a + b
        return (t * a).relu() + b


@pytest.mark.parametrize("factory,exclude", [
    (transformer_block, ["aten.softmax"]),
    (small_cnn, ["aten.max_pool2d_with_indices"]),
    (transformer_block, []),
])
def test_models_match_eager_and_copies_match_report(factory, exclude, tmp_path, monkeypatch):
    model, example = factory()
    program = _compile(model, example, exclude=exclude)
    program.save(tmp_path / "m.ferry")
    module = ferry.Module(tmp_path / "m.ferry")
    counting = _Counting(monkeypatch)
    module.load_method()
    counting.reset()
    for _ in range(3):
        x = torch.randn_like(example[0])
        with torch.no_grad():
            want = model(x)
        got = module(x)
        assert got.device.type == "cpu"
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    rep = ferry.copy_report(program, "forward").totals()
    assert counting.totals() == {d: (n * 3, b * 3) for d, (n, b) in rep.items()}


def test_add_and_chain_on_gpu():
    for model in (Add(), Chain()):
        a, b = torch.randn(64, 32), torch.randn(64, 32)
        module = ferry.Module(_compile(model, (a, b)))
        for _ in range(3):
            a, b = torch.randn(64, 32), torch.randn(64, 32)
            torch.testing.assert_close(module(a, b), model(a, b))


def test_a_load_leaves_no_cached_memory_reserved():
    """Memory the caching allocator holds unused when a method loads (here a freed 256 MiB block)
    is handed back by the load: the process reserves what its tensors and the module hold."""
    model, (x,) = small_cnn()
    module = ferry.Module(_compile(model, (x,)))
    a = torch.ones(16, 16, device="cuda")
    torch.addmm(a[0], a, torch.mm(a, a))  # this stream's cuBLAS workspaces, which the load's timing (or a first
    del a  # call) would make: made later, the allocator would put them inside the freed block, held then
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()  # (earlier tests of the process may hold blocks of their own)
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del block
    assert torch.cuda.memory_reserved() - before >= 256 << 20
    module.load_method("forward")
    assert torch.cuda.memory_reserved() - before < 64 << 20  # the block went back; the load holds a little
    torch.testing.assert_close(module(x), model(x), atol=1e-4, rtol=1e-4)


def test_skip_flags_take_and_return_device_tensors():
    a, b = torch.randn(128, 64), torch.randn(128, 64)
    cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(True, True))
    program = _compile(Chain(), (a, b), config=cfg)
    rep = ferry.copy_report(program, "forward")
    assert rep.count() == 0
    module = ferry.Module(program)
    a, b = torch.randn(128, 64, device="cuda"), torch.randn(128, 64, device="cuda")
    out = module(a, b)
    assert out.is_cuda
    torch.testing.assert_close(out, Chain()(a, b))
    with pytest.raises(InputError, match="cuda:0"):
        module(a.cpu(), b.cpu())
    torch.testing.assert_close(module(a, b), Chain()(a, b))  # still usable


def test_prefill_decode_hand_off_stays_on_gpu(monkeypatch):
    class Prefill(torch.nn.Module):
        def forward(self, x):
            return (x * 2).tanh()

    class Decode(torch.nn.Module):
        def forward(self, h, y):
            return h + y.sin()

    x, y = torch.randn(8, 16), torch.randn(8, 16)
    eps = {"prefill": torch.export.export(Prefill(), (x,)), "decode": torch.export.export(Decode(), (x, y))}
    cfg = ferry.CompileConfig(propagate_device={
        "prefill": ferry.PropagateDeviceConfig(skip_d2h_for_method_outputs=True),
        "decode": ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True),
    })
    program = ferry.compile(eps, ferry.OpSupportPartitioner("cuda:0"), cfg)
    module = ferry.Module(program)
    counting = _Counting(monkeypatch)
    module.load_method("prefill")
    module.load_method("decode")
    counting.reset()
    h = module.run_method("prefill", [x])[0]
    assert h.is_cuda
    y_dev = y.cuda()
    out = module.run_method("decode", [h, y_dev])[0]
    torch.testing.assert_close(out.cpu(), Decode()(Prefill()(x), y))
    # prefill's input went up and decode's result came down; the hand-off itself never
    # touched the host (no d2h in prefill, no h2d in decode)
    assert counting.totals() == {"h2d": (1, x.nbytes), "d2h": (1, out.nbytes), "d2d": (0, 0)}
    assert ferry.copy_report(program, "prefill").count("d2h") == 0
    assert ferry.copy_report(program, "decode").count("h2d") == 0


def test_async_copies_are_complete_before_host_reads():
    """Large tensors, a CPU op reading a _d2h_copy result immediately, many iterations."""
    class M(torch.nn.Module):
        def forward(self, x):
            y = x * 3 + 1          # GPU
            z = torch.nn.functional.gelu(y)  # CPU fallback reads the d2h result at once
            return z * 2           # GPU again

    x = torch.randn(4096, 4096)  # 64 MiB
    program = _compile(M(), (x,), exclude=["aten.gelu"])
    assert ferry.copy_report(program, "forward").count("d2h") == 2
    module = ferry.Module(program, outputs="view")
    for _i in range(20):
        x = torch.randn(4096, 4096)
        got = module(x)
        torch.testing.assert_close(got, M()(x), atol=1e-5, rtol=1e-5)


def test_host_buffers_are_page_locked():
    model, example = transformer_block()
    module = ferry.Module(_compile(model, example, exclude=["aten.softmax"]))
    module.load_method()
    host = [b for b in loaded_method(module).memory.owned if b.device.is_cpu]
    assert host and all(b.memory.is_pinned() for b in host)


def test_cuda_graphs_match_eager_and_replay():
    model, example = transformer_block()
    program = _compile(model, example)  # everything on the GPU: one device segment
    module = ferry.Module(program, cuda_graphs=True)
    for _i in range(5):
        x = torch.randn_like(example[0])
        with torch.no_grad():
            want = model(x)
        torch.testing.assert_close(module(x), want, atol=2e-4, rtol=2e-4)
    graphs = loaded_method(module).graphs
    assert graphs and all(g.graph is not None and not g.failed for g in graphs)


@pytest.mark.skipif(not hasattr(torch._C, "_cuda_clearCublasWorkspaces"), reason="no cuBLAS workspace clearing")
def test_cuda_graphs_stay_right_after_cublas_workspaces_are_cleared():
    """torch.compile's reduce-overhead mode clears cuBLAS's workspaces, and a graph bakes its
    stream's in: ferry makes that one in a pool kept for the process before the first run and
    each capture, so clearing and emptying the cache frees nothing a graph still uses."""
    model, example = transformer_block()
    module = ferry.Module(_compile(model, example), cuda_graphs=True)
    for _ in range(3):  # first run on the capture stream, capture, replay
        module(torch.randn_like(example[0]))
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    taken = [torch.full((1 << 23,), float("nan"), device="cuda") for _ in range(4)]  # what was freed, reused
    for _ in range(4):
        x = torch.randn_like(example[0])
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), atol=2e-4, rtol=2e-4)
    torch.cuda.synchronize()
    assert all(bool(t.isnan().all()) for t in taken)  # no replay wrote into memory others hold now
    assert all(g.graph is not None and not g.failed for g in loaded_method(module).graphs)


_CALLER_WORKSPACE = """
import sys, torch, ferry
backend, graphs, dynamic = sys.argv[1], sys.argv[2] == "graphs", sys.argv[3] == "dynamic"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
model = model.to("cuda", torch.bfloat16).eval()
x = torch.randn(4 if dynamic else 1, 256, device="cuda", dtype=torch.bfloat16)
dims = ({0: torch.export.Dim("rows", max=8)},) if dynamic else None
keep = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(True, True))
program = ferry.compile(torch.export.export(model, (x,), dynamic_shapes=dims),
                        ferry.OpSupportPartitioner("cuda:0", backend_id=backend), keep)
module = ferry.Module(program, cuda_graphs=graphs)
rows = [4, 2, 4, 4, 3, 2, 4, 4] if dynamic else [1, 1, 1]  # new shapes' first calls; size 4's plan up to a replay
xs = [torch.randn(r, 256, device="cuda", dtype=torch.bfloat16) for r in rows]
got = [module(x).clone() for x in xs]
torch.cuda.synchronize()
before = torch.cuda.memory_allocated()
a = torch.ones(16, 16, device="cuda")
out = torch.mm(a, a)  # the caller's stream's cuBLAS workspace: made now unless something made it before
torch.cuda.synchronize()
print(torch.cuda.memory_allocated() - before - 2 * a.numel() * a.element_size())
with torch.no_grad():  # eager's answers last: its products make the caller's stream's workspace
    for x, g in zip(xs, got):
        torch.testing.assert_close(g, model(x), atol=2e-2, rtol=2e-2)
"""


@pytest.mark.parametrize("sizes", ["static", "dynamic"])
@pytest.mark.parametrize("backend", ["torch", "inductor"])
def test_a_plan_run_as_graphs_makes_no_cublas_workspace_on_the_callers_stream(backend, sizes):
    """Loaded and run with CUDA graphs (the first call, the dry run and the timing at load
    included; with dynamic sizes, each new shape's first call too), ferry runs cuBLAS only on its
    capture stream: the caller's stream gets no 32 MiB workspace of its own (a fresh process each,
    as workspaces last for the process). Without graphs ferry runs on the caller's stream as
    eager does, and makes it (the check's control)."""
    import os
    import subprocess
    import sys

    def workspace_made_after(graphs: str) -> int:
        done = subprocess.run([sys.executable, "-c", _CALLER_WORKSPACE, backend, graphs, sizes], capture_output=True,
                              text=True, env=os.environ.copy(), timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.strip().splitlines()[-1])  # printed before eager's reference runs

    assert workspace_made_after("graphs") >= 1 << 20
    assert workspace_made_after("eager") == 0


def test_cuda_graphs_with_cpu_fallback_segments():
    model, example = transformer_block()
    module = ferry.Module(_compile(model, example, exclude=["aten.softmax"]), cuda_graphs=True)
    for _ in range(4):
        x = torch.randn_like(example[0])
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), atol=2e-4, rtol=2e-4)
    assert len(loaded_method(module).graphs) >= 2


def test_pageable_copies_run_without_a_graph_with_a_warning():
    # pageable host buffers make the copy synchronise with the host: not capturable
    # (two distinct example tensors: torch.export folds one tensor passed twice into one input)
    module = ferry.Module(_compile(Chain(), (torch.randn(64, 32), torch.randn(64, 32))), cuda_graphs=True,
                          pin_host_memory=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(4):
            a, b = torch.randn(64, 32), torch.randn(64, 32)
            torch.testing.assert_close(module(a, b), Chain()(a, b))
    # the copies read and write pageable host memory: they are never captured, and the user is
    # told so; the device work between them still is
    graphs = loaded_method(module).graphs
    assert graphs and all(g.graph is not None and "_copy" not in g.label for g in graphs)
    assert any("without a graph" in str(m.message) for m in w)


def test_cuda_graphs_capture_device_resident_io():
    """skip_h2d/skip_d2h: the caller's device tensors are copied into fixed tensors, so the
    segment is captured; replays read each call's new inputs and outputs stay correct."""
    a, b = torch.randn(128, 64), torch.randn(128, 64)
    cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(True, True))
    program = _compile(Chain(), (a, b), config=cfg)
    for outputs in ("copy", "view"):
        module = ferry.Module(program, cuda_graphs=True, outputs=outputs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "without a graph" note
            module.load_method()
        kept = []
        for _ in range(5):
            a, b = torch.randn(128, 64, device="cuda"), torch.randn(128, 64, device="cuda")
            out = module(a, b)
            assert out.is_cuda
            torch.testing.assert_close(out, Chain()(a, b))
            kept.append((out, Chain()(a, b)))
        graphs = loaded_method(module).graphs
        assert len(graphs) == 1 and graphs[0].graph is not None
        if outputs == "copy":  # the caller owns each result: later replays do not change it
            for out, want in kept:
                torch.testing.assert_close(out, want)
        module.close()


def test_cuda_graphs_device_input_handed_back_is_the_callers():
    class PassAndAdd(torch.nn.Module):
        def forward(self, x, y):
            return x, x + y

    x, y = torch.randn(16, 8), torch.randn(16, 8)
    cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(True, True))
    module = ferry.Module(_compile(PassAndAdd(), (x, y), config=cfg), cuda_graphs=True)
    for _ in range(4):
        x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 8, device="cuda")
        same, total = module(x, y)
        assert same is x
        torch.testing.assert_close(total, x + y)


def test_cuda_graphs_are_captured_per_shape():
    """A dynamic program binds a plan per shape, and each captures its own graphs: a new shape
    is no reason to give up graphs, and no warning."""
    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1

    batch = torch.export.Dim("batch", max=64)
    ep = torch.export.export(Scale(), (torch.randn(8, 16),), dynamic_shapes=({0: batch},))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0")), cuda_graphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (8, 8, 8, 5, 5, 5, 8, 5, 5):
            x = torch.randn(n, 16)
            torch.testing.assert_close(module(x), Scale()(x))
    m = loaded_method(module)
    assert m.shape_plans() == 2 and sum(g.graph is not None for g in m.graphs) == 2


def test_legacy_mode_runs_on_gpu():
    a, b = torch.randn(32, 8), torch.randn(32, 8)
    program = _compile(Chain(), (a, b), config=ferry.CompileConfig(enable_non_cpu_memory_planning=False))
    assert ferry.copy_report(program, "forward").count() == 0
    module = ferry.Module(program)
    a, b = torch.randn(32, 8), torch.randn(32, 8)
    torch.testing.assert_close(module(a, b), Chain()(a, b))


# ---------------------------------------------------------------- ATen mode


def test_aten_mode_copy_kernels():
    ops = torch.ops.et_copy
    x = torch.randn(3, 5)
    out = torch.empty(15, device="cuda")
    r = ops._h2d_copy.out(x, out=out)
    assert r is out and out.shape == x.shape and torch.equal(out.cpu(), x)
    host = torch.empty(3, 5)
    assert ops._d2h_copy.out(out, out=host) is host and torch.equal(host, x)
    with ferry.ops.aten_mode():
        f = ops._h2d_copy(x)
    assert f.is_cuda and torch.equal(f.cpu(), x)
    assert ops._d2h_copy(f).device.type == "cpu"
    traced = ops._h2d_copy(x)  # outside aten_mode: the tracing clone, as on a machine without a GPU
    assert traced.device.type == "cpu" and torch.equal(traced, x) and traced.data_ptr() != x.data_ptr()


def test_aten_mode_checks_before_writing():
    ops = torch.ops.et_copy
    x = torch.randn(8)
    small = torch.full((4,), 7.0, device="cuda")
    with pytest.raises(RuntimeError, match="bytes"):
        ops._h2d_copy.out(x, out=small)
    assert torch.equal(small.cpu(), torch.full((4,), 7.0))
    wrong = torch.full((8,), 7, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="dtype"):
        ops._h2d_copy.out(x, out=wrong)
    assert torch.equal(wrong.cpu(), torch.full((8,), 7, dtype=torch.int32))
    empty = torch.empty(0, device="cuda")
    ops._h2d_copy.out(torch.empty(0), out=empty)
    with pytest.raises(RuntimeError, match="needs"):
        ops._d2h_copy.out(torch.randn(4), out=torch.empty(4, device="cuda"))


def test_placed_graph_runs_eagerly_on_gpu():
    model, example = transformer_block()
    placed = ferry.place(torch.export.export(model, example), ferry.OpSupportPartitioner("cuda:0", exclude=["aten.softmax"]))
    x = torch.randn_like(example[0])
    with ferry.ops.aten_mode():
        got = placed(x)
    assert got.device.type == "cpu"
    with torch.no_grad():
        torch.testing.assert_close(got.cpu(), model(x), atol=2e-4, rtol=2e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_move_with_one_device_to_device_copy(monkeypatch):
    class TwoStage(torch.nn.Module):
        def forward(self, a, b):
            t = a + b
            return t * t

    class PerOp:
        def partition(self, ep):
            nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
            return [ferry.Partition([n.name], ferry.target_device(f"cuda:{i}")) for i, n in enumerate(nodes)]

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    program = ferry.compile(torch.export.export(TwoStage(), (a, b)), PerOp())
    rep = ferry.copy_report(program, "forward")
    assert rep.count("d2d") == 1 and rep.count("h2d") == 2 and rep.count("d2h") == 1
    module = ferry.Module(program)
    counting = _Counting(monkeypatch)
    module.load_method()
    counting.reset()
    torch.testing.assert_close(module(a, b), TwoStage()(a, b))
    assert counting.totals()["d2d"][0] == 1
    t = torch.ops.et_copy._d2d_copy.out(torch.randn(4, device="cuda:0"), out=torch.empty(4, device="cuda:1"))
    assert t.device.index == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_capture_one_graph_each():
    class TwoStage(torch.nn.Module):
        def forward(self, a, b):
            t = (a + b).relu()
            return t * t + a.sum()

    class Halves:
        def partition(self, ep):
            nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
            half = len(nodes) // 2
            return [ferry.Partition([n.name for n in nodes[:half]], ferry.target_device("cuda:0")),
                    ferry.Partition([n.name for n in nodes[half:]], ferry.target_device("cuda:1"))]

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    program = ferry.compile(torch.export.export(TwoStage(), (a, b)), Halves())
    assert ferry.copy_report(program, "forward").count("d2d") >= 1
    module = ferry.Module(program, cuda_graphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the copy between the GPUs is no reason to warn
        module.load_method()
    for _ in range(5):
        a, b = torch.randn(64, 64), torch.randn(64, 64)
        torch.testing.assert_close(module(a, b), TwoStage()(a, b))
    graphs = loaded_method(module).graphs
    assert {g.index for g in graphs} == {0, 1} and all(g.graph is not None for g in graphs)


def test_capture_that_fails_midway_falls_back_with_correct_results(monkeypatch):
    """An operation that is illegal during capture (a device synchronisation) aborts it: the
    call that tried still returns the right result, with a warning, and later calls run eagerly."""
    import ferry.runtime.devices.graphs as cuda_graphs

    # internal: a segment's eager run is the one place a capture can be made to fail from outside
    eager = cuda_graphs.GraphSegment._eager

    def syncs_while_capturing(self):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return eager(self)

    monkeypatch.setattr(cuda_graphs.GraphSegment, "_eager", syncs_while_capturing)
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    module = ferry.Module(_compile(Chain(), (a, b)), cuda_graphs=True, outputs="view")
    with pytest.warns(RuntimeWarning, match="capture failed"):
        for _ in range(5):
            a, b = torch.randn(64, 32), torch.randn(64, 32)
            torch.testing.assert_close(module(a, b), Chain()(a, b))
    assert all(g.graph is None and g.failed for g in loaded_method(module).graphs)
    # the failed capture left the GPU's random generator out of capture mode: random ops work
    # (they raised "Offset increment outside graph capture" in every later test of the process)
    torch.cuda.manual_seed(3)
    first = torch.rand(1000, device="cuda")
    torch.cuda.manual_seed(3)
    assert torch.equal(torch.rand(1000, device="cuda"), first) and first.std() > 0.2


class TwoSegments(torch.nn.Module):
    """Two GPU segments around a ReLU left on the CPU."""

    def forward(self, a, b):
        return torch.relu((a + b) * a) * b + a


def test_a_segment_whose_capture_failed_leaves_the_next_segment_free_to_capture(monkeypatch):
    """The first segment's capture fails (a device synchronisation). torch.cuda.graph left the
    set's graph pool recording, and the second segment's capture into it then failed too
    ("already recording to mempool_id"); now the failed capture is undone, and later captures
    go to a fresh pool (GraphMemory.spoiled)."""
    import ferry.runtime.devices.graphs as cuda_graphs

    eager, breaking = cuda_graphs.GraphSegment._eager, []

    def first_one_syncs_while_capturing(self):
        if torch.cuda.is_current_stream_capturing() and breaking in ([], [self]):
            breaking[:] = [self]
            torch.cuda.synchronize()
        return eager(self)

    monkeypatch.setattr(cuda_graphs.GraphSegment, "_eager", first_one_syncs_while_capturing)
    caller = torch.cuda.current_stream()
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    module = ferry.Module(_compile(TwoSegments(), (a, b), exclude=["aten.relu"]), cuda_graphs=True)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        for _ in range(5):
            a, b = torch.randn(64, 32), torch.randn(64, 32)
            torch.testing.assert_close(module(a, b), TwoSegments()(a, b))
    graphs = loaded_method(module).graphs
    assert len(graphs) == 2 and breaking[0] in graphs and breaking[0].failed
    assert all(g.graph is not None and not g.failed for g in graphs if g is not breaking[0])
    assert torch.cuda.current_stream() == caller  # not the failed capture's stream
    module.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_an_empty_capture_is_never_replayed(monkeypatch):
    """Capturing on another GPU's stream records nothing (the work runs outside the capture,
    with undefined results for that one call). ferry detects the empty graph, warns, and never
    replays it: every later call runs eagerly and is correct."""
    from ferry.runtime.devices.streams import CopyStreams

    wrong = {}
    monkeypatch.setattr(CopyStreams, "capture_stream",
                        lambda self, index: wrong.setdefault(index, torch.cuda.Stream(device=1 - index)))
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    module = ferry.Module(_compile(Chain(), (a, b)), cuda_graphs=True)
    with pytest.warns(RuntimeWarning, match="graph is empty"):
        for _ in range(3):  # first call, warm-up, capture
            module(torch.randn(64, 32), torch.randn(64, 32))
    assert all(g.graph is None and g.failed for g in loaded_method(module).graphs)
    for _ in range(3):
        a, b = torch.randn(64, 32), torch.randn(64, 32)
        torch.testing.assert_close(module(a, b), Chain()(a, b))


@pytest.mark.parametrize("alignment", [None, 4096])
def test_planned_device_tensors_are_aligned_in_real_addresses(alignment):
    """cudaMalloc-like 256 B by default; a larger alignment is honoured in the address, not
    only in the offset within the buffer."""
    from ferry.runtime.stages.load import load_memory

    model, example = transformer_block()
    program = _compile(model, example, config=ferry.CompileConfig(alignment=alignment))
    m = program.method("forward")
    want = 256 if alignment is None else alignment
    mem = load_memory(program.segments, m)
    try:
        ptrs = [mem.slots[v].data_ptr() for v, t in enumerate(m.values)
                if isinstance(t, ferry.program.TensorValue) and t.storage == "planned" and t.device.type == "cuda"
                and t.nbytes]
        assert ptrs and all(p % want == 0 for p in ptrs)
    finally:
        mem.close()
    x = torch.randn_like(example[0])
    with torch.no_grad():
        torch.testing.assert_close(ferry.Module(program)(x), model(x), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("outputs", ["copy", "view"])
def test_graphs_of_every_shape_share_one_pool_and_stay_right(outputs):
    """Every shape's graphs allocate from the set's one pool (runtime/devices/graphs.py: GraphMemory):
    what one graph frees in its capture another may keep, so shapes called in any order after
    their capture must still equal eager; inputs and outputs kept on the GPU."""
    import random

    from test_device_map import TinyLM

    model = TinyLM(layers=2).eval()
    dims = {0: torch.export.Dim("batch", max=8), 1: torch.export.Dim("seq", max=32)}
    ep = torch.export.export(model, (torch.randint(0, 32, (4, 16)),), dynamic_shapes=(dims,))
    keep = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(True, True))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0"), keep), cuda_graphs=True,
                          outputs=outputs)
    shapes = [(2, 16), (4, 5), (1, 9), (8, 32)]
    for i, shape in enumerate(shapes * 4 + random.Random(0).choices(shapes, k=16)):
        x = torch.randint(0, 32, shape, generator=torch.Generator().manual_seed(i))
        got = module(x.cuda())
        assert got.is_cuda
        torch.testing.assert_close(got.cpu(), model(x), atol=1e-4, rtol=1e-4)
    graphs = [g.graph for g in loaded_method(module).graphs if g.graph is not None]
    assert len(graphs) >= len(shapes) and len({g.pool() for g in graphs}) == 1


class _Convs(torch.nn.Module):
    """1x1 convolutions at 128 x 128: results of 1-4 MB that ATen allocates (no out variant), as
    EfficientNet's do, and no patches (a 3x3 one's, up to 38 MB here, would make the room 10 MiB or
    more: a segment of its own, made after the load)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Conv2d(i, o, 1) for i, o in ((8, 32), (32, 64), (64, 16)))
        self.head = torch.nn.Linear(16, 1 << 16)  # 4 MiB of weights: the load's allocation is a large block

    def forward(self, x):
        return self.head(self.c(torch.relu(self.b(torch.relu(self.a(x))))).mean((2, 3)))


def test_graph_results_fit_in_the_room_the_load_left_in_the_graph_pool():
    """A load whose graphs will be captured makes its one allocation in the set's graph pool with
    the call's run-time results' room behind it (runtime/devices/graphs.py: GraphMemory.home):
    the captured convolutions' results fit there, where before they took a 20 MiB segment of
    their own that held nothing between calls."""
    model = _Convs().eval()
    x = torch.randn(1, 8, 128, 128)
    keep = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(True, True))
    module = ferry.Module(_compile(model, (x,), config=keep), cuda_graphs=True)
    for i in range(4):
        x = torch.randn(1, 8, 128, 128, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            torch.testing.assert_close(module(x.cuda()).cpu(), model(x), atol=2e-4, rtol=2e-4)
    graphs = [g.graph for g in loaded_method(module).graphs if g.graph is not None]
    assert graphs, "nothing was captured"
    pool = tuple(graphs[0].pool())
    torch.cuda.synchronize()
    segments = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool]
    large = [(s["total_size"], s["allocated_size"]) for s in segments if s["segment_type"] == "large"]
    assert len(large) == 1 and large[0][1] >= 4 << 20, f"graph results took segments of their own: {large}"
    module.close()


def test_a_module_with_graphs_closed_and_called_again_reloads_into_a_new_pool():
    """Closing lets the set's graph pool go; torch's allocator refuses to hold a pool again after
    that (an internal assert), so the reload makes a new one. Results stay eager's throughout,
    and a second method loaded after the first one's capture keeps its memory outside the pool."""
    model = _Convs().eval()
    x = torch.randn(1, 8, 128, 128)
    keep = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(True, True))
    ep = torch.export.export(model, (x,))
    module = ferry.Module(ferry.compile({"forward": ep, "again": ep}, ferry.OpSupportPartitioner("cuda:0"), keep),
                          cuda_graphs=True)
    for round_ in range(2):
        for i, name in enumerate(["forward"] * 3 + ["again", "forward", "again", "again"]):
            x = torch.randn(1, 8, 128, 128, generator=torch.Generator().manual_seed(10 * round_ + i))
            with torch.no_grad():
                got = module.call(name, x.cuda())
                torch.testing.assert_close(got.cpu(), model(x), atol=2e-4, rtol=2e-4)
        module.close()

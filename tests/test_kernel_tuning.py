"""Inductor's tuning of a load's kernels timed as a decode step's graph runs them
(ferry/choices/kernel_tuning.py): the autotuner's timing is replaced only inside `steady()` and
restored after (on an error too); kernels it cannot time so go to Inductor's own timing; a timed
kernel is launched only on copies of its arguments, each with the original's strides and values,
enough copies to be out of L2, and its time is per launch. On the GPU: an Inductor kernel tuned so
writes its inputs once, as without the patch, and a tuned one-row product equals eager's."""

import contextlib
import threading
import types

import pytest
import torch

from ferry.choices import kernel_tuning

triton_heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
Autotuner = triton_heuristics.CachingAutotuner
_GPU = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.fixture
def own_bench(monkeypatch):
    """Inductor's own timing, recorded: what the patch falls back to."""
    calls = []

    def bench(self, launcher, *args, with_profiler=False, **kwargs):
        calls.append((launcher, args, with_profiler, kwargs))
        return 7.0

    monkeypatch.setattr(Autotuner, "bench", bench)
    return calls


def test_patched_inside_only_and_restored_on_error(own_bench):
    original = Autotuner.bench
    with kernel_tuning.steady():
        assert Autotuner.bench is not original
        with kernel_tuning.steady():  # nested: the same patch, not one around it
            inner = Autotuner.bench
        assert Autotuner.bench is inner
    assert Autotuner.bench is original
    with pytest.raises(ValueError), kernel_tuning.steady():
        raise ValueError("a load failed")
    assert Autotuner.bench is original
    with kernel_tuning.steady():  # after the error, patched again
        assert Autotuner.bench is not original


@pytest.mark.parametrize("how", ["disabled", "STEADY off"])
def test_off_leaves_inductor_timing(own_bench, monkeypatch, how):
    original = Autotuner.bench
    if how == "STEADY off":
        monkeypatch.setattr(kernel_tuning, "STEADY", False)
    with kernel_tuning.steady(enabled=how != "disabled"):
        assert Autotuner.bench is original


@pytest.fixture
def on_fake_gpu(monkeypatch):
    """Tensors on the CPU taken for one GPU's, copies counted without CUDA, and each replayed
    timing recorded (returning 1.0 ms)."""
    replayed = []
    monkeypatch.setattr(kernel_tuning, "_gpu", lambda ts: torch.device("cpu") if ts else None)
    monkeypatch.setattr(kernel_tuning, "copies_past_l2", lambda n, d, most=32: 1 if n > 1 << 20 else 3)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(kernel_tuning, "_time_launches", lambda *a: replayed.append(a) or 1.0)
    return replayed


def _tuner(reset=(), written=(), names=("in_ptr0", "out_ptr0", "xnumel"), spill_threshold=16):
    return types.SimpleNamespace(reset_to_zero_arg_names=list(reset), mutated_arg_names=list(written),
                                 fn=types.SimpleNamespace(arg_names=list(names)),
                                 inductor_meta={"spill_threshold": spill_threshold})


@pytest.mark.parametrize("case, replayed", [
    ("plain", True), ("float written", True), ("integer written", False), ("written unknown", False),
    ("reset to zero", False), ("spills", False), ("spills under its threshold", True), ("profiler", False),
    ("larger than L2", False), ("no tensors", False), ("capture fails", False), ("launcher unknown", False)])
def test_which_kernels_are_timed_by_replay(own_bench, on_fake_gpu, monkeypatch, case, replayed):
    """Replayed where the kernel can be launched a dozen times on unrestored copies: not where an
    integer it writes may be a position it reads, where Inductor zeroes an argument per launch,
    where the config spills past Inductor's threshold, or where the capture fails."""
    out = torch.empty(4, dtype=torch.int64 if case == "integer written" else torch.float32)
    args = (torch.randn(1 << 19 if case == "larger than L2" else 4, 8), out, 32)
    tuner = _tuner(reset=["out_ptr0"] if case == "reset to zero" else (),
                   written=["out_ptr0"] if "written" in case else (),
                   spill_threshold=64 if case == "spills under its threshold" else 16)
    if case == "written unknown":
        del tuner.mutated_arg_names
    if case == "no tensors":
        args = (4, 8)
    if case in ("capture fails", "launcher unknown"):
        error = RuntimeError("capture") if case == "capture fails" else TypeError("unexpected keyword 'stream'")
        monkeypatch.setattr(kernel_tuning, "_time_launches", lambda *a: (_ for _ in ()).throw(error))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    launcher = types.SimpleNamespace(n_spills=40 if "spills" in case else 0)
    with kernel_tuning.steady():
        got = Autotuner.bench(tuner, launcher, *args, with_profiler=case == "profiler", grid=(1,))
    assert (got == 1.0) is replayed and bool(on_fake_gpu) is replayed
    assert own_bench == ([] if replayed else [(launcher, args, case == "profiler", {"grid": (1,)})])
    if replayed:
        (launched, (got_args, got_kwargs, copies)), = [(a[0], a[1:]) for a in on_fake_gpu]
        assert launched is launcher and got_args == args and got_kwargs == {"grid": (1,)} and copies == 3


def test_another_threads_kernels_are_timed_inductors_way(own_bench, on_fake_gpu):
    """The class is patched for the process, the replayed timing is only this thread's: another
    thread's first launch meanwhile (a user's torch.compile) is timed as it would be."""
    args = (torch.randn(4, 8), torch.empty(4), 32)
    seen = []
    with kernel_tuning.steady():
        thread = threading.Thread(target=lambda: seen.append(Autotuner.bench(_tuner(), "launcher", *args)))
        thread.start()
        thread.join()
        mine = Autotuner.bench(_tuner(), "launcher", *args)
    assert seen == [7.0] and mine == 1.0 and len(own_bench) == 1 and len(on_fake_gpu) == 1


@pytest.fixture
def fake_graphs(monkeypatch):
    """A GPU whose launches advance a host clock by 2 ms each (events read it), whose graphs
    replay the launches they captured (each replay but every third 1 ms slower), and whose
    streams are no-ops; launches made during replays are recorded."""
    clock, launched, replays = [0.0], [], [0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = 0.0

        def record(self):
            self.t = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    class Graph:
        def __init__(self, fn):
            self.fn = fn

        def replay(self):
            replays[0] += 1
            clock[0] += 0.0 if replays[0] % 3 == 0 else 1.0
            self.fn()

    def launcher(*args, stream=None, **kwargs):
        if replays[0]:
            launched.append((args, kwargs))
        clock[0] += 2.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(kernel_tuning, "on_side_stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(kernel_tuning, "capture", lambda fn, reps: Graph(fn))
    return launcher, launched


def test_launched_on_copies_only_and_timed_per_launch(fake_graphs):
    launcher, launched = fake_graphs
    base = torch.randn(6, 10)
    x = base[1:5, 2:9]  # a view into a larger storage, strided
    w = torch.randn(7, 3).t()
    bias = torch.randn(7)
    ms = kernel_tuning._time_launches(launcher, (x, w, 28), {"grid": (2,), "bias": bias}, 3)
    assert ms == pytest.approx(2.0)  # the best replay's time over its launches
    sets = {tuple(id(a) for a in (*args[:2], kwargs["bias"])) for args, kwargs in launched}
    assert len(sets) == 3 and not {id(x), id(w), id(bias)} & {i for s in sets for i in s}
    for args, kwargs in launched:
        cx, cw, n = args
        assert n == 28 and kwargs["grid"] == (2,) and torch.equal(kwargs["bias"], bias)
        assert cx.stride() == x.stride() and cw.stride() == w.stride()
        assert torch.equal(cx, x) and torch.equal(cw, w)
        assert cx.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
        assert cx.untyped_storage().nbytes() < base.untyped_storage().nbytes()  # the view's extent only


def test_a_broadcast_argument_is_copied_as_it_lies_in_memory():
    row = torch.randn(1, 8)
    wide = row.expand(5, 8)  # stride 0
    got = kernel_tuning._copy(wide)
    assert got.stride() == wide.stride() and torch.equal(got, wide)
    assert got.untyped_storage().nbytes() == row.untyped_storage().nbytes()


def test_extent_of_views():
    base = torch.randn(6, 10)
    assert kernel_tuning._extent(base) == 240
    assert kernel_tuning._extent(base[1:5, 2:9]) == (1 + 3 * 10 + 6) * 4
    assert kernel_tuning._extent(base.t()) == 240
    assert kernel_tuning._extent(base[:0]) == 0


def test_copies_past_l2(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(L2_cache_size=50 << 20))
    cpu = torch.device("cpu")
    assert kernel_tuning.copies_past_l2(60 << 20, cpu) == 1
    assert kernel_tuning.copies_past_l2(12 << 20, cpu) == 6  # 5 fill L2, one more evicts the first
    assert kernel_tuning.copies_past_l2(1 << 10, cpu) == 32
    assert kernel_tuning.copies_past_l2(1 << 10, cpu, most=64) == 64


def _compiled_twice(fn, *args):
    from torch._inductor.utils import fresh_inductor_cache

    from ferry.choices.gemv import TUNING
    with fresh_inductor_cache():
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, options=TUNING)
        with kernel_tuning.steady():
            return compiled(*args)


@pytest.mark.parametrize("_", [pytest.param(None, marks=_GPU)])
def test_gpu_tuned_kernel_writes_its_inputs_once(_, monkeypatch):
    timed = []
    own = kernel_tuning._time_launches
    monkeypatch.setattr(kernel_tuning, "_time_launches", lambda *a: timed.append(a[-1]) or own(*a))

    def step(cache, row, w):  # a cache written in place, and a one-row product
        cache.add_(row.float().sum())
        return (row.float().unsqueeze(-2) * w.float()).sum(-1).to(row.dtype)

    cache = torch.randn(4096, device="cuda")
    row = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    want_cache = cache + row.float().sum()
    want = torch.nn.functional.linear(row.float(), w.float())
    got = _compiled_twice(step, cache, row, w)
    assert timed, "no candidate was timed by replay"
    assert all(n > 1 for n in timed)  # copies past L2 for a 4 MB weight
    torch.testing.assert_close(cache, want_cache)  # once: the tuning's launches ran on copies
    torch.testing.assert_close(got.float(), want, atol=0.5, rtol=2e-2)


@pytest.mark.parametrize("_", [pytest.param(None, marks=_GPU)])
def test_gpu_a_candidate_that_cannot_be_captured_goes_to_inductor_and_the_allocator_stays_usable(_):
    """A launch that syncs the host cannot be captured: the candidate falls back (None), and
    the failed capture leaves nothing registered with the allocator: `empty_cache` (which
    `steady` calls on exit) and later captures work."""
    x = torch.randn(256, 256, device="cuda")
    calls = []

    def launcher(*args, stream=None, **kwargs):
        calls.append(stream)
        args[1].copy_(args[0].sum(0))
        torch.cuda.synchronize()  # not allowed while capturing

    with kernel_tuning.steady():
        got = kernel_tuning._replayed(_tuner(), launcher, (x, torch.empty(256, device="cuda"), 256), {})
    assert got is None and calls
    torch.cuda.empty_cache()
    stream = torch.cuda.Stream()
    with kernel_tuning.on_side_stream(stream):
        graph = kernel_tuning.capture(lambda: x.mul_(2), 1)
    before = x.clone()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(x, before * 2)

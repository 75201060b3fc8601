"""Inductor's tuning of a load's kernels timed as a decode step's graph runs them
(ferry/choices/kernel_tuning.py): the autotuner's timing is replaced only inside `steady()` and
restored after (on an error too); kernels it cannot time so go to Inductor's own timing; a timed
kernel is launched only on copies of its arguments, each with the original's strides and values,
enough copies to be out of L2, and its time is per launch. On the GPU: an Inductor kernel tuned so
writes its inputs once, as without the patch, and a tuned one-row product equals eager's."""

import contextlib
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


@pytest.mark.parametrize("how", ["disabled", "STEADY off"])
def test_off_leaves_inductor_timing(own_bench, monkeypatch, how):
    original = Autotuner.bench
    if how == "STEADY off":
        monkeypatch.setattr(kernel_tuning, "STEADY", False)
    with kernel_tuning.steady(enabled=how != "disabled"):
        assert Autotuner.bench is original


@pytest.mark.parametrize("case", ["cpu tensors", "no tensors", "reset to zero", "spills", "profiler"])
def test_untimeable_kernels_go_to_inductor(own_bench, monkeypatch, case):
    replayed = []
    monkeypatch.setattr(kernel_tuning, "_time_launches", lambda *a: replayed.append(a) or 1.0)
    tuner = types.SimpleNamespace(reset_to_zero_arg_names=["out"] if case == "reset to zero" else [])
    launcher = types.SimpleNamespace(n_spills=40 if case == "spills" else 0)
    args = (4, 8) if case == "no tensors" else (torch.randn(4, 8), torch.empty(4), 4, 8)
    with kernel_tuning.steady():
        got = Autotuner.bench(tuner, launcher, *args, with_profiler=case == "profiler", grid=(1,))
    assert got == 7.0 and not replayed
    assert own_bench == [(launcher, args, case == "profiler", {"grid": (1,)})]


@pytest.fixture
def fake_graphs(monkeypatch):
    """A GPU whose launches advance a host clock by 2 ms each (events read it), whose graphs
    replay the launches they captured, and whose streams are no-ops."""
    clock, launched = [0.0], []

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
            self.fn()

    def launcher(*args, stream=None, **kwargs):
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
    ms = kernel_tuning._time_launches(launcher, (x, w, 28), {"grid": (2,)}, 3)
    assert ms == pytest.approx(2.0)  # the replay's time over its launches
    sets = {tuple(id(a) for a in args[:2]) for args, _ in launched}
    assert len(sets) == 3 and (id(x), id(w)) not in sets
    for args, kwargs in launched:
        cx, cw, n = args
        assert n == 28 and kwargs == {"grid": (2,)}
        assert cx.stride() == x.stride() and cw.stride() == w.stride()
        assert torch.equal(cx, x) and torch.equal(cw, w)
        assert cx.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
        assert cx.untyped_storage().nbytes() < base.untyped_storage().nbytes()  # the view's extent only


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

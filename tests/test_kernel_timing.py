"""The timing behind the kernel choices (ferry/choices/timing.py), on a fake GPU whose events
read a fake host clock: a run the host launches slower than the GPU's queued wait lasts is timed
again behind a longer wait, so a form of many small launches is not timed at the host's pace; in
a plan captured as CUDA graphs, each form is captured on the plan's capture stream and replayed,
after the stream's cuBLAS workspace was made in a memory pool kept alive, and nothing, the forms'
warm-up included, runs on the caller's stream (its cuBLAS workspace would be 32 MiB more)."""

import contextlib
import math
import weakref

import pytest
import torch

from ferry import capture as shared_capture
from ferry.capture import TimingRoom
from ferry.choices import hook
from ferry.choices import timing as kernel_timing
from ferry.choices.decisions import DECISIONS, Site


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU whose `_sleep` of n cycles lasts n ns from its launch, on a fake clock that each
    launched 'kernel' advances by its host time; events stamp that clock, and an event is done
    once the wait queued before it has ended."""
    clock, sleeps, waiting_until = [0.0], [], [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = 0.0

        def record(self):
            self.t = clock[0]

        def query(self):
            return clock[0] >= waiting_until[0]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3  # ms

    def sleep(cycles):
        sleeps.append(cycles)
        waiting_until[0] = clock[0] + cycles * 1e-9

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", sleep)

    def kernel(us):
        def run():
            if capturing:
                capturing[-1].recorded.append(us)
            else:
                clock[0] += us * 1e-6
                ran_on.append(current[0])
        return run

    capturing, graphs, alive, emptied, ran_on, workspaces = [], [], weakref.WeakSet(), [], [], []
    emptied_after: list[int] = []

    class Capture:
        """What a fake graph captured (kept after the graph is gone): its stream, pool and kernels."""

        def __init__(self):
            self.recorded, self.pool_arg, self.stream, self.mode = [], None, None, None

        def pool(self):  # the pool it was captured into
            return self.pool_arg if self.pool_arg is not None else ("pool of", id(self))

    class Graph:
        """Records the fake kernels launched while it captures; a replay runs them on the clock."""

        def __init__(self):
            self.capture = Capture()
            graphs.append(self.capture)
            alive.add(self)

        def capture_begin(self, pool=None, capture_error_mode="global"):
            self.capture.pool_arg, self.capture.stream, self.capture.mode = pool, current[0], capture_error_mode
            capturing.append(self.capture)

        def capture_end(self):
            capturing.pop()

        def replay(self):
            clock[0] += sum(self.capture.recorded) * 1e-6

        def pool(self):
            return self.capture.pool()

    def empty_cache():  # how many timing graphs are still alive, and how many were captured so far
        emptied.append(len(list(alive)))
        emptied_after.append(len(graphs))

    current = ["default"]

    class MemPool:
        pass

    @contextlib.contextmanager
    def use_mem_pool(pool):  # where cuBLAS's workspace would be made: the pool and the stream
        workspaces.append((pool, current[0]))
        yield

    class Stream:
        device = "cpu"

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def on_stream(stream):
        saved, current[0] = current[0], stream
        try:
            yield
        finally:
            current[0] = saved

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", len(graphs)))
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "MemPool", MemPool)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(shared_capture, "KEPT_WORKSPACES", {})
    kernel.graphs, kernel.Stream, kernel.capturing, kernel.emptied = graphs, Stream, capturing, emptied
    kernel.emptied_after = emptied_after
    kernel.ran_on, kernel.workspaces = ran_on, workspaces
    return kernel, sleeps


class CudaStreams:
    """A plan's CopyStreams as a Site sees them: a CUDA API and one capture stream per GPU."""

    def __init__(self, stream):
        self.api = type("Api", (), {"device_type": "cuda"})()
        self.stream, self.asked = stream, []

    def capture_stream(self, index):
        self.asked.append(index)
        return self.stream


def test_a_run_launched_slower_than_the_wait_is_timed_behind_a_longer_one(fake_gpu):
    kernel, sleeps = fake_gpu
    quick, slow = kernel(1.0), kernel(100.0)  # 10 calls of the slow one take 1 ms to queue: longer than 0.5 ms
    assert kernel_timing.time_both(quick, slow) == pytest.approx((1.0, 100.0))
    first = kernel_timing._QUEUE_CYCLES
    assert sleeps == [first, first, 4 * first] + [4 * first] * 4  # the longer wait kept for the later rounds


def test_a_host_slower_than_the_longest_wait_is_timed_at_its_pace(fake_gpu):
    kernel, sleeps = fake_gpu
    kernel_timing.time_both(kernel(1.0), kernel(20_000.0))  # 200 ms of launches
    assert max(sleeps) == kernel_timing._MAX_QUEUE_CYCLES


def test_in_a_captured_plan_each_form_is_replayed_from_a_graph_on_its_capture_stream(fake_gpu):
    kernel, sleeps = fake_gpu
    stream = kernel.Stream()
    streams = CudaStreams(stream)
    site = Site(captured=True, streams=streams)
    assert site.replays
    assert kernel_timing.time_both(kernel(3.0), kernel(2.0), site.replay_stream(), reps=4) == pytest.approx((3.0, 2.0))
    kernel_timing.time_both(kernel(3.0), kernel(2.0), site.replay_stream())
    assert sleeps == [] and streams.asked == [0, 0]  # no queued waits: replays run back to back
    first, second, *_ = kernel.graphs
    assert first.stream is stream and second.stream is stream and first.recorded == [3.0] * 4
    assert first.pool_arg is not None and second.pool_arg == first.pool_arg  # one fresh pool for the two forms
    # the workspace made on the capture stream in one kept pool, again before each timing
    (pool,) = shared_capture.KEPT_WORKSPACES.values()
    assert kernel.workspaces == [(pool, stream), (pool, stream)]
    assert kernel.ran_on and set(kernel.ran_on) == {stream}  # the warm-up too: the caller's stream runs nothing
    # before each capture (the warm-up's cached blocks, which the capture's pool cannot reuse) and
    # after it, its graphs gone (their pool)
    assert kernel.emptied == [0, 0, 0, 0] and kernel.emptied_after == [0, 2, 2, 4]
    assert {g.mode for g in kernel.graphs} == {"thread_local"}  # another thread's host wait breaks nothing


def test_with_room_lent_the_warm_up_and_both_captures_allocate_in_it(fake_gpu):
    kernel, _ = fake_gpu
    inside, eager_runs = [False], []

    @contextlib.contextmanager
    def allocating():  # where the plan's graph pool takes this thread's allocations
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    def form(us):
        run = kernel(us)

        def traced():
            if not kernel.capturing:
                eager_runs.append(inside[0])
            run()
        return traced

    stream = kernel.Stream()
    spoiled: list[bool] = []
    room = TimingRoom(("the plan's pool",), allocating, lambda: spoiled.append(True))
    assert kernel_timing.time_both(form(3.0), form(2.0), stream, reps=4, room=room) == pytest.approx((3.0, 2.0))
    assert spoiled == []
    first, second, *_ = kernel.graphs
    assert first.pool_arg == second.pool_arg == ("the plan's pool",)
    assert eager_runs and all(eager_runs) and not inside[0]  # the warm-up's results there too, and only then

    def uncapturable():
        if kernel.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        eager_runs.append(inside[0])

    eager_runs.clear()
    assert kernel_timing.time_both(form(1.0), uncapturable, stream, room=room)[1] == math.inf
    assert eager_runs and all(eager_runs)  # timed on the stream instead: in the room as well
    assert spoiled == [True]  # the plan's graphs then capture into a fresh pool (GraphMemory.spoiled)


def test_a_form_that_cannot_be_captured_is_timed_on_the_stream(fake_gpu):
    kernel, sleeps = fake_gpu

    def host_sync():
        if kernel.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        kernel(5.0)()

    stream = Site(captured=True, streams=CudaStreams(kernel.Stream())).replay_stream()
    eager_us, other_us = kernel_timing.time_both(kernel(1.0), host_sync, stream)
    assert eager_us == pytest.approx(1.0) and other_us == math.inf  # never chosen: the plan's capture would fail
    assert sleeps  # eager's form timed behind queued waits

    assert kernel.capturing == []


def test_running_out_of_memory_in_a_timing_graph_is_the_callers_to_see(fake_gpu):
    kernel, _ = fake_gpu

    def needs_too_much():
        if kernel.capturing:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    stream = Site(captured=True, streams=CudaStreams(kernel.Stream())).replay_stream()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        kernel_timing.time_both(kernel(1.0), needs_too_much, stream)


def test_a_decision_timed_by_replay_is_not_reused_where_the_plan_times_on_a_stream(timed, monkeypatch):
    """A replay times a form of many launches faster than a stream does: the two are kept apart
    (here a biased GEMM, asked through the hook as the binder asks)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    streams, stream, made = CudaStreams(None), object(), []
    streams.stream = stream

    def time_both(eager, other, replay_stream=None):
        made.append(replay_stream)
        return timed.times

    monkeypatch.setattr(kernel_timing, "time_both", time_both)
    bias, mat1, mat2, out = torch.randn(7), torch.randn(6, 5), torch.randn(5, 7), torch.empty(6, 7)

    def split(site):
        return hook.choose(torch.ops.aten.addmm.out, [bias, mat1, mat2], {"out": out}, site) is not None

    assert split(Site(measure=True))  # a plan on a stream
    assert split(Site(measure=True, captured=True, streams=streams))  # replayed on the plan's capture stream
    assert split(Site(measure=False, captured=True, streams=streams))  # known: not timed again
    assert split(Site(measure=True, captured=True))  # graphs, but no streams of their own: timed on a stream
    assert made == [None, stream] and streams.asked == [0]
    assert len(DECISIONS.values(timed=True)) == 2


def test_a_plan_on_another_device_type_is_timed_on_the_stream(fake_gpu):
    kernel, sleeps = fake_gpu
    emulated = CudaStreams(kernel.Stream())
    emulated.api.device_type = "emu"
    site = Site(captured=True, streams=emulated)
    assert not site.replays and site.replay_stream() is None
    kernel_timing.time_both(kernel(1.0), kernel(2.0), site.replay_stream())
    assert sleeps and kernel.graphs == [] and emulated.asked == []


def test_faster_needs_a_tenth_and_two_microseconds():
    assert kernel_timing.faster(100.0, 89.0) and not kernel_timing.faster(100.0, 91.0)
    assert not kernel_timing.faster(10.0, 8.5) and kernel_timing.faster(20.0, 17.5)


def test_the_margins_are_read_when_deciding_so_a_form_can_be_forced(monkeypatch):
    """The GPU tests force the other form by setting the margins: a decision must read them then."""
    times = (10.0, 30.0)  # the other form three times slower: eager's kept
    assert not kernel_timing.faster(*times)
    monkeypatch.setattr(kernel_timing, "KEEP_IF_ABOVE", math.inf)
    monkeypatch.setattr(kernel_timing, "MIN_SAVING_US", -math.inf)
    assert kernel_timing.faster(*times)
    d = kernel_timing.decision("f", "op", "s", torch.device("cpu"), torch.float32, ("eager", "other"), times)
    assert d.taken
    assert not kernel_timing.faster(*times, keep_if_above=0.9, min_saving_us=2.0)  # given: those


def test_the_summary_says_what_load_chose_of_each_kind(timed, monkeypatch):
    from ferry.choices import summary as kernel_choices
    from ferry.ops import fused

    assert kernel_choices.summary() == []
    monkeypatch.setattr(fused, "cudnn_takes", lambda *args: True)
    captured = Site(measure=True, captured=True)
    q = torch.randn(1, 2, 5, 4)
    hook.choose(torch.ops.aten.scaled_dot_product_attention.default, [q, q, q], {}, captured)
    conv = [torch.randn(1, 8, 3, 3), torch.randn(6, 8, 1, 1), torch.randn(6), [1, 1], [0, 0], [1, 1], 1]
    hook.choose(fused.CONV_RELU, conv, {}, captured)
    timed.times = (10.0, 9.5)
    hook.choose(fused.CONV_RELU, [torch.randn(1, 8, 4, 4), *conv[1:]], {}, captured)
    timed.times = (30.0, 20.0)
    hook.choose(torch.ops.aten.addmm.out, [torch.randn(7), torch.randn(6, 5), torch.randn(5, 7)],
                {"out": torch.empty(6, 7)}, captured)
    assert kernel_choices.summary() == [
        "attention: 1 of 1 timed at load are faster as GEMMs and a softmax (largest saving: "
        "1x2x5x5x4 float32, 100.0 -> 40.0 µs)",
        "convolution of one image: 1 of 2 timed at load are faster as one GEMM over patches (largest saving: "
        "1x1, 6x8x9 float32, 100.0 -> 40.0 µs)",
        "biased GEMM: 1 of 1 timed at load are faster as mm + bias (largest saving: 6x5x7 float32, 30.0 -> 20.0 µs)"]


def test_a_choice_in_a_captured_plan_is_decided_on_its_capture_stream(fake_gpu, monkeypatch):
    """Stand-ins made there share the caching allocator's segments (kept per stream) with what the
    forms allocate, where on the caller's stream each took one of its own (RegNetY's load)."""
    kernel, _ = fake_gpu
    entered = []

    @contextlib.contextmanager
    def on_side_stream(stream):
        entered.append(stream)
        yield

    monkeypatch.setattr(kernel_timing, "on_side_stream", on_side_stream)
    stream = kernel.Stream()
    replaying = Site(captured=True, streams=CudaStreams(stream))
    with kernel_timing.deciding(torch.device("cuda", 0), replaying):
        assert entered == [stream] and not torch.is_grad_enabled()
    for site, device in ((Site(measure=True), torch.device("cuda", 0)), (replaying, torch.device("cpu"))):
        with kernel_timing.deciding(device, site):
            assert not torch.is_grad_enabled()
    assert entered == [stream]  # a plan timed on a stream, and a CPU choice, stay where they are

"""A CUDA graph capture that fails is undone (ferry/capture.py `recording`): on a fake of
torch's graph and caching-allocator bookkeeping, kept to torch's order of events, the pool the
capture allocated from is no longer recording and holds no reference for it afterwards, so the
next capture into the same pool (a plan's next segment, in the set's one pool) works; and the
plan's capture (the CUDA streams API) leaves the caller's stream current."""

from __future__ import annotations

import itertools

import pytest
import torch

from ferry import capture as shared_capture
from ferry.runtime.devices.streams import CudaApi

HOST_SYNC = "CUDA error: operation not permitted when stream is capturing"


class Allocator:
    """torch's CUDA caching allocator as captures see it: a reference count per graph pool, and
    the pools being recorded into."""

    def __init__(self):
        self.refs: dict = {}
        self.recording: set = set()
        self.handles = itertools.count(1)

    def begin(self, pool):  # beginAllocateToPool: the reference is taken before the check
        self.refs[pool] = self.refs.get(pool, 0) + 1
        if pool in self.recording:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.recording.add(pool)

    def end(self, index, pool):  # endAllocateToPool
        if pool not in self.recording:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.recording.discard(pool)

    def release(self, index, pool):  # releasePool
        assert self.refs[pool] > 0, "a pool released more often than it was taken"
        self.refs[pool] -= 1

    def hold(self, pool):  # a pool held open, as GraphMemory holds the set's
        self.begin(pool)
        self.end(0, pool)


class Graph:
    """torch.cuda.CUDAGraph's capture_end, in its order: cudaStreamEndCapture (raises for a
    capture an illegal call invalidated) before the pool's recording ends; "Invalid capture."
    after; instantiation after the capture is marked ended. Its reset gives the pool back only
    once the capture was marked ended."""

    fail_at: str | None = None  # "invalid" | "instantiate": how the next capture_end fails
    invalidated = False  # an illegal call was made while capturing

    def __init__(self, allocator):
        self.allocator, self.ended, self.pool_id = allocator, False, None

    def capture_begin(self, pool=None, capture_error_mode="global", **options):
        self.allocator.begin(pool)
        self.pool_id, self.mode = pool, capture_error_mode
        Graph.invalidated = False

    def capture_end(self):
        fail, Graph.fail_at = Graph.fail_at, None
        if Graph.invalidated:
            raise RuntimeError(HOST_SYNC)
        self.allocator.end(0, self.pool_id)
        if fail == "invalid":
            raise RuntimeError("Invalid capture.")
        self.ended = True
        if fail == "instantiate":
            raise RuntimeError("CUDA error: out of memory (instantiating)")

    def pool(self):
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self.pool_id

    def reset(self):  # what its destructor does
        if self.ended:
            self.allocator.release(0, self.pool_id)
            self.ended = False


@pytest.fixture
def fake_cuda(monkeypatch):
    allocator = Allocator()
    current = ["caller's stream"]

    class on_stream:  # noqa: N801 - torch.cuda.stream: the stream before is current again only at exit
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            self.saved, current[0] = current[0], self.stream

        def __exit__(self, *exc):
            current[0] = self.saved

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", allocator.end)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", allocator.release)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: Graph(allocator))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(allocator.handles)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
    allocator.current = current
    return allocator


def host_sync():
    Graph.invalidated = True  # the call fails and invalidates the capture, as CUDA's do
    raise RuntimeError(HOST_SYNC)


def test_a_timing_capture_that_an_illegal_call_broke_leaves_its_pool_as_it_found_it(fake_cuda):
    pool = (0, 99)
    fake_cuda.hold(pool)  # the set's pool, lent as a timing room
    with pytest.raises(RuntimeError, match="not permitted"):
        shared_capture.capture(host_sync, reps=3, pool=pool)
    assert pool not in fake_cuda.recording and fake_cuda.refs[pool] == 1
    graph = shared_capture.capture(lambda: None, reps=3, pool=pool)  # the next capture into it works
    assert graph.pool() == pool and fake_cuda.refs[pool] == 2


def test_a_timing_capture_in_a_pool_of_its_own_gives_that_pool_back(fake_cuda):
    with pytest.raises(RuntimeError, match="not permitted"):
        shared_capture.capture(host_sync, reps=3)
    assert fake_cuda.recording == set() and set(fake_cuda.refs.values()) == {0}


def test_an_invalid_capture_gives_back_the_reference_its_graph_keeps(fake_cuda):
    pool = (0, 8)
    fake_cuda.hold(pool)
    Graph.fail_at = "invalid"
    with pytest.raises(RuntimeError, match="Invalid capture"):
        shared_capture.capture(lambda: None, reps=2, pool=pool)
    assert pool not in fake_cuda.recording and fake_cuda.refs[pool] == 1


def test_where_a_graph_gives_back_any_capture_it_began_ferry_leaves_that_to_it(fake_cuda, monkeypatch):
    """pytorch #190348 (after 2.13): a graph's reset releases its pool for any capture begun."""

    class LaterGraph(Graph):
        def reset(self):
            if self.pool_id is not None:
                self.allocator.release(0, self.pool_id)
                self.pool_id = None

    monkeypatch.setattr(shared_capture, "_RESET_RELEASES_ONLY_ENDED_CAPTURES", False)
    pool = (0, 9)
    fake_cuda.hold(pool)
    graph = LaterGraph(fake_cuda)
    Graph.fail_at = "invalid"
    with pytest.raises(RuntimeError, match="Invalid capture"):
        with shared_capture.recording(graph, pool, 0):
            pass
    graph.reset()
    assert pool not in fake_cuda.recording and fake_cuda.refs[pool] == 1


@pytest.mark.parametrize("fail_at, graph_gives_back", [("invalid", False), ("instantiate", True)])
def test_a_capture_that_fails_after_its_recording_ended_is_given_back_once(fake_cuda, fail_at, graph_gives_back):
    """"Invalid capture." comes before the capture is marked ended (the graph will not give the
    pool back: ferry does); a failed instantiation after (the graph does: ferry must not)."""
    pool = (0, 7)
    fake_cuda.hold(pool)
    graph = Graph(fake_cuda)
    Graph.fail_at = fail_at
    with pytest.raises(RuntimeError):
        with shared_capture.recording(graph, pool, 0):
            pass
    assert pool not in fake_cuda.recording
    assert fake_cuda.refs[pool] == (2 if graph_gives_back else 1)
    graph.reset()
    assert fake_cuda.refs[pool] == 1


def test_a_capture_whose_body_raised_after_a_clean_capture_needs_nothing_undone(fake_cuda):
    pool = (0, 5)
    fake_cuda.hold(pool)
    graph = Graph(fake_cuda)
    with pytest.raises(ValueError):
        with shared_capture.recording(graph, pool, 0):
            raise ValueError("a Python error; the capture itself ended cleanly")
    assert graph.pool() == pool and fake_cuda.refs[pool] == 2  # the graph's, given back at its reset
    graph.reset()
    assert fake_cuda.refs[pool] == 1


def test_a_plans_capture_that_failed_leaves_the_set_pool_usable_and_the_callers_stream_current(fake_cuda):
    """Two segments of one plan capture into the set's pool: the first fails (a host sync), the
    second still captures; torch.cuda.graph left the pool recording, so the second failed."""

    class Stream:
        device, device_index = torch.device("cuda", 0), 0

    pool, stream = (0, 42), Stream()
    fake_cuda.hold(pool)
    first, second = Graph(fake_cuda), Graph(fake_cuda)
    with pytest.raises(RuntimeError, match="not permitted"):
        with CudaApi.capture(first, stream, pool):
            assert fake_cuda.current[0] is stream
            host_sync()
    assert fake_cuda.current[0] == "caller's stream"
    assert pool not in fake_cuda.recording and fake_cuda.refs[pool] == 1
    with CudaApi.capture(second, stream, pool):
        pass
    assert second.pool() == pool and second.mode == "global" and fake_cuda.refs[pool] == 2

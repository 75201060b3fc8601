"""A CUDA graph capture that fails is undone (ferry/capture.py `recording`): on a fake of
torch's graph and caching-allocator bookkeeping, kept to torch's order of events, the pool the
capture allocated from is no longer recording and holds no reference for it afterwards, so the
next capture into the same pool (a plan's next segment, in the set's one pool) works; and the
plan's capture (the CUDA streams API) leaves the caller's stream current."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from ferry import capture as shared_capture
from ferry.runtime.devices.streams import CudaApi

HOST_SYNC = "CUDA error: operation not permitted when stream is capturing"


class Allocator:
    """torch's CUDA caching allocator as captures see it: a reference count per graph pool, and
    the pools being recorded into. `host`: torch 2.11's pinned-host allocator, which graphs
    record into after the device's (None: a torch without pools there, or one that ends their
    recording with the device's)."""

    def __init__(self, name="device"):
        self.refs: dict = {}
        self.recording: set = set()
        self.handles = itertools.count(1)
        self.name, self.host = name, None

    def begin(self, pool):  # beginAllocateToPool: the reference is taken before the check
        if self.refs.get(pool) == 0:  # create_or_incref_pool: a pool every holder let go
            raise RuntimeError(f"it->second->use_count > 0 INTERNAL ASSERT FAILED ({self.name} allocator)")
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
        if self.allocator.host is not None:
            self.allocator.host.begin(pool)
        self.pool_id, self.mode = pool, capture_error_mode
        Graph.invalidated = False

    def capture_end(self):
        fail, Graph.fail_at = Graph.fail_at, None
        if Graph.invalidated:
            raise RuntimeError(HOST_SYNC)
        self.allocator.end(0, self.pool_id)
        if self.allocator.host is not None:
            self.allocator.host.end(0, self.pool_id)
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
            if self.allocator.host is not None:
                self.allocator.host.release(0, self.pool_id)
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
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", lambda index, pool: allocator.begin(pool))
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


class Stream:
    device, device_index = torch.device("cuda", 0), 0


@pytest.fixture
def torch_2_11(fake_cuda):
    """torch 2.11: a graph records into the pinned-host allocator's pool too, after the device's;
    a capture that cudaStreamEndCapture refused ends neither; Python can end only the device's."""
    fake_cuda.host = Allocator("host")
    return fake_cuda


def test_a_capture_the_host_allocator_refuses_leaves_the_device_pool_as_it_found_it(torch_2_11):
    """What stopped every segment of Swin-T's plan (an H100, torch 2.11): the host allocator let
    the set's pool go when the load's timing graphs in it were freed, the next capture there
    failed in `capture_begin` after the device pool began recording, and the first run routed
    into the pool then failed with "already recording to mempool_id"."""
    pool = (0, 3)
    torch_2_11.hold(pool)  # the device allocator's hold alone, as `use_mem_pool` takes
    shared_capture.capture(lambda: None, reps=1, pool=pool).reset()  # a timing graph, freed
    with pytest.raises(RuntimeError, match="INTERNAL ASSERT FAILED \\(host"):
        shared_capture.capture(lambda: None, reps=1, pool=pool)
    assert pool not in torch_2_11.recording and torch_2_11.refs[pool] == 1
    torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)  # a first run's allocations routed there work
    assert pool in torch_2_11.recording


def test_a_pool_held_with_hold_pool_takes_captures_after_every_graph_in_it_was_freed(torch_2_11):
    pool = (0, 4)
    release = shared_capture.hold_pool(pool, Stream())
    for _ in range(3):  # the load's timing graphs in the room, each freed before the next
        shared_capture.capture(lambda: None, reps=1, pool=pool).reset()
    assert torch_2_11.refs[pool] == 1 and torch_2_11.host.refs[pool] == 1
    assert pool not in torch_2_11.recording | torch_2_11.host.recording
    release()
    assert torch_2_11.refs[pool] == 0 and torch_2_11.host.refs[pool] == 0


def test_where_no_graph_can_hold_a_pool_the_device_allocators_hold_is_taken(torch_2_11, monkeypatch):
    def refuse(self, pool=None, **options):
        raise RuntimeError("CUDA graphs must be captured on a non-default stream")

    monkeypatch.setattr(Graph, "capture_begin", refuse)
    pool = (0, 5)
    release = shared_capture.hold_pool(pool, Stream())
    assert torch_2_11.refs[pool] == 1 and pool not in torch_2_11.recording
    release()
    assert torch_2_11.refs[pool] == 0


def test_on_torch_2_11_a_pool_whose_capture_failed_takes_no_capture_but_stays_usable(torch_2_11):
    """Why a set's later captures go to a fresh pool (GraphMemory.spoiled): the host allocator's
    recording of the failed capture cannot be ended from Python."""
    pool = (0, 6)
    release = shared_capture.hold_pool(pool, Stream())
    with pytest.raises(RuntimeError, match="not permitted"):
        shared_capture.capture(host_sync, reps=1, pool=pool)
    assert pool not in torch_2_11.recording and pool in torch_2_11.host.recording
    with pytest.raises(RuntimeError, match="already recording"):
        shared_capture.capture(lambda: None, reps=1, pool=pool)
    assert pool not in torch_2_11.recording and torch_2_11.refs[pool] == 1
    fresh = torch.cuda.graph_pool_handle()
    assert shared_capture.capture(lambda: None, reps=1, pool=fresh).pool() == fresh
    release()
    assert torch_2_11.refs[pool] == 0

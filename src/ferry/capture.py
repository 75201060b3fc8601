"""What every CUDA graph capture in the process shares: one lock, the cuBLAS workspace kept
alive, and capturing calls on a side stream.

One lock for all: a kernel timed at load (ferry/choices/timing.py) while another thread
captures a plan's graphs (runtime/devices/graphs.py) would break that capture with its host
waits and allocations. It is re-entrant: a capture holds it, and a plan bound inside may ask
for kernel decisions, which take it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["LOCK", "TimingRoom", "capture", "hold_pool", "keep_workspace", "on_side_stream",
           "random_state_kept_on_failure", "recording"]

LOCK = threading.RLock()


class TimingRoom(NamedTuple):
    """Memory a load's kernel timing may allocate its forms' results in: a plan's graph pool
    (`pool`, what its timing graphs capture into) and a context routing eager allocations there
    (`allocating()`, for the forms' warm-up)."""

    pool: Any
    allocating: Callable[[], contextlib.AbstractContextManager]
    spoiled: Callable[[], None] = lambda: None  # a capture into `pool` failed (GraphMemory.spoiled)

# registry: capture stream -> the memory pool its cuBLAS workspace lives in (see keep_workspace);
# kept for the life of the process, one pool per capture stream (torch has 32 per device)
KEPT_WORKSPACES: dict = {}


@contextlib.contextmanager
def on_side_stream(stream):
    """Work on `stream`, ordered after the work queued on the current stream and before its later work."""
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        torch.cuda.current_stream().wait_stream(stream)


@contextlib.contextmanager
def random_state_kept_on_failure(device):
    """A capture that fails leaves the random generator of `device` as it was before it. torch
    ends a generator's capture mode only when the graph's capture ends cleanly: after a failed
    one, every later random op on that GPU (dropout, torch.rand, an Inductor kernel's seed)
    raised "Offset increment outside graph capture encountered unexpectedly"."""
    index = device if isinstance(device, int) else (torch.device(device).index or 0)
    generators = torch.cuda.default_generators
    if index >= len(generators):  # no such GPU (a fake CUDA in tests): nothing to keep
        yield
        return
    generator = generators[index]
    before = generator.clone_state()
    try:
        yield
    except BaseException:
        generator.graphsafe_set_state(before)
        raise


def capture(fn: Callable, reps: int, pool=None):
    """`reps` calls of `fn` captured on the current stream. Thread-local: a module already loaded
    may run in another thread meanwhile, and its host waits must neither fail nor break this."""
    graph = torch.cuda.CUDAGraph()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()  # known here: a failed graph won't say
    with recording(graph, pool, torch.cuda.current_device()):
        for _ in range(reps):
            fn()
    return graph


@contextlib.contextmanager
def recording(graph, pool, index: int, mode: str = "thread_local"):
    """Capture what is queued on the current stream of GPU `index` into `graph`, allocating from
    graph pool `pool`. A capture that fails is undone: the GPU's random generator, and the pool's
    recording and the reference the capture took (`_end_allocating`)."""
    with random_state_kept_on_failure(index):
        try:
            graph.capture_begin(pool=pool, capture_error_mode=mode)
        except BaseException:
            _end_begun(index, pool, graph)
            raise
        try:
            yield graph
        finally:
            try:
                graph.capture_end()
            except BaseException:
                _end_allocating(index, pool, graph)
                raise


# up to torch 2.13 a graph gives its pool reference back only once its capture was marked ended
_RESET_RELEASES_ONLY_ENDED_CAPTURES = tuple(int(n) for n in torch.__version__.split(".")[:2]) < (2, 14)


def _end_allocating(index: int, pool, graph) -> None:
    """After a capture that failed. torch 2.11's `capture_end` raises at `cudaStreamEndCapture`
    (an invalidated capture) before it ends the pool's recording: left so, the next capture into
    the pool fails ("already recording to mempool_id"), as does every allocation routed there,
    and `empty_cache()` cannot release memory. And up to torch 2.13 the graph gives back the pool
    reference its `capture_begin` took only if its capture was marked ended (`graph.pool()`
    answers then); later, its reset does so for any capture begun (pytorch #190348), and a
    release here would be a second one: there the reference is left to the graph."""
    with contextlib.suppress(RuntimeError):  # capture_end had ended it
        torch._C._cuda_endAllocateToPool(index, pool)
    _give_back_unless_the_graph_will(index, pool, graph)


def _give_back_unless_the_graph_will(index: int, pool, graph) -> None:
    if not _RESET_RELEASES_ONLY_ENDED_CAPTURES:
        return
    try:
        graph.pool()
    except RuntimeError:
        torch._C._cuda_releasePool(index, pool)


def _end_begun(index: int, pool, graph) -> None:
    """After a `capture_begin` that failed part way. torch 2.11's begins the device pool's
    recording (taking a reference) before the pinned-host allocator's, which may refuse (its pool
    let go by every graph: "use_count > 0 INTERNAL ASSERT FAILED"): left so, the device pool stays
    recording, and every allocation routed there fails ("already recording to mempool_id"), as
    does `empty_cache()`'s release. Ended only where it records (a capture that failed before
    beginning it took nothing; ferry never captures into one pool twice at once); its reference
    given back where the graph will not (as in `_end_allocating`)."""
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except RuntimeError:
        return
    _give_back_unless_the_graph_will(index, pool, graph)


def hold_pool(pool, stream) -> Callable[[], None]:
    """Hold graph pool `pool` open, on `stream`'s device, until the returned function is called,
    in both of torch's caching allocators: an empty graph captured into it and kept. A hold of
    the device allocator's alone (as `use_mem_pool` takes) left torch 2.11's pinned-host allocator
    letting the pool go once every graph in it was freed (a load's timing graphs in the room its
    plan lends): the next capture into it then failed ("use_count > 0 INTERNAL ASSERT FAILED") and
    so did every segment of Swin-T's plan. Where such a graph cannot be captured, the device
    allocator's hold."""
    keeper, index = torch.cuda.CUDAGraph(), stream.device_index
    with LOCK, torch.cuda.device(index), torch.cuda.stream(stream), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        try:
            with recording(keeper, pool, index):
                pass
            return keeper.reset
        except RuntimeError:
            pass
    torch._C._cuda_beginAllocateCurrentThreadToPool(index, pool)
    torch._C._cuda_endAllocateToPool(index, pool)
    return lambda: torch._C._cuda_releasePool(index, pool)


def keep_workspace(stream) -> None:
    """Make the cuBLAS workspace of `stream` (one per stream, 32 MiB on an H200) inside a memory
    pool kept for the life of the process. A graph bakes that workspace's address in; made in a
    timing graph's pool, it would be freed with it, and `torch._C._cuda_clearCublasWorkspaces`
    (torch.compile's reduce-overhead mode calls it) would then hand its memory to anyone while the
    plan's own graphs still use it. In the kept pool, freed memory is reused only by the workspace
    made again there. The products that make it run on `stream` itself: run on the caller's
    stream they would make that stream's workspace too, 32 MiB more than eager holds. Called
    again before every timing and every capture of a plan's graphs (a few µs): the workspace may
    have been cleared since."""
    with LOCK, torch.cuda.device(stream.device):
        pool = KEPT_WORKSPACES.get(stream)
        if pool is None:
            pool = KEPT_WORKSPACES[stream] = _immortal(torch.cuda.MemPool())
        with on_side_stream(stream), torch.cuda.use_mem_pool(pool):
            # the operands too: made in the default pool after a timing's empty_cache, they took
            # a 2 MiB segment of their own at every timing (Swin-T's load: one on top of its peak)
            a = torch.ones(16, 16, device=stream.device)
            bias = torch.ones(16, device=stream.device)
            torch.mm(a, a)  # cuBLAS's handle made (outside any capture) and the stream's workspace
            torch.addmm(bias, a, a)  # cublasLt's path, where its workspace may be separate


def _immortal(pool):
    """`pool`, never destroyed, not even at exit: its destructor empties the pool's cache, which
    torch refuses once any graph capture of the process failed (it leaves the capture registered),
    with an internal assert in a destructor that aborts the process."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool))
    return pool

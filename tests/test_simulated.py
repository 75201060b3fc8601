"""The simulated asynchronous device: its stream semantics, and the runtime's scheduling,
host waits and graph capture exercised on it — the code CUDA runs, tested on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

import ferry
import ferry.runtime.stages.method as method_mod
from ferry.errors import InternalError
from ferry.examples import transformer_block
from ferry.runtime import clone_to
from ferry.runtime.devices.simulated import SimulatedApi
from ferry.runtime.devices.streams import CopyStreams
from ferry.runtime.stages.schedule import HostWait, Schedule
from models import AddChain, PerAdd, fresh_inputs, launched_streams, loaded_method, small

# ---------------------------------------------------------------- stream semantics


def test_work_waits_until_the_host_does():
    api = SimulatedApi()
    log = []
    s = api.current_stream(0)
    api.enqueue(s, lambda: log.append("a"))
    ev = api.Event()
    ev.record(s)
    api.enqueue(s, lambda: log.append("b"))
    assert log == []  # nothing ran: the host has not waited
    ev.synchronize()
    assert log == ["a"]  # up to the event, not beyond
    api.synchronize(0)
    assert log == ["a", "b"]


@pytest.mark.parametrize("side_made_first", [False, True], ids=["side stream made after", "side stream made first"])
def test_wait_event_orders_two_streams(side_made_first):
    """Work queued on a side stream after it waits on an event runs after the compute stream's work
    before the event, whichever stream the simulation looks at first (the older one)."""
    api = SimulatedApi()
    log = []
    if side_made_first:
        side, compute = api.Stream(0), api.current_stream(0)
    else:
        compute, side = api.current_stream(0), api.Stream(0)
    api.enqueue(compute, lambda: log.append("kernel"))
    ready = api.Event()
    ready.record(compute)
    side.wait_event(ready)
    api.enqueue(side, lambda: log.append("copy"))
    api.synchronize(0)
    assert log == ["kernel", "copy"] and ready.mark.reached


def test_an_event_never_recorded_is_complete():
    api = SimulatedApi()
    api.Event().synchronize()
    s = api.Stream(0)
    s.wait_event(api.Event())  # waiting on nothing queues nothing
    assert s.queue == []


def test_a_stream_waiting_on_a_mark_nobody_reaches_deadlocks_clearly():
    api = SimulatedApi()
    a, b = api.Stream(0), api.Stream(0)
    ev_a, ev_b = api.Event(), api.Event()
    ev_a.record(a)
    ev_b.record(b)
    # each stream now waits on the other's later mark
    a.queue.insert(0, ("wait", ev_b.mark))
    b.queue.insert(0, ("wait", ev_a.mark))
    with pytest.raises(RuntimeError, match="deadlocked"):
        api.synchronize(0)


def test_capture_records_and_replay_requeues():
    api = SimulatedApi()
    log = []
    g, cs = api.new_graph(), api.Stream(0)
    with api.capture(g, cs):
        api.enqueue(cs, lambda: log.append("x"))
        api.on_device(0, lambda: log.append("y"))()  # the current stream of device 0 = the capture stream
    assert log == [] and len(g.work) == 2
    g.replay()
    g.replay()
    api.synchronize(0)
    assert log == ["x", "y", "x", "y"]


def test_host_wait_during_capture_fails_and_empty_capture_warns():
    api = SimulatedApi()
    g = api.new_graph()
    with pytest.raises(RuntimeError, match="capturing"):
        with api.capture(g, api.Stream(0)):
            api.synchronize(0)
    with pytest.warns(UserWarning, match="Graph is empty"):
        with api.capture(api.new_graph(), api.Stream(0)):
            api.enqueue(api.current_stream(1), lambda: None)  # another device: not captured
    with pytest.raises(RuntimeError, match="never captured"):
        api.new_graph().replay()


def test_end_of_call_reports_a_host_copy_not_waited_for():
    api = SimulatedApi()
    api.enqueue(api.current_stream(0), lambda: None, touches_host=True)
    with pytest.raises(InternalError, match="not waited for"):
        api.end_of_call()


def test_copy_streams_small_copies_stay_on_the_compute_stream():
    api = SimulatedApi()
    streams = CopyStreams(api)
    dev, host = ferry.Device("emu", 0), ferry.Device("cpu")
    log = []
    small_copy = streams.bind("k1", lambda: log.append("small"), (host, dev), nbytes=64)
    big_copy = streams.bind("k2", lambda: log.append("big"), (host, dev), nbytes=1 << 24)
    small_copy()
    big_copy()
    # internal: the queues of the simulated streams and the copies pending a host wait are what this checks
    assert [s.name for s in api._streams if s.queue] and log == []
    assert len(streams._pending) == 2  # both touch host memory: the host must wait for both
    streams.wait_host()
    assert sorted(log) == ["big", "small"] and streams._pending == []
    assert api.current_stream(0).queue == [] or all(i[0] != "run" for i in api.current_stream(0).queue)


# ---------------------------------------------------------------- the runtime on it

EXCLUDE_SOFTMAX = ["aten.softmax"]


def _block_program(exclude=EXCLUDE_SOFTMAX, config=None):
    model, example = transformer_block()
    program = ferry.compile(torch.export.export(model, example), ferry.OpSupportPartitioner("emu:0", exclude=exclude),
                            config)
    return model, example, program


def test_cpu_fallback_in_the_middle_matches_eager(emu_async):
    model, example, program = _block_program()
    module = ferry.Module(program)
    for seed in range(3):
        (x,) = fresh_inputs(example, seed)
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    assert emu_async.streams_api().launched > 0  # device work really went through the streams


def _without_host_waits(monkeypatch):
    real = method_mod.schedule

    def no_waits(steps, async_type, graphs=False, pending=False):
        s = real(steps, async_type, graphs, pending)
        return Schedule(tuple(w for w in s.work if not isinstance(w, HostWait)), s.notes)

    monkeypatch.setattr(method_mod, "schedule", no_waits)


def test_a_missing_host_wait_is_caught(emu_async, monkeypatch):
    """The simulated device runs device work only when the host waits: without the waits the
    schedule places, the CPU softmax reads a d2h result that is not there yet."""
    _without_host_waits(monkeypatch)
    model, example, program = _block_program()
    module = ferry.Module(program)
    (x,) = fresh_inputs(example, 7)
    try:
        got = module(x)
    except InternalError:
        return  # the end-of-call check caught it
    assert not torch.allclose(got, model(x), atol=1e-4, rtol=1e-3), "stale data must show"


def test_synchronous_emulated_device_does_not_need_waits(emu, monkeypatch):
    """The same program without waits is right on the synchronous device: which is why the
    asynchronous one exists."""
    _without_host_waits(monkeypatch)
    model, example, program = _block_program()
    (x,) = fresh_inputs(example, 7)
    torch.testing.assert_close(ferry.Module(program)(x), model(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("outputs", ["copy", "view"])
def test_graphs_capture_replay_and_match_eager(emu_async, outputs):
    model, example, program = _block_program()
    module = ferry.Module(program, cuda_graphs=True, outputs=outputs)
    kept = []
    for seed in range(5):
        (x,) = fresh_inputs(example, seed)
        got = module(x)
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)
        kept.append((got.clone() if outputs == "view" else got, model(x)))
    graphs = loaded_method(module).graphs
    assert len(graphs) == 2 and all(g.graph is not None and not g.failed for g in graphs)
    if outputs == "copy":
        for got, want in kept:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_graphs_with_device_resident_io(emu_async):
    cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(True, True))
    model, example, program = _block_program(exclude=(), config=cfg)
    module = ferry.Module(program, cuda_graphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every segment capturable: no note
        module.load_method()
    for seed in range(4):
        (x,) = fresh_inputs(example, seed)
        got = module(clone_to(x, "emu:0"))
        torch.testing.assert_close(clone_to(got, "cpu"), model(x), atol=1e-5, rtol=1e-4)
    (g,) = loaded_method(module).graphs
    assert g.graph is not None


def test_one_graph_per_device_and_the_copy_between_them(emu_async):
    a, b = small(n=2)
    program = ferry.compile(torch.export.export(AddChain(), (a, b)), PerAdd("emu:0", "emu:1"))
    assert ferry.copy_report(program, "forward").count("d2d") == 1
    module = ferry.Module(program, cuda_graphs=True)
    for seed in range(4):
        x, y = fresh_inputs((a, b), seed)
        torch.testing.assert_close(module(x, y), AddChain()(x, y))
    graphs = loaded_method(module).graphs
    assert sorted(g.index for g in graphs) == [0, 1] and all(g.graph is not None for g in graphs)


def test_each_first_run_and_capture_goes_to_its_capture_stream_once_prepared(emu_async, monkeypatch):
    """A segment's first (eager) run and its capture go to the capture stream, after the streams
    API prepared that stream (CUDA: cuBLAS's workspace made in a kept pool, and none made for the
    caller's stream); the answers stay right in either order of running streams."""
    import ferry.runtime.devices.graphs as graphs_mod

    # internal: a segment's eager run is where the stream it runs on can be seen
    eager, seen = graphs_mod.GraphSegment._eager, []

    def recording(self):
        seen.append((self.api.current_stream(self.index) is self.streams.capture_stream(self.index),
                     len(self.api.prepared) and self.api.prepared[-1] is self.streams.capture_stream(self.index)))
        return eager(self)

    monkeypatch.setattr(graphs_mod.GraphSegment, "_eager", recording)
    model, example, program = _block_program()
    module = ferry.Module(program, cuda_graphs=True)
    for seed in range(4):
        (x,) = fresh_inputs(example, seed)
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    graphs = loaded_method(module).graphs
    assert all(g.graph is not None for g in graphs)
    assert seen == [(True, True)] * (2 * len(graphs))
    assert len(graphs[0].api.prepared) == 1 + 2 * len(graphs)  # the first call's too


def test_with_graphs_no_call_before_the_capture_runs_device_work_on_the_callers_stream(emu_async, monkeypatch):
    """The first call (steps one by one, shapes checked) and the second (each segment's eager run)
    launch their kernels on the capture stream, as the capture does: on CUDA the caller's stream
    then never makes a cuBLAS workspace of its own. What every call puts on the caller's stream
    (the input staged into the graph's fixed memory, a replay) is the same in all four calls."""
    launched_on = launched_streams(emu_async.streams_api(), monkeypatch)
    cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(True, True))
    model, example, program = _block_program(exclude=(), config=cfg)
    module = ferry.Module(program, cuda_graphs=True, outputs="view")  # no copy of the result, on the caller's stream
    per_call = []
    for seed in range(4):
        (x,) = fresh_inputs(example, seed)
        on_device = clone_to(x, "emu:0")
        launched_on.clear()
        got = module(on_device)
        per_call.append(list(launched_on))
        torch.testing.assert_close(clone_to(got, "cpu"), model(x), atol=1e-5, rtol=1e-4)
    (g,) = loaded_method(module).graphs
    capture = g.streams.capture_stream(g.index).name
    on_caller = [sum(name == "default" for name in names) for names in per_call]
    on_capture = [sum(name == capture for name in names) for names in per_call]
    assert on_caller == [on_caller[3]] * 4 and on_caller[3] <= 1  # the staged input only
    assert min(on_capture[:3]) >= 1  # first call, first run, capture
    assert on_capture[3] == 0  # a replay: the graph's work queued as a whole on the caller's stream


def test_capture_that_fails_falls_back_with_correct_results(emu_async, monkeypatch):
    """A host synchronisation while capturing aborts the capture: that call is still right,
    with a warning, and later calls run eagerly."""
    import ferry.runtime.devices.graphs as graphs_mod

    # internal: a segment's eager run is the one place a capture can be made to fail from outside
    eager = graphs_mod.GraphSegment._eager

    def syncs(self):
        self.api.synchronize(self.index)  # illegal while capturing
        return eager(self)

    monkeypatch.setattr(graphs_mod.GraphSegment, "_eager", syncs)
    model, example, program = _block_program()
    module = ferry.Module(program, cuda_graphs=True)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        for seed in range(5):
            (x,) = fresh_inputs(example, seed)
            torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    assert all(g.graph is None and g.failed for g in loaded_method(module).graphs)


def test_after_one_segments_capture_failed_the_others_capture_into_a_fresh_pool(emu_async, monkeypatch):
    """Some torch versions leave a failed capture's pool recording, and every later capture into
    it fails (the simulated pool does the same): the plan's other segments then capture into a
    fresh pool, and the set's room is lent to no timing any more."""
    import ferry.runtime.devices.graphs as graphs_mod

    eager, breaking = graphs_mod.GraphSegment._eager, []

    def first_one_syncs(self):
        if self.api._capturing is not None and breaking in ([], [self]):
            breaking[:] = [self]
            self.api.synchronize(self.index)  # illegal while capturing
        return eager(self)

    monkeypatch.setattr(graphs_mod.GraphSegment, "_eager", first_one_syncs)
    model, example, program = _block_program()
    module = ferry.Module(program, cuda_graphs=True)
    module.load_method()
    streams = loaded_method(module).streams
    set_pool = streams.graph_memory.pool(streams.api, 0)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        for seed in range(5):
            (x,) = fresh_inputs(example, seed)
            torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    graphs = loaded_method(module).graphs
    others = [g for g in graphs if g is not breaking[0]]
    assert breaking[0].failed and set_pool.spoiled and others
    assert all(g.graph is not None and g.graph.pool is streams.capture_pool(0) is not set_pool for g in others)
    assert streams.timing_room(0, 1) is None
    module.close()


def test_an_empty_capture_is_never_replayed(emu_async, monkeypatch):
    """Capturing on another device's stream records nothing; ferry never replays it."""
    api = emu_async.streams_api()
    monkeypatch.setattr(CopyStreams, "capture_stream", lambda self, index: api.Stream(1 - index))
    monkeypatch.setattr(CopyStreams, "capture_pool", lambda self, index: api.new_pool(1 - index))
    model, example, program = _block_program()
    module = ferry.Module(program, cuda_graphs=True)
    with pytest.warns(RuntimeWarning, match="graph is empty"):
        for seed in range(3):
            module(*fresh_inputs(example, seed))
    assert all(g.graph is None and g.failed for g in loaded_method(module).graphs)
    for seed in range(3):
        (x,) = fresh_inputs(example, seed)
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)


def test_a_new_input_shape_runs_without_the_graph(emu_async):
    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1

    batch = torch.export.Dim("batch", max=64)
    ep = torch.export.export(Scale(), (torch.randn(8, 16),), dynamic_shapes=({0: batch},))
    cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(False, False))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"), cfg), cuda_graphs=True)
    for n in (8, 8, 8, 5, 8):
        x = torch.randn(n, 16)
        torch.testing.assert_close(module(x), Scale()(x))


def test_a_dynamic_method_with_graphs_loads_its_delegates_as_captured(emu_async, monkeypatch):
    """Its first plan is bound without graphs (each new shape's first call runs through it), but
    the plans per shape are captured: a delegate, loaded once by the first plan, is told so (an
    inductor delegate then loads on the capture stream), while the first plan's own kernel
    choices stay those of a plan run eagerly."""
    from ferry.runtime.stages import module as module_mod

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1

    callers, init = [], module_mod.Module._init_delegate

    def recording(self, index, memory, caller, *rest):
        callers.append(caller.captured)
        return init(self, index, memory, caller, *rest)

    monkeypatch.setattr(module_mod.Module, "_init_delegate", recording)
    batch = torch.export.Dim("batch", max=64)
    ep = torch.export.export(Scale(), (torch.randn(8, 16),), dynamic_shapes=({0: batch},))
    cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(False, False))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"), cfg)
    for graphs in (True, False):
        callers.clear()
        module = ferry.Module(program, cuda_graphs=graphs)
        for n in (8, 8, 8, 5):
            x = torch.randn(n, 16)
            torch.testing.assert_close(module(x), Scale()(x))
        assert callers and set(callers) == {graphs}


def test_pageable_host_memory_is_never_captured(emu_async, monkeypatch):
    """A copy from pageable host memory would replay a staging buffer filled at capture: it
    runs without a graph, and the user is told; the device work after it is still captured."""
    monkeypatch.setattr(type(emu_async.streams_api()), "page_locked", staticmethod(lambda t: False))
    model, example, program = _block_program()
    with pytest.warns(RuntimeWarning, match="without a graph"):
        module = ferry.Module(program, cuda_graphs=True)
        module.load_method()
    for seed in range(3):
        (x,) = fresh_inputs(example, seed)
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    graphs = loaded_method(module).graphs
    assert graphs and all("_copy" not in g.label for g in graphs)


def test_the_load_and_the_calls_before_the_first_capture_allocate_in_the_graph_pool(emu_async, monkeypatch):
    """With graphs, a load makes its one device allocation in the set's graph pool, with room
    behind it for what a call allocates at run time (a block of both handed back, then the
    slab from its front), and the calls before the first capture allocate there too; after it,
    eager work allocates outside the pool (a replay would overwrite it there). Closing lets
    the pool go."""
    from ferry.runtime.devices.limits import call_bytes

    api = emu_async.streams_api()
    allocations, entered = [], []
    allocate, allocating_in = type(emu_async)._allocate, SimulatedApi.allocating_in

    def recorded(self, nbytes, index, alignment):
        allocations.append((nbytes, api.allocating_to))
        return allocate(self, nbytes, index, alignment)

    def entering(self, pool, stream):
        entered.append(pool)
        return allocating_in(self, pool, stream)

    monkeypatch.setattr(type(emu_async), "_allocate", recorded)
    monkeypatch.setattr(SimulatedApi, "allocating_in", entering)
    monkeypatch.setattr(SimulatedApi, "splits_above", 0)  # (this block's room is smaller than CUDA's split limit)
    model, example, program = _block_program(exclude=())
    tail = call_bytes(program, program.method("forward"), handed_out=False)[ferry.Device.parse("emu:0")]
    assert tail > 0  # the block's functional kernels' results
    module = ferry.Module(program, cuda_graphs=True)
    module.load_method()
    method = loaded_method(module)
    pool = method.streams.capture_pool(0)
    (both, first_pool), (slab, slab_pool) = allocations[:2]
    assert both - slab == tail and first_pool is pool is slab_pool
    assert method.streams.graph_memory.tail == {0: tail} and pool.holds == 1
    per_call = []
    for seed in range(5):
        entered.clear()
        (x,) = fresh_inputs(example, seed)
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
        per_call.append(len(entered))
    assert all(g.graph is not None for g in method.graphs) and all(g.graph.pool is pool for g in method.graphs)
    assert per_call[0] > 0 and per_call[1] > 0 and per_call[3:] == [0, 0]  # first runs in the pool; replays
    module.close()
    assert pool.holds == 0


def test_the_room_a_load_leaves_in_the_graph_pool_is_lent_to_its_timing_until_a_call_runs(emu_async, monkeypatch):
    """The room behind the slab is free while the set loads: its kernel timing may allocate the
    forms' results there (choices/timing.py, `Site.timing_room`). A call's first, eager run
    allocates there (its results may still hold part of it), and after a capture a free block
    there may be a replay's temporary: neither is lent afterwards."""
    from ferry.runtime.devices.limits import call_bytes

    monkeypatch.setattr(SimulatedApi, "splits_above", 0)  # (this block's room is smaller than CUDA's split limit)
    model, example, program = _block_program(exclude=())
    tail = call_bytes(program, program.method("forward"), handed_out=False)[ferry.Device.parse("emu:0")]
    module = ferry.Module(program, cuda_graphs=True)
    module.load_method()
    streams = loaded_method(module).streams
    api = streams.api
    room = streams.timing_room(0, tail)
    assert room is not None and room.pool is streams.capture_pool(0)
    with room.allocating():  # allocations go to the set's pool, on its capture stream
        assert api.allocating_to is room.pool and api.current_stream(0) is streams.capture_stream(0)
    assert api.allocating_to is None
    assert streams.timing_room(0, tail + 1) is None and streams.timing_room(1, 1) is None  # more; another device
    (x,) = fresh_inputs(example, 0)
    torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)  # the first, eager run: in the pool
    assert streams.timing_room(0, 1) is None
    torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)  # captured
    assert streams.timing_room(0, 1) is None
    module.close()


def test_a_module_closed_and_called_again_makes_a_new_graph_pool(emu_async, monkeypatch):
    """torch refuses to hold a pool again once it was let go: a set closed and loaded again makes
    a new pool (and lets it go at the next close), its room counted afresh."""
    monkeypatch.setattr(SimulatedApi, "splits_above", 0)  # (this block's room is smaller than CUDA's split limit)
    model, example, program = _block_program(exclude=())
    module = ferry.Module(program, cuda_graphs=True)
    pools = []
    for _ in range(3):
        for seed in range(4):
            (x,) = fresh_inputs(example, seed)
            torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
        method = loaded_method(module)
        pools.append(method.streams.capture_pool(0))
        assert method.streams.graph_memory.tail.get(0, 0) > 0 and pools[-1].holds >= 1
        module.close()
        assert pools[-1].holds == 0
    assert len({id(p) for p in pools}) == 3


def test_a_method_loaded_after_a_capture_keeps_its_memory_out_of_the_graph_pool(emu_async, monkeypatch):
    """Once a graph of the set was captured, its temporaries are free memory in the pool: a slab
    allocated there later could be given it and a replay would overwrite its weights. A method
    loaded then (decode after three prefills) allocates outside the pool, and both stay right."""
    from test_shared_state import _call, _seeded, compiled

    api = emu_async.streams_api()
    allocations, allocate = [], type(emu_async)._allocate

    def recorded(self, nbytes, index, alignment):
        allocations.append(api.allocating_to)
        return allocate(self, nbytes, index, alignment)

    monkeypatch.setattr(type(emu_async), "_allocate", recorded)
    program, reference = compiled("emu"), _seeded()
    module = ferry.Module(program, cuda_graphs=True)

    def both(i: int, name: str, positions: list[int]) -> None:
        x, pos = torch.randn(len(positions), 64, generator=torch.Generator().manual_seed(i)), torch.tensor(positions)
        got = _call(module, "emu", name, x, pos)
        with torch.no_grad():
            torch.testing.assert_close(got, reference.step(x, pos), atol=1e-5, rtol=1e-4)

    for i in range(3):
        both(i, "prefill", [0, 1, 2, 3])
    assert any(g.graph is not None for g in loaded_method(module, "prefill").graphs)
    allocations.clear()
    module.load_method("decode")
    assert allocations and not any(allocations)
    for i, (name, positions) in enumerate([("decode", [4]), ("prefill", [5, 6, 7, 8]), ("decode", [9]),
                                           ("decode", [10]), ("prefill", [0, 1, 2, 3]), ("decode", [4])]):
        both(10 + i, name, positions)


def test_a_failed_first_load_lets_the_graph_pool_go(emu_async, monkeypatch):
    """A set whose first load fails holds no pool afterwards (its memory goes back with the
    rest of the failed load's), and loads again with a new one."""
    from ferry.backends.torch import TorchBackend

    model, example, program = _block_program(exclude=())
    module = ferry.Module(program, cuda_graphs=True)
    pools, make_pool, init = [], SimulatedApi.new_pool, TorchBackend.init
    monkeypatch.setattr(SimulatedApi, "new_pool", lambda self, index: pools.append(make_pool(self, index)) or pools[-1])
    monkeypatch.setattr(TorchBackend, "init", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    with pytest.raises(Exception, match="no"):
        module.load_method()
    assert pools and all(p.holds == 0 for p in pools)
    monkeypatch.setattr(TorchBackend, "init", init)
    (x,) = fresh_inputs(example, 0)
    torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    assert len(pools) == 2 and pools[-1].holds == 1
    module.close()


def test_room_of_a_segment_of_its_own_is_made_once_the_load_is_over(emu_async, monkeypatch):
    """Room the allocator would give a segment of its own anyway (10 MiB or more on CUDA) is not
    put behind the slab: it is made in the pool after the load, once the load's kernel timing
    handed its memory back, so it does not add to the load's peak."""
    from ferry.runtime.devices.limits import call_bytes

    api = emu_async.streams_api()
    allocations, allocate = [], type(emu_async)._allocate

    def recorded(self, nbytes, index, alignment):
        allocations.append((nbytes, api.allocating_to))
        return allocate(self, nbytes, index, alignment)

    monkeypatch.setattr(type(emu_async), "_allocate", recorded)
    monkeypatch.setattr(SimulatedApi, "own_segment_from", 1)
    model, example, program = _block_program(exclude=())
    room = call_bytes(program, program.method("forward"), handed_out=False)[ferry.Device.parse("emu:0")]
    module = ferry.Module(program, cuda_graphs=True)
    module.load_method()
    method = loaded_method(module)
    pool = method.streams.capture_pool(0)
    assert allocations[0][1] is pool and allocations[0][0] != room  # the slab, in the pool, nothing behind it
    assert allocations[-1] == (room, pool)  # the room, last
    assert method.streams.graph_memory.tail == {0: room} and not method.streams.graph_memory.pending
    for seed in range(4):
        (x,) = fresh_inputs(example, seed)
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    module.close()


def test_room_the_allocator_would_not_split_off_is_not_asked_for(emu_async, monkeypatch):
    """The caching allocator splits a free block only where more than 1 MiB is left: a room
    of less (this block's) would stay inside the slab's own block, so none is asked for."""
    api = emu_async.streams_api()
    model, example, program = _block_program(exclude=())
    module = ferry.Module(program, cuda_graphs=True)
    module.load_method()
    method = loaded_method(module)
    assert method.streams.graph_memory.tail == {} and api.splits_above == 1 << 20
    (x,) = fresh_inputs(example, 0)
    torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    module.close()


def test_a_fresh_pool_is_held_and_let_go_once_another_replaces_it():
    """After each failed capture the set's later captures go to a new pool: the one it replaces
    is let go (the graphs captured in it hold it), and a hold torch refuses leaves the set usable."""
    from ferry.runtime.devices.graphs import GraphMemory

    api, memory = SimulatedApi(), GraphMemory()
    memory.spoiled(api, 0)
    first = memory.capture_pool(api, 0)
    assert first.holds == 1
    memory.spoiled(api, 0)
    second = memory.capture_pool(api, 0)
    assert second is not first and (first.holds, second.holds) == (0, 1)
    api.hold_pool = lambda pool, stream: (_ for _ in ()).throw(RuntimeError("use_count > 0 INTERNAL ASSERT FAILED"))
    memory.spoiled(api, 0)
    third = memory.capture_pool(api, 0)
    assert third is not second and second.holds == 0 and third.holds == 0
    memory.close()

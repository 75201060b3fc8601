"""ferry.Module: load a program, allocate its planned memory per device, run its methods."""

from __future__ import annotations

import os
import queue
import threading
import warnings

import torch

from ferry.backend_registry import NOT_CAPTURED, CallerPlan, DelegateHandle, ProgramData, data_kwargs, get_backend
from ferry.capture import LOCK
from ferry.device import CPU
from ferry.errors import BackendError, ConfigError, DeviceError, FerryError, ProgramError
from ferry.ops import OUT_COPY_KERNELS
from ferry.program import Program, load_program
from ferry.program.dataflow import state_overwrites
from ferry.program.footprint import load_pieces, unknown_limit_keys
from ferry.program.ranks import program_ranks
from ferry.program.schema import DelegateCall, MethodMeta, TensorValue
from ferry.program.states import program_states
from ferry.progress import Progress, checked, tell
from ferry.runtime.devices.graphs import GraphMemory
from ferry.runtime.devices.limits import allocated_by_load, call_bytes, check_limits, parse_limits
from ferry.runtime.devices.slab import MemoryReservation
from ferry.runtime.parallel.microbatch import MicroBatches
from ferry.runtime.stages.buckets import ShapeBuckets, check_buckets
from ferry.runtime.stages.call_tree import CallTree
from ferry.runtime.stages.input_writes import check_writable, written_back
from ferry.runtime.stages.method import LoadedMethod, streams_api_for
from ferry.runtime.stages.run import caller_copy
from ferry.runtime.stages.shared import DeviceUploads, ProgramState


def _hand_back_cached_memory() -> None:
    """What a load allocated for a while (dry runs at a dynamic method's longest shape, kernels
    timed and tuned, a failed load's buffers) is returned to the driver rather than held by the
    caching allocator: the process then holds what its tensors and modules hold, as after eager's
    own load (an int4 decode program of 931 MiB at its peak left 3.7 GiB reserved). Process-wide,
    as `torch.cuda.empty_cache` is: other modules' next calls may allocate afresh. Under the capture
    lock, as the load's other GPU work: no other thread's graph capture is under way meanwhile."""
    if torch.cuda.is_initialized():  # (a process that never used CUDA has nothing cached)
        with LOCK:
            torch.cuda.empty_cache()


def _check_delegate_calls(program: Program, method) -> None:
    """Each delegate call agrees with its payload (backend_registry.Backend.check_call), before
    anything of the method is allocated."""
    host_io = not any(getattr(ins, "kernel", None) in OUT_COPY_KERNELS for ins in method.instructions)  # no placement
    overwrites = state_overwrites(method)
    for k, ins in enumerate(method.instructions):
        if isinstance(ins, DelegateCall):
            d = program.delegates[ins.delegate]
            backend = get_backend(d.backend_id)
            data = data_kwargs(backend, ProgramData(program.segments))
            try:
                backend.check_call(program.segments[d.payload], [method.values[a] for a in ins.args],
                                   [method.values[o] for o in ins.outputs], host_io=host_io, **data)
                _check_state_written_over(method, ins, overwrites, backend, program.segments[d.payload], data)
            except ProgramError as e:
                raise ProgramError(f"method {method.name!r} instruction {k} (delegate {ins.delegate}): {e}") from None


def _check_state_written_over(method, ins: DelegateCall, overwrites: dict, backend, payload, data: dict) -> None:
    """Each result the call writes over a state (storage 'state'; dataflow.py checked the method's
    side: `overwrites`, its state_overwrites) is one its backend says it may write over that
    argument (the payload read only where there is one)."""
    written = [o for o in ins.outputs if method.tensor(o).storage == "state"]
    allowed = backend.writes_over(payload, **data) if written else {}
    names = {mb.update: mb.name for mb in method.mutable_buffers}
    for o in written:
        where = overwrites.get(o)
        if where is None or allowed.get(where[2]) != where[1]:
            raise ProgramError(f"result {ins.outputs.index(o)} is written over the state {names.get(o)!r} in place, "
                               "which the delegate's payload does not allow")


def _state_overwrites(program: Program, index: int) -> dict[int, int]:
    """{result: argument} of delegate `index`'s call whose result the program keeps in that
    argument's memory: the update of a state written over the state in place."""
    for m in program.methods.values():
        for k, ins in enumerate(m.instructions):
            if isinstance(ins, DelegateCall) and ins.delegate == index:
                return {result: arg for o, (at, arg, result) in state_overwrites(m).items()
                        if at == k and m.tensor(o).storage == "state"}
    return {}


def _check_limit_keys(limits: dict[str, int] | None, program: Program) -> None:
    """A `max_memory` key that names no device of the program is a mistake (a misspelled key
    would silently mean no cap): refused, listing the devices the program uses."""
    if not limits:
        return
    devices = {CPU} | {v.device for m in program.methods.values() for v in m.values if isinstance(v, TensorValue)}
    unknown = unknown_limit_keys(limits, devices)
    if unknown:
        raise ConfigError(f"max_memory names {', '.join(map(repr, unknown))}, which this program does not use; its "
                          f"devices: {', '.join(sorted(map(str, devices)))} (or a type such as 'cuda', or '*')")


def _refuse_state_per_set(program: Program, concurrency: int) -> None:
    """Each set of memory holds the program's state of its own, and a call runs in whichever set
    is free: successive calls of a stateful model (decode steps) would read and write different
    KV caches. Refused, never a wrong answer."""
    states = program_states(program.methods)
    if concurrency > 1 and states:
        raise ConfigError(f"this program keeps state between calls ({', '.join(list(states)[:3])}"
                          f"{', ...' if len(states) > 3 else ''}), and with concurrency={concurrency} each set of "
                          "memory would hold a KV cache of its own, calls going to any of them: load it with "
                          "concurrency=1 (one Module per concurrent caller)")


class _Instance:
    """One set of planned memory: the loaded methods and their delegates. One call at a time."""

    def __init__(self, module: Module, label: str = ""):
        self.module, self.label = module, label  # label: which set, in progress reports
        self.state = ProgramState(module.program.segments, module.program.methods, pin_host=module.pin_host_memory)
        self.graph_memory = GraphMemory()  # one capture stream and graph pool per device for all methods
        self.methods: dict[str, LoadedMethod] = {}
        self.microbatches: dict[str, MicroBatches] = {}
        self.buckets: dict[str, ShapeBuckets] = {}
        self.delegates: dict[int, DelegateHandle] = {}

    def load(self, name: str) -> LoadedMethod:
        loaded = self.methods.get(name)
        if loaded is not None:
            return loaded
        reservation = self._reserve(name)
        try:
            return self._load(name, reservation)
        except BaseException:
            reservation.seal()
            self.graph_memory.pending.clear()
            if not self.methods:  # the set's first load: its graph pool goes too (nothing else is in it)
                self.graph_memory.close()
            raise
        finally:  # what no piece holds (a failed load's, a short-lived one's) is freed now
            reservation.seal()

    def _reserve(self, name: str) -> MemoryReservation:
        """One allocation per device for what loading `name` will newly allocate: the weights the
        module uploaded, the states and delegates this set made, are held already."""
        mod = self.module
        method = mod.program.method(name)
        held = mod.uploads.keys() | {("state", s) for s in self.state.tensors} | {("delegate", i) for i in self.delegates}
        api = streams_api_for(method)
        stage_io = mod.cuda_graphs and api is not None  # as LoadedMethod stages I/O
        pieces = load_pieces(mod.program, method, stage_io, ProgramData(mod.program.segments, counted=held))
        reserved = [(p.device, p.nbytes, p.alignment) for p in pieces if p.reserved]
        if not stage_io:
            return MemoryReservation(reserved)
        graph_memory = self.graph_memory
        need = call_bytes(mod.program, method, handed_out=False)  # what a call's graphs allocate
        behind = {d.local: n for d, n in need.items() if api.splits_above < n < api.own_segment_from}
        reservation = MemoryReservation(reserved, behind, lambda device: graph_memory.slab_home(api, device))
        for device, slab in reservation.slabs.items():
            if slab.tail:
                graph_memory.tail[device.index] = slab.tail
        for d, n in need.items():  # room of a segment of its own: made once the load is over (make_rooms)
            if n >= api.own_segment_from and graph_memory.room_wanted(api, d.local):
                graph_memory.pending[d.index] = (api, n)
        return reservation

    def _load(self, name: str, reservation: MemoryReservation) -> LoadedMethod:
        mod = self.module
        created: list[int] = []
        marks = mod.uploads.mark(), self.state.mark()
        task = f"load {name}{self.label}"
        parts = len({i.delegate for i in mod.program.method(name).instructions if isinstance(i, DelegateCall)}) + 1

        def delegate(index: int, memory=(), caller: CallerPlan = NOT_CAPTURED):
            if index not in self.delegates:
                self.delegates[index] = mod._init_delegate(index, list(memory), caller, reservation)
                created.append(index)
                tell(mod.progress, task, len(created), parts, "part")
            return self.delegates[index]

        try:
            loaded = LoadedMethod(mod.program, mod.program.method(name), delegate, pin_host=mod.pin_host_memory,
                                  cuda_graphs=mod.cuda_graphs, transport=mod.transport, uploads=mod.uploads,
                                  state=self.state, graph_memory=self.graph_memory, reservation=reservation)
            try:
                if mod.microbatches is not None:
                    self.microbatches[name] = MicroBatches(loaded, mod.microbatches, mod.cuda_graphs)
                if mod.shape_buckets is not None:
                    self.buckets[name] = ShapeBuckets(loaded, mod.shape_buckets)
            except BaseException:
                loaded.close()
                raise
        except BaseException:
            for index in created:
                self.delegates.pop(index).close()
            mod.uploads.rollback(marks[0])  # nothing the failed load made stays allocated
            self.state.rollback(marks[1])
            raise
        self.methods[name] = loaded
        tell(mod.progress, task, parts, parts, "part")
        return loaded

    def close(self) -> None:
        for m in self.methods.values():
            m.close()
        for d in self.delegates.values():
            d.close()
        self.state.close()
        self.graph_memory.close()
        self.methods.clear()
        self.microbatches.clear()
        self.buckets.clear()
        self.delegates.clear()


class Module:
    """Runs a ferry Program.

    cuda_graphs=True captures each device segment (the delegates and copies between two host
    instructions) as a CUDA graph after one warm-up call and replays it afterwards. Device
    inputs (skip_h2d) are then copied on the device into fixed tensors each call, and device
    outputs (skip_d2h) come from fixed tensors, so those segments are captured too.

    outputs="copy" (default) returns tensors the caller owns; outputs="view" returns views of
    planned memory, valid until the next call (zero copy). Without CUDA graphs, outputs kept on
    a device by skip_d2h come back as device tensors the caller owns either way.

    A Module may be shared by threads. Calls use planned memory, so calls that overlap in time
    wait for each other; `concurrency=k` gives the Module k sets of planned memory and state
    (a KV cache each; the weights are held once), allocated at load, and up to k calls run at
    once, each in its own set. With
    outputs="view", a view is valid until the next call of the set that made it: take a copy
    before handing it to another thread.

    microbatches=k pipelines a program split over several devices (a device map): each call's
    batch (dim 0 of every input) is split into up to k parts, issued one after the other
    without host waits between them, so that device s runs part m while device s+1 runs part
    m-1. Compile the program for one part (export with a batch of B/k rows, or a dynamic
    batch dimension): memory is planned for one micro-batch per stage. A call then takes up
    to k times the program's batch; a part that comes out short is padded, and outputs are
    joined along dim 0 (runtime/parallel/microbatch.py). Rows must be independent, as in any pipeline.

    A program exported with dynamic sizes (torch.export.Dim) binds a plan per shape it meets:
    the first call at a shape records every size, later calls at that shape run as fast as a
    program compiled for it (plans for the last 64 shapes are kept). shape_buckets=[1, 2, 4, 8]
    pads a dynamic batch (dim 0) up to the smallest bucket that holds it and slices the results,
    so that CUDA graphs are captured once per bucket; a call beyond the largest bucket runs at
    its own shape without graphs (one warning, once). Without buckets, every shape called three
    times captures graphs of its own and keeps their memory while its plan is kept.

    progress(task, done, total, unit) hears of each method's loading (its delegates, then the
    method) and of the weights uploaded, in bytes (ferry/progress.py; the CLI draws bars).

    max_memory caps what loading and calling may allocate: one size for every device, or
    {device: size} ("cpu", "cuda:0", or a type for all its indices; sizes in bytes or like
    "20GiB"). A call allocates only results of the sizes the program declares (the bounds of
    dynamic dims; each kernel is held to them before it runs), so loading a method counts its
    memory and the most one call makes, and raises AllocationError before allocating anything
    when that is over the cap.
    """

    def __init__(self, program: Program | str | os.PathLike, *, outputs: str = "copy", pin_host_memory: bool = True,
                 cuda_graphs: bool = False, concurrency: int = 1, max_memory=None, microbatches: int | None = None,
                 shape_buckets=None, transport=None, progress: Progress | None = None):
        if not isinstance(program, Program):
            program = load_program(program)
        ranks = program_ranks(program)
        if len(ranks) > 1 and transport is None:
            raise DeviceError(f"this program spans the processes of ranks {', '.join(map(str, ranks))} (devices "
                              "such as 'rank1:cuda:0'): load it with ferry.distributed.Module in each process of a "
                              "torch.distributed job (torchrun), or compile it without ranks")
        if outputs not in ("copy", "view"):
            raise ValueError(f"outputs must be 'copy' or 'view', got {outputs!r}")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1 (sets of planned memory), got {concurrency!r}")
        if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                         or microbatches < 1):
            raise ConfigError(f"microbatches must be an int >= 1 (parts each call's batch is split into), "
                             f"got {microbatches!r}")
        if microbatches is not None and shape_buckets is not None:
            raise ConfigError("microbatches and shape_buckets both reshape the batch: pick one (a program for one "
                              "micro-batch has a static batch to pipeline; buckets pad a dynamic one)")
        if shape_buckets is not None:
            check_buckets(shape_buckets)
        _refuse_state_per_set(program, concurrency)
        self.microbatches, self.shape_buckets = microbatches, shape_buckets
        self.program = program
        self.max_memory = parse_limits(max_memory)
        _check_limit_keys(self.max_memory, program)
        self.outputs = outputs
        self.pin_host_memory = pin_host_memory
        self.cuda_graphs = cuda_graphs
        self.transport = transport  # a distributed rank's part (ferry.distributed): its copies between ranks
        self.progress = checked(progress)
        self.uploads = DeviceUploads(program.segments, self.progress)  # the weights on each device, once for all
        self._instances = [_Instance(self, f" (set {i + 1} of {concurrency})" if concurrency > 1 else "")
                           for i in range(concurrency)]
        self._free: queue.SimpleQueue[_Instance] = queue.SimpleQueue()
        for inst in self._instances:
            self._free.put(inst)
        self._load_lock = threading.Lock()
        self._loaded: set[str] = set()  # methods loaded in every set of memory (a call's one check)
        # how each method takes its arguments and builds its result: a result type the file names
        # that this process lacks, or a structure that cannot be built, is told here
        self._trees = {name: CallTree(m.signature, name, len(m.inputs)) for name, m in program.methods.items()}

    @property
    def _methods(self) -> dict[str, LoadedMethod]:
        """The loaded methods of the first set of memory (for inspection and tests)."""
        return self._instances[0].methods

    # ---------------------------------------------------------------- load

    def method_names(self) -> list[str]:
        return list(self.program.methods)

    def method_meta(self, name: str = "forward") -> MethodMeta:
        return self.program.method_meta(name)

    def load_method(self, name: str = "forward") -> None:
        """Allocate every planned buffer of `name` on its device, in every set of memory; all or
        nothing for each set."""
        with self._load_lock:
            if all(name in inst.methods for inst in self._instances):
                return
            _check_delegate_calls(self.program, self.program.method(name))
            if self.max_memory:
                method = self.program.method(name)
                check_limits(self.max_memory, allocated_by_load(self.program, method, self.cuda_graphs), len(self._instances),
                             name, call_bytes(self.program, method))
            taken = [self._free.get() for _ in self._instances]  # no call runs while loading
            try:
                for inst in taken:
                    loaded = inst.load(name)
                self._loaded.add(name)
                for note in loaded.notes:
                    warnings.warn(f"method {name!r}: {note}", RuntimeWarning, stacklevel=2)
            finally:
                try:
                    _hand_back_cached_memory()
                    for inst in taken:
                        inst.graph_memory.make_rooms()  # after the load's timing handed its memory back
                finally:
                    for inst in taken:
                        self._free.put(inst)

    def _init_delegate(self, index: int, memory: list, caller: CallerPlan, reservation=None):
        """`memory`: the delegate's working memory, planned in the method's arenas; `reservation`:
        the load's, for a backend that takes its memory from it."""
        d = self.program.delegates[index]
        backend = get_backend(d.backend_id)
        payload = self.program.segments[d.payload]
        data = ProgramData(self.program.segments, uploads=self.uploads,
                           reservation=reservation if backend.takes_reservation else None)
        extra = data_kwargs(backend, data)
        if backend.takes_overwrites:
            extra["overwrites"] = _state_overwrites(self.program, index)
        try:
            handle = backend.init(payload, d.compile_specs, memory=memory or None, caller=caller, **extra)
        except FerryError:
            raise
        except Exception as e:
            raise BackendError(f"backend {d.backend_id!r} failed to initialise delegate {index}: {e}") from e
        if not isinstance(handle, DelegateHandle):
            raise BackendError(f"backend {d.backend_id!r} returned a {type(handle).__name__} for delegate {index}, "
                               "not a ferry.backends.DelegateHandle (subclass it: it declares what a handle can do)")
        return handle

    # ---------------------------------------------------------------- run

    def parts(self, name: str, inputs) -> int:
        """How many micro-batches a call of `name` on `inputs` runs (1 without microbatches=),
        after checking the inputs: a distributed rank 0 tells the other ranks before it starts."""
        self.load_method(name)
        inst = self._instances[0]
        check_writable(inst.methods[name].method, list(inputs))
        split = inst.microbatches.get(name)
        if split is not None:
            return split.count(list(inputs))
        inst.methods[name].check_inputs(list(inputs))
        return 1

    def run_method(self, name: str, inputs) -> list:
        while True:
            if name not in self._loaded:
                self.load_method(name)
            inst = self._free.get()  # waits while every set of memory is in use
            if name in inst.methods:
                break
            self._free.put(inst)  # closed since the check: load again, then take a set
        try:
            inputs, method = list(inputs), inst.methods[name].method
            check_writable(method, inputs)
            return written_back(method, inputs, self._call(inst, name, inputs))
        finally:
            self._free.put(inst)

    def _call(self, inst: _Instance, name: str, inputs: list) -> list:
        """Every output of one call of `name`, those written into inputs included."""
        split = inst.microbatches.get(name)
        if split is not None:
            return split(inputs)  # joined results: the caller's own
        buckets = inst.buckets.get(name)
        if buckets is None:
            return self._run(inst.methods[name], inputs)
        method = inst.methods[name]
        bucket = buckets.bucket_for(inputs, method.runs_at if method.checks_sizes else None)
        if bucket is None or bucket == inputs[0].shape[0]:
            return self._run(inst.methods[name], inputs, graphs=bucket is not None)
        return self._rows(inst.methods[name], buckets, inputs, bucket)

    def _rows(self, m: LoadedMethod, buckets: ShapeBuckets, inputs: list, bucket: int) -> list:
        """A call padded to its bucket: its results are the first rows, as many as it has. The
        plan bound at the bucket pads the inputs as it copies them into planned memory, or they
        are padded first (the first call at the bucket, or inputs it binds in place). A fresh
        output the caller owns (or any, with outputs="view") is returned as a view of those
        rows; the rest are copied: they are planned memory or the padded inputs reused."""
        m.check_inputs(inputs, rows=bucket)
        outs = m.execute_padded(inputs, bucket)
        if outs is None:
            outs = m.execute(buckets.pad(inputs, bucket))
        rows = inputs[0].shape[0]
        if any(o.shape[0] != bucket for o in outs):
            raise ProgramError(f"method {m.name!r}: an output's dim 0 is not the padded batch "
                               f"({[tuple(o.shape) for o in outs]}); load it without shape_buckets=")
        keep = m.caller_owned_outputs | m.written_outputs | (
            set(range(len(outs))) - m.constant_outputs if self.outputs == "view" else set())
        devices = m.output_devices
        return [o[:rows] if i in keep and not buckets.owns(o) else caller_copy(o[:rows], devices[i])
                for i, o in enumerate(outs)]

    def _run(self, m: LoadedMethod, inputs: list, graphs: bool = True) -> list:
        m.check_inputs(inputs)
        outs = m.execute(inputs, graphs=graphs)
        devices = m.output_devices
        if self.outputs == "view":
            # a view of a constant would let the caller write into the program (a read-only
            # file mapping: a crash); those few outputs are copies, the rest stay views
            constant = m.constant_outputs
            return [caller_copy(o, devices[i]) if i in constant else o for i, o in enumerate(outs)] if constant else outs
        # (an output written into an input is copied there while this set of memory is held)
        keep = m.caller_owned_outputs | m.written_outputs if m.written_outputs else m.caller_owned_outputs
        return [o if i in keep else caller_copy(o, devices[i]) for i, o in enumerate(outs)]

    def run_parts(self, name: str, parts: int) -> None:
        """A serving rank's share of one call of a program over ranks (ferry.distributed): the
        method, which takes no inputs here, run `parts` times back to back as micro-batches,
        with one wait at the end, as rank 0 runs its parts."""
        self.load_method(name)
        inst = self._free.get()
        try:
            m = inst.methods[name]
            try:
                for i in range(parts):
                    m.execute([], finish=i == parts - 1, part=parts > 1)
            except BaseException:
                m.finish()
                raise
        finally:
            self._free.put(inst)

    # ---------------------------------------------------------------- graphs

    def graph_report(self, method: str = "forward") -> list:
        """What `method` captured as CUDA graphs so far, per shape it was called at (a static
        method: its one plan): segments captured, waiting for their second run, and those run
        step by step with why (ferry.runtime.stages.graph_report.ShapeGraphs)."""
        self.load_method(method)
        return self._instances[0].methods[method].graph_report()

    # ---------------------------------------------------------------- state

    def state_names(self) -> list[str]:
        """The program's mutable buffers (a KV cache), shared by every method that names them."""
        return list(self._instances[0].state.states)

    def reset_state(self, names=None) -> None:
        """Set the program's state (all of it, or the buffers named) back to its initial value,
        in every set of memory, after the calls in flight; in place, so CUDA graphs stay valid.
        Models whose cache is masked by a position input need no reset between generations."""
        known = self.state_names()
        unknown = [n for n in (names or ()) if n not in known]
        if unknown:
            raise ConfigError(f"no state named {', '.join(map(repr, unknown))}; this program's state: "
                              f"{', '.join(known) or 'none'}")
        taken = [self._free.get() for _ in self._instances]  # waits for calls in flight
        try:
            for inst in taken:
                for m in inst.methods.values():
                    m.finish()  # its device work is done before the state is written from the host
                inst.state.reset(names)
        finally:
            for inst in taken:
                self._free.put(inst)

    def call_tree(self, name: str = "forward") -> CallTree:
        """How `call` takes `name`'s arguments and builds its result (its signature as exported)."""
        try:
            return self._trees[name]
        except KeyError:
            self.program.method(name)  # an UnknownMethodError naming the methods
            raise

    def call(self, method: str, /, *args, **kwargs):
        """Run `method` as the exported model is called: positional and keyword arguments (nested
        lists, tuples, dicts) as at export, the result in the model's own structure (a tensor, a
        tuple, a dict, a ModelOutput). `run_method` takes and returns the flat tensors instead."""
        tree = self.call_tree(method)
        return tree.result(self.run_method(method, tree.inputs(args, kwargs)))

    def forward(self, /, *args, **kwargs):
        return self.call("forward", *args, **kwargs)

    __call__ = forward

    def close(self) -> None:
        with self._load_lock:  # as loading: two takers of every set, one at a time, would deadlock
            taken = [self._free.get() for _ in self._instances]  # waits for calls in flight
            try:
                self._loaded.clear()
                for inst in taken:
                    inst.close()
                self.uploads.close()
            finally:
                for inst in taken:
                    self._free.put(inst)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

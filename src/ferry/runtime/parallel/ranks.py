"""One program over the processes of a torch.distributed job: stages on other ranks, and hosts.

Compile with devices that name a rank (`"rank1:cuda:0"`: device `cuda:0` of the process of
rank 1) in a device map, then, in every process of the job (torchrun sets the environment)::

    with ferry.distributed.Module("model.ferry", microbatches=8) as module:
        if module.rank == 0:
            y = module(x)          # rank 0 takes the inputs and returns the outputs
        else:
            module.serve()         # other ranks run their stages until rank 0 closes

Each rank loads only its own part of the program (program/ranks.py): its planned memory,
its delegates, and a send or receive where a copy crosses to another rank
(runtime/parallel/transport.py: NCCL between GPUs, Gloo in host memory otherwise). For each call,
rank 0 tells the others, over Gloo, which method to run and for how many micro-batches;
then every rank walks its part, and the copies between ranks pace the pipeline. A rank that
dies or stops answering for `timeout` seconds is a PeerError on the others, never a hang.
docs/distributed.md says how this spans hosts.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch

from ferry.errors import ConfigError, PeerError
from ferry.program import Program, load_program
from ferry.program.ranks import boundaries, program_ranks, project
from ferry.runtime.parallel.microbatch import batched_values
from ferry.runtime.parallel.transport import Groups, Transport
from ferry.runtime.stages.module import Module as _LocalModule

__all__ = ["Module"]

_STOP, _CALL = 0, 1
_ABORT_WAIT = 5.0  # seconds closing waits for NCCL to abort after a peer failed
_ABANDONED: list = []  # registry: what a failed NCCL abort left: freeing it could race the stuck transfer
_IDLE = timedelta(days=365)  # a serving rank waits this long for rank 0's next call


class Module:
    """This process's part of a program split over ranks (see the module docstring).

    timeout: seconds any transfer or command may wait for another rank before PeerError.
    idle_timeout: seconds a serving rank waits for the next call (None: as long as rank 0 lives).
    The other options are those of ferry.Module; microbatches= pipelines each call's batch
    across the ranks. Joins the default process group, initialising it from torchrun's
    environment when the caller has not.
    """

    def __init__(self, program: Program | str | os.PathLike, *, timeout: float = 60.0,
                 idle_timeout: float | None = None, microbatches: int | None = None, cuda_graphs: bool = False,
                 outputs: str = "copy", pin_host_memory: bool = True):
        import torch.distributed as dist

        if not isinstance(program, Program):
            program = load_program(program)
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if microbatches is not None:  # every rank's stages: a stateful one elsewhere would be split silently
            for m in program.methods.values():
                batched_values(m, "microbatches=")
        self._owns_group = _join(timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.closed, self._lock = False, threading.Lock()
        self._groups: Groups | None = None
        try:
            self._open(program, dist, timeout, idle_timeout, microbatches=microbatches if self.rank == 0 else None,
                       cuda_graphs=cuda_graphs, outputs=outputs, pin_host_memory=pin_host_memory)
        except BaseException:  # nothing stays allocated or joined
            self.closed = True
            self._release(clean=False)
            raise

    def _open(self, program: Program, dist, timeout: float, idle_timeout, **options) -> None:
        ranks = program_ranks(program)
        if ranks[-1] >= self.world_size:
            raise ConfigError(f"the program has stages on rank {ranks[-1]}, but this job has {self.world_size} "
                              f"processes: start it with --nproc-per-node={ranks[-1] + 1} (or more)")
        local = project(program, self.rank)  # a program ferry cannot split fails here, before any group
        self.methods = list(program.methods)
        self.boundaries = boundaries(program)
        self._groups = _groups(dist, self.boundaries, timeout, idle_timeout)
        self.transport = Transport(self.rank, self._groups, float(timeout))
        self._control = self._groups.control
        self.module: _LocalModule = _LocalModule(local, transport=self.transport, **options)
        for name in self.methods:  # every rank allocates before the first call, so no call waits on a load
            self.module.load_method(name)
        self.transport.wait(dist.barrier(group=self._groups.gloo, async_op=True), "waiting for every rank to load")

    # ---- rank 0

    def method_meta(self, name: str = "forward"):
        return self.module.method_meta(name)

    def load_method(self, name: str = "forward") -> None:
        """Every method is loaded on every rank when the module is made."""
        self.module.load_method(name)

    def run_method(self, name: str, inputs) -> list:
        self._require(rank0=True)
        with self._lock:  # one call at a time: the other ranks follow rank 0's commands in order
            parts = self.module.parts(name, inputs)  # a bad call fails here, before any rank hears of it
            self._command(_CALL, self.methods.index(name), parts)
            try:
                return self.module.run_method(name, inputs)
            except BaseException as e:  # the other ranks are mid-call: they cannot be told to stop
                if self.transport.broken is None:
                    self.transport.broken = f"rank 0 failed during a call ({type(e).__name__}: {e})"
                raise

    def call(self, method: str, /, *args, **kwargs):
        """As ferry.Module.call: the model's own arguments and result structure."""
        tree = self.module.call_tree(method)
        return tree.result(self.run_method(method, tree.inputs(args, kwargs)))

    def forward(self, /, *args, **kwargs):
        return self.call("forward", *args, **kwargs)

    __call__ = forward

    def _command(self, kind: int, method: int = 0, parts: int = 0) -> None:
        import torch.distributed as dist

        message = torch.tensor([kind, method, parts], dtype=torch.int64)
        for r in range(1, self.world_size):
            self.transport.wait(dist.isend(message, r, group=self._control), f"telling rank {r} what to run")

    # ---- other ranks

    def serve(self) -> None:
        """Run this rank's stages for every call of rank 0, until rank 0 closes the module."""
        import torch.distributed as dist

        self._require(rank0=False)
        message = torch.empty(3, dtype=torch.int64)
        while True:
            try:
                dist.recv(message, 0, group=self._control)
            except Exception as e:
                self.transport.broken = f"rank 0 is gone: {e}"
                raise PeerError(f"rank {self.rank}: waiting for rank 0's next call failed ({e}); rank 0 died or "
                                "its job ended without closing the module") from None
            kind, method, parts = (int(x) for x in message)
            if kind == _STOP:
                return
            self.module.run_parts(self.methods[method], parts)

    # ---- both

    def _require(self, rank0: bool) -> None:
        if self.closed:
            raise ConfigError("this distributed module is closed")
        self.transport.check()
        if rank0 and self.rank != 0:
            raise ConfigError(f"only rank 0 takes calls; rank {self.rank} runs module.serve()")
        if not rank0 and self.rank == 0:
            raise ConfigError("rank 0 takes the calls (module(x)); module.serve() is for the other ranks")

    def close(self) -> None:
        """Rank 0 stops the serving ranks; every rank frees its memory and its process groups."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.rank == 0 and self.transport.broken is None:
                try:
                    self._command(_STOP)
                except PeerError:
                    pass  # a dead rank needs no stopping
        finally:
            self._release(clean=self.transport.broken is None)

    def _release(self, clean: bool) -> None:
        """Free this rank's memory and groups (what exists of them: opening may have failed)."""
        local = self.__dict__.get("module")
        if clean:  # memory first: closing it waits for a call still running on another thread
            if local is not None:
                local.close()
            _leave(self._groups, self._owns_group, True)
        elif _leave(self._groups, self._owns_group, False):  # groups first: aborting NCCL ends
            if local is not None:                           # device work stuck on a dead peer
                local.close()
        else:  # a transfer NCCL could not abort may still write into this module's memory: it
            # stays allocated (kept from the garbage collector too) until the process ends
            _ABANDONED.append((local, self._groups))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _join(timeout: float) -> bool:
    """Join the default group (from torchrun's environment) unless the caller already has."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"no torch.distributed job: {', '.join(missing)} not set. Start every rank with torchrun "
                          "(torchrun --nproc-per-node=N ...), or call torch.distributed.init_process_group first")
    dist.init_process_group("gloo", timeout=timedelta(seconds=max(timeout, 60)))
    return True


def _groups(dist, bounds, timeout: float, idle_timeout: float | None) -> Groups:
    """Every rank creates the same groups in the same order (new_group is collective)."""
    wait = timedelta(seconds=timeout)
    idle = _IDLE if idle_timeout is None else timedelta(seconds=idle_timeout)
    groups = Groups(dist.new_group(backend="gloo", timeout=wait), dist.new_group(backend="gloo", timeout=idle))
    # NCCL's watchdog kills the process when a request outlives its group's timeout: give ferry's
    # own bounded waits (transport polls, host waits) the time to fail first, with a PeerError
    watchdog = timedelta(seconds=2 * timeout + 10)
    for pair in sorted({(b.src.rank, b.dst.rank) for b in bounds if b.nccl}):
        groups.nccl[pair] = dist.new_group(ranks=sorted(pair), backend="nccl", timeout=watchdog)
    return groups


def _leave(groups: Groups | None, owns_default: bool, clean: bool) -> bool:
    """Destroy this module's groups. After a peer failed, NCCL groups are aborted first, in a
    thread given _ABORT_WAIT seconds: NCCL's abort can block on a transfer whose peer is dead
    (measured on two H200s, torch 2.11), and closing must not hang. If it does not finish, no
    group is destroyed (that blocks behind the abort): they end with the process, and the GPU
    stream stays busy until then (docs/distributed.md: end the process after such a PeerError).
    Returns False in that case."""
    import torch.distributed as dist

    if groups is None:
        return True
    nccl = list(groups.nccl.values())
    if not clean and nccl and not _abort_within(nccl, _ABORT_WAIT):
        return False  # still aborting: destroying any group now blocks behind it (measured)
    gloo = [groups.control, groups.gloo]
    for g in (*nccl, *gloo):
        try:
            if not clean and g in gloo and hasattr(g, "abort"):
                g.abort()
            dist.destroy_process_group(g)
        except Exception:  # a group a dead peer broke: nothing more to free
            pass
    if owns_default and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    return True


def _abort_within(groups: list, seconds: float) -> bool:
    """Abort each group in a daemon thread; True if all were aborted within `seconds`."""
    def abort():
        for g in groups:
            try:
                g.abort()
            except Exception:
                pass

    worker = threading.Thread(target=abort, name="ferry-abort-nccl", daemon=True)
    worker.start()
    worker.join(seconds)
    return not worker.is_alive()

"""Transport: the two steps a copy between ranks becomes, on torch.distributed.

`ferry::send` and `ferry::recv` (program/ranks.py) move planned tensors point to point, never
pickled objects: NCCL when both ends are GPUs (device to device), Gloo otherwise (host
memory; a GPU end goes through a page-locked staging tensor made at bind time). NCCL
carries each direction between two ranks on a group of its own, so the results coming back
never queue behind the next micro-batch going out.

Every wait is bounded: Gloo waits with `timeout`, an NCCL request is polled until it
completes or `timeout` seconds pass (its wait() only orders streams), and a dead peer (Gloo
sees the socket close) or a timeout becomes a PeerError on this rank; the transport is then
broken and says so on every later call. A transfer touches its device's memory from the
host or from NCCL's stream, so it first waits for the device work queued before it. A
receive whose destination no later step of the call reads (an output) is waited for at the
end of the call, so that rank 0 can issue the next micro-batch while the previous one is
still on its way back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ferry.errors import PeerError

__all__ = ["Groups", "Transport"]


@dataclass
class Groups:
    """The process groups of a distributed module: `gloo` for host memory, `nccl[(src, dst)]` for
    GPU to GPU in one direction, `control` for rank 0's commands (a serving rank waits on it
    between calls, so its timeout is the idle one)."""

    gloo: object
    control: object = None
    nccl: dict[tuple[int, int], object] = field(default_factory=dict)


class Transport:
    def __init__(self, rank: int, groups: Groups, timeout: float, dist=None):
        if dist is None:
            import torch.distributed as dist
        self.rank, self.groups, self.timeout, self.dist = rank, groups, timeout, dist
        self.pending: list[tuple[object, str, bool]] = []
        self.broken: str | None = None

    # ---- binding (runtime/bind.py calls these once per transfer step)

    def bind_send(self, get: Callable[[], torch.Tensor], peer: int, tag: int, nccl: bool, sync: Callable[[], None]):
        """The call of one send; `get()` is the tensor (planned memory, or host memory the
        caller binds per call: a micro-batch's rows)."""
        what = f"sending to rank {peer} (copy #{tag})"
        if nccl:
            group = self.groups.nccl[(self.rank, peer)]
            return lambda: self._run(sync, lambda: self.dist.isend(get(), peer, group=group), what, poll=True)
        gloo, host = self.groups.gloo, _HostTwin(get)

        def send():
            self._run(sync, lambda: self.dist.isend(host.filled(), peer, group=gloo, tag=tag), what)

        return send

    def bind_recv(self, get: Callable[[], torch.Tensor], peer: int, tag: int, nccl: bool, deferred: bool,
                  sync: Callable[[], None]):
        what = f"receiving from rank {peer} (copy #{tag})"
        if nccl:
            group = self.groups.nccl[(peer, self.rank)]
            return lambda: self._run(sync, lambda: self.dist.irecv(get(), peer, group=group), what, deferred, poll=True)
        gloo, host = self.groups.gloo, _HostTwin(get)

        def recv():
            t, staged = get(), host.empty()
            self._run(sync, lambda: self.dist.irecv(staged, peer, group=gloo, tag=tag), what,
                      deferred and staged is t)
            if staged is not t:
                t.copy_(staged)

        return recv

    # ---- running

    def _run(self, sync, issue, what: str, deferred: bool = False, poll: bool = False) -> None:
        self.check()
        sync()
        try:
            work = issue()
        except Exception as e:
            self._fail(f"{what} failed: {e}")
        if deferred:
            self.pending.append((work, what, poll))
        else:
            self._wait(work, what, poll)

    def finish(self) -> None:
        """Wait for the receives a call left pending (its outputs)."""
        pending, self.pending = self.pending, []
        for work, what, poll in pending:
            self._wait(work, what, poll)

    def check(self) -> None:
        if self.broken is not None:
            raise PeerError(f"an earlier transfer failed ({self.broken}); the ranks are out of step: restart all "
                            "of them")

    def _wait(self, work, what: str, poll: bool = False) -> None:
        """Wait for `work` at most `timeout` seconds. `poll`: an NCCL request, whose wait() would
        not block the host (Gloo's blocks, up to the timeout it is given)."""
        if not poll:
            try:
                work.wait(timedelta(seconds=self.timeout))
            except Exception as e:
                self._fail(f"{what} failed (a peer died, or gave no answer within {self.timeout:g} s): {e}")
            return
        deadline = time.monotonic() + self.timeout
        spins = 0
        while not work.is_completed():
            if time.monotonic() > deadline:
                self._fail(f"{what}: no answer within {self.timeout:g} s (the peer is stuck or dead)")
            spins += 1
            if spins > 2000:  # a short spin first: a transfer between GPUs takes microseconds
                time.sleep(min(1e-3, 1e-6 * (spins - 2000)))
        try:
            work.wait()
        except Exception as e:
            self._fail(f"{what} failed: {e}")

    def _fail(self, message: str):
        self.broken = message
        self.pending.clear()
        raise PeerError(message)


class _HostTwin:
    """Host memory for a tensor Gloo moves: the tensor itself when it is host memory, else a
    page-locked twin made on first use and reused."""

    def __init__(self, get: Callable[[], torch.Tensor]):
        self.get, self.twin = get, None

    def empty(self) -> torch.Tensor:
        t = self.get()
        if t.device.type == "cpu":
            return t
        if self.twin is None or self.twin.shape != t.shape:
            self.twin = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
        return self.twin

    def filled(self) -> torch.Tensor:
        t, host = self.get(), self.empty()
        if host is not t:
            host.copy_(t)
        return host

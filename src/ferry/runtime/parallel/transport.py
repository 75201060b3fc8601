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

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from ferry.errors import PeerError

__all__ = ["Groups", "Transport"]


@dataclass
class Groups:
    """The process groups of a distributed module: `gloo` for host memory, `nccl[(src, dst)]` for
    GPU to GPU in one direction, `control` for rank 0's commands (a serving rank waits on it
    between calls, so its timeout is the idle one)."""

    gloo: Any
    control: Any = None
    nccl: dict[tuple[int, int], Any] = field(default_factory=dict)


class Transport:
    def __init__(self, rank: int, groups: Groups, timeout: float, dist=None):
        if dist is None:
            import torch.distributed as dist
        self.rank, self.groups, self.timeout, self.dist = rank, groups, timeout, dist
        self.pending: list[tuple] = []  # (request, what, poll, then): receives waited for at the end
        self.broken: str | None = None

    # ---- binding (runtime/stages/bind.py calls these once per transfer step)

    def bind_send(self, get: Callable[[], torch.Tensor], peer: int, tag: int, cuda: int | None,
                  sync: Callable[[], None]):
        """The call of one send. `get()` is the tensor (planned memory, or host memory bound per
        call: a micro-batch's rows); `cuda`: the GPU of this rank NCCL moves it from (the
        tensor's own, or one to stage host memory through), None for Gloo."""
        what = f"sending to rank {peer} (copy #{tag})"
        twin, group, poll = self._route(get, peer, cuda, sending=True)
        kwargs = {} if poll else {"tag": tag}
        return lambda: self._run(sync, lambda: self.dist.isend(twin.filled(), peer, group=group, **kwargs), what,
                                 poll=poll)

    def bind_recv(self, get: Callable[[], torch.Tensor], peer: int, tag: int, cuda: int | None, deferred: bool,
                  sync: Callable[[], None]):
        """The call of one receive into `get()`; `deferred`: nothing later in the call reads it, so
        it is waited for at the end of the call (`finish`)."""
        what = f"receiving from rank {peer} (copy #{tag})"
        twin, group, poll = self._route(get, peer, cuda, sending=False)
        kwargs = {} if poll else {"tag": tag}

        def recv():  # a staged receive left pending gets a twin of its own: the next part's would overwrite it
            t, staged = get(), twin.empty(fresh=deferred)
            then = None if staged is t else functools.partial(t.copy_, staged)
            self._run(sync, lambda: self.dist.irecv(staged, peer, group=group, **kwargs), what, deferred, poll, then)

        return recv

    def _route(self, get, peer: int, cuda: int | None, sending: bool):
        """(where the bytes are staged, the group, whether its requests are polled: NCCL's)."""
        if cuda is None:
            return _Twin(get, torch.device("cpu")), self.groups.gloo, False
        pair = (self.rank, peer) if sending else (peer, self.rank)
        return _Twin(get, torch.device("cuda", cuda)), self.groups.nccl[pair], True

    # ---- running

    def _run(self, sync, issue, what: str, deferred: bool = False, poll: bool = False, then=None) -> None:
        self.check()
        sync()
        try:
            work = issue()
        except Exception as e:
            self._fail(f"{what} failed: {e}")
        if poll and then is None:  # NCCL into or out of GPU memory: ordered on the device, not the host
            work.wait()  # the current stream waits for the transfer; the host goes on
            self.pending.append((work, what, poll, None))  # polled, bounded, at the end of the call
            return
        if deferred:
            self.pending.append((work, what, poll, then))
            return
        self._wait(work, what, poll)
        if then is not None:
            then()

    def finish(self) -> None:
        """Wait for the receives a call left pending (its outputs)."""
        pending, self.pending = self.pending, []
        for work, what, poll, then in pending:
            self._wait(work, what, poll)
            if then is not None:
                then()

    def stuck(self) -> None:
        """A host wait for the device ran out of time: device work is queued behind a transfer
        whose peer does not answer."""
        self._fail(f"the device did not finish within {self.timeout:g} s: a transfer to or from another rank is "
                   "waiting on a peer that died or is stuck")

    def check(self) -> None:
        if self.broken is not None:
            raise PeerError(f"an earlier transfer failed ({self.broken}); the ranks are out of step: restart all "
                            "of them")

    def wait(self, work, what: str) -> None:
        """Wait for a Gloo request of the caller's (a command, a barrier), bounded, as transfers wait."""
        self._wait(work, what)

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


class _Twin:
    """Where a transport moves a tensor from or into: the tensor itself when it already lives
    there (host memory for Gloo, the GPU for NCCL) and is contiguous (both transports move dense
    bytes, and the two ends of a copy may lay the tensor out differently), else a contiguous
    twin made on first use and reused (page-locked, on the host)."""

    def __init__(self, get: Callable[[], torch.Tensor], device: torch.device):
        self.get, self.device = get, device
        self.twin: torch.Tensor | None = None

    def empty(self, fresh: bool = False) -> torch.Tensor:
        """`fresh`: a new twin (from PyTorch's caching allocator), not the reused one."""
        t = self.get()
        here = t.device == self.device or (self.device.type == "cpu" and t.device.type == "cpu")
        if here and t.is_contiguous():
            return t
        if fresh or self.twin is None or self.twin.shape != t.shape:
            pin = self.device.type == "cpu" and torch.cuda.is_available()
            twin = torch.empty(t.shape, dtype=t.dtype, device=self.device, pin_memory=pin)
            if fresh:
                return twin
            self.twin = twin
        return self.twin

    def filled(self) -> torch.Tensor:
        t, staged = self.get(), self.empty()
        if staged is not t:
            staged.copy_(t)
        return staged

"""Micro-batches: one call's batch split along dim 0 and issued part after part, so that the
stages of a program split over several devices overlap (stage s runs part m while stage s+1
runs part m-1 on the next device).

Nothing here schedules devices. The copy discipline of runtime/devices/streams.py already orders a
copy after the work queued on both of its devices, and the work queued after it behind the
copy. Issued back to back, part m+1's first stage therefore waits only for the copy that
hands part m to the next device, and that copy waits for the next device to finish part
m-1: a pipeline, in the planned memory of one micro-batch per stage, with every hazard
between parts covered by the same events that cover one call. What this module adds is
what keeps the host from blocking between parts:

* host inputs are page-locked once per call, so each part's host-to-device copy is
  asynchronous (a copy from pageable memory blocks the host until it is done);
* each part's outputs are written straight into its rows of the joined result (page-locked
  too), and the host waits once, after the last part, not after each; a part whose program
  runs host code waits there (runtime/stages/schedule.py, `pending`) for the previous part's copies,
  which may still read the host memory that code writes;
* a part shorter than the program's batch (the last one, when the batch does not divide)
  is padded with copies of its own rows and its results sliced: the program's shapes and
  its captured graphs stay those of one micro-batch.

Rows must be independent (the batch dimension of a model in inference): that is what makes
the split legal, here as in every pipeline runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.device import Device
from ferry.errors import ConfigError, InputError
from ferry.layout import contiguous_strides, dense_strides_like
from ferry.program.schema import TensorValue
from ferry.runtime.devices.tensor import pad_rows
from ferry.runtime.stages.method import remember
from ferry.runtime.stages.run import empty_on

__all__ = ["MicroBatches", "batched_values"]


@dataclass(frozen=True)
class _Part:
    start: int  # first row of the call's batch
    rows: int  # rows of the call in this part (the part itself has `size` rows, padded)


class MicroBatches:
    """Runs a loaded method on `parts` micro-batches of each call's batch."""

    def __init__(self, method, parts: int, graphs: bool = False):
        self.method, self.parts = method, parts
        m = method.method
        self.inputs, self.outputs = batched_values(m, "microbatches=")
        static = [not v.dynamic or not v.dynamic[0] for v in self.inputs]
        if any(static) and not all(static) or len({v.shape[0] for v in self.inputs}) != 1:
            raise ConfigError(f"method {m.name!r}: micro-batches split every input along dim 0, but the inputs "
                              f"disagree on it ({', '.join(_rows(v) for v in self.inputs)}): export with one batch "
                              "dimension shared by all inputs")
        self.static = all(static)
        self.bound = self.inputs[0].shape[0]  # rows of one micro-batch (static), or at most (dynamic)
        other = [f"{what} {i}" for what, vs in (("input", self.inputs), ("output", self.outputs))
                 for i, v in enumerate(vs) if any(v.dynamic[1:])]
        if other:
            raise ConfigError(f"method {m.name!r}: {', '.join(other)} of it have a dynamic size beyond the batch "
                              "(dim 0), which micro-batches cannot join: export the other dims static (one "
                              "program per sequence length), or load the method without microbatches=")
        for i, v in enumerate(self.outputs):
            if v.shape[0] != self.bound or bool(v.dynamic and v.dynamic[0]) != (not self.static):
                raise ConfigError(f"method {m.name!r}: output {i} has {_rows(v)} rows where the inputs have "
                                  f"{_rows(self.inputs[0])}; micro-batches join outputs along dim 0, so every "
                                  "output must keep the batch dimension")
        api = method.streams.api if method.streams is not None else None
        self.pin = api is not None and api.device_type == "cuda"  # a copy from pageable memory blocks the host
        self.graphs = graphs
        self._chosen: dict[tuple, int] = {}  # the part size chosen per input shapes

    # ---- a call

    def count(self, inputs: list) -> int:
        """How many parts a call on `inputs` runs (the inputs checked as a call checks them)."""
        rows = self._rows(inputs)
        size = self._part_size(rows, inputs)
        first = size if self.static else min(size, rows)  # the first part's shape, as a call makes it (a view)
        if not self.static:
            self.method.check_sizes(inputs)  # the call as the caller made it, as ep.module() checks it
        self.method.check_inputs([t[:1].expand(first, *t.shape[1:]) for t in inputs], part_of=rows)
        last = rows - (-(-rows // size) - 1) * size
        if last != first and not (self.static or self.graphs):  # run at its own rows: checked before any part runs
            self.method.check_inputs([t[:1].expand(last, *t.shape[1:]) for t in inputs], part_of=rows)
        return -(-rows // size)

    def __call__(self, inputs: list) -> list:
        self.count(inputs)  # the first and last parts' shapes checked before any part runs
        rows = self._rows(inputs)
        size = self._part_size(rows, inputs)
        parts = [_Part(a, min(size, rows - a)) for a in range(0, rows, size)]
        inputs = [self._host(t) for t in inputs]
        joined = [self._empty(v, d, rows) for v, d in zip(self.outputs, self.method.output_devices)]
        later: list[tuple[torch.Tensor, _Part, torch.Tensor]] = []
        try:
            for n, p in enumerate(parts):
                part_in = [t[p.start:p.start + p.rows] for t in inputs]
                if p.rows < size and (self.static or self.graphs):  # one shape: the program's, or the graphs'
                    part_in = [self._host(pad_rows(t, size)) for t in part_in]
                targets = self._targets(joined, p, part_in[0].shape[0], later)  # (the parts: checked in count())
                self.method.execute(part_in, targets, finish=n == len(parts) - 1, part=True)
        except BaseException:
            self.method.finish()  # the earlier parts' copies: nothing stays in flight after an error
            raise
        for out, p, t in later:  # after the wait: copies in flight wrote them
            out[p.start:p.start + p.rows].copy_(t[:p.rows])
        return joined

    def _rows(self, inputs: list) -> int:
        name = self.method.name
        if len(inputs) != len(self.inputs):
            raise InputError(f"method {name!r} takes {len(self.inputs)} inputs, got {len(inputs)}")
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise InputError(f"input {i} of {name!r} must be a tensor with a batch dimension (dim 0) to split "
                                 f"into micro-batches, got {type(t).__name__ if not isinstance(t, torch.Tensor) else 'a scalar'}")
        sizes = {t.shape[0] for t in inputs}
        if len(sizes) != 1:
            raise InputError(f"method {name!r}: the inputs disagree on the batch size (dim 0: "
                             f"{', '.join(str(t.shape[0]) for t in inputs)})")
        (rows,) = sizes
        if rows == 0:
            raise InputError(f"method {name!r}: an empty batch (0 rows) has no micro-batches")
        return rows

    def _part_size(self, rows: int, inputs: list) -> int:
        """Rows per part: the program's batch when it is static, else the batch split evenly, or
        the next size up whose parts meet export's size checks (6 rows under `!= 3` in parts of
        4 and 2; at worst one part of them all); where none does, the even split, which the
        check of the parts then refuses, naming the one that fails."""
        size = self.bound if self.static else -(-rows // self.parts)
        if size > self.bound or -(-rows // size) > self.parts:
            per = "of" if self.static else "of at most"
            raise InputError(f"method {self.method.name!r} takes at most {self.parts * self.bound} rows "
                             f"({self.parts} micro-batches {per} {self.bound}), got {rows}: split the batch, or "
                             "load the program with more micro-batches")
        if self.static or not self.method.checks_sizes:
            return size
        key = tuple(tuple(t.shape) for t in inputs)  # (the choice is remembered per shape: checks cost once)
        chosen = self._chosen.get(key)
        if chosen is None:
            fits = (s for s in range(size, min(self.bound, rows) + 1) if self._parts_fit(inputs, rows, s))
            chosen = next(fits, size)
            remember(self._chosen, key, chosen)
        return chosen

    def _parts_fit(self, inputs: list, rows: int, size: int) -> bool:
        """Whether parts of `size` rows, and the last one (padded to `size` with graphs), meet the
        program's size checks."""
        last = rows - (-(-rows // size) - 1) * size
        runs_at = self.method.runs_at
        return runs_at(inputs, size) and (last == size or self.graphs or runs_at(inputs, last))

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        if self.pin and t.device.type == "cpu" and not t.is_pinned():
            return t.contiguous().pin_memory()
        return t

    def _targets(self, joined: list, p: _Part, size: int, later: list) -> list[torch.Tensor]:
        """Where the part's outputs go: its rows of the joined result, or (a padded part, an
        output the program lays out in another order) a tensor of its own, copied at the end."""
        targets = []
        for out, v, device in zip(joined, self.outputs, self.method.output_devices):
            if size == p.rows and _row_major(v):
                targets.append(out[p.start:p.start + p.rows])
            else:
                t = self._empty(v, device, size, ordered=True)
                targets.append(t)
                later.append((out, p, t))
        return targets

    def _empty(self, v: TensorValue, device: Device, rows: int, ordered: bool = False) -> torch.Tensor:
        """A fresh output of `rows` rows (laid out as the program lays `v` out, when `ordered`)."""
        shape = (rows, *v.shape[1:])
        strides = dense_strides_like(shape, v.strides) if ordered and v.strides else ()
        if device.is_cpu:
            if strides:
                return torch.empty_strided(shape, strides, dtype=v.torch_dtype, pin_memory=self.pin)
            return torch.empty(shape, dtype=v.torch_dtype, pin_memory=self.pin)
        return empty_on(device, shape, v.torch_dtype, strides)


def batched_values(m, feature: str) -> tuple[list[TensorValue], list[TensorValue]]:
    """The method's inputs and outputs, each of which must carry a batch dimension (dim 0). A
    method with state (buffers it updates) is refused: its rows are not independent (one call
    made of parts would update the state once per part, padding rows would enter it)."""
    if m.mutable_buffers:
        raise ConfigError(f"method {m.name!r} holds the program's state (buffers a method updates), so its rows "
                          f"are not independent and {feature} cannot split or pad a call: load the method without "
                          f"{feature}")
    def batched(vid: int, what: str) -> TensorValue:
        v = m.values[vid]
        if not isinstance(v, TensorValue) or not v.shape:
            raise ConfigError(f"method {m.name!r}: {what} has no batch dimension (dim 0) for {feature} to "
                              f"split or pad: load the method without {feature}")
        return v

    return ([batched(vid, f"input {i}") for i, vid in enumerate(m.inputs)],
            [batched(vid, f"output {i}") for i, vid in enumerate(m.outputs)])


def _rows(v: TensorValue) -> str:
    return f"<={v.shape[0]}" if v.dynamic and v.dynamic[0] else str(v.shape[0])


def _row_major(v: TensorValue) -> bool:
    """Whether the program writes `v` contiguously (so a run of rows of a joined result fits)."""
    return not v.strides or tuple(v.strides) == contiguous_strides(v.shape)

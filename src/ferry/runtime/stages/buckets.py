"""Shape buckets: a dynamic batch padded up to one of a few sizes, so that CUDA graphs are
captured once per bucket, as serving engines capture one per batch size.

A method with a dynamic batch binds a plan per shape it meets (runtime/stages/method.py), and with
CUDA graphs each such plan captures its own. Serving traffic brings every batch size up to
the bound; buckets keep the number of shapes, captures and graph pools to `len(buckets)`: a
call is padded up to the smallest bucket that holds it and meets the program's size checks,
runs at that shape, and its results are sliced back. A call beyond the largest bucket (or with
no bucket where the checks hold) runs at its own shape without graphs, and says so once.
"""

from __future__ import annotations

import warnings

import torch

from ferry.errors import ConfigError, InputError
from ferry.runtime.devices.tensor import device_of, pad_rows
from ferry.runtime.parallel.microbatch import batched_values
from ferry.runtime.stages.method import remember
from ferry.runtime.stages.run import empty_on

__all__ = ["ShapeBuckets", "check_buckets"]


def check_buckets(buckets) -> None:
    """A non-empty sequence of batch sizes (ints >= 1)."""
    try:
        ok = (not isinstance(buckets, (str, bytes)) and len(buckets) > 0
              and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in buckets))
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(f"shape_buckets must be batch sizes (ints >= 1), got {buckets!r}")


class ShapeBuckets:
    def __init__(self, method, buckets) -> None:
        m = method.method
        check_buckets(buckets)
        inputs, outputs = batched_values(m, "shape_buckets=")
        if not all(v.dynamic and v.dynamic[0] for v in inputs):
            raise ConfigError(f"method {m.name!r}: shape_buckets pad a dynamic batch dimension, but dim 0 of its "
                              "inputs is static; export with torch.export.Dim('batch', max=N) on dim 0")
        for i, v in enumerate(outputs):
            if not (v.dynamic and v.dynamic[0]) or v.shape[0] != inputs[0].shape[0]:
                raise ConfigError(f"method {m.name!r}: output {i} does not carry the batch in dim 0 (its dim 0 is "
                                  f"{v.shape[0]}{'' if v.dynamic and v.dynamic[0] else ', static'}), so padding rows "
                                  "would reach it: load the method without shape_buckets=")
        bound = inputs[0].shape[0]
        ambiguous = [v.name or "a value" for v in (*inputs, *outputs)
                     if any(d and n == bound for n, d in zip(v.shape[1:], v.dynamic[1:]))]
        if ambiguous:  # the program records which dims are dynamic, not which symbol each is
            raise ConfigError(f"method {m.name!r}: {ambiguous[0]!r} has another dynamic dim with the batch's bound "
                              f"({bound}), so ferry cannot tell which dim 0 of the outputs is the batch: export the "
                              "batch with a bound no other dim shares")
        self.buckets = sorted(set(buckets))
        if self.buckets[-1] > bound:
            raise ConfigError(f"method {m.name!r}: bucket {self.buckets[-1]} is larger than the batch the program "
                              f"was planned for ({bound}); the largest bucket can be {bound}")
        self.name, self.bound = m.name, bound
        self.warned = self.warned_checks = False
        self._chosen: dict[tuple, int | None] = {}  # the bucket chosen per input shapes (where a guard decides)
        self._padded: dict[tuple, torch.Tensor] = {}  # one tensor per input and bucket, reused

    def bucket_for(self, inputs: list, fits=None) -> int | None:
        """The bucket a call runs at: the smallest that holds its rows and where
        `fits(inputs, bucket)` (the program's size checks hold there: a graph padded to a bucket
        where a guard fails would answer for another branch of the model), or None: the call
        runs at its own shape without graphs (beyond the buckets, or no bucket meets the checks;
        a call that breaks a check itself is refused by the call's own check, without a word
        here). The choice is remembered per shape: a bucket that fails costs its check once."""
        if not inputs or not all(isinstance(t, torch.Tensor) and t.dim() for t in inputs):
            raise InputError(f"method {self.name!r} takes batched tensors (dim 0) with shape buckets")
        rows = inputs[0].shape[0]
        if any(t.shape[0] != rows for t in inputs):
            raise InputError(f"method {self.name!r}: the inputs disagree on the batch size (dim 0: "
                             f"{', '.join(str(t.shape[0]) for t in inputs)})")
        if rows == 0:
            return 0
        holding = [b for b in self.buckets if b >= rows]
        if not holding or holding[0] == rows or fits is None:
            if not holding and rows <= self.bound and not self.warned:  # (past the bound: refused)
                self.warned = True
                warnings.warn(f"method {self.name!r}: a call of {rows} rows is beyond the largest shape bucket "
                              f"({self.buckets[-1]}); such calls run at their own shape without CUDA graphs "
                              "(this warning is shown once)", RuntimeWarning, stacklevel=4)
            return holding[0] if holding else None
        key = tuple(tuple(t.shape) for t in inputs)
        if key in self._chosen:
            return self._chosen[key]
        bucket = next((b for b in holding if fits(inputs, b)), None)
        if bucket is None and fits(inputs, None) and not self.warned_checks:
            self.warned_checks = True
            warnings.warn(f"method {self.name!r}: at a call of {rows} rows no shape bucket that holds it "
                          f"({', '.join(map(str, holding))}) meets the size checks the program was exported under; "
                          "such calls run at their own shape without CUDA graphs (this warning is shown once)",
                          RuntimeWarning, stacklevel=4)
        remember(self._chosen, key, bucket)
        return bucket

    def pad(self, inputs: list, bucket: int) -> list:
        """The inputs padded to `bucket` rows."""
        return [self._pad(i, t, bucket) for i, t in enumerate(inputs)]

    def _pad(self, i: int, t: torch.Tensor, bucket: int) -> torch.Tensor:
        """`t` padded to `bucket` rows in a tensor kept for this input and shape: a fresh one per
        call would cost an allocation (page faults, for a large input) every call. Only the
        call's rows are written: the rows past them hold copies of the rows of the call that
        made the tensor, or rows of a later call, always real values (a padded row of zeros could
        be a masked-out sequence, whose softmax is NaN). A set of planned memory runs one call at
        a time, so its buckets may reuse their tensors. (Most calls do not come here: the plan
        bound at the bucket pads as it copies into planned memory, LoadedMethod.execute_padded.)"""
        device = device_of(t)  # where the program expects it (an emulated device's memory is host memory)
        key = (i, bucket, tuple(t.shape[1:]), t.dtype, device)
        out = self._padded.get(key)
        if out is None:
            out = self._padded[key] = pad_rows(t, bucket, empty_on(device, (bucket, *t.shape[1:]), t.dtype))
            return out
        out[:t.shape[0]].copy_(t)
        return out

    def owns(self, t: torch.Tensor) -> bool:
        """Whether `t` shares memory with a padded tensor the buckets reuse."""
        ptr = t.untyped_storage().data_ptr()
        return any(p.untyped_storage().data_ptr() == ptr for p in self._padded.values())

"""Tensor layouts ferry makes memory for: contiguous, or a dense permutation of it.

Eager PyTorch gives some results a permuted layout (a `relu` of a transposed tensor keeps the
transposed strides) and later views rely on it; memory ferry plans for such a value takes the
same layout. A dense layout has no gaps and no overlap, so its bytes are one run in memory and
a byte copy between two tensors of one layout moves the tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["contiguous_strides", "is_dense"]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(out))


def is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """`strides` lay `shape` out without gaps or overlap (a permutation of contiguous)."""
    if len(strides) != len(shape):
        return False
    want = 1
    for i in sorted(range(len(shape)), key=lambda i: (strides[i], shape[i])):
        if shape[i] != 1 and strides[i] != want:
            return False
        want *= shape[i]
    return True

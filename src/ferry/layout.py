"""Tensor layouts ferry makes memory for: contiguous, or a dense permutation of it.

Eager PyTorch gives some results a permuted layout (a `relu` of a transposed tensor keeps the
transposed strides) and later views rely on it; memory ferry plans for such a value takes the
same layout. A dense layout has no gaps and no overlap, so its bytes are one run in memory and
a byte copy between two tensors of one layout moves the tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["contiguous_strides", "dense_strides_like", "element_span", "is_dense", "same_strides"]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(out))


def dense_strides_like(shape: Sequence[int], like: Sequence[int]) -> tuple[int, ...]:
    """Dense strides for `shape` with its dims in the order strides `like` put them (a value's
    layout carried to another size of it, such as a micro-batch's rows)."""
    strides, step = [0] * len(shape), 1
    for d in sorted(range(len(shape)), key=lambda d: like[d]):
        strides[d], step = step, step * max(int(shape[d]), 1)
    return tuple(strides)


def is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """`strides` lay `shape` out without gaps or overlap (a permutation of contiguous). An empty
    shape has no elements to lay out: any strides do."""
    if len(strides) != len(shape):
        return False
    if any(int(d) == 0 for d in shape):
        return True
    want = 1
    for i in sorted(range(len(shape)), key=lambda i: (strides[i], shape[i])):
        if shape[i] != 1 and strides[i] != want:
            return False
        want *= shape[i]
    return True


def same_strides(shape: Sequence[int], a: Sequence[int], b: Sequence[int]) -> bool:
    """`a` and `b` lay `shape` out alike (a dim of size 1 may have any stride)."""
    return len(a) == len(b) == len(shape) and all(n == 1 or x == y for n, x, y in zip(shape, a, b))


def element_span(shape, stride, offset: int = 0) -> tuple[int, int]:
    """[first, last + 1) element of a storage a strided layout touches (no elements: [offset, offset))."""
    if any(int(n) == 0 for n in shape):
        return offset, offset
    low = offset + sum((int(n) - 1) * int(st) for n, st in zip(shape, stride) if int(st) < 0)
    high = offset + sum((int(n) - 1) * int(st) for n, st in zip(shape, stride) if int(st) > 0) + 1
    return low, high

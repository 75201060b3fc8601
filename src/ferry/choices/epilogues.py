"""In a decode step compiled with Inductor's tuning, the residual add after a one-row product is
not fused into the product's reduction: Inductor fuses it into the next norm's kernel instead.

Inductor may fuse a pointwise consumer into the reduction whose outputs it reads (an epilogue).
After a one-row product the consumer is the residual stream's add, `h = residual + x @ W.T`;
Inductor put it either in the product's kernel or in the next RMSNorm's, which reads `h` anyway,
and chose differently from layer to layer. Profiles of Llama-1B's decode step on an H200
(`bench/llm_profile.py`; docs/benchmarks.md) measured the o projection at 3.6–3.9 µs wherever
the add stayed out of it (three loads), and at 4.4, 10.0 and 15.7 µs where it was fused (one load
each): the fused kernel tunes to other block sizes, at times poor ones, and it ran in 7 of 16
layers. So in a graph ferry compiles with `gemv.TUNING`, a pointwise consumer of a reduction's
outputs (the same count of elements) that also reads a buffer another kernel of the graph
computed (the residual) stays out of the reduction. A cast of the outputs, or a bias add (a
constant or an input), still fuses; so does everything in other graphs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

from torch._inductor.choices import InductorChoices
from torch._inductor.virtualized import V

__all__ = ["ResidualsApart", "cache_options", "residual_epilogue", "residuals_apart"]


def _count(sizes) -> int | None:
    """The element count of a scheduler node's group part: a tuple of sizes (C++) or their product
    (Triton); None where it is symbolic."""
    try:
        return math.prod(int(s) for s in sizes) if isinstance(sizes, (tuple, list)) else int(sizes)
    except TypeError:
        return None


def residual_epilogue(node1, node2) -> bool:
    """`node2` is a pointwise consumer of the reduction `node1` over as many elements as its outputs
    that also reads a buffer another kernel of the graph computes."""
    if not node1.is_reduction() or node2.is_reduction():
        return False
    (outputs, _), (elements, rest) = node1.group[1], node2.group[1]
    n = _count(outputs)
    if n is None or n < 2 or _count(elements) != n or _count(rest) != 1:
        return False
    own = node1.get_buffer_names()
    given = set(V.graph.graph_inputs) | set(V.graph.constants)
    return any(d.name not in own and d.name not in given for d in node2.read_writes.reads)


class ResidualsApart(InductorChoices):
    """Inductor's own choices, but for a residual add after a reduction (`residual_epilogue`)."""

    def uuid(self) -> str:  # Inductor's cache key: code compiled with these choices is not another's
        return "ferry.choices.epilogues.ResidualsApart/1"

    @staticmethod
    def can_fuse_vertical(scheduler, node1, node2, shared_data_score) -> bool:
        if residual_epilogue(node1, node2):
            return False
        return InductorChoices.can_fuse_vertical(scheduler, node1, node2, shared_data_score)


def cache_options() -> dict:
    """Options that put these choices in Inductor's cache key, where this torch has the key (2.13
    does): a graph compiled without them (an earlier ferry, torch.compile) is not served instead."""
    import torch._inductor.config as config

    return {"inductor_choices_class": ResidualsApart} if hasattr(config, "inductor_choices_class") else {}


@contextlib.contextmanager
def residuals_apart() -> Iterator[None]:
    """Inductor's compiles in this block keep residual adds out of reductions (this thread's)."""
    if not hasattr(InductorChoices, "can_fuse_vertical"):  # a torch without the hook: Inductor's choices
        yield
        return
    with V.set_choices_handler(ResidualsApart()):
        yield

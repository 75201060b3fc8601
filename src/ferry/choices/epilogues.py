"""In a decode step compiled with Inductor's tuning, the residual add after a one-row product is
not fused into the product's reduction: Inductor fuses it into the next norm's kernel instead.

Inductor may fuse a pointwise consumer into the reduction whose outputs it reads (an epilogue).
After a one-row product the consumer is the residual stream's add, `h = residual + x @ W.T`;
Inductor put it either in the product's kernel or in the next RMSNorm's, which reads `h` anyway,
and chose differently from layer to layer. Profiles of Llama-1B's decode step on an H200
(`bench/llm_profile.py`; docs/benchmarks.md) measured the o projection at 3.6–3.9 µs wherever
the add stayed out of it (three loads), and at 4.4, 10.0 and 15.7 µs where it was fused (one load
each): the fused kernel tunes to other block sizes, at times poor ones, and it ran in 7 of 16
layers. The rule is structural: in a graph ferry compiles with `gemv.TUNING`, a pointwise
consumer of a reduction's outputs (the same count of elements) that also reads a buffer another
kernel of the graph computed stays out of the reduction. That is the residual add; it would also
be a product of two reductions' outputs (SwiGLU's, where gate and up were not one product), or a
rotary embedding after a q or k product of its own (ferry's q/k/v are one product, whose outputs
outnumber the rotary's), neither measured apart. A cast of the outputs, or a bias add (a constant
or an input), still fuses; so does everything in other graphs, and in a process that installed
Inductor choices of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch._inductor.config as inductor_config
from torch._inductor import virtualized
from torch._inductor.choices import InductorChoices
from torch._inductor.virtualized import V

__all__ = ["ResidualsApart", "cache_options", "residual_epilogue", "residuals_apart"]


def _version() -> str:
    """This rule's code, for Inductor's cache key (where the cache keys a choices class by its uuid)."""
    try:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    except OSError:  # installed without its source
        return "1"


_VERSION = _version()


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
    parts1, parts2 = node1.group[1], node2.group[1]
    if len(parts1) != 2 or len(parts2) != 2:  # a combo kernel's group, say
        return False
    n = _count(parts1[0])
    if n is None or n < 2 or _count(parts2[0]) != n or _count(parts2[1]) != 1:
        return False
    own = node1.get_buffer_names()
    given = set(V.graph.graph_inputs) | set(V.graph.constants)
    return any(d.name not in own and d.name not in given for d in node2.read_writes.reads)


class ResidualsApart(InductorChoices):
    """Inductor's own choices, but for a residual add after a reduction (`residual_epilogue`)."""

    def uuid(self) -> str:  # Inductor's cache key: code compiled with these choices is not another's
        return f"ferry.choices.epilogues.ResidualsApart/{_VERSION}"

    @staticmethod
    def can_fuse_vertical(scheduler, node1, node2, shared_data_score) -> bool:
        if residual_epilogue(node1, node2):
            return False
        return InductorChoices.can_fuse_vertical(scheduler, node1, node2, shared_data_score)


def _hookable() -> bool:
    """This torch asks its choices about vertical fusions (2.11 does)."""
    return hasattr(InductorChoices, "can_fuse_vertical") and hasattr(inductor_config, "inductor_choices_class")


def cache_options() -> dict:
    """Options that put these choices in Inductor's cache key by their uuid, where torch keys a
    choices class so (2.13): a graph compiled without them (an earlier ferry, torch.compile) is not
    served instead. None elsewhere (2.11 would pickle the class into the key, and patches its config
    for every thread): there a graph the cache kept from such a compile may be served, the same
    values fused otherwise."""
    keyed = "inductor_choices_class" in getattr(inductor_config, "_cache_config_factory_keys", ())
    return {"inductor_choices_class": ResidualsApart} if keyed else {}


@contextlib.contextmanager
def residuals_apart() -> Iterator[bool]:
    """Inductor's compiles in this block, on this thread, keep residual adds out of reductions;
    yields whether they do: not where this torch lacks the hooks, nor where the process chose
    Inductor's choices itself. On leaving, this thread's choices are as they were, unset included
    (a choices class the process sets later still takes effect)."""
    slot = getattr(getattr(virtualized, "_choices", None), "_key", None)
    local = getattr(virtualized, "threadlocal", None)
    prior = getattr(local, slot, None) if slot and local is not None else None
    ours = (InductorChoices, ResidualsApart)  # (nested: an enclosing block's)
    own = (inductor_config.inductor_choices_class not in (None, ResidualsApart)
           or (prior is not None and type(prior) not in ours))
    if own or not slot or local is None or not _hookable():
        yield False
        return
    setattr(local, slot, ResidualsApart())
    try:
        yield True
    finally:
        if prior is None:
            local.__dict__.pop(slot, None)
        else:
            setattr(local, slot, prior)

"""Which inputs of a method an op reads through their storage, in the method or its delegates.

`as_strided(x, size, stride, storage_offset)` indexes `x`'s storage, not its elements: eager
reads from wherever the caller's storage starts, ferry from where the tensor's memory starts
(its own planned copy, or a place in an arena). The two agree for a tensor that is its whole
storage; the method records the inputs that must be one, and each call checks them
(runtime/stages/method.py), so a view into a larger storage is refused instead of read differently.
"""

from __future__ import annotations

import torch
import torch.fx

from ferry import node_meta as M
from ferry.aot.lower import is_delegate_node
from ferry.op_names import kernel_name
from ferry.ops import is_copy_node
from ferry.ops.aliasing import STORAGE_OFFSET_AT, view_base

__all__ = ["storage_inputs"]


def storage_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Positions (among the user inputs) of the inputs read through their storage."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and M.input_info(n).kind == M.USER_INPUT]
    return sorted({inputs.index(r) for r in _read_roots(gm) if r in inputs})


def _read_roots(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The placeholders of `gm` whose storage an op reads, itself or through a delegate."""
    roots = set()
    for node in gm.graph.nodes:
        if is_delegate_node(node):
            lowered = getattr(gm, node.args[0].target)
            inner = [n for n in lowered.original_module.graph.nodes if n.op == "placeholder"]
            for r in _read_roots(lowered.original_module):
                if r in inner and inner.index(r) + 1 < len(node.args):
                    roots.add(_root(node.args[inner.index(r) + 1]))
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            at = STORAGE_OFFSET_AT.get(kernel_name(node.target))
            offset = node.args[at] if at is not None and at < len(node.args) else node.kwargs.get("storage_offset")
            if at is not None and offset is not None:
                roots.add(_root(node.args[0]))
    return {r for r in roots if r is not None and r.op == "placeholder"}


def _root(node) -> torch.fx.Node | None:
    """The node whose memory `node` is, through views and copies to a device."""
    root = view_base(node, through=lambda n: 0 if is_copy_node(n) else None)
    return root if isinstance(root, torch.fx.Node) else None

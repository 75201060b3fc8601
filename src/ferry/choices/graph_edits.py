"""Editing a traced graph at compile time: the record of a rewrite and the few node helpers the
op families' patterns share (choices/conv.py, attention.py, gemm.py; aot/fuse.py runs them)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ferry import node_meta as M

__all__ = ["Rewrite", "attr", "call", "constant", "single_use"]


class Rewrite(NamedTuple):
    kind: str  # "copy dropped", "fold", "conv relu", "patches", "attention", "mask dropped", "mask causal", "gemm",
    # "projections merged", "grouped heads", "additive mask", "rows padded"
    where: str  # the node or module call it applied to


def attr(gm, node):
    """The tensor a get_attr node names, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
        return None
    t = gm
    for part in str(node.target).split("."):
        t = getattr(t, part, None)
    return t if isinstance(t, torch.Tensor) and not t.is_meta else None


def constant(gm, name: str, value: torch.Tensor, like: torch.fx.Node) -> torch.fx.Node:
    target = name
    while hasattr(gm, target):
        target += "_"
    gm.register_buffer(target, value)
    node = gm.graph.get_attr(target)
    device = M.get_device(like)
    if device is not None:
        M.set_device(node, device)
    val = like.meta.get("val")
    if isinstance(val, torch.Tensor):
        node.meta["val"] = val.new_empty(value.shape)
    return node


def call(gm, like: torch.fx.Node, op, args, val, kwargs: dict | None = None) -> torch.fx.Node:
    """A new node calling `op`, with `like`'s metadata (device, module stack) and value `val`."""
    node = gm.graph.call_function(op, args, kwargs)
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")})
    node.meta["val"] = val
    if isinstance(val, torch.Tensor):  # its own, not `like`'s
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    return node


def single_use(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and len(node.users) == 1

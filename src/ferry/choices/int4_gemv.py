"""One-row products of int4 weights in the inductor backend: ATen's tinygemm kernel on its packed
tiles, or the product written over the plain int4 values as a reduction Inductor generates
(load time, timed).

torchao's `Int4WeightOnlyConfig` stores a weight as tinygemm's tiles (`_weight_int4pack_mm`), a
layout made for tensor-core GEMMs. A decode step multiplies one row by each weight, and there
tinygemm's kernel streamed a packed weight at a fraction of the GPU's bandwidth (Llama-1B's
products took 6-7 µs each on an H200, where reading them takes 1-4). The tiles are not
documented, so ferry learns the plain values from the kernel itself: the product of the identity
by the weight is its dequantized matrix, from which the scales and zeros give each int4 value
back; packing those again must give the stored tiles byte for byte, or nothing is rewritten.
The values are kept two to a byte, in row order (`plain_values`), and the product becomes a
multiply and a sum over them that Inductor fuses into one kernel: the dequantization rounded to
the activations' dtype as tinygemm rounds it, products accumulated in fp32. Each shape is timed
both ways once per process, weights cold, and the reduction kept where it saves 3%.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from ferry.capture import LOCK
from ferry.choices import gemv, timing
from ferry.choices.decisions import DECISIONS, Decision

__all__ = ["FAMILY", "FORMS", "TIMED_ON", "apply", "by_reduction", "candidates", "measure", "plain_values", "rewrite"]

aten = torch.ops.aten
FAMILY = "int4 matrix-vector product"
FORMS = ("tinygemm", "Inductor reduction")
KEEP_IF_ABOVE = 0.97  # the reduction's time over tinygemm's: above this, tinygemm's kernel stays
TIMED_ON = frozenset({"cuda"})  # device types whose products are timed (tests add the CPU, with a fake clock)
_CHUNK = 512  # identity rows per probe: bounds the dequantized slice a probe makes (512 x N bf16)
_TIMES: dict[tuple, tuple[float, float] | None] = {}  # per shape, group size and device


def _pack_cuda(q: torch.Tensor, tiles: int) -> torch.Tensor:
    return aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), tiles)


def _pack_cpu(q: torch.Tensor, tiles: int) -> torch.Tensor:
    return aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), tiles)


# each tinygemm product op and the op that packs plain values (uint8, 0..15, [N, K]) for it
PACKINGS = {aten._weight_int4pack_mm.default: _pack_cuda, aten._weight_int4pack_mm_for_cpu.default: _pack_cpu}
_TILES = (8, 4, 2)  # the inner K tiles a packing may have used (torchao: 8)


def candidates(gm: torch.fx.GraphModule, shapes: dict[torch.fx.Node, torch.Tensor]) -> list[torch.fx.Node]:
    """The tinygemm products of one half-precision row by a constant packed weight and constant
    scales. `shapes`: a meta tensor per node, as the dry run made it."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in PACKINGS or len(node.args) != 4 or node.kwargs:
            continue
        x, packed, group, scales = node.args
        meta = shapes.get(x) if isinstance(x, torch.fx.Node) else None
        constant = all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in (packed, scales))
        if (meta is not None and constant and isinstance(group, int) and meta.dim() == 2 and meta.shape[0] == 1
                and meta.dtype in (torch.bfloat16, torch.float16) and node in shapes):
            out.append(node)
    return out


def _args(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, int, torch.fx.Node]:
    """A candidate's row, packed weight, group size and scales (candidates checked their kinds)."""
    x, packed, group, scales = node.args
    assert isinstance(x, torch.fx.Node) and isinstance(packed, torch.fx.Node) and isinstance(scales, torch.fx.Node)
    return x, packed, int(group), scales  # type: ignore[arg-type]


def _operands(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[torch.Tensor, int, torch.Tensor]:
    _, packed, group, scales = _args(node)
    return getattr(gm, str(packed.target)), group, getattr(gm, str(scales.target))


def plain_values(op, packed: torch.Tensor, group: int, scales: torch.Tensor, k: int, n: int,
                 dtype: torch.dtype) -> torch.Tensor | None:
    """The int4 values of a packed [n, k] weight as uint8 [n, k / 2], value 2j in the low nibble of
    byte j and 2j + 1 in the high one; None where they cannot be told exactly: the dequantized
    weight (the identity times it, through `op`) does not follow `(q - 8) * scale + zero`, or the
    values found do not pack to the stored tiles byte for byte."""
    if k % 2 or k % group or tuple(scales.shape) != (k // group, n, 2):
        return None
    scale = scales[..., 0].t().float().repeat_interleave(group, 1)  # [n, k]
    zero = scales[..., 1].t().float().repeat_interleave(group, 1)
    q = torch.empty((n, k), dtype=torch.uint8, device=packed.device)
    eye = torch.eye(k, dtype=dtype, device=packed.device)
    for i in range(0, k, _CHUNK):
        rows = slice(i, min(i + _CHUNK, k))
        dequantized = op(eye[rows], packed, group, scales).t().float()  # [n, rows]
        found = ((dequantized - zero[:, rows]) / scale[:, rows] + 8).round()
        if not bool(((found >= 0) & (found <= 15)).all()):
            return None
        if not torch.equal(_dequantize(found, scale[:, rows], zero[:, rows], dtype), dequantized.to(dtype)):
            return None
        q[:, rows] = found.to(torch.uint8)
    del eye, scale, zero
    if not any(_packs_to(PACKINGS[op], q, tiles, packed) for tiles in _TILES):
        return None
    return q[:, ::2] | (q[:, 1::2] << 4)


def _packs_to(pack, q: torch.Tensor, tiles: int, packed: torch.Tensor) -> bool:
    try:
        again = pack(q, tiles)
    except RuntimeError:  # a tile count the packing refuses for this shape
        return False
    return again.dtype == packed.dtype and again.shape == packed.shape and torch.equal(again, packed)


def _dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tinygemm's dequantized weight: `(q - 8) * scale + zero`, rounded to the activations' dtype."""
    return ((q - 8) * scale + zero).to(dtype)


def by_reduction(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """`x @ W.t()` for the int4 weight W of `values` (plain_values) and tinygemm's `scales`
    ([k / group, n, 2]: scale and zero per group of a row): a multiply and a sum per output, the
    weight dequantized and rounded to x's dtype as tinygemm does, accumulated in fp32."""
    n, k = values.shape[0], values.shape[1] * 2
    q = torch.stack([values & 15, values >> 4], -1).view(n, k // group, group).float()
    scale = scales[..., 0].t().unsqueeze(-1).float()  # [n, groups, 1]
    zero = scales[..., 1].t().unsqueeze(-1).float()
    weight = _dequantize(q, scale, zero, x.dtype).float()
    out = (x.float().view(x.shape[0], 1, k // group, group) * weight).sum([-2, -1])
    return out.to(x.dtype)


def apply(gm: torch.fx.GraphModule, shapes: dict[torch.fx.Node, torch.Tensor]) -> list[Decision]:
    """One decision per product shape of the graph's one-row tinygemm products (on a device of
    TIMED_ON): the reduction over plain values where it is faster, else tinygemm's kernel. A
    weight whose values cannot be told exactly keeps tinygemm's kernel, untimed. Returns the
    decisions (none: nothing to choose)."""
    nodes = [n for n in candidates(gm, shapes) if _operands(gm, n)[0].device.type in TIMED_ON]
    values: dict[str, torch.Tensor] = {}  # per packed weight, its plain values: made once
    for node in nodes:
        packed, group, scales = _operands(gm, node)
        row = shapes[_args(node)[0]]
        if _name(node) not in values:
            found = plain_values(node.target, packed, group, scales, row.shape[1], shapes[node].shape[1], row.dtype)
            if found is not None:
                values[_name(node)] = found
    nodes = [n for n in nodes if _name(n) in values]
    by_shape: dict[str, list[torch.fx.Node]] = {}
    for node in nodes:
        by_shape.setdefault(_shape(gm, node, shapes), []).append(node)
    decided = []
    for shape, same in sorted(by_shape.items()):
        made = _decided(gm, same[0], shape, values[_name(same[0])], shapes)
        if made is None:
            continue
        decided.append(made)
        for node in same if made.taken else ():
            rewrite(gm, node, values[_name(node)], shapes)
    if any(d.taken for d in decided):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return decided


def _name(node: torch.fx.Node) -> str:
    """The packed weight's attribute in the graph module."""
    return str(_args(node)[1].target)


def _shape(gm: torch.fx.GraphModule, node: torch.fx.Node, shapes: dict) -> str:
    return f"{shapes[_args(node)[0]].shape[1]}->{shapes[node].shape[1]} g{_operands(gm, node)[1]}"


def _decided(gm: torch.fx.GraphModule, node: torch.fx.Node, shape: str, values: torch.Tensor,
             shapes: dict) -> Decision | None:
    """The decision for the products of one shape, timed once per process; None where the product
    could not be timed (tinygemm's kernel stays)."""
    packed, group, scales = _operands(gm, node)
    dtype = shapes[_args(node)[0]].dtype
    key = (FAMILY, shape, dtype, str(packed.device))
    with LOCK:
        known = _TIMES.get(key, ...)
    if known is ...:
        reduction = _compiled(values, scales, group, dtype) if packed.device.type == "cuda" else None
        with LOCK:
            if key not in _TIMES and (packed.device.type != "cuda" or not timing.capturing(packed.device)):
                _TIMES[key] = measure(node.target, packed, group, scales, values, reduction)
            known = _TIMES.get(key)
    if known is None:
        return None
    made = timing.decision(FAMILY, str(node.target).split("::")[-1], shape, packed.device, dtype, FORMS, known,
                           min_saving_us=0, keep_if_above=KEEP_IF_ABOVE)
    return DECISIONS.get(key, lambda: made) or made  # kept, so `ferry run` lists it


def _compiled(values: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype):
    """Inductor's kernel for `by_reduction` of one row, as the method's graph will have it (traced
    on fake tensors, compiled with the gemv choice's tuning); None where Inductor fails."""
    x = torch.zeros((1, values.shape[1] * 2), dtype=dtype, device=values.device)
    try:
        gm = make_fx(lambda x, v, s: (by_reduction(x, v, s, group),), tracing_mode="fake")(x, values, scales)
        fn = torch._inductor.compile(gm, [x, values, scales], options=gemv.TUNING)
    except Exception:  # noqa: BLE001 - Inductor could not build it: nothing is timed, tinygemm stays
        return None
    return lambda x, v, s: fn(x, v, s)[0]


def measure(op, packed: torch.Tensor, group: int, scales: torch.Tensor, values: torch.Tensor,
            reduction) -> tuple[float, float] | None:
    """(tinygemm µs, reduction µs) on the weight's GPU, each weight cold (copies past the L2 cache),
    or None where nothing could be timed."""
    if reduction is None:
        return None
    device, copies = packed.device, [(packed, values)]
    try:
        with timing.on(device):
            x = torch.full((1, values.shape[1] * 2), 0.5, dtype=scales.dtype, device=device)
            copies += [(packed.clone(), values.clone()) for _ in range(gemv.cold_copies(values) - 1)]
            times = timing.time_both(lambda: [op(x, p, group, scales) for p, _ in copies],
                                     lambda: [reduction(x, v, scales) for _, v in copies])
            return times[0] / len(copies), times[1] / len(copies)
    except Exception:  # noqa: BLE001 - a choice that cannot be timed is not made; the load goes on
        return None
    finally:
        copies.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node, values: torch.Tensor,
            shapes: dict[torch.fx.Node, torch.Tensor]) -> None:
    """Replace the tinygemm product by `by_reduction`'s ops over `values` (a constant of `gm`,
    added once per packed weight), which Inductor fuses into one kernel; the row read from memory
    as the timed kernel read it."""
    x, packed, group, scales = _args(node)
    name = f"{packed.target}_int4_values"
    if not hasattr(gm, name):
        gm.register_buffer(name, values)
    meta = shapes[x]
    traced = make_fx(lambda x, v, s: by_reduction(x, v, s, group), tracing_mode="fake")(
        torch.empty(meta.shape, dtype=meta.dtype, device=values.device), values, getattr(gm, str(scales.target)))
    g = gm.graph
    with g.inserting_before(node):
        row = gemv.realized(g, x, meta)
        inputs = [p for p in traced.graph.nodes if p.op == "placeholder"]
        out = g.graph_copy(traced.graph, dict(zip(inputs, [row, g.get_attr(name), scales])))
    assert isinstance(out, torch.fx.Node)  # (by_reduction returns one tensor)
    node.replace_all_uses_with(out)
    g.erase_node(node)


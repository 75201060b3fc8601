"""Matrix-vector products in the inductor backend: cuBLAS's GEMV, or the product written as a
multiply and a sum, which Inductor generates as one reduction kernel (load time, timed).

A decode step multiplies one row by each weight and reads every weight once: its time is how fast
each product streams its weight. On an H200 (`bench/gemv_kernels.py`, bf16, weights cold), cuBLAS
streams Llama-1B's 2048 x 2048 weight at 1.4 TB/s, its 2048 x 3072 at 2.0 and its 8192 x 2048 at
2.5, where Inductor's reduction, its block sizes tuned (TUNING), reaches 2.1, 2.5 and 3.6; at
2048 x 16384 and the 128k-token head the two are within 10% (3.7 and 4.2 TB/s against 3.9 and
4.5), and at 8 rows the reduction would read the weight once per row. No shape rule holds across
GPUs, so each distinct one-row product of a half-precision weight in a graph of static sizes is
timed both ways when its method loads, weights rotated through more copies than the GPU's L2
holds (a decode step reads them cold). The choice is made per shape (`apply`): the reduction where it saves 3% (one kernel
either way: no launch to pay for). One graph may mix the two: Llama-1B's q/k/v, o and down
products as reductions and its 128k-token head as cuBLAS's, whose tuned reduction took 117 µs at
one load and 175 at another against cuBLAS's 121-126. Inside the graph Inductor also fuses what
surrounds a reduction into it (the norm that makes its row, SiLU(gate) * up after it), which
cuBLAS's kernel cannot: such a product is timed with what its reduction would take in (`Region`),
both forms compiled as the graph will run them. On an H100 that moved Llama-1B's q/k/v and
gate/up products to reductions (q/k/v with its norm: 13.5 µs as cuBLAS's form, 7.4 as one
kernel; alone cuBLAS's 8.4 had won): 120 kernels a decode step where an earlier load, its
q/k/v norm inside but gate/up cuBLAS's, ran 152.
Both forms accumulate in fp32 and round once, as cuBLAS does for half types."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from ferry.capture import LOCK
from ferry.choices import kernel_tuning, timing
from ferry.choices.decisions import DECISIONS, Decision
from ferry.choices.gemm import blas_settings
from ferry.ops.aliasing import view_base
from ferry.ops.library import new_fragment
from ferry.ops.split_kv import SPLIT_KV_ATTENTION

__all__ = ["FAMILY", "FORMS", "LIBRARY_LINEAR", "Region", "SPLIT_EQUAL_SLICES", "TIMED_ON", "TUNING", "UNTUNED", "apply",
           "by_reduction", "candidates", "cold_copies", "measure", "product_times", "rewrite", "settings"]

aten = torch.ops.aten
FAMILY = "matrix-vector product"
FORMS = ("linear (cuBLAS)", "Inductor reduction")
_DTYPES = (torch.bfloat16, torch.float16)  # where both forms accumulate in fp32 and round once
# Inductor's search of each reduction's block sizes: with it the reduction beat cuBLAS at all five
# Llama-1B shapes (three by 10% or more), without it at two (bench/gemv_kernels.py); a decode
# step's graph is compiled with it too, so its kernels are the ones that were timed. Both keys are
# set for every compile (UNTUNED otherwise): torchao's `quantize_` turns the search on, all
# directions checked, for every later compile in the process, and the dynamic prefill of one int4
# layer then took 116 s to load (251 kernel variants compiled and timed; bf16's, two layers,
# untuned: 14.5 s; bench/results/prefill_census_{int4,bf16}.log).
TUNING = {"coordinate_descent_tuning": True, "coordinate_descent_check_all_directions": False}
UNTUNED = {"coordinate_descent_tuning": False, "coordinate_descent_check_all_directions": False}
_PACKED = frozenset({aten._weight_int4pack_mm.default, aten._weight_int8pack_mm.default})  # (x, packed weight, ...)
_WEIGHT_AT = {aten.mm.default: 1, aten.linear.default: 1, aten.addmm.default: 2}  # where a cast weight is read
_CASTS = frozenset({aten._to_copy.default, torch.ops.prims.convert_element_type.default})
# a merged product read as two equal column slices (gate and up) as one reduction per slice
# (rewrite). Two only: that is the form measured (Llama-1B decode, 1.070 against 1.094 ms on an
# H200, within the spread between loads); three equal q/k/v slices would be three reductions whose
# fusion nobody has timed, where one reduction is what the load timed
SPLIT_EQUAL_SLICES = True
# a row a norm makes (RMSNorm: a mean of squares, pointwise ops) and only a reduction reads is
# computed again inside that reduction's kernel, once per output (rewrite): the norm's own kernel,
# ~1.5 µs and a launch gap in each of two norms a layer, goes (decode: a kernel fewer per norm)
FUSE_NORMS = True
# the most outputs a product recomputing its norm may have: each block of outputs reads the row
# again for its sum (from L2), which a 128k-token head's thousands of blocks would do thousands of times
FUSED_NORM_OUTPUTS = 16384
_ROW_SUMS = frozenset({aten.mean.dim, aten.sum.dim_IntList})
KEEP_IF_ABOVE = 0.97  # the reduction's time over cuBLAS's: above this, cuBLAS's kernel stays
TIMED_ON = frozenset({"cuda"})  # device types whose products are timed (tests add the CPU, with a fake clock)
_TIMES: dict[tuple, tuple[float, float] | None] = {}  # per product shape, dtype, device and BLAS settings


def _library_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return aten.linear.default(x, weight, bias)


def _register() -> torch.library.Library | None:
    """`ferry::library_linear`: `linear`, opaque to Inductor, so a product cuBLAS runs faster stays
    cuBLAS's in a graph compiled with TUNING (which rewrites every one-row `mm` it sees)."""
    lib = new_fragment("library_linear")
    if lib is None:
        return None
    lib.define("library_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
    lib.impl("library_linear", _library_linear, "CompositeExplicitAutograd")
    torch.library.register_fake("ferry::library_linear",
                                lambda x, weight, bias=None: x.new_empty((*x.shape[:-1], weight.shape[0])), lib=lib)
    return lib


_lib = globals().get("_lib") or _register()  # kept: the registrations live as long as it does
LIBRARY_LINEAR = torch.ops.ferry.library_linear.default


def settings(gm: torch.fx.GraphModule, shapes: dict[torch.fx.Node, torch.Tensor], static: bool) -> dict:
    """Inductor's settings for this graph's compile, ferry's own whatever the process's config says.
    TUNING for a decode step of static sizes on a device of TIMED_ON: where a one-row product of a
    half-precision weight is made a reduction (`apply`), or where a product of one row reads a
    quantized weight (int8's cast and `mm` become one reduction over the int8 weight only under
    the tuning). Else UNTUNED: in particular any graph of dynamic sizes, whose kernels Inductor
    would tune at the first size it meets, keep for every size, and compile every candidate of."""
    if not static:
        return UNTUNED
    quantized = any(_quantized_one_row(gm, n, shapes) for n in gm.graph.nodes)
    made = apply(gm, shapes, tuned=quantized)
    return TUNING if quantized or any(d.taken for d in made) else UNTUNED


def _quantized_one_row(gm: torch.fx.GraphModule, node: torch.fx.Node, shapes: dict[torch.fx.Node, torch.Tensor]) -> bool:
    """A product of one row by a quantized constant on a device of TIMED_ON: int4/int8 packed
    kernels, or an `mm`/`linear`/`addmm` of an int8 constant cast to the row's type (torchao's
    int8 weight-only linear)."""
    if node.op != "call_function" or (node.target not in _PACKED and node.target not in _WEIGHT_AT):
        return False
    row = node.args[1] if node.target is aten.addmm.default else node.args[0]
    x = shapes.get(row) if isinstance(row, torch.fx.Node) else None
    if x is None or x.dim() == 0 or math.prod(x.shape[:-1]) != 1:
        return False
    weight = node.args[1] if node.target in _PACKED else node.args[_WEIGHT_AT[node.target]]
    w, cast = _constant_read(gm, weight)
    if w is None or w.device.type not in TIMED_ON:
        return False
    return node.target in _PACKED or (cast and w.dtype in (torch.int8, torch.uint8))


def _constant_read(gm: torch.fx.GraphModule, node) -> tuple[torch.Tensor | None, bool]:
    """The constant `node` reads through views and casts (None: something else), and whether it is cast."""
    casts: list[torch.fx.Node] = []

    def past_casts(n: torch.fx.Node) -> int | None:
        if n.target not in _CASTS:
            return None
        casts.append(n)
        return 0

    base = view_base(node, through=past_casts)
    if not (isinstance(base, torch.fx.Node) and base.op == "get_attr"):
        return None, bool(casts)
    value = getattr(gm, str(base.target), None)
    return (value if isinstance(value, torch.Tensor) else None), bool(casts)


def apply(gm: torch.fx.GraphModule, shapes: dict[torch.fx.Node, torch.Tensor], tuned: bool = False) -> list[Decision]:
    """One decision per product shape of the graph's one-row products of a half-precision weight
    (on a device of TIMED_ON): a tuned reduction where it streams the weight faster, else cuBLAS's
    kernel. Each shape is timed both ways once per process. Where any product becomes a reduction,
    or the graph is `tuned` anyway, it is compiled with TUNING, under which Inductor itself would
    turn every one-row `mm` into an untimed reduction: the products left to cuBLAS (slower, or not
    timed) are then called through `library_linear`, which it leaves alone (outside CUDA graphs:
    a Python call per product and call). A product whose reduction would take in the norm that
    makes its row or the pointwise ops after it is timed with them (`_region`): the kernels each
    form leaves, per shape and what is taken in. Other one-row products (fp32, a weight passed in,
    a `bmm` of one query row) are not candidates and are left to Inductor. Returns the decisions."""
    by_shape: dict[tuple[str, str], list[torch.fx.Node]] = {}
    regions: dict[torch.fx.Node, Region | None] = {}
    edited = False
    for node in candidates(gm, shapes):
        if _weights(gm, node)[0].device.type in TIMED_ON:
            edited |= SPLIT_EQUAL_SLICES and _halves_as_slices(node, shapes)
            edited |= _layer_norm_written_out(gm, node, shapes)
            region = regions[node] = _region(gm, node, shapes)
            by_shape.setdefault((_shape(*_weights(gm, node)), region.key if region else ""), []).append(node)
    decided = [(_decided(gm, group, regions[group[0]]) if product_times(gm, group[0], regions[group[0]]) is not None
                else None, group) for _, group in sorted(by_shape.items())]
    if tuned or any(d is not None and d.taken for d, _ in decided):
        for d, group in decided:
            for node in group:
                if d is not None and d.taken:
                    rewrite(gm, node, shapes)
                else:
                    node.target = LIBRARY_LINEAR
        gm.recompile()
    elif edited:
        gm.recompile()
    return [d for d, _ in decided if d is not None]


def _decided(gm: torch.fx.GraphModule, group: list[torch.fx.Node], region: Region | None) -> Decision:
    """The decision for the products of one shape and region (`group`), made once per process.
    The reduction never launches more kernels than cuBLAS's form, so no launch to pay for: it is
    kept where it saves 3% (what the timing of one graph-captured kernel tells apart; the graph's
    own compile tunes it again)."""
    weight, bias = _weights(gm, group[0])
    times = product_times(gm, group[0], region)  # (measured already, by apply)
    assert times is not None  # (apply: every product was timed)
    name = _shape(weight, bias) + (f" (+ {region.inside})" if region else "")
    key = (FAMILY, name, region.key if region else "", weight.dtype, str(weight.device), blas_settings())
    made = timing.decision(FAMILY, "aten.linear", name, weight.device, weight.dtype, FORMS, times,
                           min_saving_us=0, keep_if_above=KEEP_IF_ABOVE)
    return DECISIONS.get(key, lambda: made) or made  # kept, so `ferry run` lists it


def by_reduction(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` as a multiply and a sum over the inner dimension, in fp32."""
    out = (x.unsqueeze(-2).float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def candidates(gm: torch.fx.GraphModule, shapes: dict[torch.fx.Node, torch.Tensor]) -> list[torch.fx.Node]:
    """The `linear` nodes of one row by a constant half-precision weight (and constant bias).
    `shapes`: a meta tensor per node, as the dry run made it."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        x, w = (shapes.get(a) if isinstance(a, torch.fx.Node) else None for a in node.args[:2])
        constant = [isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in node.args[1:]]
        if x is None or w is None or node.kwargs or not all(c or a is None for c, a in zip(constant, node.args[1:])):
            continue
        if (x.dtype in _DTYPES and w.dtype == x.dtype and w.dim() == 2 and w.is_contiguous()
                and math.prod(x.shape[:-1]) == 1):
            out.append(node)
    return out


def product_times(gm: torch.fx.GraphModule, node: torch.fx.Node,
                  region: Region | None = None) -> tuple[float, float] | None:
    """(cuBLAS µs, tuned reduction µs) of this product on its GPU, with what its reduction would
    take in (its `_region`, where it has one), measured once per process per shape and region;
    None where it could not be timed. The forms are compiled outside the capture lock (seconds,
    with tuning); only the timing holds it."""
    weight, bias = _weights(gm, node)
    key = (_shape(weight, bias), region.key if region else "", weight.dtype, str(weight.device), blas_settings())
    with LOCK:
        if key in _TIMES:
            return _TIMES[key]
    try:
        forms = (region.forms(gm, weight.device) if region else _product_forms(weight, bias)) \
            if weight.device.type == "cuda" else None
    except Exception:  # noqa: BLE001 - Inductor could not build it: nothing is timed, cuBLAS stays
        forms = None
    with LOCK:
        if key not in _TIMES and (weight.device.type != "cuda" or not timing.capturing(weight.device)):
            _TIMES[key] = measure(weight, bias, *(forms or (None, None)))
        return _TIMES.get(key)


def _product_forms(weight: torch.Tensor, bias: torch.Tensor | None):
    """cuBLAS's product and the compiled reduction of one row, each a function of (weight, bias)."""
    reduction = _compiled(weight, bias)
    with timing.on(weight.device):
        x = torch.full((1, weight.shape[1]), 0.5, dtype=weight.dtype, device=weight.device)
    return (lambda w, b: torch.nn.functional.linear(x, w, b)), (lambda w, b: reduction(x, w, b))


# a product is timed with the norm and the pointwise ops its reduction would take in (`Region`);
# off, each product alone, as if cuBLAS's form ran them in no kernels of their own
TIME_REGIONS = True
# the most pointwise ops after a product a region takes in (an MLP's SiLU and multiply: 2; BLOOM's
# GELU as exported: 9; one op past the cap that reads the region leaves it without any)
REGION_AFTER = 16


@dataclass(eq=False)
class Region:
    """A product with what its reduction would take into its kernel, which cuBLAS's form leaves to
    kernels of their own: the norm that makes its row (`norm`, as `_norm_of` gives it) and the
    pointwise ops that read only its result (`after`, with its two slices where it is split: an
    MLP's SiLU(gate) * up). Timed as two graphs of the same values (`forms`), so a choice counts
    the kernels the reduction saves: Qwen3-0.6B's gate/up product alone took 7.0 µs against
    cuBLAS's 7.1 on an H200, and cuBLAS's form also runs its norm and its SiLU * up apart."""

    product: torch.fx.Node
    norm: tuple[list[torch.fx.Node], list[torch.fx.Node]] | None
    after: list[torch.fx.Node]
    shapes: dict

    @property
    def inside(self) -> str:
        """What the reduction takes in, in words ("norm, silu, mul")."""
        ops = [n.target._overloadpacket.__name__ for n in self.after if n.target is not aten.slice.Tensor]  # type: ignore[union-attr]
        return ", ".join((["norm"] if self.norm else []) + ops)

    @property
    def key(self) -> str:
        """The ops taken in and the rows they read: regions of one key time alike."""
        ops = [str(n.target) for n in (self.norm[0] if self.norm else []) + self.after]
        return repr((ops, [(tuple(m.shape), m.dtype) for m in map(self.shapes.get, self._leaves())
                           if isinstance(m, torch.Tensor)]))

    def _leaves(self) -> list[torch.fx.Node]:
        return self.norm[1] if self.norm else [self.product.args[0]]  # type: ignore[list-item]

    def forms(self, gm: torch.fx.GraphModule, device: torch.device):
        """cuBLAS's form (the norm, `library_linear`, the ops after, as Inductor compiles them) and
        the reduction's (rewritten as the method's graph will be), each compiled with TUNING and a
        function of (weight, bias); the rows they read are scratch, the constants the graph's."""
        leaves, built = self._leaves(), [self.graph(gm, fused) for fused in (False, True)]
        weight, bias = _weights(gm, self.product)
        with timing.on(device):
            inputs = [getattr(gm, str(n.target)) if n.op == "get_attr" else timing.scratch(self.shapes[n], device)
                      for n in leaves]
        tail = [weight] + ([bias] if bias is not None else [])
        compiled = [torch._inductor.compile(g, inputs + tail, options=TUNING) for g in built]
        return tuple((lambda w, b, f=f: f(*inputs, w, *([] if b is None else [b]))) for f in compiled)

    def graph(self, gm: torch.fx.GraphModule, fused: bool) -> torch.fx.GraphModule:
        """The region as a graph of (its leaves..., weight[, bias]) returning what is read outside
        it: the product through `library_linear`, or (`fused`) rewritten as `apply` would."""
        g, root, env, leaves = torch.fx.Graph(), torch.nn.Module(), {}, self._leaves()
        for i, leaf in enumerate(leaves):
            env[leaf] = g.placeholder(f"row{i}")
        consts = [a for a in self.product.args[1:3] if isinstance(a, torch.fx.Node)]
        for name, const in zip(("weight", "bias"), consts):
            setattr(root, name, getattr(gm, str(const.target)))
            env[const] = g.get_attr(name)
        inner = (self.norm[0] if self.norm else []) + [self.product] + self.after
        for n in inner:
            env[n] = g.node_copy(n, lambda a: env[a])
        g.output(tuple(env[n] for n in inner if any(u not in inner for u in n.users)))
        small = torch.fx.GraphModule(root, g)
        shapes = {env[n]: self.shapes[n] for n in env if n in self.shapes}
        if fused:
            rewrite(small, env[self.product], shapes)
        else:
            env[self.product].target = LIBRARY_LINEAR
        return _constants_as_inputs(small, len(leaves))


def _constants_as_inputs(gm: torch.fx.GraphModule, after: int) -> torch.fx.GraphModule:
    """`gm` with its constants (weight, bias) as inputs placed after its first `after` inputs:
    the timing passes each copy of the weight in turn."""
    g = gm.graph
    last = [n for n in g.nodes if n.op == "placeholder"][after - 1]
    for node in [n for n in g.nodes if n.op == "get_attr"]:
        with g.inserting_after(last):
            last = g.placeholder(str(node.target))
        node.replace_all_uses_with(last)
        g.erase_node(node)
        delattr(gm, str(node.target))
    gm.recompile()
    return gm


def _region(gm: torch.fx.GraphModule, node: torch.fx.Node, shapes: dict) -> Region | None:
    """The product's region (what its reduction would take in), or None where it takes in nothing
    (or TIME_REGIONS is off)."""
    if not TIME_REGIONS:
        return None
    parts, widths = _parts(gm, node, shapes)
    norm = _fused_norm(node, widths, shapes)
    after = _after(node, [user for user, _ in parts if user is not node])
    if norm is None and all(n.target is aten.slice.Tensor for n in after):
        return None
    return Region(node, norm, after, shapes)


def _after(product: torch.fx.Node, slices: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The product's slices and the pointwise ops that read only the product, its slices and each
    other (at most REGION_AFTER, each after what it reads): what Inductor computes in the
    reduction's kernel, and in cuBLAS's form in kernels of their own. Only where everything else
    that reads them stores its result apart (a product, a library op, the graph's output): an op
    read by another pointwise op or a norm would be computed in that op's kernel in either form,
    and counting it against cuBLAS's would be a kernel that never runs."""
    inside, after = [product, *slices], list(slices)
    for node in inside:  # (grows as ops are taken in: each is visited once)
        for user in node.users:
            if (len(after) < len(slices) + REGION_AFTER and user not in inside and user.op == "call_function"
                    and _pointwise(user) and all(r in inside for r in user.all_input_nodes)):
                inside.append(user)
                after.append(user)
    if len(after) > len(slices) and any(u not in inside and not _stores_apart(u) for n in inside for u in n.users):
        return list(slices)
    return after


def _stores_apart(reader: torch.fx.Node) -> bool:
    """`reader` reads a tensor from memory whatever made it: a product, a library op, the output."""
    op = reader.target
    return reader.op == "output" or op in (aten.linear.default, LIBRARY_LINEAR) or (
        getattr(op, "_overloadpacket", None) in _LIBRARY)


def _shape(weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    return f"{weight.shape[1]}->{weight.shape[0]}" + (" +bias" if bias is not None else "")


def _weights(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A candidate's weight and bias (None where it has none): constants of the graph module."""
    got = [getattr(gm, str(a.target)) if isinstance(a, torch.fx.Node) else None for a in node.args[1:3]]
    assert got[0] is not None  # (candidates: a constant weight)
    return got[0], got[1] if len(got) > 1 else None


def measure(weight: torch.Tensor, bias: torch.Tensor | None, library, reduction) -> tuple[float, float] | None:
    """(µs of the `library` form, µs of the `reduction`), each a function of (weight, bias), on the
    weight's GPU, the weight rotated through copies past L2; None where nothing could be timed (no
    reduction was built, or out of memory): cuBLAS's kernel stays."""
    if reduction is None:
        return None
    device, copies = weight.device, [weight]
    try:
        with timing.on(device):
            copies += [torch.full_like(weight, 0.5) for _ in range(cold_copies(weight) - 1)]
            with kernel_tuning.steady():  # the reduction's block sizes, tuned at its first launch here
                times = timing.time_both(lambda: [library(w, bias) for w in copies],
                                         lambda: [reduction(w, bias) for w in copies])
            return times[0] / len(copies), times[1] / len(copies)
    except Exception:  # noqa: BLE001 - a choice that cannot be timed is not made; the load goes on
        return None
    finally:
        copies.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def cold_copies(weight: torch.Tensor) -> int:
    """Copies enough that each is out of L2 by the time it is read again; one for a weight larger
    than L2, which evicts itself (a second copy of a 525 MB head raised the load's peak by as much)."""
    return kernel_tuning.copies_past_l2(weight.numel() * weight.element_size(), weight.device)


def _compiled(weight, bias):
    """Inductor's kernel for `by_reduction` of one row by this weight, as the method's graph will
    have it: traced on fake tensors (a real trace would make the fp32 product, 1 GB for a
    128k-token head), compiled with coordinate-descent tuning (TUNING)."""
    x = torch.zeros((1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    args = [x, weight] + ([bias] if bias is not None else [])
    gm = make_fx(lambda *a: (by_reduction(*a),), tracing_mode="fake")(*args)
    fn = torch._inductor.compile(gm, args, options=TUNING)
    return lambda x, w, b: fn(*([x, w] + ([b] if b is not None else [])))[0]


def rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node,
            shapes: dict[torch.fx.Node, torch.Tensor] | None = None) -> None:
    """Replace the `linear` node by `by_reduction`'s ops, which Inductor fuses into one kernel, its
    row read from memory as the timed kernel read it (`_realized`), or, where a norm makes the row
    and nothing else reads it, the norm computed inside that kernel (`_norm_of`). A merged product
    read only as two column slices of one width (an MLP's gate and up, choices/projections.py)
    becomes one reduction per slice over its rows of the stacked weight (SPLIT_EQUAL_SLICES):
    reductions of one size over one row fuse into one kernel, and so does what combines their
    results (SiLU(gate) * up), which a single reduction's result, read at two offsets, keeps in a
    kernel of its own."""
    x, weight = node.args[:2]
    bias = node.args[2] if len(node.args) > 2 else None
    assert isinstance(x, torch.fx.Node)  # (candidates: a row the graph computes or takes)
    g = gm.graph
    shapes = shapes or {}
    dtype = _weights(gm, node)[0].dtype
    parts, widths = _parts(gm, node, shapes)
    norm = _fused_norm(node, widths, shapes)
    with g.inserting_before(node):
        if norm is None:
            row = _realized(g, x, shapes.get(x))
            xf = g.call_function(aten._to_copy.default, (g.call_function(aten.unsqueeze.default, (row, -2)),),
                                 {"dtype": torch.float32})
        for (user, rows), width in zip(parts, widths):
            if norm is not None:
                xf = g.call_function(aten._to_copy.default, (_norm_per_output(g, norm, width, shapes),),
                                     {"dtype": torch.float32})
            result = _reduction(g, xf, weight, bias, rows, dtype)
            user.replace_all_uses_with(result)
            if user is not node:
                g.erase_node(user)
    g.erase_node(node)
    for old in reversed(norm[0] if norm else []):
        if not old.users:
            g.erase_node(old)


def _parts(gm: torch.fx.GraphModule, node: torch.fx.Node,
           shapes: dict) -> tuple[list[tuple[torch.fx.Node, tuple[int, int] | None]], list[int]]:
    """What each reduction of the rewrite replaces, with the rows of the weight it reads (all:
    None), and how many outputs each has: the product, or its two equal slices (`_equal_slices`)."""
    split = _equal_slices(node, shapes) if SPLIT_EQUAL_SLICES else None
    parts: list[tuple[torch.fx.Node, tuple[int, int] | None]] = [*split] if split else [(node, None)]
    return parts, [rows[1] - rows[0] if rows else _weights(gm, node)[0].shape[0] for _, rows in parts]


def _fused_norm(node: torch.fx.Node, widths: list[int], shapes: dict):
    """The norm the rewrite computes inside the product's reductions (`_norm_of`), or None."""
    x = node.args[0]
    assert isinstance(x, torch.fx.Node)  # (candidates: a row the graph computes or takes)
    return _norm_of(x, node, shapes) if FUSE_NORMS and max(widths) <= FUSED_NORM_OUTPUTS else None


def _norm_of(x: torch.fx.Node, product: torch.fx.Node,
             shapes: dict) -> tuple[list[torch.fx.Node], list[torch.fx.Node]] | None:
    """The nodes that make the one row `x` from rows in memory through pointwise ops and at least
    one sum or mean of a row over its last dim (RMSNorm's mean of squares), in graph order, and
    the nodes they read (leaves); None where `x` is not made so, or where anything besides
    `product` reads it or the nodes that make it (a norm's result read twice is stored once)."""
    row = shapes.get(x)
    if not isinstance(row, torch.Tensor) or row.dim() == 0 or math.prod(row.shape[:-1]) != 1 or set(x.users) != {product}:
        return None
    inner, leaves = {x}, set()
    for n in reversed(x.graph.nodes):  # users before what they read
        if n is x or not any(u in inner for u in n.users):
            continue
        if n.op == "call_function" and all(u in inner for u in n.users) and _norm_step(n, shapes):
            inner.add(n)
        else:
            leaves.add(n)
    made = [n for n in x.graph.nodes if n in inner]  # (each but x passed _norm_step above)
    if not _norm_step(x, shapes) or not any(n.target in _ROW_SUMS for n in made):
        return None
    for leaf in leaves:  # rows in memory, or what broadcasts against one (a norm's weight, a scalar)
        meta = shapes.get(leaf)
        if not isinstance(meta, torch.Tensor) or meta.dim() > row.dim() or (
                meta.dim() == row.dim() and tuple(meta.shape[:-1]) != tuple(row.shape[:-1])):
            return None
    return made, [n for n in x.graph.nodes if n in leaves]


def _norm_step(n: torch.fx.Node, shapes: dict) -> bool:
    """A pointwise op, a cast, or a sum/mean of a row over its last dim keeping it (a norm's)."""
    op = n.target
    if op in _ROW_SUMS:
        meta = shapes.get(n.args[0])
        dims = n.args[1] if len(n.args) > 1 else None
        keep = (n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim")) is True
        return (isinstance(meta, torch.Tensor) and meta.dim() > 0 and keep and isinstance(dims, (list, tuple))
                and len(dims) == 1 and dims[0] in (-1, meta.dim() - 1) and set(n.kwargs) <= {"keepdim"})
    if op is aten._to_copy.default:
        return set(n.kwargs) <= {"dtype"}
    if op in (aten.type_as.default, aten.to.dtype):  # casts (type_as reads its second tensor's dtype only)
        return len(n.args) == 2 and not n.kwargs
    return op is aten.alias.default or _pointwise(n)  # (run once per output: no writes)


def _pointwise(n: torch.fx.Node) -> bool:
    """A pointwise op that writes nothing."""
    op = n.target
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags and not op._schema.is_mutable


def _norm_per_output(g: torch.fx.Graph, norm: tuple[list[torch.fx.Node], list[torch.fx.Node]], width: int,
                     shapes: dict) -> torch.fx.Node:
    """The norm's ops again, each row sum taken over the row repeated once per output (`width`):
    the sum then has the product's shape, so Inductor computes it in the product's own kernel, as
    it computes a softmax's max and sum in one. The row comes out [..., width, K], each copy the
    norm's result op for op (the same casts and roundings)."""
    made, leaves = norm
    env: dict[torch.fx.Node, Any] = {}
    rank = shapes[made[-1]].dim()
    for leaf in leaves:  # a row gains the outputs' dim; what broadcasts from the right stays
        env[leaf] = g.call_function(aten.unsqueeze.default, (leaf, -2)) if shapes[leaf].dim() == rank else leaf
    for n in made:
        assert callable(n.target)  # (_norm_step: call_function nodes)
        args = torch.fx.map_arg(n.args, lambda a: env[a])
        kwargs = torch.fx.map_arg(dict(n.kwargs), lambda a: env[a])
        if n.target in _ROW_SUMS:
            meta = shapes[n.args[0]]
            wide = [*meta.shape[:-1], width, meta.shape[-1]]
            args = (g.call_function(aten.expand.default, (args[0], wide)), [-1], *args[2:])
        env[n] = g.call_function(n.target, args, kwargs)
    return env[made[-1]]


def _reduction(g: torch.fx.Graph, xf: torch.fx.Node, weight, bias, rows: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.fx.Node:
    """`by_reduction`'s ops on the fp32 row `xf`, over `rows` of the weight (all where None)."""
    def part(t):
        t = t if rows is None else g.call_function(aten.slice.Tensor, (t, 0, *rows))
        return g.call_function(aten._to_copy.default, (t,), {"dtype": torch.float32})
    out = g.call_function(aten.sum.dim_IntList, (g.call_function(aten.mul.Tensor, (xf, part(weight))), [-1]))
    if bias is not None:
        out = g.call_function(aten.add.Tensor, (out, part(bias)))
    return g.call_function(aten._to_copy.default, (out,), {"dtype": dtype})


def _layer_norm_written_out(gm: torch.fx.GraphModule, node: torch.fx.Node, shapes: dict) -> bool:
    """An `aten.layer_norm` over the last dim whose row only this product reads, directly or
    through casts (OPT's, GPT-NeoX's, BLOOM's, StableLM's, OLMo's), written out as the ops it
    computes, in fp32 as eager's kernel does (two means, the second of the centred row's squares;
    the weight and bias; one rounding back), so that the rule for norms (`_norm_of`) computes it
    inside the product's reduction. Only where that rule would (FUSE_NORMS, outputs up to
    FUSED_NORM_OUTPUTS). True where the graph changed."""
    reader, norm = node, node.args[0]
    while (isinstance(norm, torch.fx.Node) and norm.op == "call_function" and set(norm.users) == {reader}
           and norm.target in (aten._to_copy.default, aten.alias.default) and _norm_step(norm, shapes)):
        reader, norm = norm, norm.args[0]  # a cast, or an alias
    if (not FUSE_NORMS or not isinstance(norm, torch.fx.Node) or norm.op != "call_function"
            or norm.target is not aten.layer_norm.default or set(norm.users) != {reader} or norm.kwargs
            or max(_parts(gm, node, shapes)[1]) > FUSED_NORM_OUTPUTS):
        return False
    x, dims, weight, bias, eps = [*norm.args, *(None, None, 1e-5)[len(norm.args) - 2:]][:5]  # (its defaults)
    row = shapes.get(x)
    if (not isinstance(x, torch.fx.Node) or not isinstance(row, torch.Tensor) or not row.dim()
            or not isinstance(dims, (list, tuple)) or list(dims) != [row.shape[-1]] or not row.is_floating_point()):
        return False
    graph = node.graph

    def op(target, *args, **kwargs):
        made = graph.call_function(target, args, kwargs)
        metas = torch.fx.map_arg(args, lambda a: shapes.get(a, a.meta.get("val")).to("meta"))
        made.meta["val"] = shapes[made] = target(*metas, **kwargs)
        return made

    with graph.inserting_before(norm):
        xf = op(aten._to_copy.default, x, dtype=torch.float32) if row.dtype != torch.float32 else x
        centred = op(aten.sub.Tensor, xf, op(aten.mean.dim, xf, [-1], True))
        rstd = op(aten.rsqrt.default, op(aten.add.Tensor, op(aten.mean.dim, op(aten.mul.Tensor, centred, centred),
                                                             [-1], True), eps))
        y = op(aten.mul.Tensor, centred, rstd)
        y = op(aten.mul.Tensor, y, weight) if weight is not None else y
        y = op(aten.add.Tensor, y, bias) if bias is not None else y
        y = op(aten._to_copy.default, y, dtype=row.dtype) if row.dtype != torch.float32 else y
    norm.replace_all_uses_with(y)
    graph.erase_node(norm)
    return True


def _halves_as_slices(node: torch.fx.Node, shapes: dict) -> bool:
    """A product read only through `split` into two halves of its last dim (`chunk(2, -1)`: Phi-3's
    and GLM's merged gate and up) read through the two `slice`s those halves are, so that the
    rule for slices (`_equal_slices`) splits it too. True where the graph changed."""
    meta, users = shapes.get(node), list(node.users)
    if len(users) != 1 or not isinstance(meta, torch.Tensor) or not meta.dim() or not isinstance(meta.shape[-1], int):
        return False
    (split,), n = users, meta.shape[-1]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    sizes = split.args[1] if len(split.args) > 1 else None
    halves = ([sizes, sizes] if split.target is aten.split.Tensor else sizes) if isinstance(sizes, (int, list)) else None
    pieces = list(split.users)
    if (split.op != "call_function" or split.target not in (aten.split.Tensor, aten.split_with_sizes.default)
            or set(split.kwargs) - {"dim"} or dim not in (-1, meta.dim() - 1) or halves != [n // 2] * 2 or n % 2
            or not all(p.op == "call_function" and p.target is operator.getitem and p.args[1] in (0, 1, -2, -1)
                       for p in pieces)):
        return False
    graph = node.graph
    for piece in pieces:
        start = (n // 2) * (piece.args[1] in (1, -1))
        with graph.inserting_before(piece):
            part = graph.call_function(aten.slice.Tensor, (node, -1, start, start + n // 2))
        part.meta = dict(piece.meta)
        if piece in shapes:
            shapes[part] = shapes[piece]
        piece.replace_all_uses_with(part)
        graph.erase_node(piece)
    graph.erase_node(split)
    return True


def _equal_slices(node: torch.fx.Node, shapes: dict) -> list[tuple[torch.fx.Node, tuple[int, int]]] | None:
    """The users of `node` with the rows each reads, where they are two step-1 slices of the last
    dim of one width (SPLIT_EQUAL_SLICES); else None (and where the product's size is not known)."""
    meta = shapes.get(node)
    if not isinstance(meta, torch.Tensor) or not meta.dim() or not isinstance(meta.shape[-1], int):
        return None
    n = meta.shape[-1]
    parts = []
    for user in node.users:
        args = user.args
        start, end = (args[2], args[3]) if len(args) >= 4 else (None, None)
        if (user.op != "call_function" or user.target is not aten.slice.Tensor or user.kwargs
                or args[1] not in (-1, meta.dim() - 1) or not isinstance(start, int) or not isinstance(end, int)
                or not 0 <= start < min(end, n) or (len(args) > 4 and args[4] != 1)):
            return None
        parts.append((user, (start, min(end, n))))
    widths = {b - a for _, (a, b) in parts}
    return parts if len(parts) == 2 and len(widths) == 1 else None


def _realized(g: torch.fx.Graph, x: torch.fx.Node, meta: torch.Tensor | None) -> torch.fx.Node:
    """The row as a tensor in memory. Left to itself Inductor computes the ops that make the row
    inside the reduction, once per block of outputs: a down projection fused so with its SiLU and
    multiply took 15 µs on an H200 where the timed kernel, reading its row, took 9.3. A view
    Inductor cannot inline (`as_strided`, the row's own layout) makes it store the row first, in
    the kernel that computes it (a norm's, or one of its own). A row that is memory already (an
    input, a constant, a view of what a library kernel made, such as attention's output) is read
    as it is: marked too, the o projection took 15.7 µs instead of 4.4 in 7 of Llama-1B's 16
    layers. A row whose layout is not known is left as it is too."""
    if meta is None or meta.dim() == 0 or meta.stride(-1) != 1 or _in_memory(x):
        return x
    contiguous = [math.prod(meta.shape[d + 1:]) for d in range(meta.dim())]  # leading dims are 1: same addresses
    return g.call_function(aten.as_strided.default, (x, list(meta.shape), contiguous))


def _in_memory(x: torch.fx.Node) -> bool:
    """`x` is (a view or an element of) an input, a constant or the result of an op Inductor leaves
    to a library (no Inductor kernel computes it: GEMMs, convolutions, attention)."""
    x = view_base(x, through=lambda n: 0 if n.target is operator.getitem else None)
    return x.op != "call_function" or getattr(x.target, "_overloadpacket", None) in _LIBRARY


_LIBRARY = frozenset(getattr(aten, name) for name in (
    "mm", "bmm", "addmm", "baddbmm", "linear", "convolution", "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(aten, name)
) | {torch.ops.ferry.library_linear, SPLIT_KV_ATTENTION._overloadpacket}

"""The attention family. At compile time: `nn.MultiheadAttention`'s traced ops as eager's fused
inference op, and masks known at compile time dropped or made `is_causal`. At load: which kernels
run attention on CUDA in a plan captured as CUDA graphs: eager's fused ones, or GEMMs and a softmax.

In fp32 (flash attention takes half precision only) `scaled_dot_product_attention` runs the
memory-efficient kernel, which is slow at short sequences on an H200: ViT-B/16's 12 heads of 197
tokens take 28.9 µs there, q @ kᵀ, the softmax and @ v 18.7. With a causal mask, at 64 tokens or
at ViT's batch 4 the fused kernel is the faster (`bench/gemm_kernels.py`). The fused op of
`nn.MultiheadAttention` (`_native_multi_head_attention`) also runs its two projections as
`addmm`, whose kernels cuBLAS picks slowly at some shapes (choices/gemm.py). No rule of
shapes holds across GPUs, so each distinct attention is timed both ways when a method loads, on
the GPU it loads on, and the composed form is kept where it saves at least 10% and 2 µs
(choices/timing.py), by replaying graphs of each form on the plan's capture stream: a
stream leaves a gap after each launch that a replay does not (nn.MultiheadAttention at ViT-B/16's
batch 1, composed against fused: 84.7 against 90.7 µs on a stream, 74.1 against 89.1 replayed,
`bench/gemm_kernels.py`).

Only in plans captured as CUDA graphs: the composed forms launch three kernels for one
(attention) and up to eight for four (multi-head attention), and without graphs a small call
waits on the host's launches, not on the GPU. Only fp32 and fp64 (in half precision the scores
would be rounded before the softmax; with TF32 GEMMs allowed, fp64 only: eager's fp32 kernel is
more precise than one TF32 pass), without a mask, dropout or a causal mask; multi-head
attention only as self-attention, without its weights. Under deterministic algorithms eager's
kernels run.

A decode step's attention in half precision (a few query rows against a long KV cache, grouped
heads, a mask) has another form: ops/split_kv.py's two Triton kernels, which spread each KV head's
cache over the GPU where SDPA's give it one program. Timed against SDPA the same way, kept where it
saves 10% (on an H200, one layer of Llama-1B at a 1024-token cache: 4.5 against 6.2 µs; Qwen3-0.6B
5.0 against 7.3; bench/decode_attention.py). The torch backend asks `form`; the inductor backend
rewrites its graph before Inductor compiles it (`split_kv_rewrites`).
"""

from __future__ import annotations

import contextvars
import math
import operator
from collections.abc import Callable

import torch
import torch.fx

from ferry import node_meta as M
from ferry.choices import timing
from ferry.choices.decisions import DECISIONS, Decision, Site
from ferry.choices.gemm import biased_gemm, blas_settings
from ferry.choices.graph_edits import Rewrite, attr, call, constant_value, shape_at, size_at
from ferry.ops import split_kv
from ferry.ops.split_kv import SPLIT_KV_ATTENTION

__all__ = ["OPS", "PATTERNS", "SPLIT_KV_FORMS", "additive_masks", "composed_attention", "form", "grouped_heads",
           "split_kv_decision", "split_kv_rewrites"]

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
MHA = aten._native_multi_head_attention.default
OPS = frozenset({SDPA, MHA})
FORMS = ("fused", "GEMMs and a softmax")
_CHECK_ELEMENTS = 1 << 22  # the largest activation a numerical check materialises
# the symbols of sizes each call checks (names; aot/storage_reads.py `checked_sizes`), set while a
# program compiles; None (a graph rewritten outside ferry.compile): none is
CHECKED_SIZES: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("CHECKED_SIZES", default=None)
_MAX_BINDINGS = 512  # the most values of a mask's dynamic sizes it is computed at, at compile time
# what the traced ops of one nn.MultiheadAttention (self-attention, packed projections) may be
_MHA_OPS = frozenset({aten.linear.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
            aten.squeeze.dims, aten.squeeze.default, aten.clone.default, aten.select.int, aten.split.Tensor,
            aten.split_with_sizes.default, aten.unbind.int, aten.expand.default, aten.t.default,
            aten.mm.default, aten.addmm.default, SDPA, operator.getitem})
_MHA_CLASS = "torch.nn.modules.activation.MultiheadAttention"
_DTYPES = (torch.float32, torch.float64)
_MAX_SCORES = 1 << 24  # elements of q @ kᵀ (64 MiB in fp32): the composed form makes them a tensor


def composed_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`scaled_dot_product_attention` without a mask, dropout or grouped heads: one batched GEMM
    for the scores, scaled after it (eager's math scales q and k before: equal to rounding), a
    softmax, one batched GEMM for the result. For one sequence (batch 1) the scale is the GEMM's
    own (its alpha) and the result is written as eager's fused kernel lays it out, (batch,
    queries, heads, dim) in memory, so the transpose and reshape models make of it are views, not
    a copy (ViT-B/16's, timed at load: 18.1 µs against 19.9 before, bench/results/models_M.json)."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if q.shape[0] != 1:
        scores = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)
        return torch.matmul(torch.softmax(scores, -1), v)
    (_, h, t, d), s = q.shape, k.shape[2]
    scores = torch.baddbmm(q.new_empty(h, t, s), q[0], k[0].transpose(1, 2), beta=0, alpha=scale)
    out = q.new_empty(1, t, h, d).transpose(1, 2)
    torch.bmm(torch.softmax(scores, -1), v[0], out=out[0])
    return out


def form(op, args: list, kwargs: dict, site: Site) -> Callable | None:
    """The load-time hook (choices/hook.py): in a captured plan, the composed form of `op` where
    this GPU runs it faster than eager's fused kernel for arguments like these (real tensors, or
    meta tensors of the same shape, strides and dtype); otherwise None. Multi-head attention only
    as self-attention: query, key and value one value (the same object)."""
    if not site.captured:
        return None
    if op is SDPA:
        return _attention(args, kwargs, site) or _split_kv_form(args, kwargs, site)
    if op is MHA and len(args) >= 3 and args[0] is args[1] is args[2]:
        return _multi_head(args, kwargs, site)
    return None


def _attention(args, kwargs, site: Site) -> Callable | None:
    params = _sdpa_params(args, kwargs)
    q, k, v = (args + [None] * 3)[:3]
    tensors = (q, k, v)
    if params.get("attn_mask") is not None or params.get("dropout_p", 0.0) or params.get("is_causal", False):
        return None
    if params.get("enable_gqa", False) or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return None
    if q.dtype not in _DTYPES or len({t.dtype for t in tensors}) != 1 or k.shape != v.shape:
        return None
    if q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return None  # one-pass TF32 GEMMs: less precise than eager's fp32 kernel (3 x TF32 on sm80+)
    (b, h, t, d), s = q.shape, k.shape[2]
    if k.shape[:2] != (b, h) or k.shape[3] != d or b * h * t * s > _MAX_SCORES:
        return None
    device = timing.gpu_of(tensors, site.device)
    if device is None:
        return None
    scale = params.get("scale")
    key = ("attention", str(device), q.dtype, *blas_settings(), site.replays, scale,
           *((tuple(x.shape), x.stride()) for x in tensors))
    decision = DECISIONS.get(key, lambda: _decide_attention(device, tensors, scale, site), timing.may_time(site, device))
    return composed_attention if decision is not None and decision.taken else None


def _decide_attention(device, tensors, scale, site: Site) -> Decision | None:
    with timing.deciding(device, site):
        try:
            q, k, v = (timing.scratch(t, device) for t in tensors)
            times = timing.time_both(lambda: SDPA(q, k, v, scale=scale), lambda: composed_attention(q, k, v, scale=scale),
                                     site.replay_stream())
        except torch.cuda.OutOfMemoryError:  # eager's kernel stays; any other error is the caller's to see
            return None
    (b, h, t, d), s = q.shape, k.shape[2]
    return timing.decision("attention", str(SDPA.name()), f"{b}x{h}x{t}x{s}x{d}", device, q.dtype, FORMS, times)


# ---------------------------------------------------------------- load time: a decode step's attention

SPLIT_KV_FORMS = ("fused (SDPA)", "split-KV")


def _split_kv_form(args, kwargs, site: Site) -> Callable | None:
    """In a captured plan, `ferry::split_kv_attention` for an SDPA call it computes where this GPU
    runs it faster (choices/hook.py's form for the torch backend)."""
    decision = split_kv_decision(args, kwargs, site)
    return _split_kv_call if decision is not None and decision.taken else None


def _split_kv_call(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return SPLIT_KV_ATTENTION(q, k, v, attn_mask, _scale(q, scale))[0]


def _scale(q, scale) -> float:
    return float(scale) if scale is not None else q.shape[-1] ** -0.5


def split_kv_decision(args, kwargs, site: Site) -> Decision | None:
    """The timed choice between SDPA's fused kernels and ops/split_kv.py's for one SDPA call (its
    arguments real or meta tensors) in a plan captured as CUDA graphs, or None where split-KV does
    not compute it: dropout, a causal flag, grouped heads not declared (SDPA's own error stays),
    not on a GPU with Triton.
    Both forms launch two kernels, so split-KV is kept where it saves 10% (timing.py)."""
    params = _sdpa_params(args, kwargs)
    q, k, v = (list(args) + [None] * 3)[:3]
    mask = params.get("attn_mask")
    # uncaptured, its Python call and two launches would cost the host more than they save; the
    # inductor backend asks here directly, not through the hook, which checks determinism too
    if not site.captured or torch.are_deterministic_algorithms_enabled():
        return None
    if params.get("dropout_p", 0.0) or params.get("is_causal", False):
        return None
    if not split_kv.available():
        return None
    if not split_kv.fits(q, k, v, mask) or (q.shape[1] != k.shape[1] and not params.get("enable_gqa", False)):
        return None
    tensors = (q, k, v) + ((mask,) if mask is not None else ())
    device = timing.gpu_of(tensors, site.device)
    if device is None:
        return None
    scale = _scale(q, params.get("scale"))
    key = ("split-KV attention", str(device), site.replays, scale,
           *((tuple(x.shape), x.stride(), x.dtype) for x in tensors))
    return DECISIONS.get(key, lambda: _decide_split_kv(device, tensors, scale, site), timing.may_time(site, device))


def _decide_split_kv(device, tensors, scale, site: Site) -> Decision | None:
    with timing.deciding(device, site):
        try:
            q, k, v, *mask = (timing.scratch(t, device) for t in tensors)
            m = mask[0] if mask else None
            gqa = q.shape[1] != k.shape[1]
            times = timing.time_both(lambda: SDPA(q, k, v, m, scale=scale, enable_gqa=gqa),
                                     lambda: SPLIT_KV_ATTENTION(q, k, v, m, scale), site.replay_stream())
        except Exception:  # noqa: BLE001 - out of memory, or Triton could not build its kernels here: SDPA stays
            return None
    (b, h, t, d), (hkv, s) = q.shape, k.shape[1:3]
    return timing.decision("attention", str(SDPA.name()), f"{b}x{h}/{hkv}x{t}x{s}x{d}", device, q.dtype,
                           SPLIT_KV_FORMS, times, min_saving_us=0)


def split_kv_rewrites(gm: torch.fx.GraphModule, shapes: dict[torch.fx.Node, torch.Tensor], site: Site) -> list[Decision]:
    """The inductor backend's form of the same choice, at load, in a graph of static sizes: each
    SDPA call split-KV runs faster becomes `ferry::split_kv_attention` (Inductor calls it as a
    library kernel, the mask read as it is: Inductor's cuDNN lowering copied it once per call).
    `shapes`: a meta tensor per node, as the dry run made it. Returns the decisions."""
    made = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        args = [shapes.get(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
        kwargs = {n: shapes.get(a) if isinstance(a, torch.fx.Node) else a for n, a in node.kwargs.items()}
        decision = split_kv_decision(args, kwargs, site)
        if decision is None:
            continue
        made.append(decision)
        if not decision.taken:
            continue
        options = _sdpa_options(node)
        with gm.graph.inserting_before(node):
            both = gm.graph.call_function(SPLIT_KV_ATTENTION, (*node.args[:3], options.get("attn_mask"),
                                                               _scale(args[0], options.get("scale"))))
            out = gm.graph.call_function(operator.getitem, (both, 0))
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    if any(d.taken for d in made):
        gm.recompile()
    return made


_MHA_PARAMS = ("query", "key", "value", "embed_dim", "num_head", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias",
               "mask", "need_weights", "average_attn_weights", "mask_type")


def _multi_head(args, kwargs, site: Site) -> Callable | None:
    p = dict(zip(_MHA_PARAMS, args)) | kwargs
    x, e, heads = p.get("query"), p.get("embed_dim"), p.get("num_head")
    weights = [p.get(n) for n in ("qkv_weight", "qkv_bias", "proj_weight", "proj_bias")]
    if p.get("mask") is not None or p.get("need_weights", True) or not isinstance(x, torch.Tensor) or x.dim() != 3:
        return None
    if not all(isinstance(w, torch.Tensor) for w in weights) or not isinstance(heads, int) or heads < 1:
        return None
    b, t, width = x.shape
    expected = [(3 * e, e), (3 * e,), (e, e), (e,)]
    if width != e or e % heads or [tuple(w.shape) for w in weights] != expected:
        return None
    if x.dtype not in _DTYPES or any(w.dtype != x.dtype for w in weights) or b * heads * t * t > _MAX_SCORES:
        return None
    device = timing.gpu_of((x, *weights), site.device)
    if device is None:
        return None
    site = Site(device, site.measure, site.captured, site.streams)
    composed = _composed_multi_head(x, weights, heads, site)
    key = ("multi-head attention", str(device), x.dtype, *blas_settings(), site.replays, tuple(x.shape),
           x.stride(), heads, *(w.stride() for w in weights), composed.parts)
    decision = DECISIONS.get(key, lambda: _decide_multi_head(device, x, weights, heads, composed, site),
                             timing.may_time(site, device))
    return composed if decision is not None and decision.taken else None


def _composed_multi_head(x, weights, heads, site: Site):
    """Self-attention as its projections, each GEMM as gemm_choice measures it faster, and the
    attention as this module measures it faster; `.parts` says which were chosen."""
    (b, t, e), (w_in, b_in, w_out, b_out) = x.shape, weights
    rows = torch.empty((b * t, e), dtype=x.dtype, device="meta")
    qkv = torch.empty((b * t, 3 * e), dtype=x.dtype, device="meta")
    split_in = biased_gemm(b_in, rows, w_in.t(), qkv, site) is not None
    split_out = biased_gemm(b_out, rows, w_out.t(), rows, site) is not None
    q, k, v = _heads(qkv, b, t, heads)
    attend = _attention([q, k, v], {}, site) or SDPA
    project_in, project_out = _gemm(split_in), _gemm(split_out)

    def multi_head(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, *_, **__):
        n, length, width = query.shape
        qkv = project_in(qkv_bias, query.reshape(n * length, width), qkv_weight.t())
        y = attend(*_heads(qkv, n, length, num_head)).transpose(1, 2).reshape(n * length, width)
        return project_out(proj_bias, y, proj_weight.t()).view(n, length, width), None  # no weights, as eager's

    multi_head.parts = (split_in, attend is not SDPA, split_out)  # type: ignore[attr-defined]
    return multi_head


def _heads(qkv, batch, length, heads):
    """q, k and v of (batch, heads, length, head_dim), as views of the in-projection's rows."""
    width = qkv.shape[1] // 3
    return qkv.view(batch, length, 3, heads, width // heads).permute(2, 0, 3, 1, 4).unbind(0)


def _gemm(split: bool):
    if split:
        return lambda bias, mat1, mat2: torch.mm(mat1, mat2).add_(bias)
    return torch.addmm


def _decide_multi_head(device: torch.device, x, weights, heads, composed, site: Site) -> Decision | None:
    e = x.shape[2]
    with timing.deciding(device, site):
        try:
            q = timing.scratch(x, device)
            w = [timing.scratch(t, device) for t in weights]
            times = timing.time_both(lambda: MHA(q, q, q, e, heads, *w, need_weights=False),
                                     lambda: composed(q, q, q, e, heads, *w, need_weights=False),
                                     site.replay_stream())
        except torch.cuda.OutOfMemoryError:
            return None
    b, t = x.shape[:2]
    return timing.decision("multi-head attention", str(MHA.name()), f"{b}x{heads}x{t}x{t}x{e // heads}", device,
                           x.dtype, FORMS, times)


# ---------------------------------------------------------------- compile time


def fuse_attention(gm: torch.fx.GraphModule) -> list[Rewrite]:
    done = []
    for path, members in _attention_modules(gm).items():
        region = _attention_region(gm, members)
        if region is None or not _same_result(gm, members, region):
            continue
        x, weights, heads, out = region
        with gm.graph.inserting_before(out):
            fused = gm.graph.call_function(aten._native_multi_head_attention.default,
                                           (x, x, x, x.meta["val"].shape[2], heads, *weights),
                                           {"need_weights": False})
            first = gm.graph.call_function(operator.getitem, (fused, 0))
        val = out.meta["val"].new_empty(out.meta["val"].shape)  # the fused kernel's result is contiguous
        fused.meta.update({k: v for k, v in out.meta.items() if k != "val"})
        fused.meta["val"] = (val, val.new_empty((0,)))
        first.meta.update({k: v for k, v in out.meta.items() if k != "val"})
        first.meta["val"] = val
        out.replace_all_uses_with(first)
        for node in reversed(members):
            gm.graph.erase_node(node)
        done.append(Rewrite("attention", f"{path} ({len(members)} ops)"))
    return done


def _attention_modules(gm) -> dict[str, list[torch.fx.Node]]:
    """The call_function nodes of each call of an nn.MultiheadAttention (exactly that class: a
    subclass may do more), by the module stack's key for that call, in graph order."""
    found: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for key, (_path, kind) in (node.meta.get("nn_module_stack") or {}).items():
            name = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
            if name == _MHA_CLASS:
                found.setdefault(key, []).append(node)
                break
    return found


def _attention_region(gm, members):
    """(x, [in_w, in_b, out_w, out_b], heads, output node) when `members` is self-attention
    over one input with packed projections and no mask; None otherwise. The batch and the
    sequence may be dynamic (their sizes come in as symbolic inputs); the width and heads not."""
    if any(n.target not in _MHA_OPS for n in members):
        return None  # anything else is not what the fused kernel computes
    inside = set(members)
    inputs = []
    for n in members:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs and not _is_size(a):
                inputs.append(a)
    outs = [n for n in members if any(u not in inside for u in n.users)]
    sdpa = [n for n in members if n.target is SDPA]
    if len(outs) != 1 or len(sdpa) != 1 or len(inputs) != 5 or _has_mask_or_dropout(sdpa[0]):
        return None
    acts = [a for a in inputs if a.op != "get_attr"]
    if len(acts) != 1:
        return None
    x, out = acts[0], outs[0]
    xv, ov, q = x.meta.get("val"), out.meta.get("val"), sdpa[0].args[0].meta.get("val")
    if not (isinstance(xv, torch.Tensor) and isinstance(ov, torch.Tensor) and xv.dim() == 3):
        return None
    if not M.same_sizes(xv.shape, ov.shape) or type(xv.shape[2]) is not int:
        return None
    embed = xv.shape[2]
    shapes = {tuple(attr(gm, a).shape): a for a in inputs if a.op == "get_attr" and attr(gm, a) is not None}
    want = [(3 * embed, embed), (3 * embed,), (embed, embed), (embed,)]
    if any(s not in shapes for s in want):
        return None
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or type(q.shape[1]) is not int:
        return None
    return x, [shapes[s] for s in want], q.shape[1], out


def _is_size(node: torch.fx.Node) -> bool:
    """A size (a symbolic batch or length) the traced ops take as an input: not an activation."""
    return isinstance(node.meta.get("val"), (int, torch.SymInt))


def _has_mask_or_dropout(sdpa) -> bool:
    args = list(sdpa.args[3:]) + [sdpa.kwargs.get(k) for k in ("attn_mask", "dropout_p", "is_causal", "scale")]
    return any(a not in (None, 0, 0.0, False) for a in args)


def _same_result(gm, members, region) -> bool:
    """Run the traced ops and the fused op on one random input with the real weights: at the
    traced sizes, and where a size is dynamic also with the dynamic sizes one larger."""
    x = region[0]
    bindings = _check_bindings(x.meta["val"].shape)
    return bindings is not None and all(_same_at(gm, members, region, b) for b in bindings)


def _check_bindings(shape) -> list[dict] | None:
    """Values for the symbols of `shape`: the traced ones, and all of them one larger (a second
    sample: the ops' sizes are symbolic, so what differs with a size shows there); None where a
    size has no traced value."""
    symbols = _symbols(shape)
    if not symbols:
        return [{}]
    env = next(s.node.shape_env for s in shape if isinstance(s, torch.SymInt))
    hints = getattr(env, "backed_var_to_val", None) or env.var_to_val  # renamed after torch 2.11
    if any(sym not in hints for sym in symbols):
        return None
    traced = {sym: hints[sym] for sym in symbols}
    return [traced, {sym: v + 1 for sym, v in traced.items()}]


def _symbols(sizes) -> set:
    """The symbols the symbolic ones of `sizes` are expressions of."""
    return set().union(*(s.node.expr.free_symbols for s in sizes if isinstance(s, torch.SymInt)))


def _same_at(gm, members, region, binding: dict) -> bool:
    x, weights, heads, out = region
    xv = x.meta["val"]
    shape = shape_at(xv, binding)
    try:
        sizes = {a: size_at(a.meta["val"], binding) for n in members for a in n.all_input_nodes if _is_size(a)}
    except ValueError:
        return False
    if shape is None or math.prod(shape) > _CHECK_ELEMENTS or not xv.dtype.is_floating_point:
        return False
    values = {w: attr(gm, w).cpu() for w in weights} | sizes
    gen = torch.Generator().manual_seed(0)
    values[x] = torch.randn(shape, generator=gen).to(xv.dtype)
    try:
        with torch.no_grad():
            for n in members:
                args = torch.fx.node.map_arg(n.args, values.__getitem__)
                kwargs = torch.fx.node.map_arg(n.kwargs, values.__getitem__)
                values[n] = n.target(*args, **kwargs)
            fused = aten._native_multi_head_attention.default(values[x], values[x], values[x], shape[2], heads,
                                                              *(values[w] for w in weights), need_weights=False)[0]
    except Exception:  # noqa: BLE001 - an op the check cannot run here: keep the traced ops
        return False
    want = values[out]
    full = xv.dtype in (torch.float32, torch.float64)
    rtol, atol = (1e-4, 1e-5) if full else (2e-2, 2e-2)  # half precision rounds after every op
    return fused.shape == want.shape and torch.allclose(fused.float(), want.float(), rtol=rtol,
                                                        atol=atol * float(want.abs().max()) + 1e-6)


# ---------------------------------------------------------------- attention masks known at compile time

_SDPA_PARAMS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _sdpa_options(node: torch.fx.Node) -> dict:
    """An attention call's arguments after q, k and v, by name (given by position or keyword)."""
    return _sdpa_params(node.args, node.kwargs)


def _sdpa_params(args, kwargs: dict) -> dict:
    return {**dict(zip(_SDPA_PARAMS, args[3:])), **kwargs}


def simplify_attention_masks(gm: torch.fx.GraphModule) -> list[Rewrite]:
    done, known = [], {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        kwargs = _sdpa_options(node)
        mask, causal = kwargs.get("attn_mask"), bool(kwargs.get("is_causal"))
        if not isinstance(mask, torch.fx.Node):
            continue
        # every layer reads the one mask: evaluated once per (mask, q and k shapes), not per layer
        key = (mask, causal, str([getattr(a.meta.get("val"), "shape", a) if isinstance(a, torch.fx.Node) else a
                                  for a in node.args[:2]]))
        if key not in known:
            known[key] = _known_mask(gm, node, mask, causal)
        kind = known[key]
        if kind is None:
            continue
        if kind == "mask causal":
            kwargs["is_causal"] = True
        kwargs["attn_mask"] = None
        node.args, node.kwargs = tuple(node.args[:3]), kwargs
        done.append(Rewrite(kind, node.name))
    return done


def _known_mask(gm, sdpa: torch.fx.Node, mask: torch.fx.Node, causal: bool) -> str | None:
    """"mask dropped" where the boolean `mask`, computed from constants, is all true, "mask
    causal" where it is lower-triangular (and the call not causal already), at every size the
    call may have: a dynamic size at each of its values (at most _MAX_BINDINGS in all, else None)."""
    q, k = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in sdpa.args[:2])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        return None
    bindings = _every_binding([q, k, *_ancestors(mask)])
    if not bindings:
        return None
    kinds = {"mask dropped", "mask causal"}  # those that hold at every size so far
    for binding in bindings:
        value = constant_value(gm, mask, {}, binding)
        qs, ks = shape_at(q, binding), shape_at(k, binding)
        if value is None or qs is None or ks is None or value.dtype != torch.bool or not _mask_fits(value, qs, ks):
            return None
        if not bool(value.all()):
            kinds.discard("mask dropped")  # a 1 x 1 mask is both: causal over lengths that vary
        if causal or not _is_causal(value, qs, ks):
            kinds.discard("mask causal")
        if not kinds:
            return None
    return "mask dropped" if "mask dropped" in kinds else "mask causal"


def _ancestors(node: torch.fx.Node) -> list:
    """The values of `node` and of every node it is computed from."""
    seen, todo = {node}, [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return [n.meta.get("val") for n in seen]


def _every_binding(values) -> list[dict] | None:
    """Every assignment of the sizes the symbolic `values` (tensors, sizes) depend on, each from 0
    to its upper bound (a call may pass any size up to the bound, below the exported minimum
    too); [{}] where none is symbolic; None where one is unbounded, is not a size each call
    checks (`CHECKED_SIZES`: an int input alone, or a size met only in an expression such as
    2*s, may be called outside 0..bound), or there would be more than _MAX_BINDINGS."""
    sizes = [s for v in values for s in (v.shape if isinstance(v, torch.Tensor) else (v,))
             if isinstance(s, torch.SymInt)]
    bindings: list[dict] = [{}]
    for sym in sorted(_symbols(sizes), key=str):
        checked = str(sym) in (CHECKED_SIZES.get() or ())  # else a call may bring a value outside 0..bound
        ranges = sizes[0].node.shape_env.var_to_range.get(sym) if checked else None
        upper = ranges.upper if ranges is not None and ranges.upper.is_Integer else None  # not int_oo
        if upper is None or len(bindings) * (int(upper) + 1) > _MAX_BINDINGS:
            return None
        bindings = [b | {sym: v} for b in bindings for v in range(int(upper) + 1)]
    return bindings


def _is_causal(mask: torch.Tensor, q: tuple, k: tuple) -> bool:
    rows, cols = q[-2], k[-2]
    if rows != cols or mask.dim() < 2 or tuple(mask.shape[-2:]) != (rows, cols):
        return False
    return bool((mask == torch.ones(rows, cols, dtype=torch.bool).tril()).all())


def _mask_fits(mask: torch.Tensor, qs: tuple, ks: tuple) -> bool:
    """`mask` broadcasts to the attention weights' shape (q and k of shapes `qs`, `ks`) without
    growing it (else eager raises, and so must ferry)."""
    if mask.dim() > len(qs):
        return False
    weights = (*qs[:-1], ks[-2])
    try:
        return torch.broadcast_shapes(tuple(mask.shape), weights) == weights
    except RuntimeError:
        return False


def additive_masks(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """A boolean mask read by several attention calls -> one additive mask (0 where it attends,
    -inf elsewhere, in the query's dtype), made once and read by all of them. ATen turns a
    boolean mask into exactly that inside every call, so a decoder's shared causal mask cost a
    kernel per layer (Llama-1B's decode step on an H200: 16 of about 1 µs, each recomputing the
    mask). The results are the same bits: the kernels see the same bias either way."""
    users: dict[tuple[torch.fx.Node, torch.dtype], list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = _sdpa_options(node).get("attn_mask")
        mval = mask.meta.get("val") if isinstance(mask, torch.fx.Node) else None
        q = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if (isinstance(mask, torch.fx.Node) and isinstance(mval, torch.Tensor) and mval.dtype == torch.bool
                and isinstance(q, torch.Tensor) and q.dtype.is_floating_point):
            users.setdefault((mask, q.dtype), []).append(node)
    done = []
    for (mask, dtype), calls in users.items():
        if len(calls) < 2:
            continue  # one call: the same one conversion either way
        val = mask.meta["val"]
        with gm.graph.inserting_after(mask):  # no constants: only ops of the step itself
            bias = call(gm, mask, aten.where.Scalar, (mask, 0.0, -math.inf), val.new_empty(val.shape, dtype=torch.float32))
        if dtype != torch.float32:
            with gm.graph.inserting_after(bias):
                bias = call(gm, mask, aten._to_copy.default, (bias,), val.new_empty(val.shape, dtype=dtype),
                            {"dtype": dtype})
        for node in calls:
            node.args, node.kwargs = tuple(node.args[:3]), {**_sdpa_options(node), "attn_mask": bias}
            done.append(Rewrite("additive mask", node.name))
    return done


# ---------------------------------------------------------------- compile time: grouped KV heads


_REPEATED = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def grouped_heads(gm: torch.fx.GraphModule) -> list[Rewrite]:
    """`sdpa(q, repeat_kv(k), repeat_kv(v))` -> `sdpa(q, k, v, enable_gqa=True)`: transformers'
    export repeats each KV head for its group of query heads (unsqueeze, expand, a copy of the
    whole cache, view), twice per layer and step; SDPA reads the grouped heads itself, the same
    arithmetic without the copies (an H200, one decode step of Llama-3.2-1B's 32/8 heads in bf16:
    23.6 against 10.7 µs a layer at a 1024-token cache, 57.3 against 12.7 at 4096;
    bench/decode_attention.py)."""
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA or len(node.args) < 3:
            continue
        if node.kwargs.get("enable_gqa", False):  # (scale and enable_gqa are keyword-only)
            continue
        q = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        k, v = (_repeated_heads(a) for a in node.args[1:3])
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or k is None or v is None or k[1] != v[1]:
            continue
        node.args = (node.args[0], k[0], v[0], *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        done.append(Rewrite("grouped heads", node.name))
    return done


def _repeated_heads(node) -> tuple[torch.fx.Node, int] | None:
    """(k, repeats) where `node` is k [b, h, n, d] with each head repeated `repeats` times in
    place (unsqueeze at 2, expand, a contiguous copy, a view to [b, h * repeats, n, d])."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _REPEATED):
        return None
    src = node.args[0]
    if isinstance(src, torch.fx.Node) and src.target is aten.clone.default:
        src = src.args[0]
    if not (isinstance(src, torch.fx.Node) and src.target is aten.expand.default):
        return None
    unsq = src.args[0]
    if not (isinstance(unsq, torch.fx.Node) and unsq.target is aten.unsqueeze.default and unsq.args[1] == 2):
        return None
    k = unsq.args[0]
    kv, out, expanded = (n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (k, node, src))
    if not (isinstance(k, torch.fx.Node) and isinstance(kv, torch.Tensor) and isinstance(out, torch.Tensor)
            and isinstance(expanded, torch.Tensor)) or kv.dim() != 4:
        return None
    b, h, n, d = kv.shape  # the batch and the length may be symbolic; heads and repeats not
    ex, repeats = expanded.shape, expanded.shape[2] if expanded.dim() == 5 else None
    if type(repeats) is not int or type(h) is not int:
        return None
    if not (M.same_sizes(ex, (b, h, repeats, n, d)) and M.same_sizes(out.shape, (b, h * repeats, n, d))):
        return None
    return k, repeats


PATTERNS = (fuse_attention, simplify_attention_masks, grouped_heads, additive_masks)

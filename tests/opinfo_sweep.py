"""PyTorch's OpInfo database run through ferry and compared with eager PyTorch.

One *case* is (op, sample, placement). For every OpInfo op with float32 support, the first few
samples of ``op.sample_inputs("cpu", torch.float32)`` are turned into a module whose forward
takes every tensor of the sample (input, args and kwargs, tensors inside lists included) and
calls ``op.op`` with the other values baked in; its tensor outputs are returned flattened. The
module is exported (``torch.export``, non-strict), compiled by ferry for a placement, saved,
loaded with ``ferry.Module`` and called twice, on the sample's tensors and on fresh ones, each
call compared with eager PyTorch on the same inputs (outputs, and the inputs afterwards, so an
op that writes an input must write it the same way). Where export allows, the module is also
exported with a bounded dynamic dim (dim 0 of the first input where it can) and called at the
sample's size, a smaller one (the inputs narrowed, then copied to memory of their own) and the
sample's again.

Placements: ``cpu`` (no partitioner), ``emu`` (every op ferry can place on emu:0, with inputs and
outputs left there: skip_h2d/skip_d2h), ``emu_op`` (the op on emu:0, inputs and outputs on the
CPU, copies inserted) and ``cuda_op`` (as emu_op on cuda:0, against eager on cuda:0).

Outcomes of one case (`Outcome.status`):

- ``equal``: every call matched eager (``random`` set: only shape, dtype and device compared,
  for ops whose eager result changes with the seed or reads uninitialised memory);
- ``refused``: ``ferry.compile`` raised a CompileError (or another FerryError, except
  InternalError); ``names_op`` says whether the message names the op;
- ``input refused``: a call raised one of the InputErrors ferry documents for inputs it cannot
  read as eager does (`DOCUMENTED_INPUT_REFUSALS`: a view into a larger storage read by
  `as_strided` with a storage offset);
- ``wrong`` / ``run-time error``: FAILURES: a mismatch, or any other exception at compile,
  save, load or a call; a wrong result's message says whether torch.export's own module
  (``ep.module()``) agrees with eager or with ferry;
- skipped, no fault of ferry: ``eager error``, ``not exportable``, ``no tensor output``,
  ``no samples``; for the dynamic variant also ``no dynamic variant``;
- ``crashed`` / ``timeout``: only from opinfo_report.py's worker processes.

`run_op(op, placement)` gives the outcomes of one op for one placement; `Sweep` caches the
per-sample work (eager references, exports) shared by the placements of one op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from itertools import islice

import torch
from torch.utils import _pytree as pytree

import ferry
from ferry.runtime import clone_to, device_of, emulated_device, get_allocator

PLACEMENTS = ("cpu", "emu", "emu_op", "emu_inductor", "cuda_op", "cuda_inductor")
CPU_PLACEMENTS = ("cpu", "emu", "emu_op")
DEVICE_IO = ("emu", "emu_inductor")  # inputs and outputs stay on the device (skip_h2d / skip_d2h)
DEFAULT_SAMPLES = 2
RTOL, ATOL = 1e-4, 1e-5

FAILURES = ("wrong", "run-time error", "crashed", "timeout")
# InputErrors a call may raise by design (README, "Correctness"): an `as_strided` with a storage offset
# over a caller's view into a larger storage, which ferry cannot read as eager does
DOCUMENTED_INPUT_REFUSALS = ("is read through its storage",)
SKIPS = ("eager error", "not exportable", "no tensor output", "no samples", "no dynamic variant")

# ops whose output is memory nobody wrote: compared on shape, dtype and device only
_UNINITIALISED = {
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted", "resize_", "resize",
    "resize_as_", "resize_as",
}

# ops the CI subset always runs: known to be tricky for a compiler of export programs
TRICKY = (
    "as_strided", "as_strided_copy", "as_strided_scatter", "slice_scatter", "select_scatter", "diagonal_scatter",
    "type_as", "cat", "stack", "split", "meshgrid", "unsafe_split", "gradient", "native_batch_norm",
    "nn.functional.multi_head_attention_forward", "index_put", "index_copy", "narrow_copy", "item", "histogramdd",
    "to_sparse", "expand_as", "contiguous", "reshape", "view_as",
)


# ---------------------------------------------------------------------------------------------
# the database


def op_id(op) -> str:
    """'name' or 'name.variant' ('max.reduction_with_dim'): unique in op_db."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


class InplaceVariant:
    """An op's in-place variant (`x.add_(y)` for `add`) as an op of the sweep: the op's samples,
    its in-place function called on them (the first input written, as the caller's tensor).
    Its id is the op's with `.inplace` ("add.inplace")."""

    def __init__(self, op):
        self.base, self.op = op, op.inplace_variant
        self.variant_test_name = f"{op.variant_test_name}.inplace" if op.variant_test_name else "inplace"

    def __getattr__(self, name):
        return getattr(self.base, name)


def float32_ops(dtype: torch.dtype = torch.float32) -> list:
    """Every OpInfo op that supports `dtype` (float32 unless asked) on the CPU, and the in-place
    variant of each that has one, sorted by op_id."""
    from torch.testing._internal.common_methods_invocations import op_db

    _thaw_backend_flags()
    with quiet():
        ops = [op for op in op_db if dtype in op.supported_dtypes("cpu")]
    ops += [InplaceVariant(op) for op in ops if op.inplace_variant is not None]
    return sorted(ops, key=op_id)


def _thaw_backend_flags() -> None:
    """Importing PyTorch's test internals freezes torch.backends' flags (its own tests set them
    only inside context managers); the rest of this suite sets them directly (TF32 off, say)."""
    # (torch.backends is a module wrapper: the flag lives in its functions' globals)
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True


def ops_by_id(dtype: torch.dtype = torch.float32) -> dict:
    return {op_id(op): op for op in float32_ops(dtype)}


def ci_subset(ids: list[str], every: int, offset: int = 0) -> list[str]:
    """Every `every`-th op id of the sorted list (from `offset`) plus the TRICKY ones (any
    variant of a tricky name), in sorted order. Fixed: depends only on the database."""
    ids = sorted(ids)
    chosen = set(ids[offset::every])
    chosen |= {i for i in ids if _base(i) in TRICKY}
    return [i for i in ids if i in chosen]


def _base(op_id_: str) -> str:
    """The op name of an op id: 'max.reduction_with_dim' -> 'max' (names with dots: longest TRICKY prefix)."""
    for name in sorted(TRICKY, key=len, reverse=True):
        if op_id_ == name or op_id_.startswith(name + "."):
            return name
    return op_id_


# ---------------------------------------------------------------------------------------------
# outcomes


@dataclass
class Outcome:
    op: str
    sample: int  # -1: the op as a whole (no samples)
    placement: str
    variant: str  # "static" or "dynamic"
    status: str
    message: str = ""
    names_op: bool | None = None  # refused only: does the message name the op
    random: bool = False  # compared on shape, dtype and device only
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status in FAILURES or (self.status == "refused" and not self.names_op)

    def describe(self) -> str:
        what = f"{self.op} sample {self.sample} [{self.placement}, {self.variant}]: {self.status}"
        if self.random:
            what += " (random: shape, dtype and device only)"
        if self.status == "refused" and not self.names_op:
            what += " (the message does not name the op)"
        return f"{what}\n    {self.message}" if self.message else what

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def first_line(message: str) -> str:
    lines = [line for line in str(message).strip().splitlines() if line.strip()]
    return lines[0].strip() if lines else ""


def _error(where: str, e: BaseException) -> str:
    """'where: Type: message' with the innermost frames of the traceback, trimmed."""
    tb = traceback.extract_tb(e.__traceback__)
    frames = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(tb[-3:]))
    text = str(e).strip()
    if len(text) > 1500:
        text = text[:1500] + " ..."
    return f"{where}: {type(e).__name__}: {text}" + (f"\n    at {frames}" if frames else "")


def names_op(message: str, names) -> bool:
    """Does `message` name one of `names` as an op: quoted ('histogramdd', node 'argwhere'), or as
    an ATen op whose name has it as its underscore-separated words (aten::histogramdd.default,
    aten._native_batch_norm_legit_functional for native_batch_norm)? A bare word does not count:
    "keep ops like nonzero/unique out of the program" is advice, not the op that failed."""
    for name in names:
        if not name:
            continue
        n = re.escape(name)
        if re.search(rf"['\"`]{n}['\"`]|aten(?:::|\.)(?:\w*_)?{n}(?:_\w*)?(?![A-Za-z0-9_])", message):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# helpers


@contextlib.contextmanager
def quiet():
    """No warnings and no log records below ERROR for the block (torch's structured trace logs
    at DEBUG to the root logger, which pytest would capture and print with every failure)."""
    previous = logging.root.manager.disable
    trace = logging.getLogger("torch.__trace")  # logs at DEBUG whatever logging.disable says
    was_disabled = trace.disabled
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(max(previous, logging.WARNING))
        trace.disabled = True
        try:
            yield
        finally:
            logging.disable(previous)
            trace.disabled = was_disabled


@contextlib.contextmanager
def emu_registered():
    """The emulated device 'emu' (emu:0, emu:1) for the block, unless one is registered already."""
    if get_allocator("emu") is not None:
        yield
    else:
        with emulated_device(num_devices=2):
            yield


@contextlib.contextmanager
def full_fp32():
    """No TF32 on the GPU for the block (cudnn's flags through its context manager: importing
    torch.testing._internal freezes them otherwise)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    cudnn = torch.backends.cudnn
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                         allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def twin(t: torch.Tensor, device=None) -> torch.Tensor:
    """A copy of `t` with its own memory and the same sizes, strides and storage offset (an
    expanded or transposed input stays one), on `device` (default: t's)."""
    device = t.device if device is None else torch.device(device)
    if t.layout != torch.strided:
        return t.clone().to(device)
    storage = t.untyped_storage()
    new = torch.empty(0, dtype=t.dtype, device=device)
    copy = torch.UntypedStorage(storage.nbytes(), device=device)
    copy.copy_(storage)
    new.set_(copy, t.storage_offset(), t.size(), t.stride())
    return new


def twins(tensors, device=None) -> list[torch.Tensor]:
    return [twin(t, device) for t in tensors]


def poisoned(t: torch.Tensor) -> torch.Tensor:
    """As twin(t), but every byte of the storage outside t's own elements is 0xFF (NaN, -1)."""
    if t.layout != torch.strided:
        return twin(t)
    storage = torch.UntypedStorage(t.untyped_storage().nbytes(), device=t.device)
    torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage).fill_(255)
    new = torch.empty(0, dtype=t.dtype, device=t.device)
    new.set_(storage, t.storage_offset(), t.size(), t.stride())
    try:
        new.copy_(t)
    except RuntimeError:  # overlapping elements (an expanded input): no check
        return twin(t)
    return new


def reads_outside(module, inputs) -> bool:
    """Does eager read memory outside its inputs' elements (an index past a narrowed dim, say)?
    Compares eager on twins with eager on poisoned twins."""
    outs, after = eager(module, inputs)
    args = [poisoned(t) for t in inputs]
    torch.manual_seed(0)
    outs2 = [to_host(o) for o in module(*args)]
    return differ(outs, outs2)


def indexes_past(inputs) -> bool:
    """Does an integer input hold an index at least as large as the smallest dim of a floating one?"""
    floats = [t for t in inputs if t.is_floating_point() and t.dim()]
    ints = [t for t in inputs if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool and t.numel()]
    if not floats or not ints:
        return False
    return max(int(t.max()) for t in ints) >= min(min(t.shape) for t in floats)


def tensor_leaves(value) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor with t's values, wherever t lives (cuda, emu or cpu)."""
    if t.device.type != "cpu":
        return t.detach().cpu()
    dev = device_of(t)
    return t if dev.is_cpu else clone_to(t, "cpu")


def perturbed(tensors, seed: int) -> list[torch.Tensor]:
    """Fresh inputs: floating and complex tensors moved a little (t + 0.01 randn), so values stay
    in the op's domain; integer and bool tensors (often indices and masks) kept."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            noise = torch.randn(t.shape, generator=g, dtype=t.dtype)
            out.append(t + 0.01 * noise)
        else:
            out.append(t)
    return out


# ---------------------------------------------------------------------------------------------
# the module of one sample


class OpModule(torch.nn.Module):
    """forward(*tensors): op.op(input, *args, **kwargs) with the sample's tensors replaced by the
    forward inputs, in pytree order; returns the tensor leaves of the result."""

    def __init__(self, fn, leaves, spec, positions):
        super().__init__()
        self.fn, self.leaves, self.spec, self.positions = fn, leaves, spec, positions

    def forward(self, *tensors):
        leaves = list(self.leaves)
        for pos, t in zip(self.positions, tensors):
            leaves[pos] = t
        inp, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return tuple(tensor_leaves(self.fn(inp, *args, **kwargs)))


def op_module(op, sample) -> tuple[OpModule, list[torch.Tensor]]:
    leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i] for i in positions]
    for i in positions:
        leaves[i] = None  # the module holds no sample tensor
    return OpModule(op.op, leaves, spec, positions), tensors


# ---------------------------------------------------------------------------------------------
# eager references


@dataclass
class Call:
    """One call: its inputs (never written) and eager's outputs and inputs after the call."""

    name: str
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor] | None = None
    after: list[torch.Tensor] | None = None
    random: bool = False  # eager's result depends on the seed or on uninitialised memory


def reference(module, name, inputs, device, randomness) -> Call:
    """The eager Call on `inputs` (on `device`); `randomness` (see Randomness) decides `random`."""
    outs, after = eager(module, inputs, device)
    return Call(name, list(inputs), outs, after, randomness.of(module, inputs, device, outs, after))


def eager(module, inputs, device="cpu", seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(outputs, inputs after the call), as host tensors: the module on twins of `inputs` on `device`."""
    args = twins(inputs, device)
    torch.manual_seed(seed)
    outs = module(*args)
    return [to_host(o) for o in outs], [to_host(a) for a in args]


def differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    if len(a) != len(b):
        return True
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return True
        try:
            torch.testing.assert_close(x, y, equal_nan=True, rtol=0, atol=0)
        except AssertionError:
            return True
    return False


@dataclass
class Randomness:
    """Which calls are compared on shape, dtype and device only.

    A call is random when eager's result (seed 0) changes under other seeds (with the memory just
    freed filled with NaN in between, so a read of uninitialised memory shows too), or when an
    output of the exported graph comes straight from a seeded-random or an empty op. Seeds 1..3
    are tried when the graph has a seeded-random op anywhere (its effect on the result may be
    rare), seed 1 otherwise. With a seeded-random op, a call is random too when torch.export's own
    module (ep.module()) gives different results under two seeds: the program ferry compiles may
    draw its random numbers in another order than eager does (a dropout eager skips, say)."""

    outputs_random: bool = False  # an output straight from a seeded-random or empty op
    has_random_op: bool = False  # a seeded-random op anywhere in the graph
    ep: object = None  # the exported program: with a random op, its own module is asked too

    @classmethod
    def of_graph(cls, ep) -> Randomness:
        def random_op(node):
            t = node.target
            return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and (
                torch.Tag.nondeterministic_seeded in t.tags)

        def uninit(node):
            return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and (
                node.target._opname in _UNINITIALISED)

        out = next(n for n in ep.graph.nodes if n.op == "output")
        outs = [n for n in pytree.tree_leaves(out.args) if isinstance(n, torch.fx.Node)]
        return cls(any(random_op(n) or uninit(n) for n in outs), any(random_op(n) for n in ep.graph.nodes), ep)

    def of(self, module, inputs, device, outs, after) -> bool:
        if self.outputs_random:
            return True
        try:
            for seed in (1, 2, 3) if self.has_random_op else (1,):
                for o in outs:  # dirty what the allocator hands out next
                    if o.is_floating_point() and o.numel():
                        junk = torch.full(o.shape, float("nan"), dtype=o.dtype, device=device)
                        del junk
                outs2, after2 = eager(module, inputs, device, seed=seed)
                if differ(outs, outs2) or differ(after, after2):
                    return True
            if self.has_random_op and self.ep is not None:
                exported = self.ep.module()
                runs = []
                for seed in (0, 1, 2, 3):
                    torch.manual_seed(seed)
                    runs.append([to_host(o) for o in tensor_leaves(exported(*twins(inputs)))])
                if any(differ(runs[0], r) for r in runs[1:]):
                    return True
        except Exception:
            return True  # eager fails under another seed: its result is the seed's
        return False


def graph_op_names(ep) -> set[str]:
    """The ATen op names of the exported graph ('histogramdd', '_histogramdd_bin_edges')."""
    names = set()
    for n in ep.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            names.add(n.target._opname)
    return names


# ---------------------------------------------------------------------------------------------
# dynamic sizes


@dataclass
class Dynamic:
    ep: object
    calls: list[Call]  # large, small, large again


def _sym(value):
    return value.node.expr if isinstance(value, torch.SymInt) else None


def dynamic_variant(module, tensors) -> tuple[object, list[list[torch.Tensor]]] | str:
    """(exported program with one input dim dynamic, [large, small, large] inputs), or why there is
    none. The dim: dim 0 of the first tensor input whose dim 0 is at least 3, else the first dim of
    at least 3 of any input. Tries: that dim alone; every dim of any input with the same size as
    it (Dim.AUTO with bounds: export finds which are tied); the same with one named Dim."""
    dense = [i for i, t in enumerate(tensors) if t.dim() >= 1 and t.layout == torch.strided]
    if not dense:
        return "no tensor input with a dim"
    pick = next(((i, 0) for i in dense if tensors[i].shape[0] >= 3), None)
    if pick is None:
        pick = next(((i, d) for i in dense for d in range(tensors[i].dim()) if tensors[i].shape[d] >= 3), None)
    if pick is None:
        return "every dim of every input is < 3: too small to shrink"
    first, fdim = pick
    size = tensors[first].shape[fdim]
    auto = torch.export.Dim.AUTO(min=2, max=size)
    named = torch.export.Dim("d0", min=2, max=size)

    def spec(dim, everywhere):
        specs = []
        for i, t in enumerate(tensors):
            if everywhere and t.layout == torch.strided:
                ds = {d: dim for d in range(t.dim()) if t.shape[d] == size}
                specs.append(ds or None)
            elif i == first:
                specs.append({fdim: dim})
            else:
                specs.append(None)
        return (tuple(specs),)

    errors = []
    for dim, everywhere in ((auto, False), (auto, True), (named, True)):
        try:
            with quiet():
                ep = torch.export.export(module, tuple(tensors), dynamic_shapes=spec(dim, everywhere), strict=False)
        except Exception as e:
            errors.append(first_line(f"{type(e).__name__}: {e}"))
            continue
        inputs = _resized(ep, tensors, first, fdim)
        if isinstance(inputs, str):
            errors.append(inputs)
            continue
        return ep, inputs
    return "no dynamic export: " + "; ".join(dict.fromkeys(errors))


def _resized(ep, tensors, first, fdim):
    """[large, small, large] inputs for `ep`, whose input `first` has a symbolic dim `fdim`: every
    input dim whose size is an expression of that symbol is narrowed to match the small size."""
    vals = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"
            and n.name in ep.graph_signature.user_inputs]
    if len(vals) != len(tensors):
        return "export changed the inputs"
    s0 = _sym(vals[first].shape[fdim])
    if s0 is None or not s0.is_Symbol:
        return f"export kept dim {fdim} of input {first} static (specialized)"
    known = {}
    for v, t in zip(vals, tensors):
        for d, sz in enumerate(getattr(v, "shape", ())):
            e = _sym(sz)
            if e is not None and e.is_Symbol:
                known[e] = t.shape[d]
    lower = 2
    vr = ep.range_constraints.get(s0)
    if vr is not None:
        lower = max(lower, int(vr.lower))
    large = tensors[first].shape[fdim]
    exported = ep.module()
    why = f"dim {fdim} of input {first} cannot shrink below {large} (range {vr})"
    for small in range(max(lower, large // 2), large):
        small_inputs = _narrowed(vals, tensors, s0, known, small)
        if isinstance(small_inputs, str):
            why = small_inputs
            continue
        try:  # torch.export's module checks the guards export added (s0 >= s1, 25 * s0 - 75 >= 2, ...)
            with quiet():
                exported(*twins(small_inputs))
        except Exception as e:
            why = f"no smaller size passes the exported program's checks: {first_line(f'{type(e).__name__}: {e}')}"
            continue
        return [list(tensors), small_inputs, list(tensors)]
    return why


def _narrowed(vals, tensors, s0, known, small):
    """The inputs with every dim whose size is an expression of `s0` narrowed to its value at s0 = small."""
    small_inputs = []
    for v, t in zip(vals, tensors):
        x = t
        for d, sz in enumerate(getattr(v, "shape", ())):
            e = _sym(sz)
            if e is None or s0 not in e.free_symbols:
                continue
            n = int(e.subs({**known, s0: small}))
            if not 0 <= n <= t.shape[d]:
                return f"a dim of size {e} would be {n} at the small size"
            x = x.narrow(d, 0, n)
        small_inputs.append(x)
    return small_inputs


# ---------------------------------------------------------------------------------------------
# one sample, prepared once for every placement


@dataclass
class Prepared:
    op: str
    index: int
    status: str | None = None  # a skip for every placement ('eager error', 'not exportable', ...)
    message: str = ""
    module: OpModule | None = None
    calls: list[Call] = field(default_factory=list)  # sample, fresh (CPU eager)
    randomness: Randomness = field(default_factory=Randomness)
    ep: object = None
    names: set = field(default_factory=set)  # op names a refusal may name
    dynamic: Dynamic | None = None
    no_dynamic: str = ""


def prepare(op, index: int, sample) -> Prepared:
    name = op_id(op)
    prep = Prepared(name, index, names={op.aten_name, op.name.split(".")[-1], op.name})
    torch.manual_seed(1000 + index)
    try:
        module, tensors = op_module(op, sample)
    except Exception as e:
        prep.status, prep.message = "eager error", _error("building the module", e)
        return prep
    prep.module = module
    try:
        outs, after = eager(module, tensors)
    except Exception as e:
        prep.status, prep.message = "eager error", _error("eager", e)
        return prep
    if not outs:
        prep.status = "no tensor output"
        return prep
    try:
        with quiet():
            prep.ep = torch.export.export(module, tuple(tensors), strict=False)
    except Exception as e:
        prep.status, prep.message = "not exportable", _error("torch.export", e)
        return prep
    prep.names |= graph_op_names(prep.ep)
    prep.randomness = rnd = Randomness.of_graph(prep.ep)
    calls = [reference(module, "sample", tensors, "cpu", rnd)]
    fresh = perturbed(tensors, 2000 + index)
    try:
        calls.append(reference(module, "fresh", fresh, "cpu", rnd))
    except Exception:
        calls.append(dataclasses.replace(calls[0], name="fresh (eager refused fresh inputs: the sample again)"))
    prep.calls = calls
    found = dynamic_variant(module, tensors)
    if isinstance(found, str):
        prep.no_dynamic = found
    else:
        dep, inputs = found
        dcalls = []
        for label, xs in zip(("large", "small", "large again"), inputs):
            try:
                views, xs = xs, [x.clone() for x in xs] if label == "small" else xs  # the small inputs own their memory
                dcalls.append(reference(module, label, xs, "cpu", rnd))
                if label == "small" and not dcalls[-1].random and reads_outside(module, views):
                    prep.no_dynamic = ("at the small size eager reads memory outside its inputs (an index tensor of the "
                                       "sample points past the narrowed dim): not a call the program must support")
                    break
                if label == "small" and name.startswith("_unsafe") and indexes_past(xs):
                    prep.no_dynamic = ("at the small size an index of the sample points past the narrowed dim, which an "
                                       "_unsafe op does not check (eager's CPU kernel clamps it, compiled code "
                                       "reads past the tensor): not a call the program must support")
                    break
            except Exception as e:
                prep.no_dynamic = _error(f"eager at the {label} size", e)
                break
        else:
            prep.dynamic = Dynamic(dep, dcalls)
    return prep


def prepare_op(op, samples: int = DEFAULT_SAMPLES, dtype: torch.dtype = torch.float32) -> list[Prepared] | Outcome:
    """The first `samples` samples of `op` in `dtype`, prepared; or an Outcome saying why there are none."""
    name = op_id(op)
    torch.manual_seed(0)
    try:
        with quiet():
            gen = op.sample_inputs("cpu", dtype)
            got = list(islice(gen, samples))
            if hasattr(gen, "close"):
                gen.close()  # now, not when collected in the middle of a later trace
    except Exception as e:
        return Outcome(name, -1, "*", "static", "no samples", _error("sample_inputs", e))
    if not got:
        return Outcome(name, -1, "*", "static", "no samples", "sample_inputs gave none")
    with quiet():
        return [prepare(op, i, s) for i, s in enumerate(got)]


# ---------------------------------------------------------------------------------------------
# one placement


def compile_for(ep, placement: str):
    if placement == "cpu":
        return ferry.compile(ep)
    if placement in DEVICE_IO:
        cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(
            skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True))
        backend = "inductor" if placement == "emu_inductor" else "torch"
        return ferry.compile(ep, ferry.OpSupportPartitioner("emu:0", backend_id=backend), cfg)
    if placement == "emu_op":
        return ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"))
    if placement in ("cuda_op", "cuda_inductor"):
        backend = "inductor" if placement == "cuda_inductor" else "torch"
        return ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0", backend_id=backend))
    raise ValueError(f"unknown placement {placement!r}: one of {', '.join(PLACEMENTS)}")


def placed_inputs(program, inputs) -> list[torch.Tensor]:
    """The caller's tensors where the program wants them: twins on the CPU, copies on a device."""
    meta = program.method_meta("forward")
    out = []
    for i, t in enumerate(inputs):
        dev = meta.input_meta(i).device
        out.append(twin(t) if dev.is_cpu else device_twin(t, dev))
    return out


def device_twin(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device` as twin() makes it on the CPU: its whole storage copied (clone_to) and
    viewed with t's sizes, strides and offset, so a device input is the same kind of view as the
    CPU input eager was given."""
    if t.layout != torch.strided:
        return clone_to(t, device)
    nbytes, size = t.untyped_storage().nbytes(), t.element_size()
    if t.is_contiguous() and t.storage_offset() == 0 and t.numel() * size == nbytes or nbytes % size:
        return clone_to(t, device)
    flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (nbytes // size,), (1,))
    return clone_to(flat, device).as_strided(t.size(), t.stride(), t.storage_offset())


def check(placement, program, call: Call, got, args) -> str | None:
    """What is wrong with ferry's outputs `got` and inputs after the call `args`, or None."""
    meta = program.method_meta("forward")
    want_outs, want_after, random = call.outputs, call.after, call.random
    if len(got) != len(want_outs):
        return f"{len(got)} outputs, eager has {len(want_outs)}"
    problems = []
    for i, (g, w) in enumerate(zip(got, want_outs)):
        if not isinstance(g, torch.Tensor):
            problems.append(f"output {i}: a {type(g).__name__}, not a tensor")
            continue
        dev = device_of(g) if g.device.type == "cpu" else ferry.Device.parse(str(g.device))
        expect = meta.output_meta(i).device
        if placement not in DEVICE_IO and not dev.is_cpu:
            problems.append(f"output {i} is on {dev}, not the CPU")
        elif placement in DEVICE_IO and dev != expect:
            problems.append(f"output {i} is on {dev}, the program says {expect}")
        problems += _compare(f"output {i}", to_host(g), w, random)
    for i, (a, w) in enumerate(zip(args, want_after)):
        problems += _compare(f"input {i} after the call", to_host(a), w, random)
    return "; ".join(problems) or None


def _compare(what, got, want, random) -> list[str]:
    if got.shape != want.shape or got.dtype != want.dtype:
        return [f"{what}: {got.dtype}{list(got.shape)}, eager {want.dtype}{list(want.shape)}"]
    if random:
        return []
    # float32 and wider: RTOL/ATOL; half types and integers: assert_close's own per dtype (exact for integers)
    rtol, atol = (RTOL, ATOL) if want.dtype in (torch.float32, torch.float64, torch.complex64, torch.complex128) else (None, None)
    try:
        if got.layout != torch.strided or want.layout != torch.strided:
            got, want = got.to_dense(), want.to_dense()
        torch.testing.assert_close(got, want, equal_nan=True, rtol=rtol, atol=atol, check_stride=False)
    except AssertionError as e:
        return [f"{what}: " + " ".join(str(e).split())[:600]]
    return []


def cuda_reference(prep: Prepared, calls: list[Call]) -> list[Call]:
    """The calls with eager's results on cuda:0 instead of the CPU."""
    return [reference(prep.module, c.name, c.inputs, "cuda", prep.randomness) for c in calls]


def export_triage(ep, call: Call, got) -> str:
    """For a wrong result: does torch.export's own module (ep.module(), on the CPU, seed 0) agree
    with eager or with ferry? Said in the message; the case stays wrong."""
    try:
        with quiet():
            args = twins(call.inputs)
            torch.manual_seed(0)
            mine = [to_host(o) for o in tensor_leaves(ep.module()(*args))]
            after = [to_host(a) for a in args]
    except Exception as e:
        return f"[ep.module() raises {type(e).__name__}]"
    as_eager = not differ_close(mine, call.outputs) and not differ_close(after, call.after)
    as_ferry = not differ_close(mine, [to_host(g) for g in got if isinstance(g, torch.Tensor)])
    if as_eager:
        return "[ep.module() agrees with eager]"
    if as_ferry:
        return "[ep.module() gives ferry's result: torch.export itself differs from eager here]"
    return "[ep.module() differs from both]"


def differ_close(a, b) -> bool:
    if len(a) != len(b):
        return True
    return any(x.shape != y.shape or x.dtype != y.dtype or _compare("", x, y, False) for x, y in zip(a, b))


def run_program(prep: Prepared, ep, calls: list[Call], placement: str, variant: str) -> Outcome:
    out = Outcome(prep.op, prep.index, placement, variant, "equal", random=any(c.random for c in calls))
    try:
        program = compile_for(ep, placement)
    except ferry.InternalError as e:
        out.status, out.message = "run-time error", _error("compile (InternalError)", e)
        return out
    except ferry.FerryError as e:
        out.status, out.message = "refused", f"{type(e).__name__}: {first_line(str(e))}"
        out.names_op = names_op(str(e), prep.names)
        return out
    except Exception as e:
        out.status, out.message = "run-time error", _error("compile", e)
        return out
    with tempfile.TemporaryDirectory(prefix="ferry-opinfo-") as tmp:
        path = os.path.join(tmp, "program.ferry")
        try:
            program.save(path)
            module = ferry.Module(path)
            program = module.program
        except Exception as e:
            out.status, out.message = "run-time error", _error("save and load", e)
            return out
        try:
            for call in calls:
                step = f"call ({call.name})"
                try:
                    args = placed_inputs(program, call.inputs)
                    torch.manual_seed(0)
                    got = module.run_method("forward", args)
                except ferry.InputError as e:
                    documented = any(m in str(e) for m in DOCUMENTED_INPUT_REFUSALS)
                    out.status = "input refused" if documented else "run-time error"
                    out.message = _error(step, e)
                    return out
                except Exception as e:
                    out.status, out.message = "run-time error", _error(step, e)
                    return out
                try:
                    problem = check(placement, program, call, got, args)
                except Exception as e:  # reading ferry's results back failed (clone_to of an output, ...)
                    out.status, out.message = "run-time error", _error(f"{step}, reading the results", e)
                    return out
                if problem:
                    triage = "" if call.random or placement.startswith("cuda") else " " + export_triage(ep, call, got)
                    out.status, out.message = "wrong", f"{step}: {problem}{triage}"
                    return out
        finally:
            with contextlib.suppress(Exception):
                module.close()
    return out


def run_prepared(prep: Prepared, placement: str, dynamic: bool = True) -> list[Outcome]:
    """The outcomes of one prepared sample on one placement: the static program, then the dynamic one."""
    t0 = time.perf_counter()
    if prep.status is not None:
        outs = [Outcome(prep.op, prep.index, placement, "static", prep.status, prep.message)]
        return outs
    torch.manual_seed(3000 + prep.index)
    ctx = full_fp32() if placement.startswith("cuda") else emu_registered()
    results = []
    with quiet(), ctx:
        calls = prep.calls
        dcalls = prep.dynamic.calls if prep.dynamic else None
        if placement.startswith("cuda"):
            try:
                calls = cuda_reference(prep, calls)
                if dcalls:
                    dcalls = cuda_reference(prep, dcalls)
            except Exception as e:
                return [Outcome(prep.op, prep.index, placement, "static", "eager error", _error("eager on cuda:0", e))]
        results.append(run_program(prep, prep.ep, calls, placement, "static"))
        if dynamic:
            if prep.dynamic is None:
                results.append(Outcome(prep.op, prep.index, placement, "dynamic", "no dynamic variant", prep.no_dynamic))
            else:
                results.append(run_program(prep, prep.dynamic.ep, dcalls, placement, "dynamic"))
    elapsed = time.perf_counter() - t0
    for r in results:
        r.seconds = round(elapsed / len(results), 3)
    return results


# ---------------------------------------------------------------------------------------------
# the sweep


class Sweep:
    """Runs ops on placements, preparing each op's samples once (the last op's are kept)."""

    def __init__(self, samples: int = DEFAULT_SAMPLES, dynamic: bool = True, dtype: torch.dtype = torch.float32):
        self.samples, self.dynamic, self.dtype = samples, dynamic, dtype
        self._ops = None
        self._last: tuple[str, object] | None = None

    def op(self, name: str):
        if self._ops is None:
            self._ops = ops_by_id(self.dtype)
        return self._ops[name]

    def prepared(self, name: str):
        if self._last is None or self._last[0] != name:
            self._last = None  # free the previous op's tensors and exports first
            self._last = (name, prepare_op(self.op(name), self.samples, self.dtype))
        return self._last[1]

    def run(self, name: str, placement: str) -> list[Outcome]:
        preps = self.prepared(name)
        if isinstance(preps, Outcome):
            return [dataclasses.replace(preps, placement=placement)]
        out = []
        for prep in preps:
            try:
                out += run_prepared(prep, placement, self.dynamic)
            except Exception as e:  # the harness itself: never lose the other cases
                out.append(Outcome(name, prep.index, placement, "static", "run-time error", _error("harness", e)))
        return out


def run_op(op, placement: str, samples: int = DEFAULT_SAMPLES, dynamic: bool = True) -> list[Outcome]:
    """Every case of one op on one placement (prepares the samples; use Sweep for several placements)."""
    sweep = Sweep(samples, dynamic)
    sweep._ops = {op_id(op): op}
    return sweep.run(op_id(op), placement)


def available_placements() -> tuple[str, ...]:
    return CPU_PLACEMENTS + (("cuda_op",) if torch.cuda.is_available() else ())

"""The inductor backend's choice for one-row products (ferry/choices/gemv.py): cuBLAS's GEMV or an
Inductor reduction, timed at load. On the CPU the clock is faked; the rewrite itself runs for real
and is compared with eager."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
import torch.nn.functional as F

import ferry
from ferry.choices import gemv
from ferry.choices.decisions import DECISIONS


@pytest.fixture(autouse=True)
def fresh_decisions():
    DECISIONS.forget()
    gemv._TIMES.clear()
    yield
    DECISIONS.forget()
    gemv._TIMES.clear()


@pytest.fixture
def timed_on_cpu(monkeypatch):
    """Products on the CPU are 'timed' too, by a fake clock the test sets: {(out, in): (cuBLAS, reduction) µs}."""
    clock: dict = {}
    monkeypatch.setattr(gemv, "TIMED_ON", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(gemv, "measure", lambda w, b, *forms: clock[tuple(w.shape)])
    return clock


class Step(torch.nn.Module):
    """A decode step's MLP: one row through gate and up (merged by ferry into one product) and a
    biased down projection."""

    def __init__(self, hidden: int = 64, inner: int = 96):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, inner, bias=False)
        self.up = torch.nn.Linear(hidden, inner, bias=False)
        self.down = torch.nn.Linear(inner, hidden)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x)) + x


def test_the_reduction_equals_a_linear_in_fp32_within_half_precision_rounding():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        x, w, b = torch.randn(1, 1, 300, dtype=dtype), torch.randn(70, 300, dtype=dtype), torch.randn(70, dtype=dtype)
        exact = F.linear(x.double(), w.double(), b.double())
        got = gemv.by_reduction(x, w, b)
        assert got.dtype == dtype and got.shape == (1, 1, 70)
        eps = torch.finfo(dtype).eps
        assert torch.allclose(got.double(), exact, rtol=eps, atol=eps * exact.abs().max().item())


def _graph(rows: int, dtype: torch.dtype, weight_is_input: bool = False):
    torch.manual_seed(1)
    module = torch.nn.Module()
    module.register_buffer("w", torch.randn(48, 32, dtype=dtype))
    g = torch.fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w_in") if weight_is_input else g.get_attr("w")
    g.output((g.call_function(torch.ops.aten.relu.default, (g.call_function(torch.ops.aten.linear.default, (x, w)),)),))
    gm = torch.fx.GraphModule(module, g)
    xs = [torch.randn(rows, 32, dtype=dtype)] + ([module.w] if weight_is_input else [])
    shapes = {n: torch.empty(0, device="meta") for n in g.nodes}
    shapes[x] = xs[0].to("meta")
    shapes[w] = module.w.to("meta")
    return gm, xs, shapes


@pytest.mark.parametrize("rows, dtype, weight_is_input, picked", [
    (1, torch.bfloat16, False, True),
    (1, torch.float16, False, True),
    (4, torch.bfloat16, False, False),  # the reduction would read the weight once per row
    (1, torch.float32, False, False),  # measured in half precision only, where both accumulate in fp32
    (1, torch.bfloat16, True, False),  # a weight passed per call: its cast to fp32 is not free
])
def test_only_one_row_products_of_a_constant_half_precision_weight_are_candidates(rows, dtype, weight_is_input,
                                                                                    picked):
    gm, _, shapes = _graph(rows, dtype, weight_is_input)
    assert bool(gemv.candidates(gm, shapes)) is picked


def test_a_product_rewritten_as_a_reduction_equals_the_linear_and_compiles_with_inductor():
    gm, xs, shapes = _graph(1, torch.bfloat16)
    want = gm(*xs)[0]
    (node,) = gemv.candidates(gm, shapes)
    gemv.rewrite(gm, node)
    gm.recompile()
    assert torch.ops.aten.linear.default not in {n.target for n in gm.graph.nodes}
    got = torch._inductor.compile(gm, xs)(*xs)[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


def test_a_row_an_inductor_kernel_computes_is_stored_before_its_reduction_and_a_row_in_memory_is_read_as_is():
    """The timed kernel read its row from memory: a row made by fused ops (a SiLU) is marked to be
    stored first; an input, a view of a library kernel's result (a GEMM's, attention's) or an
    element of a split of one is memory already and is left as it is."""
    aten = torch.ops.aten
    torch.manual_seed(2)
    module = torch.nn.Module()
    for name in ("a", "b", "c"):
        module.register_buffer(name, torch.randn(32, 32, dtype=torch.bfloat16))
    module.register_buffer("d", torch.randn(32, 16, dtype=torch.bfloat16))
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a, b, c = (g.get_attr(n) for n in "abc")
    from_input = g.call_function(aten.linear.default, (x, a))
    computed = g.call_function(aten.linear.default, (g.call_function(aten.silu.default, (x,)), b))
    library = g.call_function(aten.view.default, (g.call_function(aten.mm.default, (x, c)), [1, 32]))
    viewed = g.call_function(aten.linear.default, (library, c))
    halves = g.call_function(aten.split.Tensor, (g.call_function(aten.mm.default, (x, c)), 16, -1))
    both = g.call_function(aten.cat.default, ([g.call_function(operator.getitem, (halves, 1)),
                                                g.call_function(operator.getitem, (halves, 0))], -1))
    split = g.call_function(aten.linear.default, (g.call_function(operator.getitem, (halves, 0)), g.get_attr("d")))
    g.output((from_input, computed, viewed, split, both))
    gm = torch.fx.GraphModule(module, g)
    xs = [torch.randn(1, 32, dtype=torch.bfloat16)]
    want = gm(*xs)
    shapes = {n: torch.empty(1, 32, dtype=torch.bfloat16, device="meta") for n in g.nodes if n.op != "output"}
    shapes[split.args[0]] = torch.empty(1, 16, dtype=torch.bfloat16, device="meta")  # an element of the split
    shapes[split.args[1]] = module.d.to("meta")
    for node in gemv.candidates(gm, shapes):
        gemv.rewrite(gm, node, shapes)
    gm.recompile()
    stored = [n for n in gm.graph.nodes if n.target is aten.as_strided.default]
    assert [n.args[0].target for n in stored] == [aten.silu.default]
    got = torch._inductor.compile(gm, xs)(*xs)
    for g_, w_ in zip(got, want):
        assert torch.allclose(g_.float(), w_.float(), rtol=2 ** -7, atol=2 ** -7 * w_.abs().max().item())


def _merged_graph(widths: list[int], bias: bool, also_whole: bool = False):
    """A merged product (as choices/projections.py leaves gate and up) read as column slices of
    `widths`, SiLU of the first times the others (unequal widths: each returned); `also_whole`: the
    product is returned too."""
    aten = torch.ops.aten
    torch.manual_seed(4)
    module = torch.nn.Module()
    module.register_buffer("w", torch.randn(sum(widths), 32, dtype=torch.bfloat16))
    module.register_buffer("b", torch.randn(sum(widths), dtype=torch.bfloat16))
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(aten.linear.default, (x, g.get_attr("w"), *([g.get_attr("b")] if bias else [])))
    starts = [sum(widths[:i]) for i in range(len(widths))]
    parts = [g.call_function(aten.slice.Tensor, (y, -1, a, a + n)) for a, n in zip(starts, widths)]
    outs = [g.call_function(aten.silu.default, (parts[0],)), *parts[1:]]  # unequal widths: each its own
    if len(set(widths)) == 1:
        for p in parts[1:]:
            outs[0] = g.call_function(aten.mul.Tensor, (outs[0], p))
        outs = outs[:1]
    g.output((*outs, y) if also_whole else tuple(outs))
    gm = torch.fx.GraphModule(module, g)
    xs = [torch.randn(1, 1, 32, dtype=torch.bfloat16)]
    shapes = {n: torch.empty(0, device="meta") for n in g.nodes}
    shapes.update({x: xs[0].to("meta"), y: torch.empty(1, 1, sum(widths), dtype=torch.bfloat16, device="meta")})
    shapes.update({a: getattr(module, a.target).to("meta") for a in y.args[1:]})
    return gm, xs, shapes


@pytest.mark.parametrize("widths, bias, also_whole, split", [
    ([48, 48], False, False, True),  # gate and up: one reduction each
    ([40, 40], True, False, True),
    ([40, 40, 40], False, False, False),  # three: q, k and v of one width stay one reduction (untimed otherwise)
    ([64, 16, 16], False, False, False),  # q, k and v: one reduction (three sizes would be three kernels)
    ([48, 48], False, True, False),  # the whole product read too
])
def test_a_merged_product_read_as_equal_slices_becomes_one_reduction_per_slice(widths, bias, also_whole, split):
    """Reductions of one size over one row fuse into one kernel with what combines them (SiLU(gate)
    * up), which one reduction read at two offsets keeps in a kernel of its own."""
    aten = torch.ops.aten
    gm, xs, shapes = _merged_graph(widths, bias, also_whole)
    want = gm(*xs)
    (node,) = gemv.candidates(gm, shapes)
    gemv.rewrite(gm, node, shapes)
    gm.recompile()
    sums = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    assert len(sums) == (len(widths) if split else 1)
    sliced_results = [n for n in gm.graph.nodes if n.target is aten.slice.Tensor and n.args[0].op != "get_attr"]
    assert (not sliced_results) is split  # split: each reduction reads its rows of the weight
    got = torch._inductor.compile(gm, xs)(*xs)
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype
        assert torch.allclose(g_.float(), w_.float(), rtol=2 ** -6, atol=2 ** -6 * w_.abs().max().item())


@pytest.mark.parametrize("how, halves", [
    ("split", True), ("split_with_sizes", True), ("counted from the end", True), ("three", False),
    ("unequal", False), ("rows", False), ("read whole too", False)])
def test_a_product_chunked_in_two_halves_is_read_as_two_slices_and_nothing_else_is(how, halves):
    """`chunk(2, -1)` exports as `split` and two `getitem`s: read as the two slices they are, the
    rule for slices splits the product; three pieces, unequal ones, a split of rows, or a product
    also read whole are left as they are."""
    aten = torch.ops.aten
    module = torch.nn.Module()
    module.register_buffer("w", torch.randn(96, 32, dtype=torch.bfloat16))
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(aten.linear.default, (x, g.get_attr("w")))
    if how == "split_with_sizes" or how == "unequal":
        split = g.call_function(aten.split_with_sizes.default, (y, [48, 48] if how != "unequal" else [40, 56], -1))
    else:
        split = g.call_function(aten.split.Tensor, (y, 32 if how == "three" else 48, 0 if how == "rows" else -1))
    count = {"three": 3, "rows": 1}.get(how, 2)
    at = (-2, -1) if how == "counted from the end" else range(count)  # gate = split[-2]: still the first half
    pieces = [g.call_function(operator.getitem, (split, i)) for i in at]
    out = g.call_function(aten.silu.default, (pieces[0],))
    g.output((out, *pieces[1:], *([y] if how == "read whole too" else [])))
    gm = torch.fx.GraphModule(module, g)
    xs = [torch.randn(1, 1, 32, dtype=torch.bfloat16)]
    want = gm(*xs)
    shapes = {x: xs[0].to("meta"), y: torch.empty(1, 1, 96, dtype=torch.bfloat16, device="meta")}
    assert gemv._halves_as_slices(y, shapes) is halves
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes]
    assert (aten.slice.Tensor in targets and operator.getitem not in targets) is halves
    assert halves is (gemv._equal_slices(y, shapes) is not None)
    for got, w in zip(gm(*xs), want):
        assert torch.equal(got, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("form", ["six args", "weight only, eps by default", "neither, eps by default",
                                  "fp32 weight and bias"])
def test_a_layer_norm_written_out_equals_eagers_in_value_and_dtype(dtype, form):
    """The ops `aten.layer_norm` is written out as give eager's result type and, from the same
    input, values within one rounding of the exact norm (fp64), as eager's do: rows far from 0
    with a small spread and a non-default eps, where a norm computed in half precision, not
    centred, or with the wrong eps is far off."""
    aten = torch.ops.aten
    torch.manual_seed(3)
    wdtype = torch.float32 if form == "fp32 weight and bias" else dtype
    module = torch.nn.Module()
    module.register_buffer("w", torch.randn(48, 64, dtype=dtype))
    module.register_buffer("gamma", torch.randn(64, dtype=wdtype))
    module.register_buffer("beta", torch.randn(64, dtype=wdtype))
    g = torch.fx.Graph()
    x = g.placeholder("x")
    gamma, beta = g.get_attr("gamma"), g.get_attr("beta")
    args = {"six args": (x, [64], gamma, beta, 1e-3, True), "weight only, eps by default": (x, [64], gamma),
            "neither, eps by default": (x, [64]), "fp32 weight and bias": (x, [64], gamma, beta, 1e-3, True)}[form]
    norm = g.call_function(aten.layer_norm.default, args)
    y = g.call_function(aten.linear.default, (norm, g.get_attr("w")))
    g.output((y,))
    xs = (3 + 0.05 * torch.randn(1, 1, 64, dtype=torch.float64)).to(dtype)
    gm = torch.fx.GraphModule(module, g)
    want = aten.layer_norm.default(*torch.fx.map_arg(args, lambda a: xs if a is x else getattr(module, a.target)))
    shapes = {x: xs.to("meta"), gamma: module.gamma, beta: module.beta}
    assert gemv._layer_norm_written_out(gm, y, shapes)
    g.output_node().args = ((y, y.args[0]),)  # the written-out norm's result returned too
    gm.recompile()
    _, got = gm(xs)
    eps = args[4] if len(args) > 4 else 1e-5
    weight, bias = (module.gamma.double(), module.beta.double()) if len(args) > 3 else (
        (module.gamma.double(), None) if len(args) > 2 else (None, None))
    exact = F.layer_norm(xs.double(), [64], weight, bias, eps)
    rounding = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -16}[dtype]  # fp32: the spread is 1/60 of the mean
    assert got.dtype == want.dtype and y.args[0].meta["val"].dtype == want.dtype
    for result in (want, got):
        assert ((result.double() - exact).abs() <= 1.01 * rounding * (exact.abs() + 1)).all()


def test_a_merged_product_stays_one_reduction_when_the_split_is_off(monkeypatch):
    monkeypatch.setattr(gemv, "SPLIT_EQUAL_SLICES", False)
    gm, _, shapes = _merged_graph([48, 48], False)
    (node,) = gemv.candidates(gm, shapes)
    gemv.rewrite(gm, node, shapes)
    assert len([n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.dim_IntList]) == 1


@pytest.mark.parametrize("times, rewritten", [((10.0, 5.0), True), ((10.0, 9.6), True), ((10.0, 9.8), False),
                                              ((3.0, 2.5), True)])
def test_the_reduction_is_kept_where_it_saves_three_percent_and_the_decision_is_recorded(timed_on_cpu, times,
                                                                                           rewritten):
    gm, xs, shapes = _graph(1, torch.bfloat16)
    timed_on_cpu[(48, 32)] = times
    (decision,) = gemv.apply(gm, shapes)
    assert decision.times_us == times and decision.taken is rewritten and decision.family == gemv.FAMILY
    assert (torch.ops.aten.linear.default not in {n.target for n in gm.graph.nodes}) is rewritten
    assert DECISIONS.values(timed=True) == [decision]


def test_nothing_is_timed_on_a_device_that_is_not_timed():
    gm, _, shapes = _graph(1, torch.bfloat16)
    assert gemv.apply(gm, shapes) == []  # the CPU: cuBLAS's question does not arise
    assert torch.ops.aten.linear.default in {n.target for n in gm.graph.nodes}


@pytest.mark.parametrize("prefer_reduction", [True, False])
def test_an_inductor_program_with_its_products_as_reductions_equals_eager(timed_on_cpu, monkeypatch,
                                                                          prefer_reduction):
    from ferry.backends import inductor

    compiled_with = []
    real_compile = inductor._inductor_compile
    monkeypatch.setattr(inductor, "_inductor_compile",
                        lambda gm, ex, method, tuning=None, **kw: compiled_with.append(tuning) or real_compile(
                            gm, ex, method, tuning, **kw))
    torch.manual_seed(2)
    model = Step().to(torch.bfloat16).eval()
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    ep = torch.export.export(model, (x,))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    faster = 5.0 if prefer_reduction else 10.0
    timed_on_cpu.update({(192, 64): (10.0, faster), (64, 96): (10.0, 9.8)})
    module = ferry.Module(program)
    for _ in range(3):
        x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
        got = module(x)
        want = model(x)
        assert got.shape == want.shape
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    gate_up, down = DECISIONS.values(timed=True)  # one per shape
    assert (gate_up.shape, down.shape) == ("64->192 (+ silu, mul) bfloat16", "96->64 +bias bfloat16")
    assert gate_up.taken is prefer_reduction and not down.taken  # 2% saved: cuBLAS's stays
    assert gate_up.times_us == (10.0, faster) and down.times_us == (10.0, 9.8)
    # a graph with a product rewritten is compiled with the tuning the reduction was timed with;
    # otherwise untuned, whatever the process's Inductor config says
    assert compiled_with == [gemv.TUNING if prefer_reduction else gemv.UNTUNED]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_on_the_gpu_each_one_row_product_is_timed_and_the_program_equals_eager(graphs):
    torch.manual_seed(3)
    model = Step(2048, 4096).to(torch.bfloat16).eval()
    ep = torch.export.export(model, (torch.randn(1, 1, 2048, dtype=torch.bfloat16),))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0", backend_id="inductor"),
                            ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(
                                skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)))
    module = ferry.Module(program, cuda_graphs=graphs)
    model = model.cuda()
    for _ in range(3):
        x = torch.randn(1, 1, 2048, dtype=torch.bfloat16, device="cuda")
        got = module(x)
        want = model(x)
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    made = [d for d in DECISIONS.values(timed=True) if d.family == gemv.FAMILY]
    assert [d.shape for d in made] == ["2048->8192 (+ silu, mul) bfloat16", "4096->2048 +bias bfloat16"]
    assert all(0 < us < 1e4 for d in made for us in d.times_us)


@pytest.mark.parametrize("device, graphs", [
    ("cpu", False),
    pytest.param("cuda", False, marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                              reason="needs a GPU")]),
    pytest.param("cuda", True, marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs a GPU")]),
])
def test_a_bf16_decoder_with_every_product_a_reduction_follows_eager_step_by_step(monkeypatch, device, graphs):
    """Teacher forcing: ferry's decode (inductor backend, every one-row product made a reduction by a
    fake clock, biased q/k/v included) and transformers' static-cache step are fed the same tokens;
    each step's logits agree within bf16 rounding."""
    pytest.importorskip("transformers")
    from test_generate import KEEP_ON_DEVICE, bf16_decode_step, follows_eager_step_by_step

    monkeypatch.setattr(gemv, "TIMED_ON", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(gemv, "measure", lambda w, b, *forms: (10.0, 1.0))
    ep, eager = bf16_decode_step(device)
    program = ferry.compile(ep, ferry.OpSupportPartitioner(f"{device}:0" if device == "cuda" else device,
                                                           backend_id="inductor"),
                            KEEP_ON_DEVICE if device == "cuda" else None)
    module = ferry.Module(program, cuda_graphs=graphs)
    module.load_method()
    made = [d for d in DECISIONS.values(timed=True) if d.family == gemv.FAMILY]
    assert len(made) >= 3 and all(d.taken for d in made)  # a decision per shape of q/k/v, o, gate/up, down, head
    follows_eager_step_by_step(module, eager, device)


def test_the_kernel_timed_is_inductors_reduction_and_equals_the_linear():
    torch.manual_seed(4)
    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(96, 64, dtype=torch.bfloat16)
    for bias in (torch.randn(96, dtype=torch.bfloat16), None):
        got = gemv._compiled(w, bias)(x, w, bias)
        want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


def test_a_product_that_cannot_be_timed_keeps_its_linear_and_the_load_goes_on(monkeypatch):
    monkeypatch.setattr(gemv, "TIMED_ON", frozenset({"cuda", "cpu"}))  # the real clock: it needs a GPU
    gm, xs, shapes = _graph(1, torch.bfloat16)
    want = gm(*xs)[0]
    assert gemv.apply(gm, shapes) == []
    assert torch.ops.aten.linear.default in {n.target for n in gm.graph.nodes}
    assert torch.equal(gm(*xs)[0], want)


def test_weights_are_copied_past_the_l2_cache_only_when_they_fit_in_it(monkeypatch):
    """A weight smaller than L2 is rotated through copies that hold more than L2; one larger than
    L2 is timed alone (a copy of a 525 MB head once raised the load's peak by as much)."""
    class Props:
        L2_cache_size = 60 << 20

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    for n, k in [(3072, 2048), (2048, 2048), (2048, 8192), (16384, 2048), (128256, 2048), (8, 8)]:
        w = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
        copies, nbytes = gemv.cold_copies(w), 2 * n * k
        if nbytes >= Props.L2_cache_size:
            assert copies == 1
        else:
            assert (copies - 1) * nbytes >= Props.L2_cache_size or copies == 32
            assert copies * nbytes <= Props.L2_cache_size + 2 * nbytes


def test_a_graph_inductor_cannot_compile_runs_op_by_op_as_the_program_states_it(timed_on_cpu, monkeypatch):
    """Not with its products rewritten: op by op, a reduction would make the fp32 product."""
    from ferry.backends import inductor

    def fails(gm, examples, method, tuning=None, combo=False):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(inductor, "_inductor_compile", fails)
    built = []
    real_rebuilt = inductor._rebuilt
    monkeypatch.setattr(inductor, "_rebuilt", lambda *a: built.append(real_rebuilt(*a)) or built[-1])
    torch.manual_seed(5)
    model = Step().to(torch.bfloat16).eval()
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    program = ferry.compile(torch.export.export(model, (x,)), ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    timed_on_cpu.update({(192, 64): (10.0, 1.0), (64, 96): (10.0, 1.0)})
    with pytest.warns(RuntimeWarning, match="Inductor could not compile"):
        module = ferry.Module(program)
        module.load_method()
    assert all(d.taken for d in DECISIONS.values(timed=True)) and len(built) == 2  # rewritten, then rebuilt as the program states it
    assert [torch.ops.aten.linear.default in {n.target for n in gm.graph.nodes} for gm in built] == [False, True]
    got = module(x)
    assert torch.equal(got, model(x))  # eager's own kernels, op by op


_GPU = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_GPU)])
@pytest.mark.parametrize("reductions", ["both", "neither", "down only"])
def test_the_compiled_graph_runs_the_products_the_decision_picked(monkeypatch, device, reductions):
    """A reduction kept: that product does not reach the BLAS library, and the down projection's
    row (SiLU times up) is stored in bf16 before its reduction reads it, as the timed kernel read
    its row, not recomputed inside it. Neither kept: every product is the library's (compiled
    without the tuning). Down only: gate/up stays cuBLAS's through `ferry::library_linear` in a graph
    compiled with the tuning, which on a GPU would otherwise turn its `mm` into a reduction too."""
    import re

    from torch._inductor.utils import run_and_get_code

    reduced = {"both": {"gate_up", "down"}, "neither": set(), "down only": {"down"}}[reductions]
    monkeypatch.setattr(gemv, "TIME_REGIONS", False)  # (their timed forms' code would be in `codes` too)
    monkeypatch.setattr(gemv, "TIMED_ON", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(gemv, "measure", lambda w, b, *forms: (
        10.0, 1.0 if ("down" if b is not None else "gate_up") in reduced else 10.0))
    torch.manual_seed(6)
    model = Step(256, 512).to(device=device, dtype=torch.bfloat16).eval()
    ep = torch.export.export(model, (torch.randn(1, 1, 256, dtype=torch.bfloat16, device=device),))
    where = "cuda:0" if device == "cuda" else "cpu"
    program = ferry.compile(ep, ferry.OpSupportPartitioner(where, backend_id="inductor"),
                            ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(
                                skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)))
    module = ferry.Module(program)
    with torch._inductor.config.patch(force_disable_caches=True):
        _, codes = run_and_get_code(module.load_method)
    code = "\n".join(codes)
    library = "ferry.library_linear" in code
    assert (("extern_kernels.mm(" in code) or library) is ("gate_up" not in reduced)  # gate/up, merged
    assert library is (reduced == {"down"})  # cuBLAS's product in a tuned graph
    assert ("extern_kernels.addmm(" in code) is ("down" not in reduced)  # down, biased
    if "down" in reduced:
        assert re.search(r"empty_strided_\w+\(\(1, 1, 512\), \([\d, ]+\), torch\.bfloat16\)", code)
    x = torch.randn(1, 1, 256, dtype=torch.bfloat16, device=device)
    want = model(x)
    assert torch.allclose(module(x).float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())


class NormedProduct(torch.nn.Module):
    """A decoder's residual, a norm of it and a projection of the normed row; `also_norm` returns
    the normed row too. Norms: transformers' RMSNorm (fp32 inside, the weight times the row cast
    back), Gemma's (times 1 + weight, in fp32), a LayerNorm written out (two means, the second of
    what the first makes, and a bias), a sum over the row divided by its length, no weight."""

    def __init__(self, hidden: int = 256, out: int = 384, also_norm: bool = False, norm: str = "rms"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.bias = torch.nn.Parameter(torch.randn(hidden))
        self.proj = torch.nn.Linear(hidden, out, bias=False)
        self.also_norm, self.norm = also_norm, norm

    def forward(self, h, r):
        h = h + r
        x = h.float()
        if self.norm == "rms":
            x = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
        elif self.norm == "gemma":
            x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight.float())).type_as(h)
        elif self.norm == "layer":
            centred = x - x.mean(-1, keepdim=True)
            x = (centred * torch.rsqrt((centred * centred).mean(-1, keepdim=True) + 1e-5)).to(h.dtype)
            x = x * self.weight + self.bias
        elif self.norm in ("layer op", "layer op unweighted"):  # nn.LayerNorm's op, on the row as it comes
            weighted = self.norm == "layer op"
            x = F.layer_norm(h, h.shape[-1:], self.weight if weighted else None, self.bias if weighted else None)
        elif self.norm == "layer op in fp32":  # OLMo's: no weight, in fp32, cast back after
            x = F.layer_norm(x, x.shape[-1:], None, None, 1e-5).to(h.dtype)
        elif self.norm == "sum":
            x = (x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) / x.shape[-1] + 1e-6)).to(h.dtype) * self.weight
        else:  # no weight
            x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
        return (self.proj(x), h, x) if self.also_norm else (self.proj(x), h)


def _compiled_graph(monkeypatch, model, device: str, *args, measure=lambda w, b, *forms: (10.0, 1.0)):
    """The module's program (inductor backend, every product a reduction unless `measure` says
    otherwise) and the graph Inductor compiled."""
    from ferry.backends import inductor

    graphs = []
    real_compile = inductor._inductor_compile
    monkeypatch.setattr(inductor, "_inductor_compile",
                        lambda gm, *a, **kw: graphs.append(gm) or real_compile(gm, *a, **kw))
    monkeypatch.setattr(gemv, "TIMED_ON", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(gemv, "measure", measure)
    ep = torch.export.export(model, args)
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0" if device == "cuda" else "cpu",
                                                           backend_id="inductor"),
                            ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(
                                skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)))
    module = ferry.Module(program)
    module.load_method()
    (gm,) = graphs
    return module, gm


def _norms_in_products(gm) -> int:
    """Means taken over a row repeated once per output: norms computed inside a product's reduction."""
    sums = (torch.ops.aten.mean.dim, torch.ops.aten.sum.dim_IntList)
    return sum(n.target in sums and n.args[0].target is torch.ops.aten.expand.default
               for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])])
@pytest.mark.parametrize("case", ["fused", "gemma", "layer", "layer op", "layer op unweighted", "layer op float32",
                                  "layer op in fp32",
                                  "sum", "unweighted", "float16", "norm read twice", "layer op read twice",
                                  "too many outputs", "off", "layer op off"])
def test_a_norm_only_a_product_reads_is_computed_inside_its_reduction_and_equals_eager(monkeypatch, device, case):
    """The norm's ops run again per output inside the product's kernel (its own kernel gone),
    with eager's casts: results within half-precision rounding of eager's, every call. Not where
    the normed row is read by something else (it is stored anyway), the product is wider than
    FUSED_NORM_OUTPUTS, or FUSE_NORMS is off."""
    torch.manual_seed(7)
    monkeypatch.setattr(gemv, "FUSE_NORMS", not case.endswith("off"))
    if case == "too many outputs":
        monkeypatch.setattr(gemv, "FUSED_NORM_OUTPUTS", 383)
    dtype = {"float16": torch.float16, "layer op float32": torch.float32}.get(case, torch.bfloat16)
    norm = case if case in ("gemma", "layer", "sum", "unweighted", "layer op unweighted", "layer op in fp32") else "rms"
    norm = "layer op" if case.startswith("layer op") and norm == "rms" else norm
    model = NormedProduct(also_norm=case.endswith("read twice"), norm=norm).to(device=device, dtype=dtype).eval()
    h, r = (torch.randn(1, 1, 256, dtype=dtype, device=device) for _ in range(2))
    if dtype == torch.float32:  # (fp32 products are not candidates: the norm's rule is asked directly)
        monkeypatch.setattr(gemv, "_DTYPES", frozenset({*gemv._DTYPES, torch.float32}))
    module, gm = _compiled_graph(monkeypatch, model, device, h, r)
    fused = {"layer": 2, "layer op": 2, "layer op unweighted": 2, "layer op float32": 2, "layer op in fp32": 2}.get(case, 1)
    assert _norms_in_products(gm) == (0 if case in ("norm read twice", "layer op read twice", "too many outputs")
                                      or case.endswith("off") else fused)
    assert (torch.ops.aten.layer_norm.default in {n.target for n in gm.graph.nodes}) is (
        case in ("layer op read twice", "layer op off"))
    for _ in range(3):
        h, r = (torch.randn(1, 1, 256, dtype=dtype, device=device) for _ in range(2))
        got, want = module(h, r), model(h, r)
        for g, w in zip(got, want):
            assert torch.allclose(g.float(), w.float(), rtol=2 ** -6, atol=2 ** -6 * w.float().abs().max().item())


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "mistral"])
def test_each_familys_bf16_decode_with_norms_inside_its_products_follows_eager_step_by_step(monkeypatch, family):
    """Teacher forcing, a tiny random model of each family in bf16 through transformers' export
    recipe (a hybrid cache where the config has sliding layers), every one-row product made a
    reduction: its norms (Llama's, Gemma's 1 + weight, Qwen 3's beside q/k norms) go inside them,
    and each step's logits agree with the recipe's own module run eagerly."""
    import copy

    pytest.importorskip("transformers")

    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from test_generate import follows_eager_step_by_step
    from test_generate_families import FAMILY, GENERATE
    from test_model_families import family_decoder

    made = []
    real = gemv._norm_of
    monkeypatch.setattr(gemv, "_norm_of", lambda x, p, s: made.append(r := real(x, p, s)) or r)
    monkeypatch.setattr(gemv, "TIMED_ON", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(gemv, "measure", lambda w, b, *forms: (10.0, 1.0))
    # transformers' own initializer (GENERATE's larger one makes bf16 logits drift past the
    # tolerance by step 5 with or without the norms inside: Llama, the inductor backend, cuBLAS's products)
    model = family_decoder(family, **{**GENERATE, "initializer_range": 0.02, **FAMILY[family]}).to(torch.bfloat16)
    model.generation_config.cache_implementation = "static"
    recipes = [TorchExportableModuleForDecoderOnlyLM(copy.deepcopy(model), batch_size=1, max_cache_len=32)
               for _ in range(2)]
    with torch.no_grad():
        ep = recipes[0].export(input_ids=torch.zeros(1, 1, dtype=torch.long), cache_position=torch.tensor([0]))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor")))
    module.load_method()
    assert sum(m is not None for m in made) >= 4  # two norms a layer, two layers
    follows_eager_step_by_step(module, recipes[1].model, "cpu", steps=8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_a_norm_computed_inside_its_product_takes_one_kernel_fewer(monkeypatch):
    """Inductor computes the repeated row's mean in the product's own kernel (as a softmax's max
    and sum), not in a kernel of its own: the graph has one Triton kernel fewer than with the norm
    apart."""
    from torch._inductor.utils import run_and_get_code

    kernels = {}
    for fuse in (False, True):
        monkeypatch.setattr(gemv, "FUSE_NORMS", fuse)
        monkeypatch.setattr(gemv, "TIME_REGIONS", False)  # (their timed forms' code would be counted too)
        model = NormedProduct(2048, 3072).to(device="cuda", dtype=torch.bfloat16).eval()
        h = torch.randn(1, 1, 2048, dtype=torch.bfloat16, device="cuda")
        with torch._inductor.config.patch(force_disable_caches=True):
            (module, _), codes = run_and_get_code(lambda m=model, x=h: _compiled_graph(monkeypatch, m, "cuda", x, x))
        kernels[fuse] = "\n".join(codes).count("@triton.jit")
        monkeypatch.undo()
    assert kernels[True] == kernels[False] - 1, kernels


class NormedMLP(torch.nn.Module):
    """A decoder layer's second half: the residual, its RMSNorm, gate and up (merged by ferry into
    one product), SiLU(gate) * up, the down projection and the residual again."""

    def __init__(self, hidden: int = 64, inner: int = 96):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.gate = torch.nn.Linear(hidden, inner, bias=False)
        self.up = torch.nn.Linear(hidden, inner, bias=False)
        self.down = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, h, r):
        h = h + r
        x = h.float()
        x = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
        return self.down(F.silu(self.gate(x)) * self.up(x)) + h


class ChunkedMLP(torch.nn.Module):
    """Phi-3's MLP: gate and up one product, split by `chunk` into its two halves."""

    def __init__(self, hidden: int = 64, inner: int = 96, norm: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden)) if norm else None
        self.gate_up = torch.nn.Linear(hidden, 2 * inner, bias=False)
        self.down = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        h = x
        if self.weight is not None:  # RMSNorm as transformers writes it
            f = x.float()
            h = self.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up) + x


class TwoRows(torch.nn.Module):
    """Two products of one weight shape, one of a normed row, one of a row as it comes."""

    def __init__(self):
        super().__init__()
        self.normed = NormedProduct(64, 48)
        self.plain = torch.nn.Linear(64, 48, bias=False)

    def forward(self, h, r):
        return self.normed(h, r)[0] + self.plain(r)


def _regions(monkeypatch):
    """Each product's region as `product_times` sees it (before the rewrite), with its two graphs."""
    seen = []
    real = gemv.product_times

    def product_times(gm, node, region=None):
        if region is not None and all(region is not r for _, r, *_ in seen):
            seen.append((gm, region, region.graph(gm, fused=False), region.graph(gm, fused=True),
                         gemv._weights(gm, node)[0], region._leaves()))
        return real(gm, node, region)

    monkeypatch.setattr(gemv, "product_times", product_times)
    return seen


@pytest.mark.parametrize("model, inside", [(NormedProduct(64, 48), ["norm"]), (Step(), ["silu, mul"]),
                                           (NormedMLP(), ["norm, silu, mul"]), (ChunkedMLP(), ["silu, mul"]),
                                           (ChunkedMLP(norm=True), ["norm, silu, mul"])])
def test_a_products_region_takes_in_its_norm_and_the_ops_after_and_its_two_forms_equal_each_other(
        monkeypatch, model, inside):
    """What a reduction would take into its kernel (the norm before, SiLU(gate) * up after, not a
    residual add that reads a row from outside) is timed as two graphs of the same values: the
    original ops with cuBLAS's product (`library_linear`), and the rewrite, its norm inside the
    reduction. Both, fed fresh random rows, agree within bf16 rounding, eagerly and compiled."""
    seen = _regions(monkeypatch)
    model = model.to(torch.bfloat16).eval()
    args = [torch.randn(1, 1, 64, dtype=torch.bfloat16) for _ in range(1 if isinstance(model, (Step, ChunkedMLP)) else 2)]
    _compiled_graph(monkeypatch, model, "cpu", *args)
    assert [region.inside for _, region, *_ in seen] == inside
    for gm, region, library, fused, weight, leaves in seen:
        targets = [{n.target for n in g.graph.nodes} for g in (library, fused)]
        assert gemv.LIBRARY_LINEAR in targets[0] and gemv.LIBRARY_LINEAR not in targets[1]
        assert torch.ops.aten.linear.default not in targets[0] | targets[1]
        assert _norms_in_products(fused) == (region.norm is not None) * (1 if "silu" not in region.inside else 2)
        for _ in range(2):
            rows = [getattr(gm, n.target) if n.op == "get_attr" else torch.randn(region.shapes[n].shape,
                                                                                   dtype=torch.bfloat16)
                    for n in leaves]
            want = library(*rows, weight)
            for got in (fused(*rows, weight), torch._inductor.compile(fused, [*rows, weight])(*rows, weight)):
                assert len(got) == len(want) == 1
                assert torch.allclose(got[0].float(), want[0].float(), rtol=2 ** -6,
                                      atol=2 ** -6 * want[0].float().abs().max().item())


@pytest.mark.parametrize("regions", [True, False])
def test_products_of_one_shape_with_and_without_a_norm_to_take_in_are_decided_apart(timed_on_cpu, monkeypatch,
                                                                                    regions):
    """The reduction of a normed row saves the norm's kernel, the other's does not: two decisions,
    each named by what its reduction takes in (TIME_REGIONS off: one, each product timed alone)."""
    monkeypatch.setattr(gemv, "TIME_REGIONS", regions)
    timed_on_cpu[(48, 64)] = (10.0, 9.9)
    _compiled_graph(monkeypatch, TwoRows().to(torch.bfloat16).eval(), "cpu",
                    *(torch.randn(1, 1, 64, dtype=torch.bfloat16) for _ in range(2)))
    assert sorted(d.shape for d in DECISIONS.values(timed=True)) == (
        ["64->48 (+ norm) bfloat16", "64->48 bfloat16"] if regions else ["64->48 bfloat16"])


class TwoNorms(torch.nn.Module):
    """Two products of one weight shape, each of a row its own kind of norm makes."""

    def __init__(self):
        super().__init__()
        self.rms, self.layer = NormedProduct(64, 48, norm="rms"), NormedProduct(64, 48, norm="layer")

    def forward(self, h, r):
        return self.rms(h, r)[0] + self.layer(h, r)[0]


def test_regions_of_one_name_and_other_ops_are_each_decided_by_their_own_times(monkeypatch):
    """Both take in "norm", but an RMSNorm and a LayerNorm time apart: the second is decided by
    its own times, not handed the first's decision."""
    times = iter([(10.0, 1.0), (10.0, 10.0)])  # the first timed saves 90%, the second nothing
    _, gm = _compiled_graph(monkeypatch, TwoNorms().to(torch.bfloat16).eval(), "cpu",
                            *(torch.randn(1, 1, 64, dtype=torch.bfloat16) for _ in range(2)),
                            measure=lambda w, b, *forms: next(times))
    assert len(gemv._TIMES) == 2
    assert sum(n.target is gemv.LIBRARY_LINEAR for n in gm.graph.nodes) == 1
    assert sorted(d.taken for d in DECISIONS.values(timed=True)) == [False, True]


class BiasedGateOut(torch.nn.Module):
    """gate/up (merged by ferry), biased; SiLU(gate) both multiplied by up and returned."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(64, 96), torch.nn.Linear(64, 96)
        self.down = torch.nn.Linear(96, 64, bias=False)

    def forward(self, x):
        a = F.silu(self.gate(x))
        return self.down(a * self.up(x)), a


class SelfNormed(torch.nn.Module):
    """A product's result normed in bf16 (no cast first): its square is read by the norm's mean."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 48, bias=False)

    def forward(self, x):
        y = self.proj(x)
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_a_biased_region_reads_weight_then_bias_and_returns_every_value_read_outside(monkeypatch):
    """The two forms take (rows, weight, bias) in that order and return each value something
    outside the region reads (SiLU(gate), returned, and SiLU(gate) * up), as F.linear makes them;
    compiled, the first form is cuBLAS's (`library_linear`), the second the reduction."""
    seen, compiled, forms = _regions(monkeypatch), [], []
    monkeypatch.setattr(torch._inductor, "compile", lambda g, inputs, options=None: compiled.append(g) or g)
    spied = gemv.product_times
    monkeypatch.setattr(gemv, "product_times", lambda gm, node, region=None: forms.extend(
        region.forms(gm, torch.device("cpu")) if region is not None and not forms else ()) or spied(gm, node, region))
    model = BiasedGateOut().to(torch.bfloat16).eval()
    _compiled_graph(monkeypatch, model, "cpu", torch.randn(1, 1, 64, dtype=torch.bfloat16))
    ((gm, region, library, fused, weight, leaves),) = seen
    assert region.inside == "silu, mul"
    assert gemv.LIBRARY_LINEAR in {n.target for n in compiled[0].graph.nodes}
    assert gemv.LIBRARY_LINEAR not in {n.target for n in compiled[1].graph.nodes}
    bias = torch.cat([model.gate.bias, model.up.bias])
    row = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    silu = F.silu(F.linear(row, model.gate.weight, model.gate.bias))
    wanted = [silu, silu * F.linear(row, model.up.weight, model.up.bias)]
    half = torch.full_like(row, 0.5)  # the rows `forms` reads (scratch)
    silu = F.silu(F.linear(half, model.gate.weight, model.gate.bias))
    wanted_at_half = [silu, silu * F.linear(half, model.up.weight, model.up.bias)]
    for got, want in [(library(row, weight, bias), wanted), (fused(row, weight, bias), wanted),
                      (forms[0](weight, bias), wanted_at_half), (forms[1](weight, bias), wanted_at_half)]:
        assert len(got) == 2
        assert all(any(torch.allclose(g.float(), w.float(), rtol=2 ** -6, atol=2 ** -6 * w.float().abs().max().item())
                       for g in got) for w in want)


def test_an_op_a_norm_reads_after_the_product_is_not_taken_in():
    """Squared for the norm's mean, the product's result is computed into the norm's kernel in
    either form: nothing to count against cuBLAS's, so the product has no region."""
    ep = torch.export.export(SelfNormed().to(torch.bfloat16).eval(), (torch.randn(1, 1, 64, dtype=torch.bfloat16),))
    gm = ep.graph_module
    (product,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert gemv._after(product, []) == []
    (square,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.pow.Tensor_Scalar]
    assert square in product.users  # (the square reads the product directly: the case above)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mlp", ["merged", "chunked"])
def test_on_the_gpu_a_region_is_timed_as_its_two_compiled_forms_and_the_program_equals_eager(monkeypatch, mlp):
    """A norm, gate/up and SiLU * up at Llama-1B's width (gate and up merged by ferry, or one
    product chunked in two as Phi-3 writes it): both forms compile with Inductor on the GPU and
    agree, the decision is named by what the reduction takes in and carries both times, and the
    program, whichever form won, follows eager call after call."""
    outputs, returned, measured = [], [], []
    real, real_measure = gemv.Region.forms, gemv.measure

    def forms(self, gm, device):
        made = real(self, gm, device)
        weight, bias = gemv._weights(gm, self.product)
        outputs.append([f(weight, bias) for f in made])
        returned.append(made)
        return made

    monkeypatch.setattr(gemv.Region, "forms", forms)
    monkeypatch.setattr(gemv, "measure", lambda w, b, *f: measured.append(f) or real_measure(w, b, *f))
    torch.manual_seed(5)
    model = (NormedMLP(2048, 8192) if mlp == "merged" else ChunkedMLP(2048, 8192, norm=True))
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    rows = 2 if mlp == "merged" else 1
    args = tuple(torch.randn(1, 1, 2048, dtype=torch.bfloat16, device="cuda") for _ in range(rows))
    program = ferry.compile(torch.export.export(model, args),
                            ferry.OpSupportPartitioner("cuda:0", backend_id="inductor"),
                            ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(
                                skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)))
    module = ferry.Module(program, cuda_graphs=True)
    for _ in range(3):
        args = tuple(torch.randn(1, 1, 2048, dtype=torch.bfloat16, device="cuda") for _ in range(rows))
        got, want = module(*args), model(*args)
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.float().abs().max().item())
    (library, fused), = outputs
    assert tuple(returned[0]) in measured  # timed in the order made: cuBLAS's form first
    assert torch.allclose(fused[0].float(), library[0].float(), rtol=2 ** -6,
                          atol=2 ** -6 * library[0].float().abs().max().item())
    (made,) = [d for d in DECISIONS.values(timed=True) if d.shape == "2048->16384 (+ norm, silu, mul) bfloat16"]
    assert all(0 < t < 1e4 for t in made.times_us)


class LastToken(torch.nn.Module):
    """A prefill's head: a dynamic number of positions in, one product over the last one out."""

    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 80, bias=False)
        self.out = torch.nn.Linear(80, 24, bias=False)

    def forward(self, x):
        return self.out(torch.relu(self.head(torch.tanh(self.mix(x))[:, -1:])))


def test_a_dynamic_graphs_one_row_products_are_left_to_cublas_and_equal_eager_at_sizes_large_small_large(
        timed_on_cpu):
    """A prefill's head takes one row in a graph of dynamic sizes: no choice is made there (a
    reduction needs the tuning, and tuning such a graph compiles every candidate configuration of
    every kernel and tunes at the first size only), even where the clock says a reduction is faster."""
    torch.manual_seed(7)
    model = LastToken().to(torch.bfloat16).eval()
    seq = torch.export.Dim("seq", min=2, max=16)
    ep = torch.export.export(model, (torch.randn(1, 16, 32, dtype=torch.bfloat16),), dynamic_shapes=({1: seq},))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    timed_on_cpu.update({(80, 32): (10.0, 5.0), (24, 80): (10.0, 5.0)})
    module = ferry.Module(program)
    for n in (16, 3, 16, 9):
        x = torch.randn(1, n, 32, dtype=torch.bfloat16)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "Inductor could not compile")  # compiled, not run op by op
            got = module(x)
        want = model(x)
        assert got.shape == want.shape == (1, 1, 24)
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    assert DECISIONS.values(timed=True) == []


def _product_graph(form: str, rows: int, device: str = "cpu"):
    """A graph of one product of `rows` rows, as `form` computes it, and its shapes (never run)."""
    aten = torch.ops.aten
    module = torch.nn.Module()
    module.register_buffer("w", torch.zeros(48, 32, dtype=torch.float32 if form == "fp32 linear" else torch.int8,
                                            device=device))
    module.register_buffer("b", torch.zeros(48, dtype=torch.bfloat16, device=device))
    g = torch.fx.Graph()
    x, w, b = g.placeholder("x"), g.get_attr("w"), g.get_attr("b")
    cast = g.call_function(aten._to_copy.default, (w,), {"dtype": torch.bfloat16})
    row = [rows, 32]
    if form == "int8 mm":
        out = g.call_function(aten.mm.default, (x, g.call_function(aten.t.default, (cast,))))
    elif form == "int8 addmm":
        out = g.call_function(aten.addmm.default, (b, x, g.call_function(aten.t.default, (cast,))))
    elif form == "int8 linear":
        out, row = g.call_function(aten.linear.default, (x, cast)), [1, rows, 32]
    elif form == "fp32 linear":  # a classifier's head at batch 1: no candidate, nothing quantized
        out = g.call_function(aten.linear.default, (x, w))
    else:
        out = g.call_function(getattr(aten, form).default, (x, w, b))
    g.output((out,))
    shapes = {n: torch.empty(0, device="meta") for n in g.nodes}
    shapes[x] = torch.empty(row, dtype=torch.float32 if form == "fp32 linear" else torch.bfloat16, device="meta")
    return torch.fx.GraphModule(module, g), shapes


@pytest.mark.parametrize("form", ["int8 mm", "int8 addmm", "int8 linear", "_weight_int8pack_mm", "fp32 linear"])
@pytest.mark.parametrize("rows, static, timed, tuned", [
    (1, True, True, True),  # a decode step: its kernels tuned
    (4, True, True, False),
    (1, False, True, False),  # dynamic sizes: tuned at one size, kept for all, every candidate compiled
    (1, True, False, False),  # a device whose kernels are not tuned
])
def test_a_quantized_decode_step_is_tuned_and_nothing_else_whatever_the_process_config_says(
        monkeypatch, form, rows, static, timed, tuned):
    """A one-row product of a quantized weight is no candidate for the timed choice, but the graph
    holding it is a decode step all the same (int8's cast and `mm` are one reduction over the int8
    weight only under the tuning); an fp32 head of one row is not. Every key of the settings is
    set, so a process-wide setting (torchao's `quantize_` turns the search on) does not reach it."""
    if timed:
        monkeypatch.setattr(gemv, "TIMED_ON", frozenset({"cuda", "cpu"}))
    gm, shapes = _product_graph(form, rows)
    before = [n.target for n in gm.graph.nodes]
    got = gemv.settings(gm, shapes, static=static)
    assert got == (gemv.TUNING if tuned and form != "fp32 linear" else gemv.UNTUNED)
    assert set(got) == set(gemv.TUNING) == set(gemv.UNTUNED) and got["coordinate_descent_check_all_directions"] is False
    assert [n.target for n in gm.graph.nodes] == before  # nothing to choose: the graph is unchanged


class _Seen:
    """Inductor's tuning settings as each compile of a delegate saw them (a post-grad pass runs inside it)."""

    def __init__(self):
        from torch._inductor.custom_graph_pass import CustomGraphPass

        seen = self.settings = []

        class Spy(CustomGraphPass):
            def __call__(self, graph):
                cfg = torch._inductor.config
                seen.append((cfg.coordinate_descent_tuning, cfg.coordinate_descent_check_all_directions))

            def uuid(self):
                return None  # never cached: every compile lowers

        self.spy = Spy()


@pytest.mark.parametrize("dynamic", [True, False])
def test_torchaos_process_wide_tuning_does_not_reach_a_delegates_compile(timed_on_cpu, dynamic):
    """torchao's `quantize_` sets coordinate-descent tuning, every direction checked, for the whole
    process (`recommended_inductor_config_setter`); ferry's load of an int4 model's dynamic prefill
    then took 116 s for one layer. A delegate is compiled with ferry's settings: a dynamic graph
    untuned (its recompile at one row too), a decode step tuned without the all-directions search;
    and still equals eager."""
    seen = _Seen()
    timed_on_cpu.update({(192, 64): (10.0, 5.0), (64, 96): (10.0, 9.8)})
    torch.manual_seed(5)
    model = Step().to(torch.bfloat16).eval()
    rows = torch.export.Dim("rows", min=1, max=8)
    example = torch.randn(1, 4 if dynamic else 1, 64, dtype=torch.bfloat16)
    ep = torch.export.export(model, (example,), dynamic_shapes=({1: rows},) if dynamic else None)
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor")))
    torchao_leaves = dict(coordinate_descent_tuning=True, coordinate_descent_check_all_directions=True)
    with torch._inductor.config.patch(post_grad_custom_post_pass=seen.spy, force_disable_caches=True,
                                      **torchao_leaves):
        for n in ([3, 8, 1, 2] if dynamic else [1, 1]):
            x = torch.randn(1, n, 64, dtype=torch.bfloat16)
            want = model(x)
            got = module(x)
            assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    assert seen.settings and set(seen.settings) == {(not dynamic, False)}, seen.settings

"""A residual add and the layer norm of its sum as one `ferry::add_layer_norm` (choices/norms.py
`residual_norms` at compile time, `form` at load; ops/layer_norm.py): equal to eager bit for bit
where the op runs as its two ATen calls (the CPU, the emulated device), what stays apart, and on
a GPU the one Triton kernel against eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ferry
from ferry.choices import hook, norms
from ferry.choices.decisions import DECISIONS, Site
from ferry.ops import layer_norm as rows_norm
from test_layout_chains import compiled
from test_norm_choice import assert_as_close_as_atens, needs_gpu_triton, on_gpu_inputs

FUSED = "ferry::add_layer_norm.default"
NORM = "aten::layer_norm.default"
CAPTURED = Site(measure=True, captured=True)


class PreNorm(torch.nn.Module):
    """A vision transformer's blocks: `x = x + f(norm(x))`, the sum read by the next norm and the
    next residual; the last sum normalised and returned."""

    def __init__(self, width=96, blocks=2, affine=True):
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width, elementwise_affine=affine) for _ in range(blocks))
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))
        self.final = torch.nn.LayerNorm(width)

    def forward(self, x):
        for norm, fc in zip(self.norms, self.fcs):
            x = x + fc(norm(x))
        return self.final(x), x


class PostNorm(torch.nn.Module):
    """BERT's: `norm(h + x)`, the sum read by the norm only."""

    def __init__(self, width=64):
        super().__init__()
        self.fc, self.norm = torch.nn.Linear(width, width), torch.nn.LayerNorm(width, eps=1e-12)

    def forward(self, x):
        return self.norm(self.fc(x) + x)


def _equal_to_eager(program, model, shape, calls=3):
    module = ferry.Module(ferry.load_program(program.to_bytes()))  # saved and loaded
    for _ in range(calls):
        x = torch.randn(shape)
        with torch.no_grad():
            want = model(x)
        got = module(x)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("model, shape, fused, alone", [(PreNorm(), (2, 49, 96), 2, 1), (PostNorm(), (3, 8, 64), 1, 0),
                                                        (PreNorm(affine=False), (1, 4, 96), 2, 1)])
def test_each_norm_of_a_sum_takes_the_add_in_and_the_program_equals_eager(emu, model, shape, fused, alone):
    torch.manual_seed(0)
    program, ran, notes = compiled(model, torch.randn(shape))
    assert ran[FUSED] == fused and ran[NORM] == alone, ran
    assert ran["aten::add.out"] == 0 and ran["aten::add.Tensor"] == 0, ran
    assert "run as one ferry::add_layer_norm" in notes
    _equal_to_eager(program, model, shape)


def test_the_switch_and_a_cpu_delegate_keep_the_add_apart(emu):
    torch.manual_seed(0)
    model, x = PreNorm(), torch.randn(2, 49, 96)
    _, on_cpu, _ = compiled(model, x, device="cpu")
    assert on_cpu[FUSED] == 0 and on_cpu[NORM] == 3, on_cpu
    norms.RESIDUALS = False
    try:
        _, off, _ = compiled(model, x)
    finally:
        norms.RESIDUALS = True
    assert off[FUSED] == 0 and off[NORM] == 3, off


class Apart(torch.nn.Module):
    """A sum the fused op does not take, then its norm."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.norm = torch.nn.LayerNorm(16)
        self.register_buffer("row", torch.randn(16))

    def forward(self, x, y):
        if self.kind == "broadcast":
            return self.norm(x + self.row)
        if self.kind == "alpha":
            return self.norm(torch.add(x, y, alpha=0.5))
        if self.kind == "transposed operand":
            return self.norm(x + y.transpose(1, 2))
        if self.kind == "two dims normalised":
            return F.layer_norm(x + y, [8, 16])
        if self.kind == "another dtype":
            return self.norm(x + y.to(torch.bfloat16))  # (promoted to float32)
        if self.kind == "float64":
            return F.layer_norm(x.double() + y.double(), [16])
        if self.kind == "weight computed":
            return F.layer_norm(x + y, [16], y[0, 0])
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["broadcast", "alpha", "transposed operand", "two dims normalised", "another dtype",
                                  "float64", "weight computed"])
def test_what_keeps_the_add_and_the_norm_apart(emu, kind):
    torch.manual_seed(0)
    x, y = torch.randn(2, 8, 16), torch.randn(2, 16, 8) if kind == "transposed operand" else torch.randn(2, 8, 16)
    model = Apart(kind).eval()
    program, ran, _ = compiled(model, x, y)
    assert ran[FUSED] == 0, ran
    module = ferry.Module(program)
    with torch.no_grad():
        torch.testing.assert_close(module(x, y), model(x, y), rtol=0, atol=0)


def test_a_dynamic_batch_is_fused_and_equals_eager_at_each_size(emu):
    torch.manual_seed(0)
    model = PreNorm().eval()
    batch = torch.export.Dim("batch", max=8)
    program, ran, _ = compiled(model, torch.randn(4, 7, 96), dynamic_shapes={"x": {0: batch}})
    assert ran[FUSED] == 2, ran
    module = ferry.Module(program)
    for rows in (8, 1, 8, 3):  # large, small, large again, between
        x = torch.randn(rows, 7, 96)
        with torch.no_grad():
            want = model(x)
        for g, w in zip(module(x), want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


# ---------------------------------------------------------------- the choice at load (timing faked)


@pytest.fixture
def triton_here(monkeypatch):
    monkeypatch.setattr(rows_norm, "available", lambda: True)


def _args(rows=3136, width=96, dtype=torch.float32, residual=None):
    x = torch.randn(1, rows, width, dtype=dtype)
    r = torch.randn(1, rows, width, dtype=dtype) if residual is None else residual
    return [x, r, [width], torch.randn(width, dtype=dtype), torch.randn(width, dtype=dtype), 1e-5]


@pytest.mark.parametrize("times, taken", [((4.0, 2.0), True), ((4.0, 3.9), False)])
def test_one_kernel_is_kept_where_it_saves_ten_percent(times, taken, timed, triton_here):
    timed.times = times
    args = _args()
    chosen = hook.choose(rows_norm.ADD_LAYER_NORM, args, {}, CAPTURED)
    made = {d.op: d for d in DECISIONS.values(timed=True)}
    assert set(made) == {"aten::layer_norm", "ferry::add_layer_norm"}, made
    fused = made["ferry::add_layer_norm"]
    assert fused.taken is taken and fused.forms == norms.FUSED_FORMS and fused.shape == "3136x96 float32"
    assert chosen is (rows_norm.add_layer_norm if taken else norms.ADD_THEN_NORM)
    assert timed.calls == 2  # the norm alone, then the fused op: each once per key
    hook.choose(rows_norm.ADD_LAYER_NORM, _args(), {}, CAPTURED)
    assert timed.calls == 2


def test_apart_the_norm_runs_in_the_form_its_own_timing_chose(timed, triton_here, monkeypatch):
    ran = []
    monkeypatch.setattr(rows_norm, "layer_norm", lambda *a, **k: ran.append(a[0].shape) or F.layer_norm(*a[:4]))
    monkeypatch.setattr(norms, "fused_decision", lambda *a, **k: None)  # the fused kernel not taken
    timed.times = (4.0, 1.0)  # the norm alone: Triton's
    args = _args(rows=8, width=16)
    chosen = hook.choose(rows_norm.ADD_LAYER_NORM, args, {}, CAPTURED)
    ran.clear()  # (the timing ran it too)
    total, y = chosen(*args)
    assert ran == [(1, 8, 16)] and torch.equal(total, args[0] + args[1])
    torch.testing.assert_close(y, F.layer_norm(args[0] + args[1], [16], args[3], args[4], 1e-5), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["uncaptured", "residual broadcast", "residual transposed", "residual of another dtype"])
def test_what_keeps_the_fused_kernel_untimed(case, timed, triton_here):
    timed.times = (4.0, 4.0)  # the norm alone: ATen's
    args, site = _args(rows=8, width=16), CAPTURED
    if case == "uncaptured":
        site = Site(measure=True, captured=False)
    elif case == "residual broadcast":
        args[1] = torch.randn(16)
    elif case == "residual transposed":
        args[1] = torch.randn(1, 16, 8).transpose(1, 2)
    elif case == "residual of another dtype":
        args[1] = args[1].double()
    assert norms.fused_decision(args, {}, site) is None
    assert hook.choose(rows_norm.ADD_LAYER_NORM, args, {}, site) is norms.ADD_THEN_NORM  # the op's ATen calls


# ---------------------------------------------------------------- the kernel, on a GPU


@pytest.mark.cuda
@pytest.mark.parametrize("rows, width", [(3136, 96), (49, 768), (1, 1), (197, 768), (5, 1000), (3, 8192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("affine", [True, False])
def test_the_gpu_kernel_adds_as_eager_and_normalises_within_rounding(rows, width, dtype, affine):
    needs_gpu_triton()
    x, w, b = on_gpu_inputs(rows, width, dtype, affine)
    r = on_gpu_inputs(rows + 1, width, dtype, False)[0][:rows]
    total, got = rows_norm.add_layer_norm(x, r, [width], w, b, 1e-6)
    assert torch.equal(total, x + r)  # the sum rounded as eager's add rounds it
    assert_as_close_as_atens(got, total, w, b, 1e-6)


@pytest.mark.cuda
def test_on_the_gpu_a_captured_pre_norm_stack_takes_the_kernel_and_equals_eager(fresh, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from ferry.choices import timing

    monkeypatch.setattr(timing, "KEEP_IF_ABOVE", 10.0)  # kept at whatever time: the results are what is tested
    torch.manual_seed(0)
    model = PreNorm(blocks=3).eval()
    x = torch.randn(1, 3136, 96)
    program = ferry.compile(torch.export.export(model, (x,)), ferry.OpSupportPartitioner("cuda:0"))
    module = ferry.Module(program, cuda_graphs=True)
    module.load_method()
    made = [d for d in DECISIONS.values(timed=True) if d.op == "ferry::add_layer_norm"]
    assert made and all(d.taken for d in made), made
    cuda_model = model.cuda()
    for _ in range(3):
        x = torch.randn(1, 3136, 96)
        with torch.no_grad():
            want = cuda_model(x.cuda())
        for g, w in zip(module(x), want):
            torch.testing.assert_close(g, w.cpu(), rtol=1e-5, atol=1e-5)


def test_a_weight_a_rewrite_put_after_the_add_is_read_from_before_it():
    """A constant made by an earlier rewrite may sit after the add (get_attr nodes go where they
    are made): it is moved before the fused op, and the graph stays in order."""
    root = torch.nn.Module()
    root.w, root.b = torch.randn(16), torch.randn(16)
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    total = g.call_function(torch.ops.aten.add.Tensor, (x, y))
    w, b = g.get_attr("w"), g.get_attr("b")
    normed = g.call_function(torch.ops.aten.layer_norm.default, (total, [16], w, b, 1e-5))
    g.output((normed, total))
    xv, yv = torch.randn(4, 16), torch.randn(4, 16)
    for node, val in ((x, xv), (y, yv), (total, xv + yv), (w, root.w), (b, root.b),
                      (normed, F.layer_norm(xv + yv, [16], root.w, root.b))):
        node.meta["val"] = val
    gm = torch.fx.GraphModule(root, g)
    assert len(norms.residual_norms(gm)) == 1
    gm.graph.lint()  # every node after what it reads
    gm.recompile()
    got = gm(xv, yv)
    assert torch.equal(got[1], xv + yv)
    torch.testing.assert_close(got[0], F.layer_norm(xv + yv, [16], root.w, root.b), rtol=0, atol=0)

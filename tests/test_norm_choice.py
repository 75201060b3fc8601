"""Layer norms of many short rows: ATen's kernel or ops/layer_norm.py's Triton kernel, timed at
load in a captured plan (choices/norms.py). On the CPU the op's ATen path stands in for the
GPU's kernel and the timing is faked; the kernel itself is tested on a GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import ferry
from ferry.capture import TimingRoom
from ferry.choices import hook, norms, timing
from ferry.choices.decisions import DECISIONS, Site
from ferry.ops import layer_norm as rows_norm

LAYER_NORM = torch.ops.aten.layer_norm.default
CAPTURED = Site(measure=True, captured=True)


@pytest.fixture
def triton_here(monkeypatch):
    """As if Triton imported: the op's ATen path (the same arithmetic) stands in for the GPU's."""
    monkeypatch.setattr(rows_norm, "available", lambda: True)


def _args(rows=3136, width=96, dtype=torch.float32, weight=True, bias=True):
    x = torch.randn(1, rows, width, dtype=dtype)
    w = torch.randn(width, dtype=dtype) if weight else None
    b = torch.randn(width, dtype=dtype) if bias else None
    return [x, [width], w, b, 1e-5]


@pytest.mark.parametrize("times, taken", [((4.0, 1.5), True), ((4.0, 3.6), True), ((4.0, 3.7), False),
                                          ((4.0, 5.0), False)])
def test_the_triton_kernel_is_kept_where_it_saves_ten_percent(times, taken, timed, triton_here):
    timed.times = times
    args = _args()
    made = norms.decision(args, {}, CAPTURED)
    assert made is not None and made.taken is taken and made.forms == norms.FORMS and made.times_us == times
    assert made.shape == "3136x96 float32"
    assert (hook.choose(LAYER_NORM, args, {}, CAPTURED) is rows_norm.layer_norm) is taken
    assert timed.calls == 1  # decided once per key


class LendingStreams:
    """A captured plan's streams on a GPU whose load left `room` bytes free in its graph pool."""

    def __init__(self, room: int):
        self.api = type("Api", (), {"device_type": "cuda"})()
        self.room, self.asked = room, []

    def capture_stream(self, index):
        return "capture stream"

    def timing_room(self, index, nbytes):
        self.asked.append((index, nbytes))
        return TimingRoom("the plan's pool", contextlib.nullcontext) if nbytes <= self.room else None


@pytest.mark.parametrize("op, buffers", [("layer norm", 1), ("add + layer norm", 2), ("rms norm", 3)])
@pytest.mark.parametrize("room", ["enough", "too little"])
def test_a_norm_is_timed_with_its_results_in_the_room_the_plan_left(op, buffers, room, timed, triton_here, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    x, shape, w, b, eps = _args(rows=64, width=32, dtype=torch.bfloat16)
    needed = buffers * x.numel() * 4  # fp32 buffers of x's size the forms hold at once at most
    streams = LendingStreams(needed if room == "enough" else needed - 1)
    site = Site(measure=True, captured=True, streams=streams)
    if op == "layer norm":
        made = norms.decision([x, shape, w, b, eps], {}, site)
    elif op == "add + layer norm":
        made = norms.fused_decision([x, torch.randn_like(x), shape, w, b, eps], {}, site)
    else:
        made = norms.rms_decision([x, w, eps], {}, site)
    assert made is not None and streams.asked == [(0, needed)]
    (lent,) = timed.rooms
    assert (lent is not None and lent.pool == "the plan's pool") is (room == "enough")


@pytest.mark.parametrize("case", ["uncaptured", "no triton", "not contiguous", "two dims", "weight of another dtype",
                                  "too wide", "fp64", "deterministic"])
def test_what_keeps_atens_kernel_untimed(case, timed, triton_here, monkeypatch):
    args, site = _args(), CAPTURED
    if case == "uncaptured":
        site = Site(measure=True, captured=False)
    elif case == "no triton":
        monkeypatch.setattr(rows_norm, "available", lambda: False)
    elif case == "not contiguous":
        args[0] = torch.randn(1, 96, 3136).transpose(1, 2)
    elif case == "two dims":
        args[0], args[1], args[2], args[3] = torch.randn(4, 8, 12), [8, 12], None, None
    elif case == "weight of another dtype":
        args[0] = args[0].to(torch.bfloat16)
    elif case == "too wide":
        args = _args(rows=2, width=rows_norm.MAX_WIDTH + 1)
    elif case == "fp64":
        args = _args(dtype=torch.float64)
    elif case == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert hook.choose(LAYER_NORM, args, {}, site) is None
    assert timed.calls == 0


class Norms(torch.nn.Module):
    """Swin's norms: a wide one over many rows, then a residual and a narrower one."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.LayerNorm(96), torch.nn.LayerNorm(96, elementwise_affine=False)
        self.fc = torch.nn.Linear(96, 96)

    def forward(self, x):
        h = self.fc(self.a(x))
        return self.b(x + h)


def test_a_captured_plan_runs_the_kernel_where_timed_faster_and_equals_eager(timed, triton_here, emu, monkeypatch):
    """The plumbing, on the emulated device (where the op is ATen's path): each norm of the plan is
    timed at load, the chosen form is what every call runs, and the results are eager's. The
    kernel's numbers are the GPU tests' below."""
    ran = []
    for name in ("layer_norm", "add_layer_norm"):
        real = getattr(rows_norm, name)
        monkeypatch.setattr(rows_norm, name, lambda *a, real=real, name=name, **k: ran.append(name) or real(*a, **k))
    calls = captured_norms_equal_eager("emu:0")
    next(calls)  # loaded (the timing ran the form too)
    ran.clear()
    for _ in calls:
        assert ran == ["layer_norm", "add_layer_norm"]  # the second norm reads a residual add: one op
        ran.clear()


def captured_norms_equal_eager(device):
    """Norms compiled for `device` and loaded with graphs, both norms decided (taken); then three
    calls, each equal to eager. A generator: it stops after the load and after each call."""
    torch.manual_seed(0)
    model = Norms().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(1, 3136, 96),)), ferry.OpSupportPartitioner(device))
    module = ferry.Module(program, cuda_graphs=True)
    module.load_method()
    made = [d for d in DECISIONS.values(timed=True) if d.family == "layer norm"]
    # each norm alone, and the second with its residual add
    assert sorted(d.op for d in made) == ["aten::layer_norm"] * 2 + ["ferry::add_layer_norm"], made
    assert {d.shape for d in made} == {"3136x96 float32"} and all(d.taken for d in made), made
    yield
    for _ in range(3):
        x = torch.randn(1, 3136, 96)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-5)
        yield


def on_gpu_inputs(rows, width, dtype, affine):
    g = torch.Generator(device="cuda").manual_seed(rows + width)
    x = torch.randn(rows, width, device="cuda", dtype=dtype, generator=g) * 3 + 1
    w = torch.randn(width, device="cuda", dtype=dtype, generator=g) if affine else None
    b = torch.randn(width, device="cuda", dtype=dtype, generator=g) if affine else None
    return x, w, b


@pytest.mark.cuda
@pytest.mark.parametrize("rows, width", [(3136, 96), (784, 192), (49, 768), (1, 1), (197, 768), (5, 1000),
                                         (3, 8192), (4096, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("affine", [True, False])
def test_the_gpu_kernel_equals_atens_within_rounding(rows, width, dtype, affine):
    needs_gpu_triton()
    x, w, b = on_gpu_inputs(rows, width, dtype, affine)
    assert_as_close_as_atens(rows_norm.layer_norm(x, [width], w, b, 1e-6), x, w, b, 1e-6)


def assert_as_close_as_atens(got, x, w, b, eps):
    """`got`, a layer norm of `x` over its last dim, is no further from fp64's than ATen's own
    kernel, give or take one rounding of the dtype."""
    width = [x.shape[-1]]
    want = F.layer_norm(x.double(), width, None if w is None else w.double(), None if b is None else b.double(), eps)
    assert_as_close_as(got, F.layer_norm(x, width, w, b, eps), want)


def assert_as_close_as(got, eager, want):
    """`got` is no further from `want` (fp64's result) than `eager` is, give or take four
    roundings of the dtype, and has eager's dtype, shape and layout."""
    assert got.dtype == eager.dtype and got.shape == eager.shape and got.is_contiguous()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[eager.dtype]
    assert (got.double() - want).abs().max().item() <= (eager.double() - want).abs().max().item() + tol * 4


def needs_gpu_triton():
    """Skips without a GPU; with one, Triton must import (the kernels under test are built from it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert rows_norm.available(), "Triton does not import beside this CUDA build"


@pytest.mark.cuda
def test_on_the_gpu_a_captured_plan_takes_the_kernel_and_equals_eager(fresh, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(timing, "KEEP_IF_ABOVE", 10.0)  # kept at whatever time: the results are what is tested
    for _ in captured_norms_equal_eager("cuda:0"):
        pass


class NormsBetweenProducts(torch.nn.Module):
    """Swin-T's first stage in small: layer norms of 3,136 rows of 96 (1.15 MiB each in fp32,
    which a pool of the timing's own would put in a 20 MiB segment)."""

    def __init__(self, layers=3):
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(96) for _ in range(layers))
        self.products = torch.nn.ModuleList(torch.nn.Linear(96, 96) for _ in range(layers))

    def forward(self, x):
        for norm, product in zip(self.norms, self.products):
            x = torch.nn.functional.gelu(product(norm(x)))
        return x


@pytest.mark.cuda
def test_on_the_gpu_the_load_times_norms_in_the_room_its_plan_left_and_calls_equal_eager(fresh, full_fp32,
                                                                                       monkeypatch):
    from ferry.runtime.devices.streams import CopyStreams

    needs_gpu_triton()
    lent, lend = [], CopyStreams.timing_room
    monkeypatch.setattr(CopyStreams, "timing_room", lambda self, *a: lent.append(lend(self, *a)) or lent[-1])
    model = NormsBetweenProducts().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(1, 3136, 96),)), ferry.OpSupportPartitioner("cuda:0"))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    try:
        module = ferry.Module(program, cuda_graphs=True)
        module.load_method()
        events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert [d for d in DECISIONS.values(timed=True) if d.family == "layer norm"]  # the norms were timed at load
    assert lent and all(room is not None for room in lent)  # in the room the load left behind its allocation
    # (the capture stream's cuBLAS workspace, made for the timing, is the plan's captures' too)
    by_norms = [e["size"] for e in events if e["action"] == "segment_alloc"
                and any(f["filename"].endswith("choices/norms.py") for f in e.get("frames", []))
                and not any(f["name"] == "keep_workspace" for f in e.get("frames", []))]
    assert [n for n in by_norms if n > 2 << 20] == []  # no segment for a result (a small block's 2 MiB may be)
    cuda_model = model.cuda()
    for _ in range(3):
        x = torch.randn(1, 3136, 96)
        with torch.no_grad():
            torch.testing.assert_close(module(x), cuda_model(x.cuda()).cpu(), rtol=1e-4, atol=1e-4)

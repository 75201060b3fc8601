"""A biased fp32 GEMM runs as `mm` and then the bias where the GPU measures that faster than
`addmm` (ferry/choices/gemm.py, asked through ferry/choices/hook.py). On the CPU the timing is
faked; the choice, its limits, its cache and the bound steps that use it are real, and results are
checked against eager."""

import math
import threading

import pytest
import torch

import ferry
from ferry.choices import gemm as gemm_choice
from ferry.choices import hook
from ferry.choices import timing as kernel_timing
from ferry.choices.decisions import DECISIONS, Site

ADDMM_OUT = torch.ops.aten.addmm.out
LOADING = Site(measure=True)  # a method loading: a new shape may be timed
IN_A_CALL = Site(measure=False)  # a plan bound during a call: only what load decided


def operands(rows=6, inner=5, cols=7, dtype=torch.float32, meta=("mat1", "out")):
    made = {"bias": torch.randn(cols, dtype=dtype), "mat1": torch.randn(rows, inner, dtype=dtype),
            "mat2": torch.randn(cols, inner, dtype=dtype).t(), "out": torch.empty(rows, cols, dtype=dtype)}
    return [t.to("meta") if name in meta else t for name, t in made.items()]


def chosen(bias, mat1, mat2, out, beta=1, alpha=1, site=LOADING):
    """What the binder's hook answers for `addmm.out(bias, mat1, mat2, beta=, alpha=, out=)`."""
    kwargs = {"out": out} | ({"beta": beta} if beta != 1 else {}) | ({"alpha": alpha} if alpha != 1 else {})
    return hook.choose(ADDMM_OUT, [bias, mat1, mat2], kwargs, site)


def gemms():
    """The biased GEMMs this process decided."""
    return [d for d in DECISIONS.values() if d.family == "biased GEMM"]


def dims(d):
    """(rows, inner, cols) of a GEMM decision, from its shape ("6x5x7 float32")."""
    return tuple(int(n) for n in d.shape.split()[0].split("x"))


def test_split_is_chosen_only_where_measured_faster_by_a_margin(timed):
    assert chosen(*operands()) is gemm_choice.mm_then_add  # 40 against 100 µs
    timed.times = (100.0, 95.0)  # under 10% faster: eager's addmm stays
    assert chosen(*operands(rows=9)) is None
    timed.times = (6.5, 5.0)  # 23% faster but 1.5 µs: less than the second launch costs
    assert chosen(*operands(rows=10)) is None
    made = {(dims(d)[0], d.taken) for d in gemms()}
    assert made == {(6, True), (9, False), (10, False)}


def test_the_serving_batches_split_gemms_are_timed(timed):
    """BERT batch 8's and ViT-B/16 batch 4's 3072 -> 768 GEMMs gained most from the split (H200:
    155 against 119 µs, 176 against 101): the size limit must leave them timed."""
    for rows in (1024, 788):
        assert chosen(*operands(rows=rows, inner=3072, cols=768)) is gemm_choice.mm_then_add
    assert timed.calls == 2


def test_each_shape_and_layout_is_measured_once(timed):
    for _ in range(3):
        chosen(*operands())
    assert timed.calls == 1
    bias, mat1, mat2, out = operands()
    chosen(bias, mat1, mat2.contiguous(), out)  # another layout of the weight
    chosen(*operands(inner=3))
    assert timed.calls == 3


@pytest.mark.parametrize("case", ["bf16", "beta", "alpha", "2-D bias", "mixed dtypes", "no real tensor", "large",
                                  "deterministic"])
def test_what_is_never_split(case, timed, monkeypatch):
    """Half precision would round the product before the bias; scaled products are not a plain
    mm + bias; without a real tensor there is nothing to say which GPU it runs on; a large GEMM
    is not worth its timing; deterministic algorithms get eager's kernel, whatever the timing."""
    if case == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    bias, mat1, mat2, out = operands(dtype=torch.bfloat16 if case == "bf16" else torch.float32,
                                     meta=("bias", "mat1", "mat2", "out") if case == "no real tensor" else ("out",),
                                     **({"rows": 8192, "inner": 1024, "cols": 2048} if case == "large" else {}))
    beta = 0.5 if case == "beta" else 1
    alpha = 2 if case == "alpha" else 1
    if case == "2-D bias":
        bias = bias.expand(out.shape)
    if case == "mixed dtypes":
        mat1 = mat1.double()
    assert chosen(bias, mat1, mat2, out, beta, alpha) is None
    assert timed.calls == 0


def test_measuring_never_writes_the_real_output(timed):
    """A planned output is bound as a real tensor: the measurement writes a stand-in instead."""
    bias, mat1, mat2, out = operands(meta=())
    out.fill_(7.0)
    chosen(bias, mat1, mat2, out)
    assert timed.calls == 1 and bool((out == 7.0).all())


def test_a_decision_made_before_a_capture_holds_during_it(timed, monkeypatch):
    """A shape measured outside a capture keeps its kernel inside one; a shape first met under a
    capture is not timed there (no host waits), and not remembered as addmm's."""
    assert chosen(*operands()) is gemm_choice.mm_then_add
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert chosen(*operands()) is gemm_choice.mm_then_add
    assert chosen(*operands(rows=3)) is None
    assert len(gemms()) == 1  # the shape met under the capture is not remembered (so it is timed below)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert chosen(*operands(rows=3)) is gemm_choice.mm_then_add
    assert timed.calls == 2


def test_only_a_loading_method_times(timed):
    """A plan bound during a call (a new shape, micro-batches) uses what load measured and times
    nothing: no host wait or allocation inside a call."""
    assert chosen(*operands(), site=IN_A_CALL) is None
    assert timed.calls == 0 and gemms() == []
    chosen(*operands())
    assert chosen(*operands(), site=IN_A_CALL) is gemm_choice.mm_then_add
    assert timed.calls == 1


def test_settings_that_change_cublas_kernels_are_measured_apart(timed):
    chosen(*operands())
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = not before
    try:
        chosen(*operands())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert timed.calls == 2


def test_concurrent_loads_measure_each_shape_once(timed):
    threads = [threading.Thread(target=chosen, args=operands()) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert timed.calls == 1 and len(gemms()) == 1


def test_without_a_gpu_nothing_is_measured(fresh, monkeypatch):
    monkeypatch.setattr(kernel_timing, "time_both", lambda *a: pytest.fail("timed on the CPU"))
    assert chosen(*operands()) is None
    assert gemms() == []


def test_no_memory_to_measure_keeps_addmm_and_other_errors_surface(timed, monkeypatch):
    def no_memory(eager, gemm, stream=None):
        raise torch.cuda.OutOfMemoryError("no scratch")
    monkeypatch.setattr(kernel_timing, "time_both", no_memory)
    assert chosen(*operands()) is None

    def broken(eager, gemm, stream=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(kernel_timing, "time_both", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):  # an earlier kernel's fault: not hidden
        chosen(*operands(rows=3))


def test_mm_then_add_equals_addmm():
    bias, mat1, mat2, out = operands(rows=33, inner=17, cols=12, meta=())
    want = torch.addmm(bias, mat1, mat2)
    assert gemm_choice.mm_then_add(bias, mat1, mat2, out=out) is out
    torch.testing.assert_close(out, want)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 48), torch.nn.Linear(48, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("io", ["host", "device output"])
def test_bound_steps_run_the_split_and_equal_eager(io, timed, emu, count_calls):
    """Both GEMMs of a delegate run as mm + bias (the first reads the call's input, the second
    planned memory), with results equal to eager's on fresh inputs, call after call."""
    ran = count_calls(gemm_choice, "mm_then_add")
    model = Mlp().eval()
    skip = io == "device output"  # the result is then made for the caller each call, not planned
    program = ferry.compile(torch.export.export(model, (torch.randn(3, 5, 16),)), ferry.OpSupportPartitioner("emu:0"),
                            ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(False, skip)))
    module = ferry.Module(program)
    module.load_method()  # measures each GEMM once (the fake timer runs the split too)
    assert timed.calls == 2
    ran.clear()
    for _ in range(3):
        x = torch.randn(3, 5, 16)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-6)
    assert len(ran) == 6 and {tuple(args[1].shape) for args in ran} == {(15, 16), (15, 48)}
    assert {dims(d) for d in gemms()} == {(15, 16, 48), (15, 48, 16)}


class Wide(torch.nn.Module):
    """BERT's feed-forward at 128 rows: the shape where cublasLt's split-K choice was slow."""
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(768, 3072), torch.nn.Linear(3072, 768)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kernel", ["measured", "split forced"])
def test_on_cuda_each_gemm_is_measured_and_results_equal_eager(graphs, kernel, fresh, full_fp32, monkeypatch):
    """Whichever kernel the timing picks, and with the split forced (a GPU where it never wins
    would otherwise check only addmm)."""
    if kernel == "split forced":
        monkeypatch.setattr(kernel_timing, "KEEP_IF_ABOVE", math.inf)
        monkeypatch.setattr(kernel_timing, "MIN_SAVING_US", -math.inf)
    model = Wide().eval()
    program = ferry.compile(torch.export.export(model, (torch.randn(1, 128, 768),)),
                            ferry.OpSupportPartitioner("cuda:0"))
    module = ferry.Module(program, cuda_graphs=graphs)
    cuda_model = model.cuda()
    for _ in range(3):
        x = torch.randn(1, 128, 768)
        with torch.no_grad():
            torch.testing.assert_close(module(x), cuda_model(x.cuda()).cpu(), rtol=1e-4, atol=1e-4)
    made = {dims(d): d for d in gemms()}
    assert set(made) == {(128, 768, 3072), (128, 3072, 768)}
    assert all(len(d.times_us) == 2 and min(d.times_us) > 0 and d.device == "cuda:0" for d in made.values())
    assert all(d.forms == ("addmm", "mm + bias") and d.op == "aten::addmm.out" for d in made.values())
    assert kernel == "measured" or all(d.taken for d in made.values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_nothing_is_timed_while_a_graph_is_captured(fresh):
    bias, mat1, mat2, out = (t.cuda() for t in operands(meta=()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert chosen(bias, mat1, mat2, out) is None
    assert gemms() == []



def test_a_method_with_dynamic_rows_times_nothing_during_its_calls(timed, emu):
    """Each new shape of a dynamic method gets a plan bound during its call: it must not time."""
    class AddMM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))

        def forward(self, x):
            return torch.addmm(self.b, x, self.w)

    model = AddMM().eval()
    ep = torch.export.export(model, (torch.randn(4, 16),), dynamic_shapes=({0: torch.export.Dim("rows", max=64)},))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("emu:0")))
    module.load_method()
    at_load = timed.calls
    for rows in (4, 9, 33, 9, 33):
        x = torch.randn(rows, 16)
        with torch.no_grad():
            torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-5)
    assert timed.calls == at_load

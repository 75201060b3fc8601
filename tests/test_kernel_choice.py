"""Which kernel computes each op: its .out overload into planned memory, or the functional one
(no out variant, a wrapper .out that computes into a temporary and copies, an eager layout)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ferry
from ferry.aot.lower import functional_aten
from ferry.choices import out_kernels
from ferry.choices.decisions import DECISIONS
from ferry.choices.out_kernels import choose_kernel, kernel_for, out_is_wrapper
from ferry.inspect import program_summary
from ferry.program import KernelCall
from models import PermutedRelu, fresh_inputs, small_cnn, transformer_block

aten = torch.ops.aten


def _node(model, inputs, target):
    ep = functional_aten(torch.export.export(model, inputs))
    return next(n for n in ep.graph.nodes if n.target == target)


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return torch.tanh(self.c(x)) + 1


def test_measurement_tells_a_wrapper_from_a_real_out_kernel(fresh, count_calls):
    conv = _node(Conv(), (torch.randn(1, 3, 8, 8),), aten.conv2d.default)
    assert choose_kernel(aten.conv2d.default, conv).pick == "functional"  # no out variant at all
    x = torch.randn(4, 4)
    clone = torch.fx.Graph()
    ph = clone.placeholder("x")
    ph.meta["val"] = x
    node = clone.call_function(aten.clone.default, (ph,))
    node.meta["val"] = x
    measured = count_calls(out_kernels, "_measure")
    assert out_is_wrapper(aten.clone.out, node), "clone.out computes a clone, then copies it"
    assert out_is_wrapper(aten.clone.out, node) and len(measured) == 1  # measured once per overload
    (made,) = [d for d in DECISIONS.values() if d.family == "out kernel" and d.op == "aten::clone.out"]
    assert made.pick == "functional" and not made.times_us and "temporary" in made.why
    add = clone.call_function(aten.add.Tensor, (ph, ph))
    add.meta["val"] = x
    choice = choose_kernel(aten.add.Tensor, add)
    assert choice.pick == "out" and kernel_for(aten.add.Tensor, choice) is aten.add.out


def test_wrappers_run_functionally_and_nothing_is_copied_twice():
    model, example = small_cnn()
    program = ferry.compile(torch.export.export(model, example))
    m = program.method("forward")
    kernels = [i.kernel for i in m.instructions if isinstance(i, KernelCall)]
    assert "aten::_native_batch_norm_legit_no_training.default" in kernels  # not the .out wrapper
    assert not any(k.startswith("aten::copy_") or k.startswith("aten::clone.out") for k in kernels)
    for op, why in m.kernel_choices.items():
        assert op in kernels and why
    assert "computed by their functional kernel" in program_summary(program)
    (x,) = fresh_inputs(example, 5)
    torch.testing.assert_close(ferry.Module(program)(x), model(x), atol=1e-5, rtol=1e-5)


def test_real_out_kernels_still_write_into_planned_memory():
    model, example = transformer_block()
    m = ferry.compile(torch.export.export(model, example)).method("forward")
    outs = [i for i in m.instructions if isinstance(i, KernelCall) and i.kernel.endswith(".out")]
    assert {"aten::linear.out", "aten::add.out", "aten::gelu.out"} <= {i.kernel for i in outs}
    assert all(m.tensor(o).storage in ("planned", "scratch") for i in outs for o in i.outputs)


@pytest.mark.parametrize("partitioner", [None, "emu:0"])
def test_a_layout_eager_gives_is_kept_so_its_views_stay_legal(emu, partitioner):
    model, x = PermutedRelu(), torch.randn(4, 2, 8)
    program = ferry.compile(torch.export.export(model, (x,)), partitioner and ferry.OpSupportPartitioner(partitioner))
    for seed in range(2):
        (x,) = fresh_inputs((x,), seed)
        torch.testing.assert_close(ferry.Module(program)(x), model(x))


class BatchFirstAttention(nn.Module):
    """nn.MultiheadAttention(batch_first=True), as torchvision's ViT uses it: export traces the
    path that transposes the tokens before the input projection."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.att = nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x):
        return self.att(x, x, x, need_weights=False)[0]


def test_a_transposed_gemm_input_is_made_contiguous_once():
    """matmul over a transposed 3-D input runs one small GEMM per row; one copy of the input
    gives the single large GEMM back (2.4x on ViT-B/16)."""
    model, x = BatchFirstAttention().eval(), torch.randn(2, 10, 64)
    program = ferry.compile(torch.export.export(model, (x,)))
    kernels = [i.kernel for i in program.method("forward").instructions if isinstance(i, KernelCall)]
    first_linear = next(i for i, k in enumerate(kernels) if k.startswith("aten::linear"))
    assert kernels[first_linear - 1] == "aten::clone.default" and kernels[first_linear] == "aten::linear.out"
    (x,) = fresh_inputs((x,), 4)
    torch.testing.assert_close(ferry.Module(program)(x), model(x), atol=1e-5, rtol=1e-4)


def test_linear_over_a_batch_of_rows_runs_functionally_on_cuda_only():
    """On CUDA the functional linear folds the batch into one GEMM with the bias fused (addmm);
    linear.out runs the GEMM, then a separate add (two kernels; measured on an H200). On the
    CPU the difference was noise, and .out keeps the result in planned memory."""
    batched = _node(nn.Linear(8, 4), (torch.randn(2, 5, 8),), aten.linear.default)
    flat = _node(nn.Linear(8, 4), (torch.randn(5, 8),), aten.linear.default)
    no_bias = _node(nn.Linear(8, 4, bias=False), (torch.randn(2, 5, 8),), aten.linear.default)
    on_cuda = choose_kernel(aten.linear.default, batched, "cuda")
    assert on_cuda.pick == "functional" and "addmm" in on_cuda.why
    assert kernel_for(aten.linear.default, on_cuda) is aten.linear.default
    assert choose_kernel(aten.linear.default, batched, "cpu").pick == "out"
    assert choose_kernel(aten.linear.default, flat, "cuda").pick == "out"
    assert choose_kernel(aten.linear.default, no_bias, "cuda").pick == "out"


class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x * 2, -1)


def _softmax_kernels(program) -> list[str]:
    return [i.kernel for i in program.method("forward").instructions if "softmax" in getattr(i, "kernel", "")]


def test_a_dynamic_first_use_of_an_overload_does_not_decide_for_every_later_one(fresh):
    """Whether an .out overload copies is measured once per overload: at the size export traced
    when the first use has a dynamic one (it used to count as a wrapper, for the whole process)."""
    dim = torch.export.Dim("rows", max=64)
    dynamic = torch.export.export(Softmax(), (torch.randn(4, 16),), dynamic_shapes=({0: dim},))
    assert _softmax_kernels(ferry.compile(dynamic)) == ["aten::softmax.int_out"]
    static = ferry.compile(torch.export.export(Softmax(), (torch.randn(4, 16),)))
    assert _softmax_kernels(static) == ["aten::softmax.int_out"]
    x = torch.randn(9, 16)
    torch.testing.assert_close(ferry.Module(ferry.compile(dynamic))(x), Softmax()(x))

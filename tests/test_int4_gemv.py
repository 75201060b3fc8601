"""The inductor backend's choice for one-row products of int4 weights (ferry/choices/int4_gemv.py):
tinygemm's kernel on its packed tiles, or a reduction over the plain int4 values, timed at load.
On the CPU the values are learned from the CPU packing (`_weight_int4pack_mm_for_cpu`), the clock
is faked and the rewritten program, compiled by Inductor, is compared with the packed kernel; on
the GPU the same with tinygemm's CUDA tiles and the real clock."""

from __future__ import annotations

import pytest
import torch

import ferry
from ferry.choices import int4_gemv
from ferry.choices.decisions import DECISIONS

aten = torch.ops.aten
CPU_MM = aten._weight_int4pack_mm_for_cpu.default


@pytest.fixture(autouse=True)
def fresh_decisions():
    DECISIONS.forget()
    int4_gemv._TIMES.clear()
    yield
    DECISIONS.forget()
    int4_gemv._TIMES.clear()


@pytest.fixture
def timed_on_cpu(monkeypatch):
    """CPU products are 'timed' too, by a fake clock: (tinygemm, reduction) µs, the same for every shape."""
    clock = {"times": (10.0, 4.0)}
    monkeypatch.setattr(int4_gemv, "TIMED_ON", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(int4_gemv, "measure", lambda *a: clock["times"])
    return clock


def _quantized(n: int, k: int, group: int, seed: int, device: str = "cpu"):
    """Random int4 values [n, k] (uint8, 0..15) and tinygemm's scales and zeros [k / group, n, 2]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(k // group, n, generator=g) * 0.05 + 0.01
    zero = torch.randn(k // group, n, generator=g) * 0.05
    return q.to(device), torch.stack([scale, zero], -1).to(torch.bfloat16).to(device)


class Int4Linear(torch.nn.Module):
    """A linear layer over CPU-packed int4 weights, as torchao's CPU layout calls it."""

    def __init__(self, k: int, n: int, group: int, seed: int):
        super().__init__()
        q, scales = _quantized(n, k, group, seed)
        self.register_buffer("packed", aten._convert_weight_to_int4pack_for_cpu(q.int(), 2))
        self.register_buffer("scales", scales)
        self.group = group

    def forward(self, x):
        flat = CPU_MM(x.reshape(-1, x.shape[-1]), self.packed, self.group, self.scales)
        return flat.view(*x.shape[:-1], -1)


class Step(torch.nn.Module):
    """An MLP step of int4 products: one row through up, SiLU, down, a residual add, and a head."""

    def __init__(self, hidden: int = 128, inner: int = 256, group: int = 64):
        super().__init__()
        self.up, self.down = Int4Linear(hidden, inner, group, 1), Int4Linear(inner, hidden, group, 2)
        self.head = Int4Linear(hidden, inner, group, 3)

    def forward(self, x):
        return self.head(self.down(torch.nn.functional.silu(self.up(x))) + x)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the output's bf16 rounding: both accumulate in fp32, in another order."""
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


@pytest.mark.parametrize("n, k, group", [(96, 256, 64), (64, 512, 128), (128, 128, 32)])
def test_the_plain_values_are_learned_exactly_from_the_packed_kernel(n, k, group):
    q, scales = _quantized(n, k, group, seed=n + k)
    packed = aten._convert_weight_to_int4pack_for_cpu(q.int(), 2)
    values = int4_gemv.plain_values(CPU_MM, packed, group, scales, k, n, torch.bfloat16)
    assert values is not None and values.dtype == torch.uint8 and values.shape == (n, k // 2)
    assert torch.equal(values & 15, q[:, ::2]) and torch.equal(values >> 4, q[:, 1::2])
    for seed in range(3):
        x = torch.randn(1, k, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(seed))
        _close(int4_gemv.by_reduction(x, values, scales, group), CPU_MM(x, packed, group, scales))


def test_values_that_do_not_pack_to_the_stored_tiles_are_not_used(monkeypatch):
    q, scales = _quantized(64, 256, 64, seed=5)
    packed = aten._convert_weight_to_int4pack_for_cpu(q.int(), 2)
    # a packing that is not the kernel's (its values swapped in pairs): the values it gives back
    # would not pack to the stored tiles
    swapped = dict(int4_gemv.PACKINGS)
    swapped[CPU_MM] = lambda values, tiles: aten._convert_weight_to_int4pack_for_cpu(
        values.view(64, 128, 2).flip(-1).reshape(64, 256).int(), tiles)
    monkeypatch.setattr(int4_gemv, "PACKINGS", swapped)
    assert int4_gemv.plain_values(CPU_MM, packed, 64, scales, 256, 64, torch.bfloat16) is None


def test_a_kernel_that_does_not_dequantize_as_tinygemm_is_not_rewritten():
    q, scales = _quantized(64, 256, 64, seed=6)
    packed = aten._convert_weight_to_int4pack_for_cpu(q.int(), 2)

    def shifted(x, w, group, s):  # zero taken as q == 7.5, not 8: the values would be guessed
        per_k = s[..., 0].float().repeat_interleave(group, 0)  # [k, n]
        return CPU_MM(x, w, group, s) + (0.5 * x.float() @ per_k).to(x.dtype)

    assert int4_gemv.plain_values(shifted, packed, 64, scales, 256, 64, torch.bfloat16) is None
    zero_scale = scales.clone()
    zero_scale[0, 0, 0] = 0  # a group whose scale is 0: its values cannot be told apart
    assert int4_gemv.plain_values(CPU_MM, packed, 64, zero_scale, 256, 64, torch.bfloat16) is None


@pytest.mark.parametrize("reduction_faster", [True, False])
def test_an_inductor_program_of_int4_products_follows_the_timed_choice_and_equals_the_packed_kernel(
        timed_on_cpu, monkeypatch, reduction_faster):
    from ferry.backends import inductor

    graphs = []
    real_compile = inductor._inductor_compile
    monkeypatch.setattr(inductor, "_inductor_compile",
                        lambda gm, ex, method, tuning=None: graphs.append(gm) or real_compile(gm, ex, method, tuning))
    timed_on_cpu["times"] = (10.0, 4.0) if reduction_faster else (10.0, 9.8)
    torch.manual_seed(0)
    model = Step().eval()
    ep = torch.export.export(model, (torch.randn(1, 1, 128, dtype=torch.bfloat16),))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor")))
    for _ in range(3):
        x = torch.randn(1, 1, 128, dtype=torch.bfloat16)
        _close(module(x), model(x))
    decided = DECISIONS.values(timed=True)
    assert sorted(d.shape for d in decided) == ["128->256 g64 bfloat16", "256->128 g64 bfloat16"]  # one per shape
    assert all(d.taken is reduction_faster for d in decided)
    left = [n for n in graphs[0].graph.nodes if n.target == CPU_MM]
    assert len(left) == (0 if reduction_faster else 3)


def test_products_of_several_rows_keep_the_packed_kernel(timed_on_cpu):
    torch.manual_seed(0)
    model = Step().eval()
    ep = torch.export.export(model, (torch.randn(1, 4, 128, dtype=torch.bfloat16),))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor")))
    x = torch.randn(1, 4, 128, dtype=torch.bfloat16)
    assert torch.equal(module(x), model(x))  # tinygemm's kernel, as eager runs it
    assert DECISIONS.values(timed=True) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("n, k, group", [(2048, 2048, 128), (256, 1024, 64), (4096, 512, 32)])
def test_tinygemm_cuda_tiles_give_their_values_back_and_the_reduction_equals_the_kernel(n, k, group):
    q, scales = _quantized(n, k, group, seed=n + k, device="cuda")
    packed = aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    values = int4_gemv.plain_values(aten._weight_int4pack_mm.default, packed, group, scales, k, n, torch.bfloat16)
    assert values is not None
    assert torch.equal(values & 15, q[:, ::2]) and torch.equal(values >> 4, q[:, 1::2])
    reduction = int4_gemv._compiled(values, scales, group, torch.bfloat16)
    for seed in range(3):
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        want = aten._weight_int4pack_mm(x, packed, group, scales)
        _close(int4_gemv.by_reduction(x, values, scales, group), want)
        _close(reduction(x, values, scales), want)
    times = int4_gemv.measure(aten._weight_int4pack_mm.default, packed, group, scales, values, reduction)
    assert times is not None and all(t > 0 for t in times)

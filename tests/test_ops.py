"""The et_copy op library: schemas, eager kernels, fake kernels, coexistence with another toolchain."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import ferry
import ferry.ops

NAMES = ("_h2d_copy", "_d2h_copy", "_d2d_copy")
DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
]


def packet(name):
    return getattr(torch.ops.et_copy, name)


def random_tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -100), min(info.max, 100) + 1, shape, generator=g, dtype=dtype)


def test_schemas_match_the_reference():
    for name in NAMES:
        p = packet(name)
        assert set(p.overloads()) >= {"default", "out"}
        assert str(p.default._schema) == f"et_copy::{name}(Tensor self) -> Tensor"
        assert str(p.out._schema) == f"et_copy::{name}.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 3), (), (0, 3), (2, 1, 5)], ids=str)
def test_functional_returns_a_new_tensor_with_equal_values(name, dtype, shape):
    x = random_tensor(shape, dtype, seed=len(shape))
    y = packet(name)(x)
    assert isinstance(y, torch.Tensor)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, x)
    if x.numel():
        assert y.data_ptr() != x.data_ptr()
        x.zero_() if dtype != torch.bool else x.logical_not_()  # the copy does not alias the source
        assert not torch.equal(y, x) or not y.any()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 3), (), (0, 3)], ids=str)
def test_out_returns_out_with_values_copied(name, dtype, shape):
    x = random_tensor(shape, dtype, seed=7)
    out = torch.empty(shape, dtype=dtype)
    ptr = out.data_ptr()
    r = packet(name).out(x, out=out)
    assert r is out
    assert out.data_ptr() == ptr
    assert torch.equal(out, x)


def test_functional_of_non_contiguous_input_is_contiguous():
    x = torch.randn(4, 6).t()
    y = torch.ops.et_copy._h2d_copy(x)
    assert y.is_contiguous() and torch.equal(y, x)


def test_out_resizes_a_differently_shaped_out():
    x = torch.randn(4)
    out = torch.empty(8)
    r = torch.ops.et_copy._d2h_copy.out(x, out=out)
    assert r is out and out.shape == (4,) and torch.equal(out, x)


def test_out_dtype_mismatch_raises():
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.et_copy._h2d_copy.out(torch.randn(3), out=torch.empty(3, dtype=torch.float64))


@pytest.mark.parametrize("name", NAMES)
def test_fake_kernels(name):
    with FakeTensorMode():
        x = torch.empty(2, 5, dtype=torch.float16)
        y = packet(name)(x)
        assert isinstance(y, FakeTensor)
        assert y.shape == (2, 5) and y.dtype == torch.float16
        out = torch.empty(2, 5, dtype=torch.float16)
        assert packet(name).out(x, out=out) is out


class _Copies(torch.nn.Module):
    def forward(self, x):
        a = torch.ops.et_copy._h2d_copy(x)
        b = torch.ops.et_copy._d2d_copy(a * 2)
        return torch.ops.et_copy._d2h_copy(b) + 1


def test_ops_appear_in_exported_graphs():
    ep = torch.export.export(_Copies(), (torch.randn(3, 4),))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    for name in NAMES:
        assert packet(name).default in targets
    x = torch.randn(3, 4)
    torch.testing.assert_close(ep.module()(x), x * 2 + 1)
    # they survive decomposition to core ATen, as lowering does
    ep2 = ep.run_decompositions()
    assert sum(1 for n in ep2.graph.nodes if ferry.ops.is_copy_node(n)) == 3


def test_reload_reuses_the_ops():
    before = {name: (packet(name).default, packet(name).out) for name in NAMES}
    # internal: the torch.library registration object is what a reload must keep
    lib = ferry.ops.copies._lib
    try:
        importlib.reload(ferry.ops.copies)
    finally:
        import gc

        gc.collect()
    assert ferry.ops.copies._lib is lib
    for name in NAMES:
        assert packet(name).default is before[name][0]
        assert packet(name).out is before[name][1]
    assert ferry.ops.copies.h2d_copy.default is before["_h2d_copy"][0]
    assert ferry.ops.copies.FUNCTIONAL_COPY_FOR["d2d"] is before["_d2d_copy"][0]
    # ops made before the reload still run
    x = torch.randn(5)
    assert torch.equal(before["_h2d_copy"][0](x), x)
    assert ferry.ops.is_copy_node is not None
    # and graphs still place: a fresh compile after reload finds its copies
    from models import Add, small

    placed = ferry.place(torch.export.export(Add(), small()), ferry.OpSupportPartitioner("cuda:0"))
    kinds = [n.target for n in placed.graph_module.graph.nodes if ferry.ops.is_copy_node(n)]
    assert kinds.count(before["_h2d_copy"][0]) == 2 and kinds.count(before["_d2h_copy"][0]) == 1


def test_another_toolchain_defined_the_namespace_first():
    code = textwrap.dedent(
        """
        import torch
        lib = torch.library.Library("et_copy", "DEF")
        lib.define("_h2d_copy(Tensor self) -> Tensor")
        theirs = torch.ops.et_copy._h2d_copy.default
        import ferry
        for name in ("_h2d_copy", "_d2h_copy", "_d2d_copy"):
            overloads = set(getattr(torch.ops.et_copy, name).overloads())
            assert {"default", "out"} <= overloads, (name, overloads)
        assert str(torch.ops.et_copy._h2d_copy.default._schema) == "et_copy::_h2d_copy(Tensor self) -> Tensor"
        x = torch.randn(4)
        assert torch.equal(torch.ops.et_copy._d2h_copy(x), x)
        out = torch.empty(4)
        assert torch.ops.et_copy._h2d_copy.out(x, out=out) is out and torch.equal(out, x)
        print("OK")
        """
    )
    import os

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                       cwd=os.path.dirname(src))  # (a fresh interpreter needs a working directory that exists)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("OK")

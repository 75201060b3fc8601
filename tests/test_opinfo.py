"""PyTorch's OpInfo database through ferry, against eager PyTorch (the harness: opinfo_sweep.py).

One test per (op, placement): the op's first samples exported, compiled for the placement,
saved, loaded and called on the sample's and on fresh inputs (and, where export allows, with a
bounded dynamic dim at two sizes). It passes iff no sample gives a wrong result or a run-time
error and every refusal (CompileError) names the op; it is skipped when no sample could be run
at all (eager raised, torch.export failed, no tensor output).

The op ids include each op's in-place variant (`add.inplace`). By default a fixed subset runs:
every `EVERY`-th op id of the sorted list plus opinfo_sweep.TRICKY (294 tests, all placements
together), and the inductor backend on the emulated device on every third op of those plus the
ops whose failures it found (43 tests). FERRY_OPINFO=all runs every op;
tests/opinfo_report.py runs the whole database in worker processes and writes docs/ops.md.
"""

from __future__ import annotations

import os

import pytest
import torch

import opinfo_sweep as sweep

RUN_ALL = os.environ.get("FERRY_OPINFO", "") == "all"
EVERY = 12  # the subset: every 12th op of the sorted list (the TRICKY ops besides)

ALL_IDS = [sweep.op_id(op) for op in sweep.float32_ops()]
IDS = ALL_IDS if RUN_ALL else sweep.ci_subset(ALL_IDS, EVERY)
# the inductor backend on the emulated device (Inductor's C++ code, compiled per case): every
# INDUCTOR_EVERY-th op of the subset, and the ops whose failures it found
INDUCTOR_EVERY = 3
INDUCTOR_FOUND = ("T", "bernoulli", "cholesky", "lu_unpack", "linalg.ldl_solve", "linalg.solve_triangular",
                  "nn.functional.embedding_bag", "geqrf", "histogram", "_unsafe_masked_index")
INDUCTOR_IDS = set(ALL_IDS if RUN_ALL else IDS[::INDUCTOR_EVERY]) | {i for i in ALL_IDS if i in INDUCTOR_FOUND}


def _params():
    out = []
    for name in sorted(set(IDS) | INDUCTOR_IDS):
        placements = sweep.CPU_PLACEMENTS if name in IDS else ()
        for placement in (*placements, *(("emu_inductor",) if name in INDUCTOR_IDS else ())):
            out.append(pytest.param(name, placement, id=f"{name}-{placement}"))
        gpu = (("cuda_op",) if name in IDS else ()) + (("cuda_inductor",) if name in INDUCTOR_IDS else ())
        for placement in gpu if torch.cuda.is_available() else ():
            out.append(pytest.param(name, placement, id=f"{name}-{placement}", marks=pytest.mark.cuda))
    return out


_sweep = sweep.Sweep(samples=sweep.DEFAULT_SAMPLES)  # an op's samples are prepared once for its placements

# other dtypes (opinfo_report.py --dtype for all of them): every DTYPE_EVERY-th op supporting each,
# the op on the emulated device with CPU inputs and outputs (copies both ways), static sizes
OTHER_DTYPES = ("int64", "bfloat16")
DTYPE_EVERY = 40
DTYPE_FOUND = {"bfloat16": ("_batch_norm_with_update", "native_layer_norm", "nn.functional.embedding_bag")}  # its failures
_dtype_sweeps = {d: sweep.Sweep(samples=sweep.DEFAULT_SAMPLES, dynamic=False, dtype=getattr(torch, d))
                 for d in OTHER_DTYPES}


def _dtype_params():
    out = []
    for dtype in OTHER_DTYPES:
        ids = sorted(sweep.op_id(op) for op in sweep.float32_ops(getattr(torch, dtype)))
        chosen = set(ids[::DTYPE_EVERY]) | {i for i in ids if i in DTYPE_FOUND.get(dtype, ())}
        out += [pytest.param(name, dtype, id=f"{name}-{dtype}") for name in sorted(chosen)]
    return out


@pytest.mark.parametrize(("name", "placement"), _params())
def test_op_matches_eager(name, placement):
    _passes(_sweep.run(name, placement), f"{name} on {placement}")


def _passes(outcomes, what: str) -> None:
    """Fails on a wrong result, a run-time error or a refusal that does not name the op; skips
    when no sample could run at all."""
    failed = [o for o in outcomes if o.failed]
    if failed:
        pytest.fail(f"{len(failed)} of {len(outcomes)} cases of {what} failed:\n"
                    + "\n".join(o.describe() for o in failed), pytrace=False)
    ran = [o for o in outcomes if o.variant == "static" and o.status not in sweep.SKIPS]
    if not ran:
        pytest.skip("; ".join(sorted({f"{o.status}: {sweep.first_line(o.message)}".rstrip(": ") for o in outcomes})))


@pytest.mark.parametrize(("name", "dtype"), _dtype_params())
def test_op_in_another_dtype_matches_eager(name, dtype):
    _passes(_dtype_sweeps[dtype].run(name, "emu_op"), f"{name} in {dtype} on emu_op")


def test_subset_is_fixed_and_covers_the_tricky_ops():
    subset = sweep.ci_subset(ALL_IDS, EVERY)
    assert subset == sweep.ci_subset(list(reversed(ALL_IDS)), EVERY)  # the order given does not matter
    covered = {sweep._base(i) for i in subset}
    present = {sweep._base(i) for i in ALL_IDS}  # type_as is not in every torch's op_db
    assert [t for t in sweep.TRICKY if t in present and t not in covered] == []
    assert len(subset) < len(ALL_IDS) // 4


def test_harness_tells_a_wrong_result_from_an_equal_one(monkeypatch):
    """The harness itself: a program that computes something else is 'wrong', the right one 'equal'."""
    op = sweep.ops_by_id()["sin"]
    assert {o.status for o in sweep.run_op(op, "cpu", samples=1)} <= {"equal", "no dynamic variant"}
    real = sweep.compile_for

    def cos_instead(ep, placement):
        class Cos(torch.nn.Module):
            def forward(self, *xs):
                return (torch.cos(xs[0]),)
        args = tuple(n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder")
        return real(torch.export.export(Cos(), tuple(torch.randn(a.shape) for a in args)), placement)

    monkeypatch.setattr(sweep, "compile_for", cos_instead)
    got = sweep.run_op(op, "cpu", samples=1, dynamic=False)
    assert [o.status for o in got] == ["wrong"], [o.describe() for o in got]
    assert got[0].failed


def test_a_refusal_names_the_op_only_as_an_op():
    assert sweep.names_op("dimension 0 of 'argwhere' is a data-dependent size", {"argwhere"})
    assert sweep.names_op("aten::histogramdd.default (node 'h') returns a list", {"histogramdd"})
    assert sweep.names_op("aten._native_batch_norm_legit_functional.default writes", {"native_batch_norm"})
    assert sweep.names_op("aten.t.default", {"t"}) and not sweep.names_op("aten.transpose.int", {"t"})
    assert not sweep.names_op("dimension 0 of 'getitem' ...: keep ops like nonzero/unique out of the program", {"nonzero"})
    assert not sweep.names_op("output TensorArgument(name='getitem_3') is a USER_INPUT_MUTATION", {"native_batch_norm"})


def test_loading_the_database_leaves_the_backend_flags_settable():
    """PyTorch's test internals freeze torch.backends' flags on import; the other tests of this
    suite (collected in the same process) set TF32 and cuDNN flags directly."""
    sweep.float32_ops()
    assert not torch.backends.flags_frozen()

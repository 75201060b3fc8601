"""What export checked of the input sizes (`torch._check`, branches on sizes, a size traced as a
product of others) is checked on every call, as `ExportedProgram.module()` checks it: a graph
traced where a guard held may be wrong where it does not. Each case is called at sizes where
its guards hold and where they fail; ferry must refuse exactly the calls ep.module() refuses and
answer the rest as ep.module() does."""

from __future__ import annotations

import math
import time
import typing
import warnings

import pytest
import torch
from torch import nn
from torch.export import Dim

import ferry
from ferry import InputError, ProgramError
from ferry.aot import input_guards as input_guards_module
from ferry.program import guards
from ferry.views.text import program_json, program_summary, size_checks

pytestmark = pytest.mark.filterwarnings("error::UserWarning")


class IntAtLeastOne(nn.Module):
    def forward(self, x, n: int):
        torch._check(n >= 1)
        torch._check(n <= 4)
        return x * n if n > 0 else x - 1  # traced at n = 2: the graph is wrong at n <= 0


class EvenLength(nn.Module):
    def forward(self, x):
        torch._check(x.shape[0] % 2 == 0)
        return x.reshape(-1, 2).sum(1)


class NotFive(nn.Module):
    def forward(self, x):
        return x - 1 if x.shape[0] == 5 else x + 1


class BigArea(nn.Module):
    def forward(self, x, y):
        return x.sum() + y.sum() if x.shape[0] * x.shape[1] > 20 else x.sum() - y.sum()


class Flattened(nn.Module):
    def forward(self, x, y):
        return x.reshape(-1) + y  # y's length is traced as x0 * x1


class LongerOfTwo(nn.Module):
    def forward(self, x, y):
        return x.sum() * 2 if max(x.shape[0], y.shape[0]) > 6 else x.sum()


class ThirdAbove(nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[0] / 3 > 2.5 else x


class NotThree(nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[0] != 3 else x - 1


class Parity(nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[0] & 1 == 0 else x - 1


class FloatScaled(nn.Module):
    def forward(self, x):
        return x * 2 if math.floor(x.shape[0] * 0.75) > 4 else x - 1


class Either(nn.Module):
    def forward(self, x, n: int):
        torch._check(n == 0 or 12 // n > 2)  # Python skips the division where n is 0
        torch._check(n <= 8)
        return x * n


class SquareOfHalf(nn.Module):
    def forward(self, x, y):  # x exported as 2*s (s no input's size), y traced as s*s
        half = x.reshape(2, -1)[0]
        return torch.outer(half, half).reshape(-1) + y


class Prefix(nn.Module):
    def forward(self, x, n: int):
        torch._check(n >= 2)
        return x[:n] * 2


def _r(*shape):
    return torch.randn(*shape)


AUTO = Dim.AUTO(max=64)
CASES = {  # model, example, dynamic shapes, calls (some failing a guard)
    "int at least one": (IntAtLeastOne(), (_r(3), 2), {"x": None, "n": Dim.DYNAMIC},
                         [(_r(3), n) for n in (2, 0, -1, 1, 4)]),
    "even length": (EvenLength(), (_r(8),), {"x": {0: AUTO}}, [(_r(n),) for n in (8, 6, 7, 4, 9, 64)]),
    "not five": (NotFive(), (_r(8),), {"x": {0: AUTO}}, [(_r(n),) for n in (8, 5, 1, 0, 64)]),
    "big area": (BigArea(), (_r(5, 5), _r(3)), {"x": {0: AUTO, 1: AUTO}, "y": None},
                 [(_r(5, 5), _r(3)), (_r(2, 3), _r(3)), (_r(3, 7), _r(3)), (_r(4, 5), _r(3))]),
    "flattened": (Flattened(), (_r(3, 3), _r(9)), {"x": {0: AUTO, 1: AUTO}, "y": {0: Dim.AUTO(max=4096)}},
                  [(_r(3, 3), _r(9)), (_r(4, 4), _r(16)), (_r(4, 4), _r(15)), (_r(2, 8), _r(16)), (_r(2, 8), _r(17))]),
    "longer of two": (LongerOfTwo(), (_r(8), _r(3)), {"x": {0: AUTO}, "y": {0: AUTO}},
                      [(_r(8), _r(3)), (_r(3), _r(8)), (_r(3), _r(3)), (_r(7), _r(7))]),
    "a third above": (ThirdAbove(), (_r(10),), {"x": {0: AUTO}}, [(_r(n),) for n in (10, 8, 7, 9, 2)]),
    "parity": (Parity(), (_r(8),), {"x": {0: AUTO}}, [(_r(n),) for n in (8, 7, 2, 63)]),
    "a float product": (FloatScaled(), (_r(8),), {"x": {0: AUTO}}, [(_r(n),) for n in (8, 6, 7, 64)]),
    "either": (Either(), (_r(3), 2), {"x": None, "n": Dim.DYNAMIC}, [(_r(3), n) for n in (2, 0, 4, 3, -5)]),
    "square of a hidden size": (SquareOfHalf(), (_r(6), _r(9)),
                                {"x": {0: 2 * Dim("s", min=2, max=8)}, "y": {0: Dim.AUTO(max=64)}},
                                [(_r(a), _r(b)) for a, b in ((6, 9), (8, 16), (8, 9), (8, 1), (16, 64))]),
    "prefix": (Prefix(), (_r(8), 3), {"x": {0: Dim("s", max=16)}, "n": Dim.DYNAMIC},
               [(_r(8), 3), (_r(8), 1), (_r(8), 0), (_r(8), 8), (_r(8), 9), (_r(16), 12)]),
}


def _runs(fn, args):
    try:
        return True, fn(*args)
    except Exception as e:  # noqa: BLE001 (either side may refuse a call its own way)
        return False, e


@pytest.mark.parametrize("case", list(CASES))
def test_a_call_is_refused_exactly_where_export_refuses_it_and_answers_as_eager_elsewhere(case, emu):
    model, example, dims, calls = CASES[case]
    ep = torch.export.export(model, example, dynamic_shapes=dims)
    reference = ep.module()
    for device in ("cpu", "emu:0"):
        partitioner = ferry.OpSupportPartitioner(device) if device != "cpu" else None
        module = ferry.Module(ferry.load_program(ferry.compile(ep, partitioner).to_bytes()))
        refused = 0
        for args in calls:
            ok, expected = _runs(reference, args)
            if not ok:
                with pytest.raises(InputError, match="fail a check the program was exported under|bound|minimum"):
                    module(*args)
                refused += 1
            else:
                got = module(*args)
                torch.testing.assert_close(got, expected)
        assert 0 < refused < len(calls)  # the case calls both sides of its guards


def test_the_file_holds_the_guards_export_recorded_in_ferrys_language():
    ep = torch.export.export(EvenLength(), (_r(8),), dynamic_shapes={"x": {0: AUTO}})
    assert ferry.load_program(ferry.compile(ep).to_bytes()).method("forward").input_guards == [
        "eq(mod(size(0, 0), 2), 0)"]


def test_a_guard_that_ferrys_own_checks_imply_is_left_out():
    """`n <= 16` of a Dim with max 16 is the bound ferry checks anyway; an equality of two sizes
    is one of equal_sizes. Neither costs a call anything."""
    class Checked(nn.Module):
        def forward(self, x, y):
            torch._check(x.shape[0] <= 16)
            return x + y

    s = Dim("s", max=16)
    ep = torch.export.export(Checked(), (_r(8), _r(8)), dynamic_shapes=({0: s}, {0: s}))
    assert ferry.compile(ep).method("forward").input_guards == []


def test_guards_of_ferrys_own_retracing_are_not_checked():
    """Retracing the program with symbolic inputs (as ferry.compile's passes do) records guards of
    its own: evaluating max(x, y) guards x > y. Export asked only max(x, y) > 6 of a call, so a
    call with y the longer runs."""
    ep = torch.export.export(LongerOfTwo(), (_r(8), _r(3)), dynamic_shapes={"x": {0: AUTO}, "y": {0: AUTO}})
    program = ferry.compile(ep)
    assert program.method("forward").input_guards == ["gt(max(size(1, 0), size(0, 0)), 6)"]
    x, y = _r(3), _r(8)
    torch.testing.assert_close(ferry.Module(program)(x, y), LongerOfTwo()(x, y))


def test_the_error_names_the_check_and_the_sizes_that_fail_it():
    ep = torch.export.export(EvenLength(), (_r(8),), dynamic_shapes={"x": {0: AUTO}})
    module = ferry.Module(ferry.compile(ep))
    with pytest.raises(InputError, match=r": \(x\.shape\[0\] % 2\) == 0 \(x\.shape\[0\] is 7\)"):
        module(_r(7))
    x = _r(6)
    torch.testing.assert_close(module(x), EvenLength()(x))  # the module is still usable


def test_a_guard_ferry_cannot_check_is_a_compile_error_naming_it():
    """Never a program whose calls go unchecked: a guard outside the language (a stride) or of no
    input stops the compile, naming it."""
    ep = torch.export.export(EvenLength(), (_r(8),), dynamic_shapes={"x": {0: AUTO}})
    method = ferry.compile(ep).method("forward")
    for code, why in [("L['x'].stride()[0] == 1", r"`L\['x'\]\.stride\(\)\[0\]` is no int input"),
                      ("L['y'].size()[0] == 1", r"`L\['y'\]` is no tensor input")]:
        ep._guards_code = [code]
        with pytest.raises(ferry.CompileError, match=why + ".*cannot check on each call"):
            input_guards_module.input_guards(ep, ep.graph_module, method)


def test_a_bound_a_guard_rules_out_is_a_compile_error_naming_the_largest_that_meets_it():
    class Triples(nn.Module):
        def forward(self, x):
            torch._check(x.shape[0] % 3 == 0)
            return x.reshape(-1, 3).sum(1)

    ep = torch.export.export(Triples(), (_r(9),), dynamic_shapes={"x": {0: Dim.AUTO(max=64)}})
    with pytest.raises(ferry.CompileError, match=r"x\.shape\[0\]'s bound 64 fails .*largest that meets it is 63"):
        ferry.compile(ep)
    ep = torch.export.export(Triples(), (_r(9),), dynamic_shapes={"x": {0: Dim.AUTO(max=63)}})
    module = ferry.Module(ferry.compile(ep))
    for n in (63, 6, 9):
        x = _r(n)
        torch.testing.assert_close(module(x), Triples()(x))


@pytest.mark.parametrize("buckets", [None, [4, 16]])
def test_buckets_and_micro_batches_check_the_callers_batch_and_the_batch_each_graph_runs_at(buckets):
    """A shape bucket pads a call of 3 rows to 4, where `!= 3` holds: the call is refused all the
    same, as ep.module() refuses it (eager would take the other branch). A call of 6 in two
    micro-batches runs in parts of 4 and 2, not 3 and 3, where the graph does not hold."""
    ep = torch.export.export(NotThree(), (_r(8, 2),), dynamic_shapes={"x": {0: Dim.AUTO(max=16)}})
    program = ferry.compile(ep)
    module = ferry.Module(program, shape_buckets=buckets) if buckets else ferry.Module(program, microbatches=2)
    with pytest.raises(InputError, match=r": x\.shape\[0\] != 3 \(x\.shape\[0\] is 3\)"):
        module(_r(3, 2))
    for n in (8, 4, 6, 2) if buckets is None else (8, 4, 5, 2):
        x = _r(n, 2)
        torch.testing.assert_close(module(x), NotThree()(x))


@pytest.mark.parametrize("text, message", [
    ("eval(1)", "not an operation"), ("__import__(1)", "cannot read"), ("add(1)", "takes 2 or more"),
    ("eq(size(0, 0), 2", "not closed"), ("size(0)", "takes 2 integer"), ("size(0, -1)", "negative"),
("1 2", "unexpected"), ("not(" * 60 + "1" + ")" * 60, "deeper"),
    ("eq(1, 1)" + " " * 5000, "at most 4096"), ("", "ends where"), ("lambda: 0", "cannot read"),
])
def test_text_outside_the_guard_language_is_refused(text, message):
    with pytest.raises(guards.GuardError, match=message):
        guards.parse(text)


def test_the_language_evaluates_as_python_does():
    sizes = {(0, 0): 7, (0, 1): 3, (1, -1): -5}
    cases = {"eq(mod(size(0, 0), 2), 1)": True, "eq(floordiv(arg(1), 2), -3)": True, "eq(mod(arg(1), 3), 1)": True,
             "gt(truediv(size(0, 0), 3), 2.3)": True, "le(max(size(0, 0), size(0, 1), 9), 8)": False,
             "and(ne(size(0, 1), 3), 1)": False, "or(not(eq(0, 0)), lt(arg(1), 0))": True,
             "eq(pow(size(0, 1), 3), 27)": True, "eq(trunc(truediv(arg(1), 2)), -2)": True,
             "eq(floor(truediv(arg(1), 2)), -3)": True, "ge(floordiv(size(0, 0), add(size(0, 1), -3)), 0)": False,
             "or(eq(add(size(0, 1), -3), 0), gt(floordiv(7, add(size(0, 1), -3)), 2))": True,
             "eq(bitand(size(0, 0), 1), 1)": True, "eq(bitxor(size(0, 0), 3), 4)": True, "eq(lshift(1, size(0, 1)), 8)": True,
             "eq(round(truediv(size(0, 0), 2)), 4)": True, "eq(ifelse(lt(arg(1), 0), 1, floordiv(1, 0)), 1)": True,
             "gt(pow(2, pow(2, 30)), 0)": False, "gt(sqrt(size(0, 0)), 2.6)": True}
    for text, want in cases.items():
        assert guards.evaluate(guards.parse(text), lambda i, d: sizes[(i, d)]) is want, text


@pytest.mark.parametrize("guard, message", [
    ("eq(size(0, 1), 2)", "reads \\(0, 1\\), not a dynamic dim"), ("ge(arg(0), 1)", "reads \\(0, -1\\)"),
    ("eq(size(3, 0), 1)", "reads \\(3, 0\\)"), ("eq(size(0, 0)", "not closed"), ("exec(1)", "not an operation"),
])
def test_a_file_whose_guard_is_malformed_or_reads_no_dynamic_size_is_refused(guard, message):
    ep = torch.export.export(EvenLength(), (_r(8, 2),), dynamic_shapes={"x": {0: AUTO, 1: None}})
    program = ferry.compile(ep)
    program.method("forward").input_guards = [guard]
    with pytest.raises(ProgramError, match=message):
        ferry.load_program(program.to_bytes())



def test_a_long_sum_of_sizes_is_one_check_not_a_nesting_per_term():
    """torch.cat of many dynamic inputs traces a size that is their sum: one `add` of every term
    (Python's chain a + b + c), where nesting one level per term passed the language's depth."""
    class Many(nn.Module):
        def forward(self, xs, z):
            return torch.cat(xs) + z

    xs = [_r(3) for _ in range(50)]
    dims = {"xs": [{0: Dim.AUTO(max=8)} for _ in xs], "z": {0: Dim.AUTO(max=400)}}
    ep = torch.export.export(Many(), (xs, _r(150)), dynamic_shapes=dims)
    module = ferry.Module(ferry.load_program(ferry.compile(ep).to_bytes()))
    xs, z = [_r(2) for _ in range(50)], _r(100)
    torch.testing.assert_close(module(xs, z), Many()(xs, z))
    with pytest.raises(InputError):
        module(xs, _r(101))


def test_an_int_bound_a_guard_rules_out_is_a_compile_error_where_the_int_sizes_memory():
    class Ones(nn.Module):
        def forward(self, x, n: int):
            torch._check(n % 3 == 0)
            torch._check(n <= 64)
            return torch.ones(n).reshape(-1, 3).sum(0) + x

    ep = torch.export.export(Ones(), (_r(3), 6), dynamic_shapes={"x": None, "n": Dim.DYNAMIC})
    with pytest.raises(ferry.CompileError, match="bound 64 fails .*largest that meets it is 63"):
        ferry.compile(ep)


@pytest.mark.parametrize("text", [
    "gt(round(7, -10000000), 0)", "gt(mul(" + ", ".join(["pow(3, 2000)"] * 100) + "), 0)",
    "gt(floordiv(lshift(1, 5000), 3), 0)", "gt(pow(2, pow(2, 30)), 0)", "gt(lshift(1, lshift(1, 40)), 0)",
])
def test_a_hostile_guard_cannot_make_a_call_compute_for_long(text):
    """An integer past 4,096 bits anywhere in a guard makes it false, at once."""
    start = time.perf_counter()
    assert guards.evaluate(guards.parse(text), lambda i, d: 3) is False
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("text, shown", [
    ("eq(pow(mul(-1, arg(0)), 2), 9)", "((-n) ** 2) == 9"), ("eq(add(not(eq(arg(0), 1)), 1), 2)", "((not (n == 1)) + 1) == 2"),
    ("ne(add(size(0, 0), mul(-1, 1)), 3)", "(x.shape[0] - 1) != 3"),
])
def test_a_guard_is_shown_as_python_reads_it(text, shown):
    """The message's text evaluates, as Python, to what the guard evaluates to."""
    tree = guards.parse(text)
    named = guards.render(tree, lambda i, d: "n" if d < 0 else f"x.shape[{d}]")
    assert named == shown
    assert eval(named, {"n": 3, "x": torch.zeros(4)}) == guards.evaluate(tree, lambda i, d: 3 if d < 0 else 4)  # noqa: S307


def test_a_program_saved_and_loaded_by_torch_export_keeps_its_guards(tmp_path):
    """torch.export.save/load keeps the guard code: the loaded program's ep.module() checks it, and
    so does ferry's program compiled from it."""
    ep = torch.export.export(EvenLength(), (_r(8),), dynamic_shapes={"x": {0: AUTO}})
    torch.export.save(ep, tmp_path / "even.pt2")
    loaded = torch.export.load(tmp_path / "even.pt2")
    module = ferry.Module(ferry.compile(loaded))
    with pytest.raises(InputError, match="% 2"):
        module(_r(7))


def test_inductors_lazy_conjugate_results_are_handed_on_as_plain_values():
    """Inductor may return ihfft's result as a lazy conjugate view (on CUDA ifft's too), which a
    copy to another device cannot read as bytes: each result is made plain."""
    from ferry.backends.inductor import _materialized

    z = torch.randn(4, dtype=torch.complex64)
    for lazy in (z.conj(), torch._neg_view(z)):
        plain = _materialized(lazy)
        assert not plain.is_conj() and not plain.is_neg()
        torch.testing.assert_close(plain, lazy.resolve_conj().resolve_neg())


def test_an_int_input_is_named_in_the_message_as_the_caller_passes_it():
    ep = torch.export.export(IntAtLeastOne(), (_r(3), 2), dynamic_shapes={"x": None, "n": Dim.DYNAMIC})
    module = ferry.Module(ferry.compile(ep))
    with pytest.raises(InputError, match=r": n >= 1 \(n is 0\)"):
        module(_r(3), 0)


def test_ferry_inspect_lists_what_each_calls_sizes_must_meet():
    class Checked(nn.Module):
        def forward(self, x, y, n: int):
            torch._check(n >= 1)
            torch._check(n <= 9)
            return (x.repeat(2) + y) * 2 if x.shape[0] != 5 else y, x * n

    dims = {"x": {0: Dim.AUTO(min=2, max=16)}, "y": {0: Dim.AUTO(max=32)}, "n": Dim.DYNAMIC}
    program = ferry.compile(torch.export.export(Checked(), (_r(4), _r(8), 2), dynamic_shapes=dims))
    checks = size_checks(program.method("forward"))
    assert checks == ["y.shape[0] >= 4", "y.shape[0] == 2 * x.shape[0]", "n >= 1", "x.shape[0] != 5"]
    assert "each call's sizes are checked as export's module checks them: y.shape[0] >= 4;" in program_summary(program)
    assert program_json(program)["methods"]["forward"]["size_checks"] == checks


def test_a_call_runs_at_the_smallest_bucket_where_the_guards_hold(monkeypatch):
    """A call of 2 rows under `!= 3` with buckets [3, 8] skips bucket 3, where the graph would
    answer for the other branch, and runs padded to 8; with no bucket meeting the guards it runs
    at its own shape, warning once. A call that breaks a guard itself is refused, as before."""
    from ferry.runtime.stages.method import LoadedMethod

    ran_at, execute_padded = [], LoadedMethod.execute_padded

    def spied(self, inputs, rows):
        ran_at.append(rows)
        return execute_padded(self, inputs, rows)

    monkeypatch.setattr(LoadedMethod, "execute_padded", spied)
    ep = torch.export.export(NotThree(), (_r(8, 2),), dynamic_shapes={"x": {0: Dim.AUTO(max=16)}})
    program = ferry.compile(ep)
    module = ferry.Module(program, shape_buckets=[3, 8])
    for n in (2, 1, 5, 2):
        x = _r(n, 2)
        torch.testing.assert_close(module(x), NotThree()(x))
    assert ran_at == [8, 8, 8, 8]
    with pytest.raises(InputError, match=r"x\.shape\[0\] != 3 \(x\.shape\[0\] is 3\)"):
        module(_r(3, 2))
    only_three = ferry.Module(program, shape_buckets=[3])
    ran_at.clear()
    with pytest.warns(RuntimeWarning, match=r"no shape bucket that holds it \(3\) meets the size checks"):
        x = _r(2, 2)
        torch.testing.assert_close(only_three(x), NotThree()(x))
    x = _r(1, 2)
    torch.testing.assert_close(only_three(x), NotThree()(x))  # (warned once)
    assert ran_at == []


class _EvenRows(nn.Module):
    def forward(self, x):
        torch._check(x.shape[1] % 2 == 0)
        return x * 2


def test_with_buckets_a_call_that_breaks_a_check_itself_is_refused_as_without_them():
    """A call whose own sizes break a guard, or whose input lacks a dim, is refused by the call's
    check with its InputError, and no warning about buckets; the module stays usable."""
    dims = {0: Dim.AUTO(max=16), 1: Dim.AUTO(max=12)}
    ep = torch.export.export(_EvenRows(), (_r(4, 6),), dynamic_shapes={"x": dims})
    module = ferry.Module(ferry.compile(ep), shape_buckets=[4, 8])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError, match=r"x\.shape\[1\] % 2\) == 0 \(x\.shape\[1\] is 3\)"):
            module(_r(2, 3))
        with pytest.raises(InputError, match="shape"):
            module(_r(2))
        x = _r(3, 4)
        torch.testing.assert_close(module(x), _EvenRows()(x))


@pytest.mark.parametrize("rows, parts, expected", [(6, 2, [4, 2]), (7, 2, [5, 2]), (9, 3, [4, 4, 1]), (8, 2, [4, 4])])
def test_micro_batches_take_the_smallest_parts_that_meet_the_guards(rows, parts, expected):
    """Parts of a call split evenly where the guards hold there; else the next size up whose
    parts (the last one too) all meet them: under `!= 3`, 6 rows in 2 parts are 4 + 2, 7 are
    5 + 2 (not 4 + 3), 9 in 3 parts are 4 + 4 + 1. The count a distributed rank 0 tells the
    others agrees."""
    from ferry.runtime.stages.method import LoadedMethod

    sizes, execute = [], LoadedMethod.execute

    def spied(self, inputs, *args, **kwargs):
        sizes.append(inputs[0].shape[0])
        return execute(self, inputs, *args, **kwargs)

    ep = torch.export.export(NotThree(), (_r(8, 2),), dynamic_shapes={"x": {0: Dim.AUTO(max=16)}})
    module = ferry.Module(ferry.compile(ep), microbatches=parts)
    x = _r(rows, 2)
    count = module.parts("forward", [x])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LoadedMethod, "execute", spied)
        torch.testing.assert_close(module(x), NotThree()(x))
    assert sizes == expected and len(sizes) == count


class _Pair(typing.NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def test_a_named_tuples_field_is_named_as_the_caller_reads_it():
    """A failing check names a named tuple's field `p.x`, as the caller writes it."""
    class Takes(nn.Module):
        def forward(self, p: _Pair):
            torch._check(p.x.shape[0] % 2 == 0)
            return p.x.reshape(-1, 2).sum(1) + p.y.sum()

    p = _Pair(_r(4), _r(3))
    ep = torch.export.export(Takes(), (p,), dynamic_shapes=(_Pair({0: Dim.AUTO(max=16)}, None),))
    module = ferry.Module(ferry.compile(ep))
    with pytest.raises(InputError, match=r"\(p\.x\.shape\[0\] % 2\) == 0 \(p\.x\.shape\[0\] is 5\)"):
        module(_Pair(_r(5), _r(3)))
    q = _Pair(_r(6), _r(3))
    torch.testing.assert_close(module(q), Takes()(q))


class PairFlip(nn.Module):
    """Rows come in pairs: the batch is exported as 2 * h, a derived size, not a guard."""

    def forward(self, x):
        return x.view(-1, 2, 4).flip(1).reshape(x.shape[0], 4) * 2


@pytest.mark.parametrize("options", [{"shape_buckets": [3, 5, 16]}, {"microbatches": 2}, {"microbatches": 3}])
def test_buckets_and_micro_batches_run_at_sizes_a_derived_batch_can_take(options):
    """A batch exported as 2 * h: a call of 4 rows pads to 16, not to the odd bucket 5 (where
    the reshape failed, then raised a bare RuntimeError on each later call); 10 rows in two
    parts run as 6 + 4, not as 5 + 5 (refused). ep.module() answers every call, and so does ferry."""
    ep = torch.export.export(PairFlip(), (_r(8, 4),), dynamic_shapes=({0: 2 * Dim("h", min=2, max=8)},))
    module = ferry.Module(ferry.compile(ep), **options)
    for n in (4, 4, 6, 10, 8, 16, 12, 4):
        x = _r(n, 4)
        torch.testing.assert_close(module(x), ep.module()(x), msg=f"{n} rows")
    with pytest.raises(InputError, match=r"is 5; the program was exported with it 2 \* s \+ 0"):
        module(_r(5, 4))

"""Tests of the pure per-device memory planner (ferry.aot.plan)."""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.aot.plan import DEFAULT_ALIGNMENT, MemoryPlan, PlanValue, lower_bound, plan_memory
from ferry.device import CPU, Device
from ferry.program.schema import Buffer

CUDA0 = Device("cuda", 0)
CUDA1 = Device("cuda", 1)
ALGOS = ("greedy", "naive")


def pv(id, nbytes, device=CPU, start=0, end=0):
    return PlanValue(id=id, nbytes=nbytes, device=device, start=start, end=end)


def check_plan(values, plan: MemoryPlan, alignment=None):
    """Invariants every plan must hold; returns the plan for chaining."""
    assert plan.buffers[0] == Buffer(0, CPU)
    assert set(plan.entries) == {v.id for v in values}
    by_id = {v.id: v for v in values}
    for v in values:
        e = plan.entries[v.id]
        assert 1 <= e.buffer < len(plan.buffers)
        buf = plan.buffers[e.buffer]
        assert e.offset >= 0
        assert e.offset + v.nbytes <= buf.size, (v, e, buf)
        if alignment is not None:
            assert e.offset % alignment(buf.device) == 0
    ids = sorted(by_id)
    for i, a in enumerate(ids):
        va, ea = by_id[a], plan.entries[a]
        for b in ids[i + 1 :]:
            vb, eb = by_id[b], plan.entries[b]
            if ea.buffer != eb.buffer or va.nbytes == 0 or vb.nbytes == 0:
                continue
            alive_together = va.start <= vb.end and vb.start <= va.end
            mem_overlap = ea.offset < eb.offset + vb.nbytes and eb.offset < ea.offset + va.nbytes
            assert not (alive_together and mem_overlap), (va, ea, vb, eb)
    return plan


# ---------------------------------------------------------------- device grouping


@pytest.mark.parametrize("algo", ALGOS)
def test_all_cpu_one_buffer(algo):
    values = [pv(i, 100 * (i + 1), CPU, i, i + 1) for i in range(5)]
    plan = check_plan(values, plan_memory(values, algorithm=algo))
    assert len(plan.buffers) == 2
    assert plan.buffers[1].device == CPU
    assert {e.buffer for e in plan.entries.values()} == {1}
    assert set(plan.lower_bounds) == {CPU}


@pytest.mark.parametrize("algo", ALGOS)
def test_all_on_one_device(algo):
    values = [pv(i, 1000, CUDA0, i, i + 1) for i in range(4)]
    plan = check_plan(values, plan_memory(values, algorithm=algo))
    assert plan.buffers == [Buffer(0, CPU), Buffer(plan.buffers[1].size, CUDA0)]
    assert plan.buffers[1].size > 0
    assert {e.buffer for e in plan.entries.values()} == {1}
    assert set(plan.planned_bytes()) == {CUDA0}


@pytest.mark.parametrize("algo", ALGOS)
def test_half_cpu_half_device(algo):
    values = [pv(i, 512, CPU if i < 3 else CUDA0, 0, 10) for i in range(6)]
    plan = check_plan(values, plan_memory(values, algorithm=algo))
    assert [b.device for b in plan.buffers] == [CPU, CPU, CUDA0]
    for v in values:
        assert plan.entries[v.id].buffer == (1 if v.device == CPU else 2)
    # all alive together: each buffer holds its three values side by side
    assert plan.buffers[1].size == 3 * 512
    assert plan.buffers[2].size == 3 * 512
    assert plan.lower_bounds == {CPU: 3 * 512, CUDA0: 3 * 512}


@pytest.mark.parametrize("algo", ALGOS)
def test_alternating_cpu_device_never_share_a_buffer(algo):
    # device order cuda, cpu, cuda, ... : the CPU buffer still comes first
    values = [pv(i, 300, CUDA0 if i % 2 == 0 else CPU, i, i + 1) for i in range(10)]
    plan = check_plan(values, plan_memory(values, algorithm=algo))
    assert [b.device for b in plan.buffers] == [CPU, CPU, CUDA0]
    cpu_bufs = {plan.entries[v.id].buffer for v in values if v.device == CPU}
    dev_bufs = {plan.entries[v.id].buffer for v in values if v.device == CUDA0}
    assert cpu_bufs == {1} and dev_bufs == {2}
    assert cpu_bufs.isdisjoint(dev_bufs)


@pytest.mark.parametrize("algo", ALGOS)
def test_two_cuda_devices_get_separate_buffers_in_order(algo):
    values = [
        pv(0, 64, CUDA1, 0, 1),  # given first, planned last
        pv(1, 64, CPU, 0, 1),
        pv(2, 64, CUDA0, 0, 1),
        pv(3, 128, CPU, 1, 2),
    ]
    plan = check_plan(values, plan_memory(values, algorithm=algo))
    assert [b.device for b in plan.buffers] == [CPU, CPU, CUDA0, CUDA1]
    assert plan.entries[1].buffer == plan.entries[3].buffer == 1
    assert plan.entries[2].buffer == 2
    assert plan.entries[0].buffer == 3
    assert plan.buffers[2].size == 256 and plan.buffers[3].size == 256  # 64 bytes, 256-aligned


def test_cuda3_keeps_its_index():
    values = [pv(0, 10, Device("cuda", 3)), pv(1, 10, CPU)]
    plan = check_plan(values, plan_memory(values))
    assert plan.buffers[2].device == Device("cuda", 3)
    assert plan.buffers[plan.entries[0].buffer].device.index == 3
    assert Device("cuda", 3) in plan.lower_bounds


def test_second_cpu_sorts_with_other_devices_but_gets_own_buffer():
    cpu1 = Device("cpu", 1)
    values = [pv(0, 10, cpu1), pv(1, 10, CUDA0), pv(2, 10, CPU)]
    plan = check_plan(values, plan_memory(values))
    assert [b.device for b in plan.buffers] == [CPU, CPU, cpu1, CUDA0]
    assert plan.entries[2].buffer == 1 and plan.entries[0].buffer == 2 and plan.entries[1].buffer == 3


def test_cpu_buffer_first_even_if_another_type_sorts_before_cpu():
    acc = Device("acc", 0)  # "acc" < "cpu" alphabetically
    values = [pv(0, 10, acc), pv(1, 10, CUDA0), pv(2, 10, CPU)]
    plan = check_plan(values, plan_memory(values))
    assert [b.device for b in plan.buffers] == [CPU, CPU, acc, CUDA0]
    assert plan.entries[2].buffer == 1


def _on_cpu(values):
    """Legacy mode: placement puts every value on the CPU, and the planner sees just that."""
    return [dataclasses.replace(v, device=CPU) for v in values]


@pytest.mark.parametrize("algo", ALGOS)
def test_legacy_mode_one_cpu_buffer(algo):
    values = _on_cpu([pv(0, 100, CPU, 0, 3), pv(1, 100, CUDA0, 0, 3), pv(2, 100, CUDA1, 0, 3)])
    plan = check_plan(values, plan_memory(values, algorithm=algo))
    assert plan.buffers == [Buffer(0, CPU), Buffer(plan.buffers[1].size, CPU)]
    assert {e.buffer for e in plan.entries.values()} == {1}
    assert plan.lower_bounds == {CPU: 300}
    assert plan.planned_bytes() == {CPU: plan.buffers[1].size}
    # legacy pool uses the CPU alignment: offsets are 64-aligned, values side by side
    assert sorted(e.offset for e in plan.entries.values()) == [0, 128, 256]


def test_no_values_only_buffer_zero():
    plan = plan_memory([])
    assert plan.buffers == [Buffer(0, CPU)]
    assert plan.entries == {}
    assert plan.lower_bounds == {}
    assert plan.planned_bytes() == {}


# ---------------------------------------------------------------- alignment


def test_default_alignment_values():
    assert DEFAULT_ALIGNMENT == {"cpu": 64, "default": 256}


@pytest.mark.parametrize("algo", ALGOS)
def test_default_alignment_respected(algo):
    values = [pv(i, 1 + 7 * i, CPU if i % 3 else CUDA0, 0, 5) for i in range(12)]
    plan = check_plan(values, plan_memory(values, algorithm=algo), lambda d: 64 if d.is_cpu else 256)
    for b in plan.buffers[1:]:
        assert b.size % (64 if b.device.is_cpu else 256) == 0
    # all alive at once: at least one cuda value sits at a non-zero 256 multiple
    assert any(plan.entries[v.id].offset >= 256 for v in values if v.device == CUDA0)


@pytest.mark.parametrize("algo", ALGOS)
def test_int_alignment_applies_everywhere(algo):
    values = [pv(i, 3, CPU if i % 2 else CUDA0, 0, 1) for i in range(6)]
    plan = check_plan(values, plan_memory(values, algorithm=algo, alignment=16), lambda d: 16)
    assert plan.buffers[1].size == 48 and plan.buffers[2].size == 48
    assert sorted(plan.entries[v.id].offset for v in values if v.device == CPU) == [0, 16, 32]


def test_mapping_alignment_and_default_key():
    values = [pv(0, 1, CPU, 0, 1), pv(1, 1, CPU, 0, 1), pv(2, 1, CUDA0, 0, 1), pv(3, 1, CUDA0, 0, 1)]
    plan = plan_memory(values, alignment={"cpu": 8, "default": 1024})
    assert sorted(plan.entries[i].offset for i in (0, 1)) == [0, 8]
    assert sorted(plan.entries[i].offset for i in (2, 3)) == [0, 1024]
    assert plan.buffers[1].size == 16 and plan.buffers[2].size == 2048
    # a mapping without the device's type nor "default" falls back to DEFAULT_ALIGNMENT
    plan = plan_memory(values, alignment={"cpu": 4})
    assert sorted(plan.entries[i].offset for i in (0, 1)) == [0, 4]
    assert sorted(plan.entries[i].offset for i in (2, 3)) == [0, 256]


def test_alignment_one_packs_tightly():
    values = [pv(i, 3, CPU, 0, 1) for i in range(3)]
    plan = check_plan(values, plan_memory(values, alignment=1))
    assert plan.buffers[1].size == 9


@pytest.mark.parametrize("bad", [0, -4, 3, 96, 2.0, True, "64", None])
def test_alignment_validated(bad):
    if bad is None:
        bad = {"cuda": 48}
        shown = "48"
    else:
        shown = repr(bad)
    with pytest.raises(ValueError, match="alignment") as info:
        plan_memory([pv(0, 1)], alignment=bad)
    assert shown in str(info.value)


def test_alignment_validated_even_without_values():
    with pytest.raises(ValueError, match="12"):
        plan_memory([], alignment={"default": 12})


# ---------------------------------------------------------------- input validation


@pytest.mark.parametrize(
    "values, needle",
    [
        ([pv(0, -1)], "nbytes"),
        ([pv(0, 1, start=3, end=2)], "end < start"),
        ([pv(0, 1), pv(0, 2)], "duplicate"),
        ([pv(0, 1, start=-2, end=0)], "start"),
        ([PlanValue(0, 1, "cuda:0", 0, 0)], "Device"),
        ([PlanValue(0, 1.5, CPU, 0, 0)], "nbytes"),
    ],
)
def test_invalid_values_rejected(values, needle):
    with pytest.raises(ValueError, match=needle) as info:
        plan_memory(values)
    assert "PlanValue(" in str(info.value)  # the offending value is named


def test_unknown_algorithm_rejected():
    with pytest.raises(ValueError, match="'best'"):
        plan_memory([pv(0, 1)], algorithm="best")


def test_zero_byte_values_get_entries_and_no_size():
    values = [pv(0, 0, CPU, 0, 1), pv(1, 0, CUDA0, 0, 1), pv(2, 64, CPU, 0, 1)]
    for algo in ALGOS:
        plan = check_plan(values, plan_memory(values, algorithm=algo))
        assert set(plan.entries) == {0, 1, 2}
        assert plan.buffers[1].size == 64
        assert plan.buffers[2] == Buffer(0, CUDA0)
        assert plan.lower_bounds == {CPU: 64, CUDA0: 0}


# ---------------------------------------------------------------- sharing and bounds


def test_greedy_shares_disjoint_lifetimes():
    values = [pv(0, 1024, CPU, 0, 1), pv(1, 1024, CPU, 2, 3)]
    greedy = plan_memory(values, algorithm="greedy")
    naive = plan_memory(values, algorithm="naive")
    assert greedy.entries[0].offset == greedy.entries[1].offset == 0
    assert greedy.buffers[1].size == 1024
    assert naive.buffers[1].size == 2048
    assert naive.entries[1].offset == 1024


def test_inclusive_lifetimes_touching_do_not_share():
    # a's last reader is instruction 2, the instruction that defines b: both alive at 2
    values = [pv(0, 64, CPU, 0, 2), pv(1, 64, CPU, 2, 4)]
    plan = check_plan(values, plan_memory(values))
    assert plan.entries[0].offset != plan.entries[1].offset
    assert plan.buffers[1].size == 128


def test_greedy_gap_choice_is_best_fit():
    # Alive during t=5,6: values at [0,768), [1280,1536), [1792,2048); holes [768,1280)
    # (512 bytes) and [1536,1792) (256 bytes). A 256-byte probe must take the smaller
    # hole although the larger one comes first in memory.
    values = [
        pv(0, 4096, CPU, 100, 101),  # largest, disjoint in time from all: @0, never a conflict
        pv(1, 768, CPU, 0, 10),  # @0
        pv(2, 512, CPU, 0, 2),  # @768, dead after t=2
        pv(3, 256, CPU, 0, 10),  # @1280
        pv(4, 256, CPU, 0, 2),  # @1536, dead after t=2
        pv(6, 256, CPU, 0, 10),  # @1792
        pv(5, 256, CPU, 5, 6),  # the probe (placed last: same size, later start)
    ]
    plan = check_plan(values, plan_memory(values, alignment=256))
    offs = {v.id: plan.entries[v.id].offset for v in values}
    assert offs == {0: 0, 1: 0, 2: 768, 3: 1280, 4: 1536, 6: 1792, 5: 1536}
    assert plan.buffers[1].size == 4096


@pytest.mark.parametrize("algo", ALGOS)
def test_lower_bound_not_above_planned(algo):
    values = [pv(i, (i * 37) % 500 + 1, [CPU, CUDA0, CUDA1][i % 3], i % 7, i % 7 + i % 5) for i in range(60)]
    plan = check_plan(values, plan_memory(values, algorithm=algo))
    planned = plan.planned_bytes()
    assert set(planned) == set(plan.lower_bounds) == {CPU, CUDA0, CUDA1}
    for d, lb in plan.lower_bounds.items():
        assert 0 < lb <= planned[d]


def test_lower_bound_sweep():
    values = [pv(0, 10, CPU, -1, 2), pv(1, 20, CPU, 1, 3), pv(2, 40, CPU, 3, 4), pv(3, 5, CPU, 4, 4)]
    # t=1,2: 10+20 = 30; t=3: 20+40 = 60; t=4: 40+5 = 45
    assert lower_bound(values) == 60
    assert lower_bound([]) == 0


def test_greedy_reaches_lower_bound_on_chain():
    # a -> b -> c: each value read by the instruction defining the next one
    for device, size in ((CPU, 64 * 10), (CUDA0, 256 * 4)):
        values = [pv(0, size, device, 0, 1), pv(1, size, device, 1, 2), pv(2, size, device, 2, 3)]
        plan = check_plan(values, plan_memory(values, algorithm="greedy"))
        assert plan.lower_bounds[device] == 2 * size
        assert plan.buffers[1].size == 2 * size
        assert plan.entries[0].offset == plan.entries[2].offset
        assert plan_memory(values, algorithm="naive").buffers[1].size == 3 * size


def test_greedy_handles_many_values_quickly():
    # a long chain plus persistent inputs/outputs: the interval index keeps this near-linear
    n = 20_000
    values = [pv(i, 64 * (1 + i % 8), CPU if i % 2 else CUDA0, i, i + 2) for i in range(n)]
    values += [pv(n + i, 128, CPU, -1, n + 5) for i in range(20)]
    t0 = time.perf_counter()
    plan = plan_memory(values)
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, elapsed
    for d, lb in plan.lower_bounds.items():
        assert plan.planned_bytes()[d] <= 2 * lb + 4096  # sharing really happened


def reference_greedy(values, align):
    """Straightforward O(n^2) greedy, the algorithm as specified, to cross-check the index."""

    def up(x):
        return (x + align - 1) // align * align

    offs, placed = {}, []
    for v in sorted(values, key=lambda v: (-v.nbytes, v.start, v.id)):
        if v.nbytes == 0:
            offs[v.id] = 0
            continue
        conflicts = sorted((o, p.nbytes) for p, o in placed if p.start <= v.end and v.start <= p.end)
        best, best_gap, cov = None, None, 0
        for o, nb in conflicts:
            gap = o - up(cov)
            if gap >= v.nbytes and (best_gap is None or gap < best_gap):
                best, best_gap = up(cov), gap
            cov = max(cov, o + nb)
        offs[v.id] = up(cov) if best is None else best
        placed.append((v, offs[v.id]))
    return offs


# ---------------------------------------------------------------- properties

DEVICES = [CPU, CUDA0, CUDA1]


@st.composite
def value_lists(draw):
    n = draw(st.integers(0, 40))
    horizon = draw(st.integers(1, 30))
    out = []
    for i in range(n):
        start = draw(st.integers(-1, horizon))
        end = draw(st.integers(start, horizon + 1))
        nbytes = draw(st.one_of(st.just(0), st.integers(1, 5000)))
        out.append(PlanValue(id=i * 3 + 7, nbytes=nbytes, device=draw(st.sampled_from(DEVICES)), start=start, end=end))
    perm = draw(st.permutations(range(len(out))))
    return [out[i] for i in perm]


@settings(max_examples=200, deadline=None)
@given(value_lists(), st.sampled_from([None, 1, 16, {"cpu": 32, "cuda": 512}]))
def test_property_plans_are_valid(values, alignment):
    def align_of(d):
        if alignment is None:
            return 64 if d.is_cpu else 256
        if isinstance(alignment, int):
            return alignment
        return alignment[d.type]

    sizes = {}
    for algo in ALGOS:
        plan = check_plan(values, plan_memory(values, algorithm=algo, alignment=alignment), align_of)
        for v in values:
            assert plan.buffers[plan.entries[v.id].buffer].device == v.device
        devices = sorted({v.device for v in values}, key=lambda d: (d != CPU, d))
        assert [b.device for b in plan.buffers[1:]] == devices
        for b in plan.buffers[1:]:
            assert b.size % align_of(b.device) == 0
        planned = plan.planned_bytes()
        for d, lb in plan.lower_bounds.items():
            assert lb <= planned[d]
        sizes[algo] = planned
    for d in sizes["naive"]:
        assert sizes["greedy"][d] <= sizes["naive"][d]


@settings(max_examples=200, deadline=None)
@given(value_lists())
def test_property_greedy_matches_reference(values):
    plan = plan_memory(values, algorithm="greedy", alignment=16)
    for d in {v.device for v in values}:
        group = [v for v in values if v.device == d]
        ref = reference_greedy(group, 16)
        assert {v.id: plan.entries[v.id].offset for v in group} == ref


@settings(max_examples=100, deadline=None)
@given(value_lists())
def test_property_legacy_single_cpu_buffer(values):
    values = _on_cpu(values)
    plan = check_plan(values, plan_memory(values), lambda d: 64)
    assert len(plan.buffers) == (2 if values else 1)
    assert all(e.buffer == 1 for e in plan.entries.values())
    assert all(b.device == CPU for b in plan.buffers)
    if values:
        assert plan.lower_bounds == {CPU: lower_bound(values)}


def test_in_place_candidates_are_taken_only_where_the_input_dies():
    """The planner decides in-place writes from lifetimes: `b` over `a` (a is last read where b is
    made) shares a's bytes, and `d` over `b` chains onto it; `c` over `a` (a still alive when c is
    made), a size that differs, or another device are refused; "naive" shares nothing."""
    from ferry.aot.plan import InPlace

    cpu, emu = Device("cpu"), Device("emu", 0)
    values = [PlanValue(0, 256, cpu, 0, 2), PlanValue(1, 256, cpu, 2, 4), PlanValue(2, 256, cpu, 1, 3),
              PlanValue(3, 256, cpu, 4, 5), PlanValue(4, 128, cpu, 5, 6), PlanValue(5, 256, emu, 5, 6)]
    offered = [InPlace(1, 0), InPlace(2, 0), InPlace(3, 1), InPlace(4, 3), InPlace(5, 3)]
    plan = plan_memory(values, in_place=offered)
    assert plan.in_place == {1: 0, 3: 0}
    assert plan.entries[0] == plan.entries[1] == plan.entries[3]
    assert plan.entries[2] != plan.entries[0] and plan.entries[4] != plan.entries[0]
    assert plan_memory(values, algorithm="naive", in_place=offered).in_place == {}

"""The one record of a kernel choice and the one cache of them (ferry/choices/decisions.py):
each key decided once, a call that may not decide gets only what was decided before, and the
summary's `values(timed=True)` holds only what was timed on a GPU."""

import threading

import pytest

from ferry.choices.decisions import DECISIONS, Decision, Decisions, Site


def timed_decision(eager_us=100.0, other_us=40.0, pick="mm + bias"):
    return Decision("biased GEMM", "aten::addmm.out", "6x5x7 float32", ("addmm", "mm + bias"), (eager_us, other_us),
                    pick, "why", "cuda:0")


def test_a_decision_is_taken_where_another_form_than_eagers_runs():
    chosen, kept = timed_decision(), timed_decision(100.0, 95.0, pick="addmm")
    assert chosen.taken and chosen.saving_us == pytest.approx(60.0)
    assert not kept.taken and kept.saving_us == 0.0  # eager's form: nothing saved
    checked = Decision("out kernel", "aten::clone.out", "", ("functional", "out"), (), "functional", "a wrapper")
    assert not checked.taken and checked.saving_us == 0.0  # decided without timing


def test_a_key_is_decided_once():
    made, calls = Decisions(), []

    def decide():
        calls.append(1)
        return timed_decision()

    first = made.get(("k",), decide)
    assert made.get(("k",), decide) is first and len(calls) == 1
    assert made.get(("other",), decide) is not first and len(calls) == 2
    assert made.values() == [first, made.get(("other",), decide)]  # in the order they were made


def test_nothing_to_decide_is_remembered_as_nothing():
    """`decide` may return None (no memory to time in): the key is then not decided again."""
    made, calls = Decisions(), []
    assert made.get(("k",), lambda: calls.append(1)) is None
    assert made.get(("k",), lambda: calls.append(1)) is None and calls == [1]
    assert made.values() == []


def test_a_call_that_may_not_decide_gets_only_what_was_decided_before():
    made = Decisions()

    def refused():
        raise AssertionError("decided though it may not")

    assert made.get(("new",), refused, may_decide=False) is None
    assert made.values() == []  # and not remembered: a later load decides it
    known = made.get(("known",), timed_decision)
    assert made.get(("known",), refused, may_decide=False) is known
    assert made.get(("new",), timed_decision) is not None


def test_values_can_be_only_the_timed_ones_and_forget_drops_all():
    made = Decisions()
    timed = made.get(("timed",), timed_decision)
    untimed = made.get(("checked",), lambda: Decision("out kernel", "aten::clone.out", "", ("functional", "out"), (),
                                                       "functional", "a wrapper"))
    assert made.values() == [timed, untimed] and made.values(timed=True) == [timed]
    made.forget()
    assert made.values() == [] and made.get(("timed",), lambda: None, may_decide=False) is None


def test_concurrent_callers_decide_a_key_once():
    made, calls, seen = Decisions(), [], []

    def decide():
        calls.append(1)
        return timed_decision()

    threads = [threading.Thread(target=lambda: seen.append(made.get(("k",), decide))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(seen) == 8 and all(d is seen[0] for d in seen)


def test_the_process_cache_is_emptied_by_fresh(fresh):
    assert DECISIONS.values() == []
    DECISIONS.get(("test_decisions",), timed_decision)
    assert DECISIONS.values(timed=True) == [timed_decision()]


def test_a_site_replays_only_in_a_captured_plan_on_cuda_streams():
    cuda = type("Streams", (), {"api": type("Api", (), {"device_type": "cuda"})()})()
    emulated = type("Streams", (), {"api": type("Api", (), {"device_type": "emu"})()})()
    assert Site(captured=True, streams=cuda).replays
    assert not Site(captured=False, streams=cuda).replays  # not captured: timed on a stream
    assert not Site(captured=True).replays and not Site(captured=True, streams=emulated).replays
    assert Site(captured=True, streams=emulated).replay_stream() is None

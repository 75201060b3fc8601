"""The schedule stage: a pure function from steps to work, tested with hand-built steps."""

from __future__ import annotations

import pytest

from ferry.device import CPU, Device
from ferry.runtime.stages.schedule import HostWait, Run, Segment, schedule
from ferry.runtime.stages.steps import Step

G0, G1 = Device("cuda", 0), Device("cuda", 1)


def step(i, *devices, host=False, capturable=True, kind="delegate"):
    """A step touching `devices`; host=True: a copy with a CPU end."""
    return Step(i, kind, f"s{i}", tuple(devices), host, capturable, lambda: None)


def h2d(i, dev=G0, capturable=True):
    return step(i, dev, host=True, capturable=capturable, kind="copy")


def d2h(i, dev=G0, capturable=True):
    return step(i, dev, host=True, capturable=capturable, kind="copy")


def host(i):
    return step(i, kind="kernel")


def shape(sched):
    """A compact picture: 'H3' a host step, 'W' a wait, '[0:1,2]' a segment on GPU 0 (capture '*')."""
    out = []
    for w in sched.work:
        if isinstance(w, HostWait):
            out.append("W")
        elif isinstance(w, Run):
            out.append(f"H{w.step.index}")
        else:
            dev = "x" if w.device is None else w.device.index
            out.append(f"[{dev}:{','.join(str(s.index) for s in w.steps)}{'*' if w.capture else ''}]")
    return " ".join(out)


def test_host_only_steps_run_in_order_without_waits():
    assert shape(schedule([host(0), host(1), None, host(3)], "cuda")) == "H0 H1 H3"
    assert shape(schedule([host(0), h2d(1)], None)) == "H0 H1"  # nothing asynchronous


def test_wait_before_host_code_after_a_copy_that_touched_the_host():
    sched = schedule([host(0), h2d(1), step(2, G0), d2h(3), host(4)], "cuda")
    assert shape(sched) == "H0 [0:1,2,3] W H4"


def test_no_wait_when_only_device_work_is_pending():
    # a delegate between two host steps touches no host memory: the host never waits for it
    assert shape(schedule([host(0), step(1, G0), host(2)], "cuda")) == "H0 [0:1] H2"


def test_wait_at_the_end_when_a_host_copy_is_still_pending():
    assert shape(schedule([h2d(0), step(1, G0), d2h(2)], "cuda")) == "[0:0,1,2] W"
    assert shape(schedule([h2d(0), step(1, G0)], "cuda")) == "[0:0,1] W"  # an h2d source may be overwritten


def test_one_wait_for_several_pending_copies():
    sched = schedule([h2d(0), d2h(1), d2h(2), host(3), host(4)], "cuda")
    assert [type(w) for w in sched.work].count(HostWait) == 1
    assert shape(sched) == "[0:0,1,2] W H3 H4"


def test_segments_end_at_a_copy_between_two_gpus():
    d2d = step(2, G0, G1, kind="copy")
    sched = schedule([h2d(0), step(1, G0), d2d, step(3, G1), d2h(4, G1)], "cuda")
    assert shape(sched) == "[0:0,1] [x:2] [1:3,4] W"
    assert [s.device for s in sched.segments()] == [G0, None, G1]


def test_back_to_back_copies_between_gpus_are_separate_segments():
    a, b = step(0, G0, G1, kind="copy"), step(1, G1, G0, kind="copy")
    assert shape(schedule([a, b], "cuda")) == "[x:0] [x:1]"


def test_steps_on_another_device_type_are_host_work():
    npu = Device("npu", 0)
    assert shape(schedule([step(0, npu), step(1, G0)], "cuda")) == "H0 [0:1]"


@pytest.mark.parametrize("graphs", [False, True])
def test_capture_only_when_asked_and_every_step_is_capturable(graphs):
    sched = schedule([h2d(0), step(1, G0), d2h(2), host(3), step(4, G0, capturable=False), step(5, G0)], "cuda", graphs)
    if graphs:  # the step that cannot be captured stands apart; its neighbour is still captured
        assert shape(sched) == "[0:0,1,2*] W H3 [0:4] [0:5*]"
        assert len(sched.notes) == 1 and "#4 s4..#4 s4" in sched.notes[0] and "without a graph" in sched.notes[0]
    else:
        assert shape(sched) == "[0:0,1,2] W H3 [0:4,5]"
        assert sched.notes == ()


def test_a_copy_of_memory_bound_per_call_stands_apart_without_a_note():
    """A micro-batch's copies read and write the caller's rows: they run eagerly, the delegate
    between them is captured, and a lone copy needs no note (a graph would save nothing)."""
    per_call = dict(kind="copy", reads=frozenset({9}))
    copy_in = Step(0, devices=(G0,), touches_host=True, capturable=False, name="h2d", call=lambda: None, **per_call)
    copy_out = Step(2, devices=(G0,), touches_host=True, capturable=False, name="d2h", call=lambda: None, **per_call)
    sched = schedule([copy_in, step(1, G0), copy_out], "cuda", graphs=True)
    assert shape(sched) == "[0:0] [0:1*] [0:2] W" and sched.notes == ()
    pageable = schedule([h2d(0, capturable=False), step(1, G0)], "cuda", graphs=True)
    assert shape(pageable) == "[0:0] [0:1*] W" and "without a graph" in pageable.notes[0]  # the user is told


def test_a_step_reading_what_an_uncaptured_step_made_is_not_captured_either():
    reader = Step(1, "delegate", "s1", (G0,), False, True, lambda: None, reads=frozenset({7}))
    maker = Step(0, "delegate", "s0", (G0,), False, False, lambda: None, writes=frozenset({7}))
    assert shape(schedule([maker, reader, step(2, G0)], "cuda", graphs=True)) == "[0:0,1] [0:2*]"


def test_a_copy_between_gpus_is_never_captured_and_needs_no_note():
    sched = schedule([step(0, G0, G1, kind="copy")], "cuda", graphs=True)
    (seg,) = sched.segments()
    assert not seg.capture and sched.notes == ()


def test_device_only_segment_does_not_touch_the_host():
    (seg,) = schedule([step(0, G0), step(1, G0)], "cuda", graphs=True).segments()
    assert isinstance(seg, Segment) and seg.capture and not seg.touches_host
    assert seg.label == "instructions #0 s0..#1 s1"


def test_writeback_steps_are_labelled_without_an_index():
    wb = Step(-1, "writeback", "write back cache", (G0,), False, True, lambda: None)
    assert wb.label == "write back cache"
    assert shape(schedule([step(0, G0), wb], "cuda")) == "[0:0,-1]"


def test_cpu_only_steps_never_wait_even_with_cpu_in_devices():
    s = Step(0, "kernel", "k", (), False, True, lambda: None)
    assert schedule([s, s], "cuda").work == (Run(s), Run(s))
    assert CPU not in s.devices


def test_a_micro_batch_starts_by_waiting_before_its_first_host_step():
    """The previous part may still be copying out of host memory this part's host code writes."""
    assert shape(schedule([host(0), h2d(1), step(2, G0)], "cuda", pending=True)) == "W H0 [0:1,2] W"
    assert shape(schedule([h2d(0), step(1, G0), host(2)], "cuda", pending=True)) == "[0:0,1] W H2"
    assert shape(schedule([host(0), h2d(1)], None, pending=True)) == "H0 H1"  # nothing asynchronous


def test_a_part_but_the_last_leaves_its_final_copies_in_flight():
    sched = schedule([h2d(0), step(1, G0), d2h(2)], "cuda", pending=True)
    assert shape(sched.without_final_wait()) == "[0:0,1,2]"
    device_only = schedule([step(0, G0)], "cuda")
    assert device_only.without_final_wait() is device_only

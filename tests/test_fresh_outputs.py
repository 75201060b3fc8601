"""Outputs made for the caller each call are allocated when first written, as eager allocates a
result when its kernel runs: not at the start of the call, where a large one (a language
model's logits) would be held through everything before it. Inside a delegate too: the
delegate makes its fresh outputs itself, as late as its own plan allows."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import ferry
from ferry.backend_registry import ProgramData, get_backend
from ferry.runtime.stages import run as run_module
from models import assert_like_eager, fresh_inputs


class Head(nn.Module):
    """A body whose steps all run before the (large) output is produced by the last op."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.GELU())
        self.head = nn.Linear(16, 256)

    def forward(self, x):
        return self.head(self.body(x))


def _events(monkeypatch) -> list[tuple[str, str]]:
    """('alloc', shape) for each fresh output made, ('step', kernel) after each step ran."""
    events: list[tuple[str, str]] = []
    # internal: when a call allocates each output, between which steps, is what these tests check
    real_empty, real_calls = run_module.empty_on, run_module.Plan._step_calls

    def empty_on(device, shape, dtype, strides=()):
        events.append(("alloc", str(tuple(shape))))
        return real_empty(device, shape, dtype, strides)

    def step_calls(self, step, first_call):
        return [*real_calls(self, step, first_call), lambda: events.append(("step", step.name))]

    monkeypatch.setattr(run_module, "empty_on", empty_on)
    monkeypatch.setattr(run_module.Plan, "_step_calls", step_calls)
    return events


def _calls_of(events, tail: list[str]) -> list[list[tuple[str, str]]]:
    """The events split into calls, each checked to be: the body's steps, the output's
    allocation, the one step that writes it, then `tail` (the delegate step ending, outside)."""
    first = events.index(("alloc", "(4, 256)"))
    per_call = first + 2 + len(tail)
    calls = [events[k:k + per_call] for k in range(0, len(events), per_call)]
    for call in calls:
        assert [e[0] for e in call] == ["step"] * first + ["alloc", "step"] + ["step"] * len(tail), call
        assert [e[1] for e in call[first + 2:]] == tail and call[first + 1][1].startswith("aten::")
    return calls


def _run_three_calls(program, model, example) -> list:
    """Three calls on fresh inputs; each output, kept by the caller, still equals eager's after
    the later calls (it is the caller's own tensor, not memory the next call writes). Returns
    each call's outputs."""
    module = ferry.Module(program)
    kept = []
    for seed in range(3):
        inputs = fresh_inputs(example, seed)
        got = module(*inputs)
        kept.append((got if isinstance(got, tuple) else (got,), model(*inputs)))
    for got, want in kept:
        assert_like_eager([g.cpu() for g in got], want)
    return [got for got, _ in kept]


def test_an_output_is_allocated_by_the_step_that_writes_it(monkeypatch):
    torch.manual_seed(0)
    model, example = Head().eval(), (torch.randn(4, 16),)
    program = ferry.compile(torch.export.export(model, example), config=ferry.CompileConfig(alloc_graph_output=False))
    events = _events(monkeypatch)
    _run_three_calls(program, model, example)
    calls = _calls_of(events, tail=[])
    assert len(calls) == 3 and sum(e[0] == "step" for e in calls[0]) >= 5


def test_a_delegate_makes_the_callers_output_when_it_writes_it(monkeypatch, emu):
    torch.manual_seed(0)
    model, example = Head().eval(), (torch.randn(4, 16),)
    skip = ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=False, skip_d2h_for_method_outputs=True)
    program = ferry.compile(torch.export.export(model, example), ferry.OpSupportPartitioner("emu:0"),
                            ferry.CompileConfig(propagate_device=skip))
    events = _events(monkeypatch)
    _run_three_calls(program, model, example)
    assert len(_calls_of(events, tail=["delegate 0"])) == 3


class ViewOut(nn.Module):
    """A delegate whose outputs are views: of its own result (`t`, `expand`), and of its input
    (which the plan copied into the device's memory), next to a `repeat` (a new tensor)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x):
        y = self.lin(x)
        return y.t(), y.expand(2, *y.shape), x[:, :4], y.repeat(2, 1)


def test_a_delegate_returning_views_hands_the_caller_its_own_tensors(emu):
    """Only an output the delegate's plan makes fresh is made by the delegate; a view of its
    result or of its input is written into a tensor made for the caller (found by review: it
    was handed over uncopied, and the next call overwrote what the caller kept)."""
    torch.manual_seed(0)
    model, example = ViewOut().eval(), (torch.randn(4, 16),)
    skip = ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=False, skip_d2h_for_method_outputs=True)
    program = ferry.compile(torch.export.export(model, example), ferry.OpSupportPartitioner("emu:0"),
                            ferry.CompileConfig(propagate_device=skip, alloc_graph_output=False))
    outputs = _run_three_calls(program, model, example)
    ptrs = [g.data_ptr() for got in outputs for g in got]
    assert len(set(ptrs)) == len(ptrs)  # every output of every call is memory of its own


def test_only_the_delegates_fresh_outputs_on_the_declared_device_are_made_by_it(emu):
    """A delegate makes an output only as the outer program declares it: on its device (the
    legacy mode, unplaced, declares host outputs of a device delegate) and only one its own
    plan makes fresh (not a view, not a functional kernel's result a graph may replay)."""
    torch.manual_seed(0)
    example = (torch.randn(4, 16),)
    skip = ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=False, skip_d2h_for_method_outputs=True)
    for model, fresh in ((Head().eval(), [[True]]), (ViewOut().eval(), [[False, False, False], [False]])):
        program = ferry.compile(torch.export.export(model, example), ferry.OpSupportPartitioner("emu:0"),
                                ferry.CompileConfig(propagate_device=skip, alloc_graph_output=False))
        method = program.method("forward")
        calls = [ins for ins in method.instructions if not hasattr(ins, "kernel")]
        assert len(calls) == len(fresh)
        for ins, want in zip(calls, fresh):
            delegate = program.delegates[ins.delegate]
            handle = get_backend(delegate.backend_id).init(program.segments[delegate.payload], delegate.compile_specs,
                                                           data=ProgramData(program.segments))
            declared = [method.values[v] for v in ins.outputs]
            assert all(v.storage == "output" and str(v.device) == "emu:0" for v in declared)
            assert [handle.makes_output(i, v) for i, v in enumerate(declared)] == want
            on_host = [dataclasses.replace(v, device=ferry.Device.parse("cpu")) for v in declared]
            assert not any(handle.makes_output(i, v) for i, v in enumerate(on_host))
            handle.close()

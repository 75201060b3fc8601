"""A non-strict export lifts a tensor the model reaches through a plain object as a constant, even
when the model writes it: that constant is the program's state (aot/lifted_state.py). Checked
against eager over a sequence of calls, in three placements."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind

import ferry
from ferry.aot.lifted_state import written_constants_as_state
from ferry.device import Device
from ferry.runtime import clone_to, device_of

EMU0 = Device("emu", 0)


class Holder:
    """Not a module: export cannot see that what it holds belongs to one."""

    def __init__(self, cache: torch.Tensor, count: torch.Tensor):
        self.cache, self.count = cache, count


class Through(nn.Module):
    """Writes a cache (rows at run-time positions) and a counter through a plain object, as
    transformers' static cache does; with `register`, the same tensors are also its buffers."""

    def __init__(self, register: bool):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)
        self.holder = Holder(torch.zeros(2, 8, 4), torch.zeros(()))
        if register:
            self.register_buffer("cache", self.holder.cache, persistent=False)
            self.register_buffer("count", self.holder.count, persistent=False)

    def forward(self, x, positions):
        self.holder.count.add_(1)
        self.holder.cache.index_copy_(1, positions, self.proj(x))
        row = self.holder.cache[:, 1:2]
        row.mul_(0.5)  # written through a view
        return self.holder.cache.sum(1) * self.holder.count


def _export(register: bool):
    """The model and its non-strict export. Tracing ran `count.add_(1)` on the real counter (no
    fake input reaches it), so the model, left as export left it, is the program's start."""
    model, x, positions = Through(register), torch.randn(2, 2, 4), torch.tensor([0, 1])
    return model, torch.export.export(model, (x, positions), strict=False)


@pytest.mark.parametrize("register", [True, False], ids=["buffer", "plain"])
def test_written_constants_become_state(register):
    _, ep = _export(register)
    written = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR]
    assert len(written) == 2, "the export this fixes: the written tensors lifted as constants"
    specs, nodes = list(ep.graph_signature.input_specs), [n.name for n in ep.graph.nodes]
    state = written_constants_as_state(ep)
    assert ep.graph_signature.input_specs == specs and [n.name for n in ep.graph.nodes] == nodes, "the caller's changed"
    kinds = {s.kind for s in state.graph_signature.input_specs}
    assert InputKind.CONSTANT_TENSOR not in kinds
    targets = {s.target for s in state.run_decompositions({}).graph_signature.output_specs
               if s.kind == OutputKind.BUFFER_MUTATION}
    # a buffer holding the same tensor takes the writes under its own name; else the constant's name
    assert targets == ({"cache", "count"} if register else {w.target for w in written})


@pytest.mark.parametrize("placement", ["cpu", "emu", "emu-io"])
@pytest.mark.parametrize("register", [True, False], ids=["buffer", "plain"])
def test_a_non_strict_export_writing_through_an_object_equals_eager_over_calls(emu, placement, register):
    eager, ep = _export(register)
    keep = ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)
    program = ferry.compile(ep, None if placement == "cpu" else ferry.OpSupportPartitioner("emu:0"),
                            ferry.CompileConfig(propagate_device=keep) if placement == "emu-io" else None)
    module = ferry.Module(ferry.load_program(program.to_bytes()))
    assert len(module.state_names()) == 2
    if register:
        assert sorted(module.state_names()) == ["cache", "count"]
    on = (lambda t: clone_to(t, EMU0)) if placement == "emu-io" else (lambda t: t)
    for call, positions in enumerate([[0, 1], [5, 2], [7, 1], [3, 4]]):
        x = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(call))
        positions = torch.tensor(positions)
        with torch.no_grad():
            want = eager(x, positions)
        got = module(on(x), on(positions))
        got = clone_to(got, "cpu") if device_of(got) == EMU0 else got
        torch.testing.assert_close(got, want, msg=lambda m, call=call: f"call {call}: {m}")

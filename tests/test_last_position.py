"""`CompileConfig(last_position_only=...)`: a method's results cut to their last position along
dimension 1 (aot/last_position.py), compared with eager's `result[:, -1:]` and with transformers'
greedy generation."""

from __future__ import annotations

import pytest
import torch

import ferry
from ferry.aot.last_position import keep_last_position
from ferry.aot.lower import functional_aten

transformers = pytest.importorskip("transformers")
from test_generate import CACHE, KEEP_ON_DEVICE, NEW, PROMPT, VOCAB, export, reference, token_ids  # noqa: E402

aten = torch.ops.aten


def both(last: bool, placement: str) -> ferry.Program:
    config = ferry.CompileConfig(propagate_device=KEEP_ON_DEVICE.propagate_device if placement != "cpu" else
                                 ferry.PropagateDeviceConfig(), last_position_only=["prefill"] if last else ())
    backend = "inductor" if placement == "emu-inductor" else "torch"
    partitioner = ferry.OpSupportPartitioner("emu:0", backend_id=backend) if placement != "cpu" else None
    return ferry.compile({"prefill": export("qwen2", 1, True), "decode": export("qwen2", 1, False)}, partitioner, config)


def logits_rows(program: ferry.Program, method: str) -> set[int]:
    """Rows (dimension 1, at its bound) of every value of the method as wide as the vocabulary."""
    return {v.shape[1] for v in program.methods[method].values
            if getattr(v, "shape", None) and len(v.shape) == 3 and v.shape[-1] == VOCAB}


@pytest.mark.parametrize("placement", ["cpu", "emu-io", "emu-inductor"])
def test_a_prefill_keeping_its_last_position_generates_what_transformers_generates(emu, placement):
    cut, whole = both(True, placement), both(False, placement)
    assert cut.method_meta("prefill").output_meta(0).shape == (1, 1, VOCAB)
    assert logits_rows(cut, "prefill") == {1} and logits_rows(whole, "prefill") == {8}  # 8: the prompt's bound
    assert logits_rows(cut, "decode") == logits_rows(whole, "decode") == {1}
    prompt = token_ids((1, PROMPT), 11)
    got = ferry.generate(ferry.Module(cut), prompt, NEW)
    assert got.tokens.tolist() == reference("qwen2", prompt, NEW).tolist()


def test_the_prefill_equals_eagers_last_row_at_every_length_and_its_head_runs_on_one_row():
    ep = export("qwen2", 1, True)
    module = ferry.Module(ferry.compile(ep, None, ferry.CompileConfig(last_position_only="forward")))
    eager = ep.module()
    for n in (5, 8, 2, 7):  # from position 0 each time: the causal mask hides what a longer call left
        ids, pos = token_ids((1, n), n), torch.arange(n)
        with torch.no_grad():
            want = eager(input_ids=ids, cache_position=pos)[:, -1:]
        torch.testing.assert_close(module(ids, pos), want, rtol=1e-5, atol=1e-5)
    lowered = functional_aten(ep)
    keep_last_position(lowered, "forward")
    (head,) = [n for n in lowered.graph.output_node().args[0] if n.target is aten.linear.default]
    assert head.args[0].target is aten.slice.Tensor and tuple(head.args[0].meta["val"].shape) == (1, 1, 32)
    assert tuple(head.meta["val"].shape) == (1, 1, VOCAB)


class Running(torch.nn.Module):
    """A result that is no product: a running sum over the positions (cut as it is)."""

    def forward(self, x):
        return x.cumsum(1).tanh(), x.sum()


def test_a_result_that_is_no_product_is_cut_as_it_is_and_one_without_positions_is_refused():
    x = torch.randn(2, 6, 4)
    ep = torch.export.export(Running(), (x,), dynamic_shapes=({1: torch.export.Dim("s", min=2, max=16)},))
    with pytest.raises(ferry.CompileError, match=r"result 1 of method 'forward' is a tensor of 0 dimension"):
        ferry.compile(ep, None, ferry.CompileConfig(last_position_only=["forward"]))

    class First(torch.nn.Module):
        def forward(self, x):
            return Running()(x)[0]

    ep = torch.export.export(First(), (x,), dynamic_shapes=({1: torch.export.Dim("s", min=2, max=16)},))
    module = ferry.Module(ferry.compile(ep, None, ferry.CompileConfig(last_position_only=["forward"])))
    for n in (6, 3, 11):
        x = torch.randn(2, n, 4)
        torch.testing.assert_close(module(x), First()(x)[:, -1:])


@pytest.mark.parametrize("value, message", [
    (["prefil"], r"last_position_only names method\(s\) \['prefil'\] that are not compiled"),
    (3, "last_position_only must name methods"),
    ([1], "last_position_only must name methods"),
])
def test_last_position_only_names_compiled_methods(value, message):
    with pytest.raises(ferry.ConfigError, match=message):
        ferry.compile({"prefill": export("qwen2", 1, True)}, None, ferry.CompileConfig(last_position_only=value))


def test_a_cache_holds_what_a_full_prefill_would_have_written():
    """Cutting the results leaves the state alone: a decode after a cut prefill reads the same
    cache as after a whole one (the cache is written before the head)."""
    prompt = token_ids((1, PROMPT), 13)
    steps = []
    for last in (True, False):
        module = ferry.Module(both(last, "cpu"))
        module.run_method("prefill", [prompt, torch.arange(PROMPT)])
        steps.append(module.run_method("decode", [prompt[:, -1:], torch.tensor([PROMPT])])[0])
    torch.testing.assert_close(steps[0], steps[1], rtol=0, atol=0)
    assert CACHE > PROMPT

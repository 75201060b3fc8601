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
from test_generate import KEEP_ON_DEVICE, NEW, PROMPT, VOCAB, export, reference, token_ids  # noqa: E402

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
        torch.testing.assert_close(module(input_ids=ids, cache_position=pos), want, rtol=1e-5, atol=1e-5)
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
    with pytest.raises(ferry.CompileError, match=r"result 1 of method 'forward' is of shape \[\], whose dimension 1"):
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
    ({"prefill": False}, "last_position_only must name methods"),
])
def test_last_position_only_names_compiled_methods(value, message):
    with pytest.raises(ferry.ConfigError, match=message):
        ferry.compile({"prefill": export("qwen2", 1, True)}, None, ferry.CompileConfig(last_position_only=value))
    if value == ["prefil"]:
        from ferry.aot.compile import place

        with pytest.raises(ferry.ConfigError, match="not placed here"):
            place(export("qwen2", 1, True), None, ferry.CompileConfig(last_position_only=value), method="prefill")


class Written(torch.nn.Module):
    """A head whose result is also written into a buffer, returned twice, and a 2-D product."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 5)
        self.register_buffer("seen", torch.zeros(2, 6, 5))
        self.reads = False  # exported again with this set: a method that reads the buffer

    def forward(self, x):
        if self.reads:
            return self.seen + 0
        y = self.head(x)
        self.seen.copy_(y)
        return y, y


class Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):  # [S, 4] -> [S, 1]: dimension 1 is no position
        return self.head(x)


def test_a_result_also_written_into_state_is_cut_after_the_write_and_one_without_positions_is_refused():
    x = torch.randn(2, 6, 4)
    model = Written()
    ep = torch.export.export(model, (x,))
    model.reads = True
    read = torch.export.export(model, (x,))
    module = ferry.Module(ferry.compile({"forward": ep, "read": read}, None,
                                        ferry.CompileConfig(last_position_only=["forward"])))
    got = module(x)
    y = model.head(x).detach()
    assert all(torch.equal(g, y[:, -1:]) for g in got)
    torch.testing.assert_close(module.run_method("read", [x])[0], y)  # the whole result was written
    with pytest.raises(ferry.CompileError, match="result 0 of method 'forward' is of shape \\[6, 1\\]"):
        ferry.compile(torch.export.export(Flat(), (torch.randn(6, 4),)), None,
                      ferry.CompileConfig(last_position_only=["forward"]))


@pytest.mark.parametrize("placement", ["cpu", "emu-io"])
def test_a_batch_of_sequences_and_a_prompt_longer_than_the_bound(emu, placement):
    """Batch 2 (the rows cut from several sequences are strided: made contiguous before the
    product), and a prompt longer than the prefill's bound, taken in calls of the bound."""
    config = ferry.CompileConfig(propagate_device=KEEP_ON_DEVICE.propagate_device if placement != "cpu" else
                                 ferry.PropagateDeviceConfig(), last_position_only="forward")
    partitioner = ferry.OpSupportPartitioner("emu:0") if placement != "cpu" else None
    module = ferry.Module(ferry.compile(export("qwen2", 2, True), partitioner, config))
    prompt = token_ids((2, 11), 17)  # the bound is 8
    got = ferry.generate(module, prompt, NEW)
    assert got.tokens.tolist() == reference("qwen2", prompt, NEW).tolist()


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

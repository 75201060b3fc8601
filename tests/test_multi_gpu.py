"""Several real GPUs: device maps, device_map='auto' under budgets, pipelined micro-batches.
Skipped with fewer than two GPUs (marker `cuda`); run on an H200 pair."""

from __future__ import annotations

import pytest
import torch

import ferry
from ferry import CompileError
from ferry.program.report import copy_report
from models import gpt2_lm, loaded_method
from test_device_map import TinyLM, ids, split_map

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.usefixtures("full_fp32"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs"),
]


def gpt2_map(layers: int) -> dict[str, int]:
    half = layers // 2
    m = {"m.transformer.wte": 0, "m.transformer.wpe": 0, "m.transformer.ln_f": 1, "m.lm_head": 1}
    m.update({f"m.transformer.h.{i}": int(i >= half) for i in range(layers)})
    return m


def test_a_device_map_over_two_gpus_equals_eager_with_tied_weights():
    model, (example,) = gpt2_lm(layers=4)  # lm_head shares wte's weight: each GPU gets its own copy
    ep = torch.export.export(model, (example.expand(2, -1).contiguous(),))
    program = ferry.compile(ep, device_map=gpt2_map(4))
    d2d = [r for r in copy_report(program, "forward").rows if r.direction == "d2d"]
    assert d2d and all((str(r.src), str(r.dst)) == ("cuda:0", "cuda:1") for r in d2d)  # hidden state, mask
    module = ferry.Module(program)
    for seed in range(2):
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(module(x), model(x), atol=1e-4, rtol=1e-4)


def test_auto_map_fits_budgets_on_two_gpus():
    model = TinyLM(layers=8, dim=64).eval()
    ep = torch.export.export(model, (ids(0, (4, 10)),))
    program = ferry.compile(ep, device_map="auto", max_memory={"cuda:0": "150KiB", "cuda:1": "150KiB"})
    assert set(program.method("forward").device_map.values()) == {"cuda:0", "cuda:1"}
    module = ferry.Module(program)
    x = ids(5, (4, 10))
    torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    with pytest.raises(CompileError, match="short by"):
        ferry.compile(ep, device_map="auto", max_memory={"cuda:0": "20KiB", "cuda:1": "20KiB"})


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_micro_batches_on_two_gpus_equal_eager(parts, graphs):
    model = TinyLM(layers=8, dim=64).eval()
    ep = torch.export.export(model, (ids(0, (2, 10)),))
    program = ferry.compile(ep, device_map=split_map(8, ["cuda:0", "cuda:1"]))
    module = ferry.Module(program, microbatches=parts, cuda_graphs=graphs)
    for rows in (2 * parts, 2 * parts - 1):
        for seed in range(3):  # the first call, the capture, replays
            x = ids(10 * rows + seed, (rows, 10))
            torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    if graphs:
        captured = [g for g in loaded_method(module).graphs if g.graph is not None]
        assert len(captured) == 2


def test_micro_batches_of_gpt2_with_graphs_equal_eager():
    model, (example,) = gpt2_lm(layers=4)
    ep = torch.export.export(model, (example.expand(2, -1).contiguous(),))
    module = ferry.Module(ferry.compile(ep, device_map=gpt2_map(4)), microbatches=4, cuda_graphs=True)
    for seed in range(3):
        x = torch.randint(0, 256, (7, 16), generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(module(x), model(x), atol=1e-4, rtol=1e-4)

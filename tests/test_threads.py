"""A Module shared by threads gives every caller its own correct result."""

from __future__ import annotations

import threading

import pytest
import torch

import ferry
from ferry.examples import transformer_block
from models import loaded_bytes


def _hammer(module, model, example, threads: int, calls: int):
    wrong, errors = [], []
    with torch.no_grad():
        inputs = [torch.randn_like(example[0]) for _ in range(16)]
        wants = [model(x) for x in inputs]

    def worker(seed):
        try:
            for i in range(calls):
                k = (seed * 7 + i) % len(inputs)
                got = module(inputs[k])
                if not torch.allclose(got, wants[k], atol=1e-5, rtol=1e-4):
                    wrong.append((seed, i))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(s,)) for s in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert not wrong, f"{len(wrong)} of {threads * calls} results wrong"


@pytest.mark.parametrize("concurrency", [1, 4])
def test_eight_threads_share_one_module(emu, concurrency):
    model, example = transformer_block()
    program = ferry.compile(torch.export.export(model, example),
                            ferry.OpSupportPartitioner("emu:0", exclude=["aten.softmax"]))
    module = ferry.Module(program, concurrency=concurrency)
    module.load_method()
    _hammer(module, model, example, threads=8, calls=250)


def test_concurrency_allocates_a_set_of_memory_each(emu):
    model, example = transformer_block()
    program = ferry.compile(torch.export.export(model, example), ferry.OpSupportPartitioner("emu:0"))
    one = loaded_bytes(emu, program)
    assert emu.live_bytes == 0
    triple = ferry.Module(program, concurrency=3)
    triple.load_method()
    # read-only: one copy for all sets (each weight's place in the upload rounded up to 256 bytes)
    weights = sum(-(-t.nbytes // 256) * 256 for t in triple.uploads._made.values())
    assert weights > 0
    assert emu.live_bytes == 3 * (one - weights) + weights
    with pytest.raises(ValueError, match="concurrency"):
        ferry.Module(program, concurrency=0)

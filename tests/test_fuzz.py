"""Mutated program files never make the runtime misbehave.

Seeded mutants of saved programs (header fields, metadata fields — ids, offsets, sizes, kernel
and constant names, instruction order — and segment bytes) are loaded, run and compared:

* as corruption (checksums left as they were): every outcome is a ferry error or the eager
  result — never another exception, a wrong answer, or memory beyond the limit;
* as deliberate edits (the metadata checksum recomputed, so the semantic checks face them):
  every outcome is a ferry error or a result, never another exception or a crash.

A few hundred mutants run in CI; FERRY_FUZZ_MUTANTS=10000 runs more.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections import Counter

import pytest
import torch

import ferry
from edits import header_of, json_paths, metadata_of, parent_of, rebuild
from ferry.errors import FerryError
from ferry.examples import transformer_block
from models import fresh_inputs

MUTANTS = int(os.environ.get("FERRY_FUZZ_MUTANTS", "300"))
LIMIT = 64 << 20  # bytes per device a mutant may make the runtime allocate
_KERNELS = ["aten::add.out", "aten::mul.out", "aten::relu.default", "aten::layer_norm.default",
            "aten::__class__.__init__", "load_library::__call__.__self__", "et_copy::_h2d_copy.out", "aten::view.default"]


def _bases():
    model, example = transformer_block(batch=1, seq=4, dim=16)  # small: many mutants
    ep = torch.export.export(model, example)
    return model, example, {
        "cpu": ferry.compile(ep).to_bytes(),
        "emu": ferry.compile(ep, ferry.OpSupportPartitioner("emu:0", exclude=["aten.softmax"])).to_bytes(),
    }


def _mutate_meta(rng: random.Random, meta):
    leaves = [(path, x) for path, x in json_paths(meta) if not isinstance(x, (dict, list))]
    path, old = rng.choice(leaves)
    if isinstance(old, bool):
        new = not old
    elif isinstance(old, int):
        new = rng.choice([old + 1, old - 1, 0, -1, old * 2 + 64, 2**31, 2**40, rng.randrange(64)])
    elif isinstance(old, float):
        new = rng.choice([0.0, -old, old * 1e30, "nan"])
    elif isinstance(old, str):
        new = rng.choice(_KERNELS + ["", "load", "float64", "cuda:7", "emu:3", "planned", "runtime", old[::-1]])
    else:
        new = rng.choice([0, [], {}, "x"])
    parent_of(meta, path)[path[-1]] = new
    if rng.random() < 0.2:  # reorder, repeat or drop an instruction
        ins = meta["methods"][0]["instructions"]
        if ins:
            k = rng.randrange(len(ins))
            rng.choice([lambda: ins.insert(k, dict(ins[k])), lambda: ins.pop(k), lambda: ins.reverse()])()


def _mutant(rng: random.Random, data: bytes) -> tuple[bytes, bool]:
    """(file, recomputed): a mutated file, and whether its metadata checksum was recomputed."""
    magic, version, flags, _, area = header_of(data)
    meta, tail = metadata_of(data), data[area:]
    what = rng.random()
    if what < 0.1:  # header
        header = (magic, rng.choice([1, 2, 3, 0]), rng.choice([0, 1, 3]))
        return rebuild(data, meta, header=header), True
    if what < 0.3 and tail:  # segment bytes: corruption a checksum must catch
        b = bytearray(tail)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return rebuild(data, meta, header=(magic, version, flags), checksum="kept", segments=bytes(b)), False
    recompute = rng.random() < 0.7
    _mutate_meta(rng, meta)
    return rebuild(data, meta, header=(magic, version, flags), checksum=recompute or "kept"), recompute


def _run(data: bytes, x: torch.Tensor):
    program = ferry.load_program(data, verify=True)
    with ferry.Module(program, max_memory=LIMIT) as module:
        return module(x)


def test_mutated_programs_are_refused_or_run_right(emu):
    model, example, bases = _bases()
    rng = random.Random(20261130)
    (x,) = fresh_inputs(example, 1)
    with torch.no_grad():
        want = model(x)
    outcomes: Counter = Counter()
    for n in range(MUTANTS):
        name = rng.choice(sorted(bases))
        data, recomputed = _mutant(rng, bases[name])
        try:
            got = _run(data, x)
        except FerryError as e:
            outcomes[f"ferry error: {type(e).__name__}"] += 1
            continue
        except Exception as e:  # noqa: BLE001 - the failure this test exists to find
            pytest.fail(f"mutant {n} ({name}, recomputed={recomputed}) raised {type(e).__name__}: {e}")
        assert emu.live_bytes == 0, "a closed module holds no device memory"
        if torch.allclose(got, want, atol=1e-4, rtol=1e-4):
            outcomes["eager result"] += 1
        elif recomputed:
            outcomes["a result (a deliberate edit: a different, valid program)"] += 1
        else:
            pytest.fail(f"mutant {n} ({name}): corruption ran and returned a wrong result")
    print(dict(outcomes))
    assert sum(outcomes.values()) == MUTANTS
    assert outcomes["eager result"] > 0, "some mutants must survive to run: the test would pass vacuously"


# ---------------------------------------------------------------- inductor payloads

INDUCTOR_MUTANTS = int(os.environ.get("FERRY_FUZZ_INDUCTOR_MUTANTS", "300"))
CANARY = 'x"); system("touch FERRY_CANARY"); //'  # text that would run if pasted into generated C++
_TEXTS = [CANARY, "floor", "trunc", "none", "tanh", "ceil", "aten::sin.default", "builtins::eval",
          "aten::_assert_async.msg", "aten::div.Tensor_mode", "aten::gelu.default", "ferry::copy.out"]


class _Ops(torch.nn.Module):
    """Ops with string, int and float arguments: what a payload's mutants may steer."""

    def forward(self, x):
        y = torch.nn.functional.gelu(x, approximate="tanh") + torch.div(x, 3.0, rounding_mode="floor")
        return torch.softmax(y.reshape(2, 8) * 0.5, -1).sum(0)


def _mutate_payload(rng: random.Random, payload: bytes) -> bytes:
    meta = metadata_of(payload)
    for _ in range(rng.randint(1, 3)):
        leaves = [(path, x) for path, x in json_paths(meta) if isinstance(x, str)]
        if leaves and rng.random() < 0.6:  # op names and string constants
            path, _ = rng.choice(leaves)
            parent_of(meta, path)[path[-1]] = rng.choice(_TEXTS + _KERNELS)
        else:
            _mutate_meta(rng, meta)  # ids, sizes, numbers, instruction order
    return rebuild(payload, meta)


def test_mutated_inductor_payloads_are_refused_or_run_and_never_reach_code_generation_with_file_text(
        monkeypatch, tmp_path):
    """Seeded mutants of an `inductor` payload (op names, string and number constants, ids,
    instruction order), its checksum recomputed as an attacker would: loading and calling is a
    ferry error or a result, never another exception, and no text from the file other than what
    ferry allows reaches Inductor (its compile is replaced by a check of the graph it is given)."""
    monkeypatch.chdir(tmp_path)
    given = []

    def compile_spy(gm, examples, options=None):
        given.append(gm)
        assert CANARY not in gm.code, "text from the file reached code generation"
        return gm  # run the checked graph op by op: C++ compiles of hundreds of mutants cost minutes

    monkeypatch.setattr(torch._inductor, "compile", compile_spy)
    base = ferry.compile(torch.export.export(_Ops(), (torch.randn(16),)),
                         ferry.OpSupportPartitioner("cpu", backend_id="inductor"))
    (d,) = base.delegates
    rng = random.Random(20261202)
    x = torch.randn(16)
    outcomes: Counter = Counter()
    for n in range(INDUCTOR_MUTANTS):
        segments = list(base.segments)
        segments[d.payload] = _mutate_payload(rng, base.segments[d.payload])
        try:
            with ferry.Module(dataclasses.replace(base, segments=segments), max_memory=LIMIT) as module:
                module(x)
        except FerryError as e:
            outcomes[f"ferry error: {type(e).__name__}"] += 1
            continue
        except Exception as e:  # noqa: BLE001 - the failure this test exists to find
            pytest.fail(f"inductor payload mutant {n} raised {type(e).__name__}: {e}")
        outcomes["ran"] += 1
    print(dict(outcomes))
    assert not (tmp_path / "FERRY_CANARY").exists()
    assert outcomes["ran"] > 0 and given, "some mutants must reach Inductor: the test would pass vacuously"

"""device_map="auto": stages that fit max_memory, balanced in time, checked against the real plan."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import ferry
from ferry import CompileError, ConfigError, Device, DeviceMapPartitioner
from ferry.aot import auto_map
from ferry.aot.auto_cost import op_flops
from ferry.aot.auto_map import collapse, parse_budgets
from ferry.aot.compile import device_bytes
from ferry.inspect import program_json, program_summary
from ferry.program import load_program
from ferry.program.report import copy_report
from ferry.runtime import emulated_device
from test_device_map import TinyLM, ids

BIG = {"emu:0": "10MB", "emu:1": "10MB"}


@pytest.fixture
def emu8():
    with emulated_device(num_devices=8) as allocator:
        yield allocator


@pytest.fixture(scope="module")
def lm():
    model = TinyLM(layers=8, dim=64, vocab=512)
    return model, torch.export.export(model, (ids(0, (4, 32), 512),))


def check_eager(program, model, seeds=(1, 2)):
    module = ferry.Module(program)
    for seed in seeds:
        x = ids(seed, (4, 32), 512)
        torch.testing.assert_close(module.forward(x), model(x), atol=1e-5, rtol=1e-4)


def bytes_after(phrase: str, message: str) -> int:
    """The byte count a message gives after `phrase` ("short by", "alone needs", ...)."""
    return int(re.search(phrase + r" ([\d,]+) bytes", message).group(1).replace(",", ""))


def shortfall(message: str) -> int:
    return bytes_after("short by", message)


# ------------------------------------------------------------------ budgets and estimates


def test_budgets_parse_like_accelerate():
    got = parse_budgets({0: "1GiB", "1": 2048, "cuda:2": "1.5 kB", "cpu": "64GB"})
    assert got == {Device("cuda", 0): 2**30, Device("cuda", 1): 2048, Device("cuda", 2): 1500, Device("cpu", 0): 64 * 10**9}


@pytest.mark.parametrize("bad, message", [
    (None, "needs max_memory"), ({}, "needs max_memory"), ({"cuda:0": "lots"}, "size like '20GiB'"),
    ({"tpu:0": "1GB"}, "unknown device type"), ({"cuda:0": -1}, "between 0 bytes and 1 EiB"),
    ({"cuda:0": "9" * 400 + "GiB"}, "size like '20GiB'"), ({"cuda:0": "9" * 30 + "GiB"}, "between 0 bytes and 1 EiB"),
])
def test_bad_budgets_are_config_errors(bad, message):
    with pytest.raises(ConfigError, match=message):
        DeviceMapPartitioner("auto", max_memory=bad)


def test_only_auto_is_a_word():
    with pytest.raises(ConfigError, match="or 'auto'"):
        DeviceMapPartitioner("balanced", max_memory=BIG)


def test_flops_of_gemms_convolutions_and_attention():
    class Ops(torch.nn.Module):
        def forward(self, a, b, img, w, q, k, v):
            return a @ b, torch.nn.functional.conv2d(img, w), torch.nn.functional.scaled_dot_product_attention(q, k, v)

    args = (torch.randn(8, 16), torch.randn(16, 4), torch.randn(1, 3, 10, 10), torch.randn(5, 3, 3, 3),
            torch.randn(2, 4, 6, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8))
    ep = torch.export.export(Ops(), args)
    flops = {str(n.target).split(".")[1]: op_flops(n) for n in ep.graph.nodes if n.op == "call_function"}
    assert flops["matmul"] == 2 * 8 * 16 * 4
    assert flops["conv2d"] == 2 * (5 * 8 * 8) * (3 * 3 * 3)
    assert flops["scaled_dot_product_attention"] == 4 * (2 * 4 * 6 * 8) * 7  # QK^T and PV


def test_collapse_names_a_module_whole_when_its_parts_agree():
    a, b = Device("cuda", 0), Device("cuda", 1)
    children = {"": ["h"], "h": ["h.0", "h.1"], "h.0": ["h.0.x", "h.0.y"], "h.1": ["h.1.x", "h.1.y"]}
    got = collapse({"h.0.x": a, "h.0.y": a, "h.1.x": a, "h.1.y": b}, children)
    assert got == {"h.0": a, "h.1.x": a, "h.1.y": b}


# ------------------------------------------------------------------ choosing


def test_auto_balances_layers_and_its_map_is_reusable(emu, lm):
    model, ep = lm
    program = ferry.compile(ep, device_map="auto", max_memory=BIG)
    check_eager(program, model)
    chosen = program.methods["forward"].device_map
    layers = [chosen[f"h.{i}"] for i in range(8)]
    k = layers.count("emu:0")
    assert layers == ["emu:0"] * k + ["emu:1"] * (8 - k) and 3 <= k <= 5  # eight equal blocks: about four each
    assert chosen["head"] == chosen["wte"]  # the tied head beside its embedding: the weight held once
    again = ferry.compile(ep, device_map=chosen)
    assert [d.compile_specs for d in again.delegates] == [d.compile_specs for d in program.delegates]
    assert len(again.methods["forward"].instructions) == len(program.methods["forward"].instructions)


def test_auto_keeps_a_dynamic_program_dynamic(emu):
    """The chooser sizes values at the sizes export traced: reading a symbolic size would add a
    guard to the caller's program and make the dimension static."""
    model = TinyLM(layers=4, dim=32, vocab=128)
    seq = torch.export.Dim("seq", min=2, max=32)
    ep = torch.export.export(model, (ids(0, (1, 8), 128),), dynamic_shapes=({1: seq},))
    program = ferry.compile(ep, device_map="auto", max_memory={"emu:0": "200kB", "emu:1": "200kB"})
    module = ferry.Module(program)
    for length in (16, 4, 32):
        x = ids(length, (1, length), 128)
        torch.testing.assert_close(module.forward(x), model(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("budget", ["500kB", "700kB"])
def test_auto_fits_every_budget(emu8, lm, budget):
    model, ep = lm
    max_memory = {f"emu:{i}": budget for i in range(4)}
    program = ferry.compile(ep, device_map="auto", max_memory=max_memory)
    check_eager(program, model, seeds=(3,))
    need, limit = device_bytes(program), parse_budgets({"emu:0": budget})[Device("emu", 0)]
    assert all(need.get(Device("emu", i), 0) <= limit for i in range(4))
    used = {d for d in need if d.type == "emu"}
    assert len(used) >= 2  # one device cannot hold it at these budgets


def test_cpu_takes_only_what_the_accelerators_cannot_hold(emu, lm):
    model, ep = lm
    roomy = ferry.compile(ep, device_map="auto", max_memory={**BIG, "cpu": "1GB"})
    assert "cpu:0" not in roomy.methods["forward"].device_map.values()
    tight = ferry.compile(ep, device_map="auto", max_memory={"emu:0": "300kB", "emu:1": "300kB", "cpu": "1GB"})
    assert "cpu:0" in tight.methods["forward"].device_map.values()
    check_eager(tight, model)


def test_a_module_larger_than_any_budget_is_named_with_the_shortfall(emu, lm):
    _, ep = lm
    with pytest.raises(CompileError, match=r"module 'wte' alone needs .*largest budget \(emu:0") as e:
        ferry.compile(ep, device_map="auto", max_memory={"emu:0": "100kB", "emu:1": "90kB"})
    assert shortfall(str(e.value)) == bytes_after("alone needs", str(e.value)) - 100_000 > 0


def test_a_model_larger_than_all_budgets_names_the_device_and_the_module(emu, lm):
    """The weights fit (285 kB of 720 kB), the logits (262 kB) do not fit beside them on either
    device: the closest split is compiled, and the error quotes its real plan and names the
    module whose bytes do not fit, with its own bytes."""
    _, ep = lm
    with pytest.raises(CompileError, match=r"found no split .* on emu:1: .*'head' needs the most") as e:
        ferry.compile(ep, device_map="auto", max_memory={"emu:0": "250kB", "emu:1": "470kB"})
    assert shortfall(str(e.value)) == bytes_after("allocates", str(e.value)) - 470_000 > 0
    assert bytes_after("needs the most:", str(e.value)) == 512 * 64 * 4  # the head's (tied) weight


def test_an_explicit_map_over_budget_names_device_and_shortfall(emu, lm):
    _, ep = lm
    device_map = {"": "emu:0", "h.6": "emu:1", "h.7": "emu:1"}
    program = ferry.compile(ep, device_map=device_map)
    need = device_bytes(program)[Device("emu", 0)]
    with pytest.raises(CompileError, match="does not fit max_memory on emu:0") as e:
        ferry.compile(ep, device_map=device_map, max_memory={"emu:0": need - 1000, "emu:1": "10MB"})
    assert shortfall(str(e.value)) == 1000


def test_a_low_estimate_is_corrected_by_the_real_plan(emu8, lm, monkeypatch):
    """The chooser works from estimates; compile checks the plan and chooses again, tighter."""
    model, ep = lm
    real_gather = auto_map.gather

    def half_the_activations(*args):
        facts = real_gather(*args)
        facts.values = [dataclasses.replace(v, nbytes=v.nbytes // 2) for v in facts.values]
        return facts

    monkeypatch.setattr(auto_map, "gather", half_the_activations)
    budgets = {"emu:0": "500kB", "emu:1": "500kB", "emu:2": "500kB"}
    calls = []
    real_tighten = DeviceMapPartitioner.tighten
    monkeypatch.setattr(DeviceMapPartitioner, "tighten", lambda self, over: (calls.append(dict(over)),
                                                                             real_tighten(self, over)))
    program = ferry.compile(ep, device_map="auto", max_memory=budgets)
    assert calls  # the first choice overshot
    need = device_bytes(program)
    assert all(need.get(Device("emu", i), 0) <= 500_000 for i in range(3))
    check_eager(program, model, seeds=(4,))


def test_partitioner_and_device_map_together_is_an_error(emu, lm):
    _, ep = lm
    with pytest.raises(ConfigError, match="not both"):
        ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"), device_map={"": "emu:0"})


# ------------------------------------------------------------------ the file, inspect, the CLI


def test_the_map_and_budgets_travel_in_the_file(emu, lm, tmp_path):
    _, ep = lm
    program = ferry.compile(ep, device_map="auto", max_memory=BIG)
    path = tmp_path / "p.ferry"
    program.save(path)
    method = load_program(path).methods["forward"]
    assert method.device_map == program.methods["forward"].device_map and method.device_map
    assert method.max_memory == {"emu:0": 10**7, "emu:1": 10**7}
    plain = ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"))
    plain.save(path)
    assert b"device_map" not in path.read_bytes()  # left out while empty: earlier readers still read it
    assert load_program(path).methods["forward"].device_map == {}


def test_inspect_shows_the_map_and_each_device_against_its_budget(emu, lm):
    _, ep = lm
    program = ferry.compile(ep, device_map="auto", max_memory=BIG)
    text = program_summary(program, instructions=False)
    shown = text.split("device_map= to compile the same split):\n")[1].splitlines()[0]
    assert json.loads(shown) == program.methods["forward"].device_map
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("emu:1 ") and "10,000,000" in ln)
    weights, planned, total = (int(x.replace(",", "")) for x in row.split()[1:4])
    assert weights + planned == total == device_bytes(program)[Device("emu", 1)]
    devices = program_json(program)["methods"]["forward"]["devices"]
    assert devices["emu:0"]["budget"] == 10**7 and devices["emu:0"]["total"] > 0


def test_cli_auto_map(tmp_path, capsys):
    from ferry.cli import main
    from ferry.runtime import get_allocator, unregister_allocator

    had = get_allocator("emu") is not None
    out = str(tmp_path / "p.ferry")
    base = ["compile", "ferry.examples:transformer_block", "-o", out]
    try:
        assert main(base + ["--device-map", "auto", "--max-memory", "emu:0=1MB,emu:1=1MB"]) == 0
        assert load_program(out).methods["forward"].max_memory == {"emu:0": 10**6, "emu:1": 10**6}
        assert main(["inspect", out]) == 0
        assert "device map (pass it back" in capsys.readouterr().out
        assert main(base + ["--device", "emu:0", "--max-memory", "emu:0=1MB"]) == 2
        assert "goes with --device-map" in capsys.readouterr().err
        assert main(base + ["--device-map", "auto", "--max-memory", "emu:0"]) == 2
        assert "DEVICE=SIZE" in capsys.readouterr().err
        assert main(base + ["--device-map", "auto", "--max-memory", "emu:0=1kB"]) == 2
        assert "short by" in capsys.readouterr().err
        split = load_program(out).methods["forward"].device_map
        assert main(base + ["--device-map", "auto", "--max-memory", "emu:0=1MB,emu:1=1MB",
                            "--no-split-module-classes", "TransformerBlock"]) == 0
        whole = load_program(out).methods["forward"].device_map
        assert len(set(whole.values())) == 1 < len(set(split.values()))  # the block kept whole
        assert main(base + ["--device", "emu:0", "--no-split-module-classes", "TransformerBlock"]) == 2
        assert "goes with --device-map auto" in capsys.readouterr().err
    finally:
        if not had and get_allocator("emu") is not None:
            unregister_allocator("emu")


# ------------------------------------------------------------------ against accelerate's map


class Logits(torch.nn.Module):
    """A transformers causal LM returning its logits (no cache: export wants tensors out)."""

    def __init__(self, model):
        super().__init__()
        self.m = model.eval()

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).logits


def causal_lm(kind: str, layers: int, dim: int, vocab: int):
    """(model, example ids, the model's no-split classes) of a small random transformers LM."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":  # tied wte / lm_head
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=layers, n_embd=dim, n_head=4, vocab_size=vocab, n_positions=64))
    elif kind == "bloom":  # tied word_embeddings / lm_head
        model = transformers.BloomForCausalLM(transformers.BloomConfig(
            n_layer=layers, hidden_size=dim, n_head=4, vocab_size=vocab))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=dim, intermediate_size=2 * dim, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64))
    return Logits(model).eval(), ids(0, (1, 16), vocab), list(model._no_split_modules)


def accelerate_map(model, budgets: dict[int, int], no_split, balanced=False):
    """accelerate's map for `budgets` ({GPU index: bytes}), on emu devices; None where it
    offloads (ferry maps no module to disk)."""
    import accelerate  # a test extra (pyproject.toml): its absence is an error, not a skip
    if balanced:
        budgets = accelerate.utils.get_balanced_memory(model, max_memory=budgets, no_split_module_classes=no_split)
    chosen = accelerate.infer_auto_device_map(model, max_memory=dict(budgets), no_split_module_classes=no_split)
    if not all(isinstance(d, int) for d in chosen.values()):
        return None
    return {path: f"emu:{d}" for path, d in chosen.items()}


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a tied weight once


def fits(ep, device_map, max_memory):
    try:
        return ferry.compile(ep, device_map=device_map, max_memory=max_memory)
    except CompileError:
        return None


@pytest.mark.parametrize("kind, shape, fractions", [
    ("gpt2", (6, 128, 1000), (0.33, 0.45)),  # the greedy chooser refused 0.33
    ("bloom", (6, 64, 1000), (0.33, 0.37)),  # the greedy chooser refused 0.33-0.39
    ("llama", (8, 64, 512), (0.34, 0.5)),
    ("toy", (6, 64, 512), (0.6, 0.65)),  # tied head, no no-split class: accelerate splits blocks
])
def test_auto_fits_wherever_accelerates_map_fits(emu8, kind, shape, fractions):
    """For each budget (a fraction of the weights on each of 4 devices) where accelerate's map,
    compiled by ferry, fits: "auto" fits too, and its program equals eager."""
    if kind == "toy":
        model, example, no_split = TinyLM(*shape), ids(0, (1, 8), shape[2]), []
    else:
        model, example, no_split = causal_lm(kind, *shape)
    ep = torch.export.export(model, (example,))
    compared = 0
    for fraction in fractions:
        budget = int(weight_bytes(model) * fraction)
        max_memory = {f"emu:{i}": budget for i in range(4)}
        theirs = accelerate_map(model, dict.fromkeys(range(4), budget), no_split)
        if theirs is None or fits(ep, theirs, max_memory) is None:
            continue
        program = ferry.compile(ep, device_map="auto", max_memory=max_memory)
        assert all(n <= budget for n in device_bytes(program).values())
        module = ferry.Module(program)
        for seed in (5, 6):
            x = ids(seed, tuple(example.shape), shape[2])
            torch.testing.assert_close(module.forward(x), model(x), atol=1e-5, rtol=1e-4)
        compared += 1
    assert compared  # accelerate's map fits at one budget at least: the comparison was made


def d2d_copies(program) -> int:
    return copy_report(program)["forward"].count("d2d")


@pytest.mark.parametrize("fraction, balanced", [(0.35, False), (1.2, True)])
def test_llama_layers_stay_whole_and_copy_no_more_than_accelerate(emu8, fraction, balanced):
    """Tight budgets (accelerate's greedy map needs all four devices) and roomy ones (against its
    balanced map, as from_pretrained(device_map="auto") makes): the model's own no-split class
    is read without being passed, no decoder layer is cut, and no more tensors cross devices."""
    model, example, no_split = causal_lm("llama", 8, 64, 512)
    ep = torch.export.export(model, (example,))
    budget = int(weight_bytes(model) * fraction)
    max_memory = {f"emu:{i}": budget for i in range(4)}
    theirs = fits(ep, accelerate_map(model, dict.fromkeys(range(4), budget), no_split, balanced), max_memory)
    assert theirs is not None and len({d for d in theirs.methods["forward"].device_map.values()}) == 4
    ours = ferry.compile(ep, device_map="auto", max_memory=max_memory)
    chosen = ours.methods["forward"].device_map
    assert all(re.fullmatch(r"m\.model\.layers\.\d+", k) for k in chosen if ".layers." in k), chosen
    assert d2d_copies(ours) <= d2d_copies(theirs)
    x = ids(7, (1, 16), 512)
    torch.testing.assert_close(ferry.Module(ours).forward(x), model(x), atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ no-split classes, tied weights


class Pair(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Pairs(torch.nn.Module):
    """Three blocks of two equal linears: on two devices of 1.9 blocks each, only a cut inside
    the middle block fits."""

    def __init__(self, dim: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.h = torch.nn.ModuleList(Pair(dim) for _ in range(3))

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return x


def test_no_split_module_classes_keeps_a_block_whole(emu):
    model = Pairs()
    ep = torch.export.export(model, (torch.randn(1, 8, 64),))
    block = sum(p.numel() * 4 for p in model.h[0].parameters())
    max_memory = {"emu:0": int(1.9 * block), "emu:1": int(1.9 * block)}
    program = ferry.compile(ep, device_map="auto", max_memory=max_memory)
    chosen = program.methods["forward"].device_map
    assert chosen["h.1.fc1"] != chosen["h.1.fc2"]  # the one split that fits cuts the middle block
    x = torch.randn(1, 8, 64)
    torch.testing.assert_close(ferry.Module(program).forward(x), model(x))
    with pytest.raises(CompileError, match=r"no split .*'h\.\d' needs the most: " + f"{block:,} bytes of weights"):
        ferry.compile(ep, device_map="auto", max_memory=max_memory, no_split_module_classes=["Pair"])


def test_a_module_kept_whole_is_blamed_for_its_own_bytes(emu):
    model = Pairs()
    ep = torch.export.export(model, (torch.randn(1, 8, 64),))
    block = sum(p.numel() * 4 for p in model.h[0].parameters())
    linear = block // 2
    budgets = {"emu:0": block - 100, "emu:1": block - 100}
    with pytest.raises(CompileError, match=r"module 'h\.0' alone needs .* \(its class Pair is not split") as e:
        ferry.compile(ep, device_map="auto", max_memory=budgets, no_split_module_classes=["Pair"])
    assert bytes_after("alone needs", str(e.value)) == block and shortfall(str(e.value)) == 100
    small = {"emu:0": linear - 100, "emu:1": linear - 100}
    with pytest.raises(CompileError, match=r"module 'h\.0\.fc1' alone needs .*no submodules") as e:
        ferry.compile(ep, device_map="auto", max_memory=small)  # a leaf, not the block above it
    assert bytes_after("alone needs", str(e.value)) == linear and shortfall(str(e.value)) == 100


@pytest.mark.parametrize("bad", ["Pair", [3], [""]])
def test_bad_no_split_module_classes_are_config_errors(bad):
    with pytest.raises(ConfigError, match="list of module class names"):
        DeviceMapPartitioner("auto", max_memory=BIG, no_split_module_classes=bad)


def test_no_split_module_classes_go_with_auto_only(emu, lm):
    _, ep = lm
    with pytest.raises(ConfigError, match="goes with device_map='auto'"):
        ferry.compile(ep, device_map={"": "emu:0"}, no_split_module_classes=["Block"])
    with pytest.raises(ConfigError, match="goes with device_map='auto'"):
        ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"), no_split_module_classes=["Block"])


def test_an_unknown_no_split_class_is_told(emu):
    ep = torch.export.export(Pairs(), (torch.randn(1, 8, 64),))
    with pytest.warns(UserWarning, match=r"\['Piar'\] matches no module .*'Pair'"):
        ferry.compile(ep, device_map="auto", max_memory=BIG, no_split_module_classes=["Piar"])


def test_a_tied_head_goes_beside_its_embedding_when_that_saves_a_copy(emu8):
    """GPT-2's lm_head reads wte's weight: placed beside wte, the weight is held once, and the
    program holds exactly the model's weights (a tied weight counted once), and the position ids
    it computes from constants alone (aot/constant_fold.py)."""
    model, example, _ = causal_lm("gpt2", 6, 128, 1000)
    ep = torch.export.export(model, (example,))
    budget = int(weight_bytes(model) * 0.33)  # on 4 devices: a second copy of wte fits nowhere
    program = ferry.compile(ep, device_map="auto", max_memory={f"emu:{i}": budget for i in range(4)})
    chosen = program.methods["forward"].device_map
    assert chosen["m.lm_head"] == chosen["m.transformer.wte"]
    devices = program_json(program)["methods"]["forward"]["devices"]
    folded = {v.constant: len(program.segments[v.constant]) for d in program.delegates  # the positions, made at
              for v in ferry.load_program(program.segments[d.payload], segments=program.segments)  # compile time
              .method("forward").values if getattr(v, "constant", None) is not None and "_folded_" in v.name}
    assert folded and sum(d["weights"] for d in devices.values()) == weight_bytes(model) + sum(folded.values())


def test_errors_after_retries_quote_the_callers_budgets(emu, lm, monkeypatch):
    """An estimate blind to activations keeps choosing splits the real plan overflows; retries
    lower the working budgets, and the error still quotes the budgets the caller gave."""
    _, ep = lm
    real_gather = auto_map.gather

    def no_activations(*args):
        facts = real_gather(*args)
        facts.values = [dataclasses.replace(v, nbytes=0) for v in facts.values]
        return facts

    monkeypatch.setattr(auto_map, "gather", no_activations)
    with pytest.raises(CompileError, match=r"over its budget of 400,000: short by") as e:
        ferry.compile(ep, device_map="auto", max_memory={"emu:0": "400kB", "emu:1": "400kB"})
    assert shortfall(str(e.value)) == bytes_after("allocates", str(e.value)) - 400_000

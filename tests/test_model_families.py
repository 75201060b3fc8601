"""Real transformers model families end to end against eager PyTorch, on small random configs.

Each model is compiled in three placements, saved to a file, loaded and run on fresh random
inputs (never only the export example):

- ``cpu``: no partitioner, everything on the CPU;
- ``emu``: every supported op on emu:0, inputs and outputs CPU tensors (copies inserted);
- ``emu-io``: every supported op on emu:0 with both skip flags: inputs passed in on emu:0,
  outputs returned on emu:0.

Families: Gemma, Gemma 2 and Gemma 3 (text) logits; a hand-written module writing slices of its
buffers over a sequence of calls; Qwen 2 and Llama with a dynamic sequence length called at
sizes in changing order; and transformers' static-cache export for ExecuTorch (a Llama with a
static KV cache, buffers ferry keeps and updates in place) decoding 20 tokens greedily.
Everything is compared with eager at rtol 1e-3 (atol 1e-4 of the output's magnitude).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int

import ferry
from ferry.device import Device
from ferry.runtime import clone_to, device_of
from models import fresh_inputs
from test_real_models import _Logits

transformers = pytest.importorskip("transformers")

EMU0 = Device("emu", 0)
KEEP_ON_DEVICE = ferry.CompileConfig(
    propagate_device=ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)
)
PLACEMENTS = ["cpu", "emu", "emu-io"]
VOCAB = 128


def close(got, want, what=""):
    """rtol 1e-3, atol 1e-4 of the larger of 1 and the reference's largest magnitude."""
    atol = 1e-4 * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-3, atol=atol, msg=lambda m: f"{what}: {m}")


class Compiled:
    """A program compiled in one placement, saved to a file and loaded: called with CPU tensors,
    it passes each input where the program expects it and returns CPU tensors (a tuple). `ep`:
    one exported program (method 'forward') or {method name: exported program}."""

    def __init__(self, ep, placement: str, path):
        partitioner = None if placement == "cpu" else ferry.OpSupportPartitioner("emu:0")
        program = ferry.compile(ep, partitioner, KEEP_ON_DEVICE if placement == "emu-io" else None)
        program.save(path)
        self.placement, self.module = placement, ferry.Module(path)
        metas = {name: self.module.method_meta(name) for name in self.module.method_names()}
        inputs = {name: [m.input_meta(i).device for i in range(m.num_inputs())] for name, m in metas.items()}
        for name, devices in inputs.items():
            if placement == "emu-io":  # the skip flags keep the model's inputs on the device
                assert EMU0 in devices, (name, devices)
            else:
                assert all(str(d).startswith("cpu") for d in devices), (name, devices)
        self.devices = inputs.get("forward")

    def __call__(self, *inputs):
        args = [t if str(d).startswith("cpu") else clone_to(t, d) for t, d in zip(inputs, self.devices)]
        outs = self.module(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if self.placement == "emu-io":  # returned where the last kernel wrote them
            assert all(device_of(o) == EMU0 for o in outs), [str(device_of(o)) for o in outs]
            return tuple(clone_to(o, "cpu") for o in outs)
        assert all(str(device_of(o)).startswith("cpu") for o in outs)
        return outs


def token_ids(shape, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# config and model class of each family, by the names transformers gives them
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
}
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def family_decoder(name: str, **config):
    """A causal LM of family `name` with random weights (seed 0), in eval mode: a tiny config,
    `config` overriding it."""
    config_cls, model_cls = (getattr(transformers, c) for c in FAMILIES[name])
    torch.manual_seed(0)
    return model_cls(config_cls(**{**TINY, **config})).eval()


# ---------------------------------------------------------------------------------------------
# Gemma, Gemma 2, Gemma 3: logits of a causal LM without a cache

GEMMA_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
)
GEMMA_SEQ = 16


@functools.cache
def gemma(name: str):
    # sliding window below the sequence length: the local layers' masks differ from the global ones
    window = {} if name == "gemma" else {"sliding_window": 8}
    model = _Logits(family_decoder(name, **GEMMA_COMMON, **window))
    return model, torch.export.export(model, (token_ids((1, GEMMA_SEQ), 0),))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_gemma_family_logits_equal_eager(emu, tmp_path, name, placement):
    model, ep = gemma(name)
    run = Compiled(ep, placement, tmp_path / f"{name}.ferry")
    for seed in (1, 2):
        ids = token_ids((1, GEMMA_SEQ), seed)
        with torch.no_grad():
            want = model(ids)
        assert want.abs().max() > 0.1  # the check below cannot pass on a zero output
        (got,) = run(ids)
        close(got, want, f"{name} logits, call {seed}")


# ---------------------------------------------------------------------------------------------
# slice writes into buffers: state carried over a sequence of calls


class SliceWrites(nn.Module):
    """A shift register written by slice assignment, a cache written by index_copy_ at run-time
    positions and a slice written by copy_: each call's outputs depend on every earlier call."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)
        self.register_buffer("window", torch.zeros(2, 6, 4))  # the last 6 rows seen, oldest first
        self.register_buffer("cache", torch.zeros(2, 8, 4))  # rows written at positions `pos`
        self.register_buffer("head", torch.zeros(2, 3, 4))  # its first 2 rows: the last input's first rows

    def forward(self, x, pos):
        n = x.shape[1]
        self.window[:, :-n] = self.window[:, n:].clone()  # shift left by n rows
        self.window[:, -n:] = self.proj(x)
        self.cache.index_copy_(1, pos, x * 2)
        self.head[:, :2].copy_(x[:, :2] + self.head[:, 1:])
        y = self.window.sum(1, keepdim=True) + self.cache.mean(1, keepdim=True) + self.head[:, :1]
        return y, self.window.clone(), self.cache.clone(), self.head.clone()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_slice_writes_into_buffers_equal_eager_over_calls(emu, tmp_path, placement):
    x0, pos0 = torch.randn(2, 2, 4), torch.tensor([0, 1])
    ep = torch.export.export(SliceWrites(), (x0, pos0))
    run = Compiled(ep, placement, tmp_path / "slice_writes.ferry")
    eager = SliceWrites()
    names = ("y", "window", "cache", "head")
    for call, pos in enumerate([[3, 4], [6, 0], [1, 7], [2, 5], [4, 3]]):
        (x,) = fresh_inputs((x0,), seed=call)
        pos = torch.tensor(pos)
        with torch.no_grad():
            want = eager(x, pos)
        got = run(x, pos)
        for name, g, w in zip(names, got, want):
            close(g, w, f"call {call}: {name}")


# ---------------------------------------------------------------------------------------------
# dynamic sequence length: Qwen 2 and Llama called at sizes in changing order

SEQ = torch.export.Dim("seq", min=2, max=32)
DYNAMIC_SIZES = [16, 8, 16, 4, 32, 8, 2]


@functools.cache
def dynamic_decoder(name: str):
    return _Logits(family_decoder(name))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_dynamic_sequence_length_in_changing_order_equals_eager(emu, tmp_path, name, placement):
    model = dynamic_decoder(name)
    # exported here, not shared between tests: a compile that specializes the program's sizes
    # (its shape environment is shared with the caller's program) must not leak into another test
    ep = torch.export.export(model, (token_ids((1, 16), 0),), dynamic_shapes=({1: SEQ},))
    run = Compiled(ep, placement, tmp_path / f"{name}_dynamic.ferry")
    assert run.module.method_meta("forward").input_meta(0).shape == (1, SEQ.max)  # planned at the bound
    for call, seq in enumerate(DYNAMIC_SIZES):
        ids = token_ids((1, seq), 100 + call)
        with torch.no_grad():
            want = model(ids)
        (got,) = run(ids)
        assert got.shape == want.shape, f"call {call} at seq {seq}: shape {tuple(got.shape)}, eager {tuple(want.shape)}"
        close(got, want, f"{name} logits, call {call} at seq {seq}")
    (ids,) = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "input_ids"]
    assert not is_concrete_int(ids.meta["val"].shape[1]), "compiling specialized the caller's program to its example size"


# ---------------------------------------------------------------------------------------------
# transformers' static-cache export (the ExecuTorch integration): greedy decoding

MAX_CACHE_LEN = 64
PROMPT_LEN, NEW_TOKENS = 4, 20


@functools.cache
def static_cache_llama():
    """The model, with static caching asked for, and its export by transformers' recipe: the
    recipe wraps it in TorchExportableModuleWithStaticCache (no sliding window), whose cache
    tensors are buffers, and exports it with (input_ids, cache_position) keyword inputs, the
    method's inputs in that order."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = family_decoder("llama")
    model.generation_config.cache_implementation = "static"
    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)
    with torch.no_grad():
        ep = recipe.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))
    return model, ep


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_static_cache_llama_decodes_greedily_as_eager(emu, tmp_path, placement):
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    model, ep = static_cache_llama()
    run = Compiled(ep, placement, tmp_path / "llama_static_cache.ferry")
    # the same wrapper in eager, with a zero cache of its own, as the program's buffers start
    eager = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)
    prompt = token_ids((1, PROMPT_LEN), 7)
    tokens = prompt[0].tolist()
    for step in range(PROMPT_LEN + NEW_TOKENS - 1):  # prefill one token at a time, then decode
        ids, cache_position = torch.tensor([[tokens[step]]]), torch.tensor([step])
        with torch.no_grad():
            want = eager(input_ids=ids, cache_position=cache_position)
        (got,) = run(ids, cache_position)
        close(got, want, f"logits at step {step}")
        nxt, want_nxt = got[0, -1].argmax().item(), want[0, -1].argmax().item()
        assert nxt == want_nxt, f"step {step}: token {nxt}, eager {want_nxt}"
        if step >= PROMPT_LEN - 1:
            tokens.append(nxt)
    assert len(tokens) == PROMPT_LEN + NEW_TOKENS


@functools.cache
def static_cache_llama_prefill_decode():
    """Prefill (the whole prompt in one call) and decode (one token), exported by transformers'
    recipe from one model: compiled together, they share the KV cache."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model, decode = static_cache_llama()
    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)
    with torch.no_grad():
        prefill = recipe.export(input_ids=torch.ones(1, PROMPT_LEN, dtype=torch.long),
                                cache_position=torch.arange(PROMPT_LEN))
    return model, prefill, decode


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_static_cache_llama_prefill_and_decode_methods_share_the_cache(emu, tmp_path, placement):
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    model, prefill, decode = static_cache_llama_prefill_decode()
    partitioner = None if placement == "cpu" else ferry.OpSupportPartitioner("emu:0")
    program = ferry.compile({"prefill": prefill, "decode": decode}, partitioner,
                            KEEP_ON_DEVICE if placement == "emu-io" else None)
    program.save(tmp_path / "llama.ferry")
    module = ferry.Module(tmp_path / "llama.ferry")
    assert len(module.state_names()) >= 4  # keys and values of 2 layers, held once
    eager = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)
    on_device = (lambda t: clone_to(t, EMU0)) if placement == "emu-io" else (lambda t: t)
    prompt = token_ids((1, PROMPT_LEN), 11)
    tokens = prompt[0].tolist()
    for step in range(NEW_TOKENS):
        start = 0 if step == 0 else PROMPT_LEN + step - 1
        ids = prompt if step == 0 else torch.tensor([[tokens[-1]]])
        pos = torch.arange(start, start + ids.shape[1])
        with torch.no_grad():
            want = eager(input_ids=ids, cache_position=pos)
        (got,) = module.run_method("prefill" if step == 0 else "decode", [on_device(ids), on_device(pos)])
        got = clone_to(got, Device("cpu", 0)) if got.device.type != "cpu" else got
        close(got[:, -1], want[:, -1], f"logits at step {step}")
        nxt, want_nxt = got[0, -1].argmax().item(), want[0, -1].argmax().item()
        assert nxt == want_nxt, f"step {step}: token {nxt}, eager {want_nxt}"
        tokens.append(nxt)
    assert len(tokens) == PROMPT_LEN + NEW_TOKENS

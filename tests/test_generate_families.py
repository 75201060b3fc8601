"""ferry.generate against transformers' own greedy `generate`, 64 new tokens in fp32, for each model
family, through the export paths users have: transformers' ExecuTorch integration.

Paths: `TorchExportableModuleForDecoderOnlyLM` with a dynamic prefill length (it picks a hybrid
cache, TorchExportableModuleWithHybridCache, for a config with `layer_types` and a sliding window,
else TorchExportableModuleWithStaticCache), strict (its default) or not; `convert_and_export_with_cache`,
one token per call or a dynamic length; and a prefill and a decode method compiled together (sharing
the cache).

Families: Llama, Qwen 2, Qwen 3, Gemma, Gemma 2, Gemma 3 (text), Gemma 4 (text, layers sharing a
cache), Phi-3, Mistral, on tiny random configs whose sliding window (8) is short beside the prompt
(12) plus 64 new tokens. Every family runs on emu:0 with token ids and logits on the device, a few
on the CPU and on emu:0 with host inputs too, each program through a saved file. transformers
exports a sliding layer with a full-length cache and a sliding mask (it replaces its ring-buffer
layer, StaticSlidingWindowLayer, which export cannot trace); its own generate uses the ring buffer.

A hand-written static-cache decoder (buffers written by index_copy_ and by index assignment)
generates what recomputing the whole sequence without a cache picks.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ferry
from test_model_families import VOCAB, Compiled, family_decoder, token_ids

transformers = pytest.importorskip("transformers")
executorch = pytest.importorskip("transformers.integrations.executorch")

PROMPT, NEW, WINDOW = 12, 64, 8
CACHE = 96  # the longest prompt (24) and 64 new tokens
PREFILL = torch.export.Dim("prefill", max=16)
# larger random weights than transformers' default (0.02): with those, a tiny model repeats one or
# two tokens, and a cache read at a wrong position could still pick them
GENERATE = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=128, initializer_range=0.2,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
HEAD_DIM = dict(head_dim=16)  # the families whose default head is larger than hidden / heads
UNTIED = dict(tie_word_embeddings=False)  # Gemma's tied, scaled embedding makes a random model echo its input
FAMILY = {
    "llama": {}, "qwen2": {}, "phi3": {},
    "qwen3": dict(**HEAD_DIM, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "gemma": dict(**HEAD_DIM, **UNTIED),
    "gemma2": dict(**HEAD_DIM, **UNTIED, sliding_window=WINDOW),
    "gemma3": dict(**HEAD_DIM, **UNTIED, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "mistral": dict(sliding_window=WINDOW),  # no layer_types: every layer slides, exported with a static cache
    # the last two layers read the keys and values of the first two (a cache of 0 positions each)
    "gemma4": dict(**HEAD_DIM, **UNTIED, global_head_dim=16, sliding_window=WINDOW, num_hidden_layers=4,
                   layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                   vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16),
}
HYBRID = {"qwen3", "gemma2", "gemma3", "gemma4"}  # layer_types and a sliding window: transformers exports a hybrid cache


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core runner their waits
    cost: this file took 1.5 times as long with torch's default of 2 threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(name: str, **config):
    model = family_decoder(name, **{**GENERATE, **FAMILY[name], **config})
    model.generation_config.cache_implementation = "static"
    # read by convert_and_export_with_cache, which takes no sizes of its own
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": CACHE}
    return model


decoder = functools.cache(make_model)


def _recipe(name: str, batch: int = 1):
    return executorch.TorchExportableModuleForDecoderOnlyLM(decoder(name), batch_size=batch, max_cache_len=CACHE)


@functools.cache
def export(name: str, path: str, batch: int = 1):
    """The exported program (or {method: program}) of `path` for family `name`."""
    one, few = torch.zeros(batch, 1, dtype=torch.long), torch.zeros(batch, 3, dtype=torch.long)
    dynamic = {"input_ids": {1: PREFILL}, "cache_position": {0: PREFILL}}
    with torch.no_grad():
        if path in ("recipe", "recipe-nonstrict"):
            return _recipe(name, batch).export(input_ids=few, cache_position=torch.arange(3), dynamic_shapes=dynamic,
                                               strict=path == "recipe")
        if path == "convert":
            return executorch.convert_and_export_with_cache(decoder(name))
        if path == "convert-dynamic":
            return executorch.convert_and_export_with_cache(decoder(name), few, torch.arange(3), dynamic_shapes=dynamic)
        assert path == "prefill+decode", path
        return {"prefill": export(name, "recipe", batch), "decode": _recipe(name, batch).export(
            input_ids=one, cache_position=torch.arange(1))}


@functools.cache
def reference(name: str, rows: int, length: int, seed: int) -> torch.Tensor:
    """transformers' greedy generate of NEW tokens after a random prompt; tokens varied enough that
    a wrong cache would show (a model repeating one token would pass with any)."""
    prompt = token_ids((rows, length), seed)
    with torch.no_grad():
        tokens = decoder(name).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                                        do_sample=False)
    assert len(set(tokens[:, length:].flatten().tolist())) >= 8, f"{name}: {tokens[:, length:].tolist()}"
    return tokens


def check_generates(run: Compiled, name: str, rows: int = 1, length: int = PROMPT, seed: int = 9):
    want = reference(name, rows, length, seed)
    got = ferry.generate(run.module, want[:, :length], NEW)
    assert got.new_tokens.shape == (rows, NEW)
    assert got.tokens.tolist() == want.tolist(), f"new token {_first_difference(got.tokens, want, length)} differs"


def _first_difference(got: torch.Tensor, want: torch.Tensor, prompt: int = PROMPT) -> int:
    return int((got != want).any(dim=0).int().argmax()) - prompt


# every family on one placement; a hybrid cache and a sliding static one on the other two; each
# other path on one family (a case costs an export and a compile: 3-10 s on 2 shared cores)
CASES = [(name, "recipe", "emu-io") for name in FAMILY]
CASES += [(name, "recipe", placement) for name in ("gemma3", "mistral") for placement in ("cpu", "emu")]
CASES += [("llama", "convert", "cpu"), ("gemma2", "convert", "emu"), ("qwen3", "convert-dynamic", "emu-io"),
          ("gemma3", "prefill+decode", "emu-io"),
          ("qwen3", "recipe-nonstrict", "emu-io")]  # its cache lifted as constants it writes (aot/lifted_state.py)


@pytest.mark.parametrize("name,path,placement", CASES, ids=["-".join(c) for c in CASES])
def test_family_generates_64_tokens_as_transformers(emu, tmp_path, name, path, placement):
    run = Compiled(export(name, path), placement, tmp_path / f"{name}.ferry")
    check_generates(run, name)


def test_a_long_prompt_of_two_rows_prefills_in_calls_across_the_window(emu, tmp_path, count_calls):
    run = Compiled(export("gemma2", "recipe", batch=2), "emu", tmp_path / "gemma2.ferry")
    calls = count_calls(run.module, "run_method")
    check_generates(run, "gemma2", rows=2, length=24, seed=9)
    assert [c[1][0].shape for c in calls[:3]] == [(2, 16), (2, 8), (2, 1)]  # the bound, the rest, a decode step


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3", "gemma4", "mistral"])
def test_the_sliding_window_slides_while_the_tests_generate(name):
    """The window shapes the reference's tokens (a wider one picks others), and transformers exports
    the family with the cache this file says."""
    wide = make_model(name, sliding_window=CACHE)
    assert all(torch.equal(a, b) for a, b in zip(wide.state_dict().values(), decoder(name).state_dict().values()))
    want = reference(name, 1, PROMPT, 9)
    with torch.no_grad():
        other = wide.generate(want[:, :PROMPT], attention_mask=torch.ones(1, PROMPT, dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False)
    assert other.tolist() != want.tolist()
    kind = "Hybrid" if name in HYBRID else "Static"
    assert type(_recipe(name).model).__name__ == f"TorchExportableModuleWith{kind}Cache"


# ---------------------------------------------------------------------------------------------
# a hand-written static cache


class CachedDecoder(nn.Module):
    """Two attention layers over a KV cache held in registered buffers: layer 0 writes its keys and
    values with index_copy_, layer 1 by index assignment (index_put_). A position attends to the
    last `window` positions. `recompute(ids)` gives the same logits from the whole sequence, without
    a cache."""

    def __init__(self, batch: int, cache: int = CACHE, window: int = WINDOW, dim: int = 32, heads: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.window = heads, window
        self.emb, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(cache, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(2))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.head = nn.Linear(dim, VOCAB)
        for i in range(2):
            self.register_buffer(f"k_cache_{i}", torch.zeros(batch, heads, cache, dim // heads))
            self.register_buffer(f"v_cache_{i}", torch.zeros(batch, heads, cache, dim // heads))

    def forward(self, ids, positions):
        x = self.emb(ids) + self.pos(positions)
        for i in range(2):
            q, k, v = self._qkv(i, x)
            keys, values = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            if i == 0:
                keys.index_copy_(2, positions, k)
                values.index_copy_(2, positions, v)
            else:
                keys[:, :, positions] = k
                values[:, :, positions] = v
            x = x + self._attend(i, q, keys, values, positions, torch.arange(keys.shape[2]))
        return self.head(x)

    def recompute(self, ids):
        positions = torch.arange(ids.shape[1])
        x = self.emb(ids) + self.pos(positions)
        for i in range(2):
            x = x + self._attend(i, *self._qkv(i, x), positions, positions)
        return self.head(x)

    def _qkv(self, i, x):
        b, t, d = x.shape
        return (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv[i](x).chunk(3, dim=-1))

    def _attend(self, i, q, k, v, at, seen):
        back = at[:, None] - seen[None, :]  # how far back each key is from each query
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=(back >= 0) & (back < self.window))
        return self.out[i](y.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("placement", ["cpu", "emu", "emu-io"])
def test_a_hand_written_static_cache_generates_what_recomputing_picks(emu, tmp_path, placement):
    model = CachedDecoder(batch=2).eval()
    with torch.no_grad():
        ep = torch.export.export(model, (torch.zeros(2, 3, dtype=torch.long), torch.arange(3)),
                                 dynamic_shapes=({1: PREFILL}, {0: PREFILL}))
    run = Compiled(ep, placement, tmp_path / "cached.ferry")
    tokens = token_ids((2, PROMPT), 9)
    got = ferry.generate(run.module, tokens, NEW)
    with torch.no_grad():
        for _ in range(NEW):
            tokens = torch.cat([tokens, model.recompute(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert len(set(tokens[:, PROMPT:].flatten().tolist())) >= 8
    assert got.tokens.tolist() == tokens.tolist()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["plain", "graphs"])
@pytest.mark.parametrize("name", ["gemma3", "gemma4", "mistral"])
def test_on_the_gpu_greedy_tokens_equal_transformers_on_the_gpu(full_fp32, name, graphs):
    """Prefill and decode compiled for cuda:0 with the skip flags (token ids, logits and the cache
    stay on the GPU), twice (graphs captured, then replayed); the reference is transformers'
    generate of the same weights on the same GPU, fp32 without TF32."""
    keep = ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)
    program = ferry.compile(export(name, "prefill+decode"), ferry.OpSupportPartitioner("cuda:0"),
                            ferry.CompileConfig(propagate_device=keep))
    module = ferry.Module(ferry.load_program(program.to_bytes()), cuda_graphs=graphs)
    prompt = token_ids((1, PROMPT), 9)
    with torch.no_grad():
        want = make_model(name).cuda().generate(prompt.cuda(), attention_mask=torch.ones_like(prompt).cuda(),
                                                max_new_tokens=NEW, do_sample=False).cpu()
    for _ in range(2):
        got = ferry.generate(module, prompt, NEW)
        assert got.tokens.tolist() == want.tolist(), f"new token {_first_difference(got.tokens, want)} differs"

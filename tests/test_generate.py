"""ferry.generate and `ferry generate` against transformers' own `generate`, on tiny random decoders
exported by transformers' ExecuTorch recipe (TorchExportableModuleForDecoderOnlyLM: a static KV
cache held as mutable buffers, inputs (input_ids, cache_position)).

Programs: a Llama taking one token per call (prefill token by token) and a Qwen 2 taking a dynamic
length (the prompt in one call), each on the CPU and on emu:0 with both skip flags (token ids in
and logits out on the device); a Qwen 2 of batch 2 for per-row stop tokens. Greedy runs equal
transformers' greedy `generate` token for token; seeded sampling draws the tokens transformers
draws after torch.manual_seed with the same seed (same order of temperature, top-k, top-p and
multinomial).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re
import sys

import pytest
import torch
from torch import nn

import ferry
from ferry.cli import main
from ferry.device import CPU, Device
from ferry.runtime import device_of

transformers = pytest.importorskip("transformers")

VOCAB, CACHE, PROMPT, NEW = 128, 32, 5, 12
EMU0 = Device("emu", 0)
SEQ = torch.export.Dim("seq", max=8)  # below the prompt of the chunked-prefill test
KEEP_ON_DEVICE = ferry.CompileConfig(
    propagate_device=ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)
)


@functools.cache
def decoder(name: str):
    """A tiny random model with no end-of-sequence token of its own (stop tokens are the test's)."""
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[name]
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.generation_config.cache_implementation = "static"
    return model


def export(name: str, batch: int, dynamic: bool):
    recipe = transformers.integrations.executorch.TorchExportableModuleForDecoderOnlyLM(
        decoder(name), batch_size=batch, max_cache_len=CACHE)
    ids = torch.zeros(batch, 3 if dynamic else 1, dtype=torch.long)
    shapes = {"input_ids": {1: SEQ}, "cache_position": {0: SEQ}} if dynamic else None
    with torch.no_grad():
        return recipe.export(input_ids=ids, cache_position=torch.arange(ids.shape[1]), dynamic_shapes=shapes)


@functools.cache
def program(name: str, batch: int, dynamic: bool, placement: str) -> ferry.Program:
    """Compiled once per process (tests using an emu placement hold the `emu` fixture)."""
    partitioner = None if placement == "cpu" else ferry.OpSupportPartitioner("emu:0")
    return ferry.compile(export(name, batch, dynamic), partitioner, KEEP_ON_DEVICE if placement == "emu-io" else None)


def token_ids(shape, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def bf16_decode_step(device: str):
    """A tiny Qwen2 in bf16 on `device`: (its decode step exported by transformers' ExecuTorch
    recipe, transformers' own static-cache step of the same weights)."""
    import copy

    from transformers.integrations.executorch import (
        TorchExportableModuleForDecoderOnlyLM,
        TorchExportableModuleWithStaticCache,
    )

    bf16 = lambda: copy.deepcopy(decoder("qwen2")).to(device=device, dtype=torch.bfloat16)  # noqa: E731
    recipe = TorchExportableModuleForDecoderOnlyLM(bf16(), batch_size=1, max_cache_len=CACHE)
    with torch.no_grad():
        ep = recipe.export(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                           cache_position=torch.tensor([0], device=device))
    return ep, TorchExportableModuleWithStaticCache(bf16(), batch_size=1, max_cache_len=CACHE)


def follows_eager_step_by_step(module, eager, device: str, steps: int = 12) -> None:
    """Teacher forcing: ferry's step and eager's are fed the same tokens; each step's logits agree
    within bf16 rounding."""
    tokens = token_ids((1, steps), 5).to(device)
    with torch.no_grad():
        for i in range(steps):
            ids, pos = tokens[:, i:i + 1].contiguous(), torch.tensor([i], device=device)
            got = module(input_ids=ids, cache_position=pos)
            want = eager(input_ids=ids, cache_position=pos)
            assert got.shape == want.shape
            scale = want.float().abs().max().item()
            assert torch.allclose(got.float(), want.float(), rtol=2 ** -5, atol=2 ** -5 * scale), i


def reference(name: str, prompt, new: int, **options) -> torch.Tensor:
    """transformers' own generate (greedy unless told), with a static cache."""
    options.setdefault("do_sample", False)
    with torch.no_grad():
        return decoder(name).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, **options)


def _copies(emu, run) -> dict[str, int]:
    """Copies through the emulated device's allocator during `run()`, by direction."""
    before = dict(emu.copy_counts)
    run()
    return {k: emu.copy_counts[k] - before[k] for k in before}


CASES = [("llama", False, "cpu"), ("llama", False, "emu-io"), ("qwen2", True, "cpu"), ("qwen2", True, "emu-io")]


@pytest.mark.parametrize("name,dynamic,placement", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_greedy_equals_transformers_generate(emu, count_calls, name, dynamic, placement):
    module = ferry.Module(program(name, 1, dynamic, placement))
    assert module.method_meta("forward").input_meta(0).device == (EMU0 if placement == "emu-io" else CPU)
    calls = count_calls(module, "run_method")
    prompt = token_ids((1, PROMPT), 3)
    got = ferry.generate(module, prompt, NEW)
    assert got.tokens.tolist() == reference(name, prompt, NEW).tolist()
    # a dynamic length takes the prompt in one call, a fixed length of 1 token by token
    assert len(calls) == (1 if dynamic else PROMPT) + NEW - 1
    if placement == "emu-io":  # token ids went in on the device; a step copies only what the program copies
        assert all(device_of(t) == EMU0 for t in calls[-1][1])
        few, more = (_copies(emu, lambda n=n: ferry.generate(module, prompt, n)) for n in (2, NEW))
        per_call = ferry.copy_report(module.program, "forward")
        assert {k: more[k] - few[k] for k in more} == {k: (NEW - 2) * per_call.count(k) for k in more}
    assert got.prompt_len == PROMPT and got.decode_steps == NEW - 1 and got.new_tokens.shape == (1, NEW)
    assert got.prefill_s > 0 and got.decode_s > 0 and got.decode_ms_per_token > 0


def test_on_an_asynchronous_device_with_graphs(emu_async):
    """Device work queued on streams until the host waits, CUDA graphs replayed: a token read
    before its step ran, or an input overwritten while a step still reads it, would differ here."""
    module = ferry.Module(program("qwen2", 2, True, "emu-io"), cuda_graphs=True)
    prompt = token_ids((2, PROMPT), 12)
    for _ in range(2):  # graphs are captured on the first calls, replayed on the second generation
        got = ferry.generate(module, prompt, NEW, stop_tokens=[5])
    assert got.tokens.tolist() == reference("qwen2", prompt, NEW, eos_token_id=5, pad_token_id=5).tolist()


def test_a_prompt_longer_than_one_call_prefills_in_calls_of_the_bound(emu, count_calls):
    module = ferry.Module(program("qwen2", 1, True, "emu-io"))
    calls = count_calls(module, "run_method")
    prompt = token_ids((1, SEQ.max + 4), 4)
    got = ferry.generate(module, prompt, 6)
    assert got.tokens.tolist() == reference("qwen2", prompt, 6).tolist()
    assert [c[1][0].shape[1] for c in calls[:2]] == [SEQ.max, 4]


class Renamed:
    """One compiled method under the names 'prefill' and 'decode': a program whose two methods share
    their KV cache, as methods compiled together do."""

    def __init__(self, module):
        self.module, self.calls = module, []

    def method_names(self):
        return ["prefill", "decode"]

    def method_meta(self, name):
        return self.module.method_meta("forward")

    def load_method(self, name):
        self.module.load_method("forward")

    def run_method(self, name, inputs):
        self.calls.append((name, inputs[0].shape[1]))
        return self.module.run_method("forward", inputs)


def test_prefill_and_decode_methods_are_called_by_name(emu):
    module = Renamed(ferry.Module(program("qwen2", 1, True, "emu-io")))
    prompt = token_ids((1, PROMPT), 5)
    got = ferry.generate(module, prompt, NEW)
    assert got.tokens.tolist() == reference("qwen2", prompt, NEW).tolist()
    assert module.calls == [("prefill", PROMPT)] + [("decode", 1)] * (NEW - 1)


def test_a_program_compiled_with_prefill_and_decode_methods(emu):
    with torch.no_grad():
        both = ferry.compile({"prefill": export("qwen2", 1, True), "decode": export("qwen2", 1, False)})
    prompt = token_ids((1, PROMPT), 5)
    got = ferry.generate(ferry.Module(both), prompt, NEW)
    assert got.tokens.tolist() == reference("qwen2", prompt, NEW).tolist()


SAMPLING = [dict(temperature=0.8, top_k=20, top_p=0.9), dict(temperature=1.3, top_k=0, top_p=1.0)]


@pytest.mark.parametrize("placement", ["cpu", "emu-io"])
@pytest.mark.parametrize("options", SAMPLING, ids=["top-k-top-p", "temperature"])
def test_seeded_sampling_draws_what_transformers_draws(emu, placement, options):
    module = ferry.Module(program("llama", 1, False, placement))
    prompt = token_ids((1, PROMPT), 6)
    ours = {k: (v or None if k == "top_k" else v) for k, v in options.items()}  # transformers: top_k=0 is off
    drawn = {seed: ferry.generate(module, prompt, NEW, do_sample=True, seed=seed, **ours).tokens for seed in (1, 2)}
    for seed in (1, 2):
        torch.manual_seed(seed)
        assert drawn[seed].tolist() == reference("llama", prompt, NEW, do_sample=True, **options).tolist()
    assert drawn[1][0, PROMPT:].tolist() != drawn[2][0, PROMPT:].tolist()
    again = ferry.generate(module, prompt, NEW, do_sample=True, generator=torch.Generator().manual_seed(1), **ours)
    assert again.tokens.tolist() == drawn[1].tolist()


def test_sampling_from_the_top_token_alone_is_greedy(emu):
    module = ferry.Module(program("llama", 1, False, "emu-io"))
    prompt = token_ids((1, PROMPT), 7)
    got = ferry.generate(module, prompt, NEW, do_sample=True, top_k=1, temperature=0.7, seed=0)
    assert got.tokens.tolist() == reference("llama", prompt, NEW).tolist()


def _first_at(row: list[int], token: int) -> int:
    return row.index(token) if token in row else len(row)


def _stop_token_of(rows: list[list[int]], row: int, other: int, start: int = 1) -> tuple[int, int]:
    """(a token row `row` emits at some step j >= start for the first time, j), one that row `other`
    emits later or never: that row stops first."""
    for j, token in enumerate(rows[row]):
        if j >= start and _first_at(rows[row], token) == j and _first_at(rows[other], token) > j:
            return token, j
    raise AssertionError(f"no stop token for row {row} in {rows}: pick another prompt seed")


def test_batch_of_two_stops_each_row_at_its_stop_token(emu):
    module = ferry.Module(program("qwen2", 2, True, "emu-io"))
    prompt = token_ids((2, PROMPT), 11)
    free = reference("qwen2", prompt, NEW)[:, PROMPT:].tolist()
    stop, j = _stop_token_of(free, 0, 1)
    want = reference("qwen2", prompt, NEW, eos_token_id=stop, pad_token_id=stop)
    for every in (1, 3, 8):  # how often the loop looks does not change the answer
        got = ferry.generate(module, prompt, NEW, stop_tokens=[stop], check_stop_every=every)
        assert got.tokens.tolist() == want.tolist(), f"check_stop_every={every}"
    assert got.tokens[0, PROMPT + j:].tolist() == [stop] * (NEW - j), "row 0 pads with its stop token"
    assert got.tokens[1, PROMPT:].tolist() != [stop] * NEW


def test_the_loop_ends_when_every_row_has_stopped(emu):
    module = ferry.Module(program("qwen2", 2, True, "emu-io"))
    prompt = token_ids((2, PROMPT), 11)
    free = reference("qwen2", prompt, NEW)[:, PROMPT:].tolist()
    (a, ja), (b, jb) = _stop_token_of(free, 0, 1), _stop_token_of(free, 1, 0, start=3)
    assert a != b and ja < jb < NEW - 1, (free, a, b)  # row 0 stops first, row 1 later, both before the end
    want = reference("qwen2", prompt, NEW, eos_token_id=[a, b], pad_token_id=0)
    for r, (stop, j) in enumerate([(a, ja), (b, jb)]):  # transformers pads with pad_token_id: ferry with the stop
        want[r, PROMPT + j + 1:] = stop
    got = ferry.generate(module, prompt, NEW, stop_tokens=(a, b))
    assert got.tokens.tolist() == want.tolist() and got.tokens.shape[1] == PROMPT + max(ja, jb) + 1


def test_streaming_gets_every_token_in_order(emu):
    module = ferry.Module(program("qwen2", 2, True, "emu-io"))
    prompt = token_ids((2, PROMPT), 11)
    free = reference("qwen2", prompt, NEW)[:, PROMPT:].tolist()
    stop, _ = _stop_token_of(free, 0, 1)
    seen = []
    got = ferry.generate(module, prompt, NEW, stop_tokens=[stop], on_token=seen.append)
    assert all(device_of(t) == CPU and t.shape == (2,) for t in seen)
    assert torch.stack(seen, dim=1).tolist() == got.new_tokens.tolist()
    assert got.tokens.tolist() == reference("qwen2", prompt, NEW, eos_token_id=stop, pad_token_id=stop).tolist()


def test_refuses_requests_the_program_cannot_hold(emu):
    module = ferry.Module(program("llama", 1, False, "cpu"))
    prompt = token_ids((1, PROMPT), 8)
    most = CACHE - PROMPT + 1  # every token but the last one goes into the cache
    assert ferry.generate(module, prompt, most).tokens.tolist() == reference("llama", prompt, most).tolist()
    with pytest.raises(ferry.InputError, match=rf"needs {CACHE + 1} cache positions .* holds {CACHE} \(key_cache_\d\): "
                                               rf"ask for at most {most} new tokens"):
        ferry.generate(module, prompt, most + 1)
    with pytest.raises(ferry.InputError, match=f"shorten the prompt to at most {CACHE} tokens"):
        ferry.generate(module, token_ids((1, CACHE + 1), 8), 1)
    with pytest.raises(ferry.InputError, match=r"holds 10 \(max_length\)"):
        ferry.generate(module, prompt, 8, max_length=10)
    with pytest.raises(ferry.InputError, match="prompt has 2 rows .* batch of 1.*batch_size=2"):
        ferry.generate(module, token_ids((2, PROMPT), 8), 2)
    with pytest.raises(ferry.InputError, match=f"token {VOCAB}, outside the program's vocabulary"):
        ferry.generate(module, [[1, VOCAB]], 2)
    with pytest.raises(ferry.InputError, match="stop token 200 is not a token id"):
        ferry.generate(module, prompt, 2, stop_tokens=[200])
    # two sets of memory, two KV caches, calls handed to either: the Module refuses, rather than wrong
    with pytest.raises(ferry.ConfigError, match=r"keeps state between calls .*concurrency=2 each set of memory would "
                                                r"hold a KV cache of its own.*concurrency=1"):
        ferry.Module(module.program, concurrency=2)
    with pytest.raises(ferry.ConfigError, match=r"holds the program.s state.*without microbatches"):
        ferry.generate(ferry.Module(module.program, microbatches=2), prompt, 2)


@pytest.mark.parametrize("options,message", [
    (dict(temperature=0.5), "pass do_sample=True"),
    (dict(do_sample=True, temperature=0.0), "temperature must be a finite number > 0"),
    (dict(do_sample=True, top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    (dict(do_sample=True, top_k=0), "top_k must be an int >= 1"),
    (dict(seed=1), "pass do_sample=True with it"),
    (dict(do_sample=True, seed=1, generator=torch.Generator()), "a generator or a seed, not both"),
    (dict(method="nope"), "no method 'nope'; its methods: forward"),
    (dict(check_stop_every=0), "check_stop_every must be an int >= 1"),
])
def test_refuses_settings_that_make_no_sense(emu, options, message):
    module = ferry.Module(program("llama", 1, False, "cpu"))
    with pytest.raises(ferry.ConfigError, match=message):
        ferry.generate(module, token_ids((1, PROMPT), 9), 4, **options)


class Window(nn.Module):
    """A cacheless stand-in decoder: logits of each token from an embedding, plus its position."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(VOCAB, VOCAB)

    def forward(self, ids, pos):
        return self.emb(ids) + pos[None, :, None].float() / 4


def test_methods_of_a_fixed_width_and_programs_of_another_kind(emu):
    model = Window().eval()
    exported = {w: torch.export.export(model, (torch.zeros(1, w, dtype=torch.long), torch.arange(w))) for w in (1, 3)}
    wide = ferry.Module(ferry.compile(exported[3]))
    with pytest.raises(ferry.ConfigError, match="'forward' takes exactly 3 tokens per call, but a decode step feeds one"):
        ferry.generate(wide, [[1, 2, 3]], 2)
    both = ferry.Module(ferry.compile({"prefill": exported[3], "decode": exported[1]}))
    with pytest.raises(ferry.InputError, match="takes exactly 3 tokens per call and the prompt has 4"):
        ferry.generate(both, [[1, 2, 3, 4]], 2)
    tokens = [5, 9, 1, 7, 3, 2]
    got = ferry.generate(both, [tokens], 5)
    with torch.no_grad():  # the window sees one token: eager, step by step
        for p in range(len(tokens) - 1, len(tokens) + 4):
            tokens.append(int(model(torch.tensor([[tokens[p]]]), torch.tensor([p]))[0, -1].argmax()))
    assert got.tokens.tolist() == [tokens]
    linear = ferry.Module(ferry.compile(torch.export.export(nn.Linear(4, 4), (torch.randn(2, 4),))))
    with pytest.raises(ferry.ConfigError, match=r"does not take a decoder step's inputs: it takes \(float32\[2, 4\]"):
        ferry.generate(linear, [[1]], 1)


# ---------------------------------------------------------------------------------------------
# the command line


def _saved(tmp_path, placement: str):
    path = tmp_path / f"llama-{placement}.ferry"
    program("llama", 1, False, placement).save(path)
    return str(path)


@pytest.mark.parametrize("placement", ["cpu", "emu-io"])
def test_cli_generates_from_prompt_ids(emu, tmp_path, capsys, placement):
    prompt = token_ids((1, PROMPT), 10)
    ids = ",".join(map(str, prompt[0].tolist()))
    assert main(["generate", _saved(tmp_path, placement), "--prompt-ids", ids, "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    want = reference("llama", prompt, 8)[0].tolist()
    lines = out.splitlines()
    assert lines[0] == f"{ids} | {','.join(map(str, want[PROMPT:]))}"
    assert "[ferry] load" in err and "[ferry] first call" in err
    assert lines[1].startswith(f"prefill: {PROMPT} tokens x 1 row(s)") and "tokens/s" in lines[1]
    assert lines[2].startswith("decode: 8 new token(s) per row, 7 step(s)") and lines[2].endswith("ms/token")
    assert lines[3] == "peak device memory: n/a (no CUDA device)" if placement == "cpu" else "(emulated)" in lines[3]


def test_cli_samples_as_transformers_does(emu, tmp_path, capsys):
    prompt = token_ids((1, PROMPT), 10)
    ids = ",".join(map(str, prompt[0].tolist()))
    argv = ["generate", _saved(tmp_path, "emu-io"), "--prompt-ids", ids, "--max-new-tokens", "8", "--do-sample",
            "--seed", "4", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9"]
    assert main(argv) == 0
    torch.manual_seed(4)
    want = reference("llama", prompt, 8, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)[0].tolist()
    assert capsys.readouterr().out.splitlines()[0] == f"{ids} | {','.join(map(str, want[PROMPT:]))}"


def tiny_tokenizer(folder):
    """A word-level tokenizer ('w0' .. 'w125', '[UNK]' 0, '</s>' 1), saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    fast.save_pretrained(folder)
    return fast


def test_cli_generates_from_text_with_a_local_tokenizer(emu, tmp_path, capsys):
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    text = "w3 w40 w17 w99 w5"
    prompt = torch.tensor([tokenizer(text)["input_ids"]])
    assert prompt.tolist() == [[5, 42, 19, 101, 7]]
    argv = ["generate", _saved(tmp_path, "cpu"), "--prompt", text, "--tokenizer", tmp_path / "tok", "--max-new-tokens", 8]
    assert main([str(a) for a in argv]) == 0
    want = reference("llama", prompt, 8, eos_token_id=1, pad_token_id=1)  # the tokenizer's </s> stops a row
    assert capsys.readouterr().out.splitlines()[0] == repr(tokenizer.decode(want[0], skip_special_tokens=True))


@pytest.mark.parametrize("argv,message", [
    (["--prompt", "w1 w2"], "--prompt needs --tokenizer DIR"),
    (["--prompt-ids", "1,2", "--prompt", "w1"], "give the prompt as --prompt-ids"),
    (["--prompt-ids", "1,x"], "--prompt-ids takes comma-separated integer token ids"),
    (["--prompt-ids", "1,2;3"], "rows of a batch must have one length"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "40"], "needs 41 cache positions"),
    (["--prompt-ids", "1,2", "--top-k", "3"], "--top-k shape sampling: add --do-sample"),
    (["--prompt", "w1", "--tokenizer", "/nonexistent/tok"], "--tokenizer /nonexistent/tok: not a folder"),
])
def test_cli_mistakes_are_one_line(emu, tmp_path, capsys, argv, message):
    assert main(["generate", _saved(tmp_path, "cpu"), *argv]) == 2
    *progress, last = capsys.readouterr().err.splitlines()
    assert last.startswith("ferry generate: error: ") and message in last, last
    assert all(line.startswith("[ferry] ") for line in progress), progress  # no traceback


def test_cli_says_when_transformers_is_missing(emu, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    assert main(["generate", _saved(tmp_path, "cpu"), "--prompt", "w1", "--tokenizer", str(tmp_path)]) == 2
    assert "needs the transformers package" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_generation_on_the_gpu_equals_transformers(full_fp32, graphs):
    """prefill + decode compiled for cuda:0 with the skip flags: ids, logits and the cache stay on
    the GPU; the tokens equal transformers' greedy generate (on the CPU, fp32)."""
    cfg = ferry.CompileConfig(propagate_device=KEEP_ON_DEVICE.propagate_device)
    both = ferry.compile({"prefill": export("qwen2", 1, True), "decode": export("qwen2", 1, False)},
                         ferry.OpSupportPartitioner("cuda:0"), cfg)
    module = ferry.Module(ferry.load_program(both.to_bytes()), cuda_graphs=graphs)
    prompt = token_ids((1, PROMPT), 21)
    for _ in range(2):  # the second generation replays what the first captured
        got = ferry.generate(module, prompt, NEW)
        assert got.tokens.tolist() == reference("qwen2", prompt, NEW).tolist()


def test_progress_hears_each_load_and_each_token_and_the_cli_draws_it(emu, tmp_path):
    """ferry.Module and ferry.generate tell a progress callback of each method loaded and each token
    issued; `ferry generate` on a terminal draws them on stderr, its stdout's tokens unchanged."""
    calls = []
    module = ferry.Module(_saved(tmp_path, "cpu"), progress=lambda *a: calls.append(a))
    prompt = token_ids((1, PROMPT), 10)
    got = ferry.generate(module, prompt, 6, progress=lambda *a: calls.append(a))
    assert [c for c in calls if c[0] == "generate"] == [("generate", k, 6, "token") for k in range(1, 7)]
    loads = {c[0]: c[1:] for c in calls if c[0].startswith("load ")}
    assert loads and all(done == total and unit == "part" for done, total, unit in loads.values())
    assert got.tokens.tolist() == reference("llama", prompt, 6).tolist()
    with pytest.raises(ferry.ConfigError, match="progress must be None or a callable"):
        ferry.Module(_saved(tmp_path, "cpu"), progress="bars")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    ids = ",".join(map(str, prompt[0].tolist()))
    outs = []
    for flags in ([], ["--no-progress"]):
        out, err = io.StringIO(), Terminal()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert main(["generate", _saved(tmp_path, "cpu"), "--prompt-ids", ids, "--max-new-tokens", "8", *flags]) == 0
        outs.append((out.getvalue().splitlines(), err.getvalue()))
    (lines, err), (quiet_lines, quiet_err) = outs
    assert lines[0] == quiet_lines[0] and len(lines) == len(quiet_lines)  # the tokens, and as many lines
    assert re.search(r"generate: +\d+%\|.*\| \d/8 ", err), err
    assert "generate:" not in quiet_err


def test_a_dynamic_prompt_compiled_by_inductor_generates_as_transformers(emu_async):
    """The whole prompt in one call of a program Inductor compiled once for every length up to
    the bound (backends/inductor.py), the cache and logits on the asynchronous emulated device,
    graphs captured per shape: transformers' greedy tokens, for two prompts of other lengths."""
    program = ferry.compile(export("qwen2", 1, True), ferry.OpSupportPartitioner("emu:0", backend_id="inductor"),
                            KEEP_ON_DEVICE)
    assert {d.backend_id for d in program.delegates} == {"inductor"}
    module = ferry.Module(program, cuda_graphs=True)
    for length, seed in ((PROMPT, 20), (7, 21), (PROMPT, 22)):
        prompt = token_ids((1, length), seed)
        got = ferry.generate(module, prompt, NEW)
        assert got.tokens.tolist() == reference("qwen2", prompt, NEW).tolist()


def test_a_dynamic_prefill_refuses_up_front_a_prompt_whose_last_call_is_below_its_minimum():
    """A prompt is fed in calls of the bound: one whose last call falls below the minimum the
    method was exported with is refused before any call writes the cache."""
    from ferry.runtime.decoder import TokenStep, check_prefill

    first = TokenStep("prefill", 0, None, None, None, None, 8, False, least=4)
    for length in (4, 8, 12, 16, 5):
        check_prefill(first, length)
    for length, last in ((10, 2), (3, 3), (17, 1)):
        with pytest.raises(ferry.InputError, match=f"ends with a call of {last}"):
            check_prefill(first, length)
    check_prefill(dataclasses.replace(first, least=0), 17)  # no minimum: any length


class _EvenChunks(nn.Module):
    """A decoder whose prefill export holds only for an even number of tokens per call."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 4), nn.Linear(4, 16)
        self.register_buffer("key_cache", torch.zeros(1, 32, 4))

    def forward(self, input_ids, cache_position):
        if input_ids.shape[1] > 1:
            torch._check(input_ids.shape[1] % 2 == 0)
        h = self.emb(input_ids)
        self.key_cache.index_copy_(1, cache_position, h)
        return self.head(h + self.key_cache.sum(1, keepdim=True))


def test_a_prompt_whose_last_prefill_call_breaks_a_guard_is_refused_before_any_call():
    """A prompt of 11 tokens fed 8 at a time ends with a call of 3, where the prefill's export
    guard (an even length) fails: refused before the first call writes the cache, naming the
    check; a prompt of 10 runs, its tokens those of eager's greedy loop."""
    model = _EvenChunks().eval()
    seq = torch.export.Dim.AUTO(min=2, max=8)
    ids, pos = torch.randint(0, 16, (1, 4)), torch.arange(4)
    prefill = torch.export.export(model, (ids, pos), dynamic_shapes=({1: seq}, {0: seq}))
    decode = torch.export.export(model, (ids[:, :1], pos[:1]))
    module = ferry.Module(ferry.compile({"prefill": prefill, "decode": decode}))
    calls, run_method = [], module.run_method
    module.run_method = lambda name, inputs: calls.append(name) or run_method(name, inputs)
    with pytest.raises(ferry.InputError, match=r"% 2\) == 0 \(input_ids\.shape\[1\] is 3\)"):
        ferry.generate(module, torch.randint(0, 16, (1, 11), generator=torch.Generator().manual_seed(0)), 3)
    assert calls == []
    prompt = torch.randint(0, 16, (1, 10), generator=torch.Generator().manual_seed(1))
    got = ferry.generate(module, prompt, 3).tokens
    expected = prompt
    with torch.no_grad():
        model.key_cache.zero_()
        logits = torch.cat([model(prompt[:, s:s + 8], torch.arange(s, min(s + 8, 10))) for s in (0, 8)][-1:], 1)
        for i in range(3):
            token = logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, token], 1)
            logits = model(token, torch.tensor([10 + i]))
    assert torch.equal(got, expected)

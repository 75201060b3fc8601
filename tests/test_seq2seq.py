"""An encoder–decoder speech model of Whisper's shape as one program: `encode` fills every decoder
layer's cross-attention cache, `decode` reads it as the program's state (never the encoder's
output), and ferry.generate runs the pair from log-mel features to the tokens transformers'
greedy generate picks; with the skip flags the encoder's work never leaves the device."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import ferry
from ferry.device import Device
from ferry.errors import ConfigError
from ferry.runtime import clone_to
from ferry.seq2seq import EncoderDecoderExport

transformers = pytest.importorskip("transformers")

NEW, FRAMES = 24, 20
KEEP_ON_DEVICE = ferry.CompileConfig(
    propagate_device=ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True))
# larger random weights than the default, so a tiny model's greedy tokens vary; no suppressed
# tokens (Whisper's defaults name ids of its real vocabulary)
CONFIG = dict(vocab_size=96, num_mel_bins=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128,
              max_source_positions=FRAMES, max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              decoder_start_token_id=1, init_std=0.5, begin_suppress_tokens=None, suppress_tokens=None)


@functools.cache
def whisper():
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**CONFIG)).eval()
    model.generation_config.begin_suppress_tokens = model.generation_config.suppress_tokens = None
    return model


def features(seed: int) -> torch.Tensor:
    return torch.randn(1, CONFIG["num_mel_bins"], 2 * FRAMES, generator=torch.Generator().manual_seed(seed))


@functools.cache
def exported(strict: bool = True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return EncoderDecoderExport(whisper(), max_cache_len=32).export(features(0), strict=strict)


def reference(feats: torch.Tensor) -> list:
    """transformers' greedy generate (the generic encoder–decoder loop, with its own cache)."""
    with torch.no_grad():
        out = transformers.GenerationMixin.generate(whisper(), input_features=feats,
                                                    decoder_input_ids=torch.tensor([[1]]), max_new_tokens=NEW,
                                                    do_sample=False, eos_token_id=None, pad_token_id=0)
    assert len(set(out[0, 1:].tolist())) >= 8, out  # varied tokens: a wrong cache read would show
    return out.tolist()


@pytest.mark.parametrize("placement,strict", [("cpu", True), ("emu", True), ("emu-io", True), ("emu-io", False)])
def test_whisper_generates_from_features_as_transformers(emu, tmp_path, placement, strict):
    """Non-strict export reads the cross-attention cache through constants that are its buffers'
    tensors (aot/lifted_state.py): read as the buffers, never as export time's values."""
    part = None if placement == "cpu" else ferry.OpSupportPartitioner("emu:0")
    program = ferry.compile(exported(strict), part, KEEP_ON_DEVICE if placement == "emu-io" else None)
    program.save(tmp_path / "whisper.ferry")
    module = ferry.Module(tmp_path / "whisper.ferry")
    assert reference(features(1)) != reference(features(2))  # so a stale cross cache would show
    for seed in (1, 2):  # a second utterance: encode overwrites the cross cache the first one left
        feats = features(seed)
        given = clone_to(feats, Device("emu", 0)) if placement == "emu-io" else feats
        got = ferry.generate(module, torch.tensor([[1]]), NEW, encoder_inputs=given)
        assert got.tokens.tolist() == reference(feats), f"utterance {seed}"


def test_decode_reads_the_cross_cache_encode_fills_as_state(emu):
    program = ferry.compile(exported(), ferry.OpSupportPartitioner("emu:0"), KEEP_ON_DEVICE)
    decode = {mb.name: mb for mb in program.method("decode").mutable_buffers}
    encode = {mb.name for mb in program.method("encode").mutable_buffers}
    cross = {f"recipe.cross_{kv}_{i}" for kv in ("key", "value") for i in range(2)}
    assert cross <= encode  # written by encode ...
    assert all(decode[n].update == decode[n].value for n in cross)  # ... read by decode, written back never
    assert all(program.method("decode").tensor(decode[n].value).device == Device("emu", 0) for n in cross)
    for name in ("encode", "decode"):  # nothing of the encoder's work crosses to the host
        assert ferry.copy_report(program, name).count("d2h") == 0, name
    decode_inputs = [program.method("decode").tensor(v).shape for v in program.method("decode").inputs]
    assert decode_inputs == [(1, 1), (1,)]  # tokens and a position: the encoder's output is not an input


def test_the_methods_are_called_by_the_recipes_own_names():
    """encode(input_features=) then decode(input_ids=, cache_position=): greedy steps by hand give
    transformers' tokens, as ferry.generate does."""
    module = ferry.Module(ferry.compile(exported()))
    feats = features(1)
    module.call("encode", input_features=feats)
    tokens = [1]
    for i in range(NEW):
        logits = module.call("decode", input_ids=torch.tensor([tokens[-1:]]), cache_position=torch.tensor([i]))
        tokens.append(int(logits[0, -1].argmax()))
    assert [tokens] == reference(feats)


def test_encoder_inputs_without_an_encode_method_are_refused():
    program = ferry.compile({"decode": exported()["decode"]})
    with pytest.raises(ConfigError, match="no method 'encode'"):
        ferry.generate(ferry.Module(program), torch.tensor([[1]]), 4, encoder_inputs=features(1))


def test_decoding_without_encoder_inputs_is_refused():
    program = ferry.compile(exported())
    with pytest.raises(ConfigError, match="pass the encoder's input as encoder_inputs="):
        ferry.generate(ferry.Module(program), torch.tensor([[1]]), 4)


def test_a_decoder_under_another_name_still_needs_the_encoder_inputs():
    """Whatever the decoder method is called (here 'forward'), it reads the cross cache only
    `encode` fills: without encoder inputs it would read an encoding of nothing."""
    ep = exported()
    module = ferry.Module(ferry.compile({"encode": ep["encode"], "forward": ep["decode"]}))
    with pytest.raises(ConfigError, match=r"reads what its 'encode' method writes \(recipe.cross_"):
        ferry.generate(module, torch.tensor([[1]]), 4)
    got = ferry.generate(module, torch.tensor([[1]]), NEW, encoder_inputs=features(1))
    assert got.tokens.tolist() == reference(features(1))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "inductor"])
def test_whisper_on_the_gpu_generates_as_transformers(backend):
    """fp32 on cuda:0 (TF32 off), inputs and outputs kept there, CUDA graphs on: 32 greedy tokens
    equal transformers' generate on the same GPU model, for two utterances in a row."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = whisper().cuda()
    try:
        feats = [features(seed).cuda() for seed in (1, 2)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            programs = EncoderDecoderExport(model, max_cache_len=40).export(feats[0])
        program = ferry.compile(programs, ferry.OpSupportPartitioner("cuda:0", backend_id=backend), KEEP_ON_DEVICE)
        for name in ("encode", "decode"):
            assert ferry.copy_report(program, name).count("d2h") == 0, name
        module = ferry.Module(program.to_bytes(), cuda_graphs=True)
        for f in feats:
            with torch.no_grad():
                want = transformers.GenerationMixin.generate(
                    model, input_features=f, decoder_input_ids=torch.tensor([[1]], device="cuda"),
                    max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
            got = ferry.generate(module, torch.tensor([[1]], device="cuda"), 32, encoder_inputs=f)
            assert got.tokens.tolist() == want.tolist()
    finally:
        whisper().cpu()

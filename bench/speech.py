"""Speech: a Whisper-small-shaped encoder–decoder from log-mel features to 64 greedy tokens.

GPU run (one H200): `python bench/speech.py`. Random weights (no downloads) in Whisper-small's
shape (12 + 12 layers, d_model 768, 51,865 tokens), bf16 on cuda:0, 30 s of random log-mel
features (80 x 3000). Smoke test on a CPU: `python bench/speech.py --tiny` (a 2 + 2 layer
model in float32, ferry on the emulated device 'emu:0').

Runners, one after another in one process:
- eager: transformers' greedy `generate` (the generic encoder–decoder loop, dynamic cache);
- compile: the same with a static cache and `model.forward` under
  torch.compile(mode="reduce-overhead"), the path transformers documents for Whisper (on torch
  2.11 and an H200 it crashed the process, 2026-12-04: run it alone);
- compile-default: the same in torch.compile's default mode (no CUDA graphs);
- ferry, ferry-graphs, ferry-inductor-graphs: ferry.seq2seq.EncoderDecoderExport compiled into
  one program (`encode` fills the cross-attention cache, `decode` reads it), inputs and outputs
  kept on the device, run by ferry.generate(encoder_inputs=features); CUDA graphs off / on; the
  inductor rows compile both methods with Inductor at load.

Columns: encode ms (the encoder alone, and for ferry the cross-attention projections it writes),
end-to-end ms for 64 new tokens (median of --repeat runs, synchronised), decode ms/token (end to
end less encode, over 64), "tokens = eager": the greedy tokens against eager's (random bf16
weights give flat logits: kernels that round otherwise may pick another token at a near tie).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import result_name, table, time_host, write_json  # noqa: E402

import ferry  # noqa: E402
from ferry.runtime import clone_to, emulated_device  # noqa: E402
from ferry.seq2seq import EncoderDecoderExport  # noqa: E402

SMALL = dict(vocab_size=51865, num_mel_bins=80, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12,
             decoder_attention_heads=12, d_model=768, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
             max_source_positions=1500, max_target_positions=448)
TINY = dict(vocab_size=96, num_mel_bins=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=20,
            max_target_positions=64, init_std=0.5)
RUNNERS = ("eager", "compile", "compile-default", "ferry", "ferry-graphs", "ferry-inductor-graphs")
START, NEW = 1, 64  # the decoder's start token; new tokens
KEEP_ON_DEVICE = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(
    skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True))


def build(tiny: bool, device: torch.device, dtype: torch.dtype):
    import transformers

    config = transformers.WhisperConfig(**(TINY if tiny else SMALL), pad_token_id=0, bos_token_id=START,
                                        eos_token_id=2, decoder_start_token_id=START, begin_suppress_tokens=None,
                                        suppress_tokens=None)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).to(device, dtype).eval()
    model.generation_config.begin_suppress_tokens = model.generation_config.suppress_tokens = None
    return model


def eager_generate(model, feats, compiled: bool, mode: str = "reduce-overhead"):
    """transformers' greedy loop; `compiled`: static cache and forward under torch.compile in `mode`
    (reduce-overhead on a GPU, default on the CPU)."""
    import transformers

    if compiled:
        model = copy.deepcopy(model)
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode=mode if feats.is_cuda else "default",
                                      fullgraph=True)
    start = torch.tensor([[START]], device=feats.device)

    def run():
        return transformers.GenerationMixin.generate(model, input_features=feats, decoder_input_ids=start,
                                                     max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                                     pad_token_id=0)

    return run, lambda: model.get_encoder()(feats)


def ferry_generate(model, feats, device: str, graphs: bool, backend: str):
    """(run, encode, compile seconds, load seconds) over one program of encode and decode."""
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps = EncoderDecoderExport(model, max_cache_len=NEW + 1).export(feats)
        program = ferry.compile(eps, ferry.OpSupportPartitioner(device, backend_id=backend), KEEP_ON_DEVICE)
    compiled_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    module = ferry.Module(program, cuda_graphs=graphs, outputs="view")
    for name in program.methods:
        module.load_method(name)
    load_s = time.perf_counter() - t0
    given = feats if feats.is_cuda else clone_to(feats, device)
    start = torch.tensor([[START]])
    return (lambda: ferry.generate(module, start, NEW, encoder_inputs=given).tokens,
            lambda: module.run_method("encode", [given]), compiled_s, load_s)


def measure(runner: str, model, feats, args, env: dict) -> dict:
    compile_s = load_s = None
    if runner in ("eager", "compile", "compile-default"):
        run, encode = eager_generate(model, feats, runner != "eager",
                                     "default" if runner == "compile-default" else "reduce-overhead")
    else:
        backend = "inductor" if "inductor" in runner else "torch"
        run, encode, compile_s, load_s = ferry_generate(model, feats, env["ferry_device"], runner.endswith("graphs"),
                                                        backend)
    t0 = time.perf_counter()
    tokens = run()
    first_s = time.perf_counter() - t0
    e2e = time_host(run, repeat=args.repeat, warmup=1)
    enc = time_host(encode, repeat=args.repeat, warmup=1)
    tokens = tokens.cpu() if tokens.device.type == "cpu" else tokens.to("cpu")
    return {"runner": runner, "encode_ms": enc * 1e3, "e2e_ms": e2e * 1e3, "decode_ms_per_token": (e2e - enc) / NEW * 1e3,
            "first_call_s": first_s, "compile_s": compile_s, "load_s": load_s, "tokens": tokens[0].tolist()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runners", default=",".join(RUNNERS))
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="a tiny model in float32 on the CPU, ferry on 'emu:0'")
    p.add_argument("--out", default=None, help="name of the JSON file under bench/results (default speech)")
    args = p.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        print("speech: skipped: no CUDA device; --tiny runs the ferry code paths on the emulated device")
        return
    device = torch.device("cpu" if args.tiny else "cuda:0")
    env = {"ferry_device": "emu:0" if args.tiny else "cuda:0", "dtype": "float32" if args.tiny else "bfloat16"}
    rows = []
    with emulated_device(num_devices=1) if args.tiny else contextlib.nullcontext(), torch.no_grad():
        model = build(args.tiny, device, torch.float32 if args.tiny else torch.bfloat16)
        frames = model.config.max_source_positions * 2
        feats = torch.randn(1, model.config.num_mel_bins, frames, generator=torch.Generator().manual_seed(1))
        feats = feats.to(device, model.dtype)
        for runner in args.runners.split(","):
            try:
                rows.append(measure(runner, model, feats, args, env))
            except Exception as e:  # noqa: BLE001 - one runner failing must not lose the others' rows
                rows.append({"runner": runner, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(f"done {runner}", flush=True)
    eager = next((r for r in rows if r["runner"] == "eager" and "tokens" in r), None)
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["runner"], "FAILED", r["error"][:80], "", "", "", ""])
            continue
        same = "-" if eager is None or r is eager else ("yes" if r["tokens"] == eager["tokens"] else "no")
        vs = eager and eager["e2e_ms"] / r["e2e_ms"]
        lines.append([r["runner"], round(r["encode_ms"], 2), round(r["e2e_ms"], 1), round(r["decode_ms_per_token"], 3),
                      round(vs, 2) if vs else "-", "-" if r["compile_s"] is None else round(r["compile_s"], 1), same])
    print(table(f"Whisper-{'tiny (smoke)' if args.tiny else 'small shape'}: {NEW} greedy tokens from "
                f"{frames} log-mel frames ({env['ferry_device']}, {env['dtype']})",
                ["runner", "encode ms", "end to end ms", "decode ms/token", "speed-up vs eager", "compile s",
                 "tokens = eager"], lines))
    print(f"wrote {write_json(args.out or result_name('speech', args.tiny), {'settings': env, 'rows': rows})}")


if __name__ == "__main__":
    main()

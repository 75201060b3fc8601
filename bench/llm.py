"""LLM generation: greedy decode and prefill with a static KV cache, ferry against eager and torch.compile.

GPU run (one H200): `python bench/llm.py`, the defaults being `--models llama-1b,qwen3-0.6b --batch 1
--cache 1024 --prompt 128,512`: 6 to 8 minutes by an estimate from CPU-side timings, not yet measured
(Qwen3's 28 layers cost most: torch.compile twice, decode then a dynamic prefill; ferry's export and
compile; Inductor's compile at load). If that is too close to a limit, run one model per process
(`--models llama-1b --out llm_llama`, `--models qwen3-0.6b --out llm_qwen`). The full grid of the
issue (--batch 1,8 --cache 128,1024,4096 --prompt 128,512,2048) is 12 configurations of about 3
minutes each (every (batch, cache) is an export, a ferry program and a torch.compile of its own):
run it as one process per configuration:
    for m in llama-1b qwen3-0.6b; do for b in 1 8; do for c in 128 1024 4096; do
      python bench/llm.py --models $m --batch $b --cache $c --prompt 128,512,2048 --out llm_${m}_b${b}_c${c}
    done; done; done
Smoke test on a CPU: `python bench/llm.py --tiny --batch 1 --cache 64 --prompt 16`.

Models have random weights (no downloads): Llama-3.2-1B's and Qwen3-0.6B's shapes from their
transformers configs, bf16 on cuda:0. `--tiny` swaps them for 2-layer, 64-wide, 256-token
versions in float32 on the CPU, with ferry on the emulated device 'emu:0'.

Runners, one after another in one process, each from an empty GPU and guarded (a failure is a row):
- eager: transformers' TorchExportableModuleWithStaticCache(model, B, L) on the GPU;
- compile: the same wrapper under torch.compile(fullgraph=True, mode="reduce-overhead"; default on CPU);
- ferry, ferry-graphs: TorchExportableModuleForDecoderOnlyLM(model, B, L).export(...) for decode (one
  token) and for prefill (a dynamic prompt length), compiled together into one program (the two
  methods share the KV cache and weights), inputs and outputs kept on the device, run by
  ferry.Module with cuda_graphs False / True;
- ferry-inductor-graphs: the same program with backend_id="inductor" (the prefill method compiled
  once for every prompt length up to the largest), CUDA graphs on;
- bound: (weight bytes + the whole static KV cache, which attention reads every step) divided by the
  bandwidth of a 1 GiB device-to-device copy (2 x bytes / time, median of 10).

A decode step: forward of one token per row at cache_position L//2, then the greedy pick on the
device fed back as the next input (nothing crosses to the host): each runner picks as its
generation loop does (eager and compile: torch's argmax, as transformers' `generate`; ferry:
`ferry.runtime.sampling.greedy`, as `ferry.generate`; bench/greedy_pick.py times the two).
ms/token: median over --repeat samples of 5 back-to-back steps, synchronised at both ends.
Prefill: one forward over a prompt of P tokens from position 0; tokens/s = B * P / time.
Peak memory: torch.cuda.max_memory_allocated (and reserved) from an empty GPU, after decode and
again after prefill. "tokens = eager": the runner's greedy tokens after a 4-token prompt fed one
token at a time, against eager's; random bf16 weights give flat logits, so kernels that round
differently may pick another token: the first-step logit error is shown beside it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import functools
import gc
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).parent))
from common import allocated_by, result_name, table, time_host, write_json  # noqa: E402

import ferry  # noqa: E402
from ferry.backends import inductor as inductor_backend  # noqa: E402
from ferry.choices import gemv, kernel_tuning, norms  # noqa: E402
from ferry.choices.summary import details  # noqa: E402
from ferry.ops import split_kv  # noqa: E402
from ferry.runtime import clone_to, device_of, emulated_device, sampling  # noqa: E402

COMBO_CHOICES = ("reductions", "pointwise", "off")  # older results say "on" for pointwise


def set_combo_kernels(choice: str) -> None:
    """--combo-kernels: what a decode graph's compile asks of Inductor's horizontal fusion."""
    inductor_backend.COMBO_KERNELS = choice != "off"
    inductor_backend.COMBINE_REDUCTIONS = choice == "reductions"


MODELS = {
    "llama-1b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
        vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072)),
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
        max_position_embeddings=40960, rms_norm_eps=1e-6)),
}
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=256, max_position_embeddings=8192)
RUNNERS = ("eager", "compile", "ferry", "ferry-graphs", "ferry-inductor-graphs", "bound")
CHECK_PROMPT, CHECK_NEW = 4, 8  # the greedy spot check: prompt tokens, then generated tokens
STEPS = 5  # decode steps per timed sample, synchronised at both ends
KEEP_ON_DEVICE = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(
    skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True))


@dataclass
class Env:
    """Where one run happens: the GPU in bf16, or (--tiny) the CPU in float32 with ferry on 'emu:0'."""

    tiny: bool
    ferry_device: str
    device: torch.device
    dtype: torch.dtype
    repeat: int
    prefill_repeat: int
    quant: str = "none"  # torchao weight-only quantization of every linear and the embedding: none, int8, int4
    last_position: bool = False  # a prefill computes the last position's logits only (every runner)
    torchao_tuning: bool = True  # torchao's quantize_ sets Inductor's tuning process-wide (its default)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Runner:
    """One way to run the model: a decode/prefill call on device tensors, and `feed` to put a tensor there."""

    step: Callable
    feed: Callable
    prefill: Callable | None = None
    no_prefill: str | None = None  # why prefill is not run
    compile_s: float | None = None
    load_s: float | None = None
    notes: list[str] = field(default_factory=list)
    close: Callable = lambda: None
    file_bytes: int | None = None  # the program file's size (ferry runners)
    pick: Callable = lambda logits: logits.argmax(-1)  # the greedy pick of its generation loop


# ---------------------------------------------------------------- models and device


def build_model(name: str, env: Env):
    """The model with random weights (seed 0) on the CPU in env.dtype, static cache asked for.
    Built on the GPU when there is one: initialising a billion weights there takes a moment."""
    import transformers

    config_cls, model_cls, cfg = MODELS[name]
    if env.tiny:
        cfg = {k: v for k, v in cfg.items() if k in ("tie_word_embeddings", "rope_theta", "rms_norm_eps")} | TINY
    config = getattr(transformers, config_cls)(**cfg)
    torch.manual_seed(0)
    with torch.device(env.device):
        model = getattr(transformers, model_cls)._from_config(config, dtype=env.dtype).eval()
    if env.quant != "none":
        quantize(model, env.quant, env.torchao_tuning)  # where the model is: int4's packing needs the GPU
    else:
        model = model.cpu()
    model.generation_config.cache_implementation = "static"
    _fresh(env)
    return model


def quantize(model, quant: str, tuning: bool = True) -> None:
    """torchao's weight-only quantization of every linear layer (lm_head too), as its docs apply it
    (int8-dynamic: int8 activations too, quantized per row each call), and of the token embedding
    (int8 per row, or int4 in groups of 32: ExecuTorch's `--qembedding`);
    a tied lm_head gets a quantized weight of its own first. `tuning`: torchao's `set_inductor_config`
    (its default, True, turns Inductor's coordinate-descent tuning on for the whole process: what
    torch.compile of its model then does; ferry sets its own)."""
    from torchao.quantization import (
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        quantize_,
    )
    from torchao.quantization.granularity import PerAxis, PerGroup

    config = {"int8": Int8WeightOnlyConfig, "int8-dynamic": Int8DynamicActivationInt8WeightConfig}.get(quant)
    quantize_(model, config(set_inductor_config=tuning) if config else Int4WeightOnlyConfig(
        group_size=128, int4_packing_format="tile_packed_to_4d", set_inductor_config=tuning))
    embedding = (IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)) if quant.startswith("int8")
                 else IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    quantize_(model, embedding, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Embedding))


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a weight holds: a quantized tensor subclass's inner tensors, else its own."""
    if hasattr(t, "__tensor_flatten__"):
        return sum(stored_bytes(getattr(t, a)) for a in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def weight_bytes_read(model) -> int:
    """Bytes of weights one decode step reads: every parameter once, but an untied input
    embedding only by the rows it looks up (none counted)."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    skip = {id(emb)} if emb is not head else set()
    return sum(stored_bytes(p) for p in model.parameters() if id(p) not in skip)


def _fresh(env: Env) -> int:
    """Free what earlier runners left; the GPU bytes still allocated (the base of the next peak)."""
    gc.collect()
    if not env.cuda:
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def copy_bandwidth(env: Env) -> float:
    """Bytes per second a large on-device copy moves (read + write): what decode's reads can reach."""
    nbytes = (1 << 30) if env.cuda else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=env.device).fill_(1)
    dst = torch.empty_like(src)
    seconds = time_host(lambda: dst.copy_(src), repeat=10, warmup=2, inner=5)
    return 2 * nbytes / seconds


# ---------------------------------------------------------------- runners


def eager_runner(model, batch: int, cache: int, env: Env, compiled: bool) -> Runner:
    """transformers' static-cache wrapper on its own copy of the weights; torch.compile'd or not."""
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    own = copy.deepcopy(model).to(env.device)
    if env.last_position:  # as transformers' generate asks: the last position's logits only
        own.forward = functools.partial(own.forward, logits_to_keep=1)
    wrapper = TorchExportableModuleWithStaticCache(own, batch_size=batch, max_cache_len=cache)
    call = wrapper
    if compiled:
        counters.clear()
        call = torch.compile(wrapper, fullgraph=True, mode="reduce-overhead" if env.cuda else "default")

    def step(ids, pos):
        if compiled and env.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        return call(input_ids=ids, cache_position=pos)

    def close():
        nonlocal wrapper, call
        wrapper = call = None
        if compiled:
            torch._dynamo.reset()

    return Runner(step=step, feed=lambda t: t.to(env.device), prefill=step, close=close)


def export_methods(model, batch: int, cache: int, prompts: list[int]) -> tuple[dict, float]:
    """transformers' export recipe: decode (one token) and, when a prompt length fits, prefill at a
    dynamic prompt length (2 to the longest prompt). ({method: ExportedProgram}, seconds)."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    t0 = time.perf_counter()
    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=batch, max_cache_len=cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dynamo's note on transformers' output-capture globals
        where = {"device": next(model.parameters()).device}  # a quantized model stays on the GPU
        eps = {"forward": recipe.export(input_ids=torch.zeros(batch, 1, dtype=torch.long, **where),
                                        cache_position=torch.tensor([0], **where))}
        if _no_prefill(prompts, "torch") is None:
            top = max(prompts)
            seq = torch.export.Dim("prompt", min=2, max=top)
            eps["prefill"] = recipe.export(input_ids=torch.zeros(batch, top, dtype=torch.long, **where),
                                           cache_position=torch.arange(top, **where),
                                           dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}})
    return eps, time.perf_counter() - t0


def compile_program(built: dict, model, batch, cache, prompts, backend: str, env: Env):
    """The methods exported once per configuration (kept in `built`), compiled for `backend` into
    one program: (program, export + compile seconds, why prefill is not run)."""
    if "eps" not in built:
        built["eps"] = export_methods(model, batch, cache, prompts)
    eps, export_s = built["eps"]
    why = _no_prefill(prompts, backend)
    t0 = time.perf_counter()
    methods = eps if why is None else {"forward": eps["forward"]}
    config = dataclasses.replace(KEEP_ON_DEVICE, last_position_only=["prefill"] if env.last_position and
                                 "prefill" in methods else ())
    program = ferry.compile(methods, ferry.OpSupportPartitioner(env.ferry_device, backend_id=backend), config)
    seconds = export_s + time.perf_counter() - t0
    built.setdefault("file_bytes", {})[backend] = len(program.to_bytes())
    return program, seconds, why


def _no_prefill(prompts: list[int], backend: str) -> str | None:
    if not prompts:
        return "no prompt length fits the cache"
    if min(prompts) < 2:
        return "prompt lengths below 2 are not exported (torch.export specialises sizes 0 and 1)"
    return None


def ferry_runner(built: dict, model, batch, cache, prompts, env: Env, graphs: bool, backend: str) -> Runner:
    """ferry.Module over the program of `backend`, compiled once per configuration (kept in `built`)."""
    if backend not in built:
        built[backend] = compile_program(built, model, batch, cache, prompts, backend, env)
    program, compile_s, why = built[backend]
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        module = ferry.Module(program, cuda_graphs=graphs, outputs="view")
        for name in program.methods:
            module.load_method(name)
    load_s = time.perf_counter() - t0
    if env.cuda:
        feed = lambda t: t.to(env.device)
    else:  # the emulated device: its memory is host memory that ferry's allocator owns
        feed = lambda t: t if str(device_of(t)) == env.ferry_device else clone_to(t, env.ferry_device)
    prefill = None if why else (lambda ids, pos: module.run_method("prefill", [ids, pos])[0])
    step = lambda ids, pos: module.run_method("forward", [ids, pos])[0]  # noqa: E731
    return Runner(step=step, feed=feed, prefill=prefill, no_prefill=why, pick=sampling.greedy,
                  compile_s=compile_s, load_s=load_s,
                  notes=[str(w.message)[:200] for w in caught] + details(),  # + the kernel choices timed at load
                  close=module.close, file_bytes=built["file_bytes"][backend])


def make_runner(runner: str, model, batch, cache, prompts, env: Env, built: dict) -> Runner:
    if runner in ("eager", "compile"):
        return eager_runner(model, batch, cache, env, compiled=runner == "compile")
    backend = "inductor" if "inductor" in runner else "torch"
    return ferry_runner(built, model, batch, cache, prompts, env, graphs=runner.endswith("graphs"), backend=backend)


# ---------------------------------------------------------------- measurements


def greedy(r: Runner, prompt: torch.Tensor, env: Env):
    """The prompt fed one token at a time, then CHECK_NEW greedy tokens: (tokens, each step's logits
    on the host, first call seconds: torch.compile compiles there, ferry captures its graphs later)."""
    t0 = time.perf_counter()
    logits, first_s = None, None
    for i in range(prompt.shape[1]):
        logits = r.step(r.feed(prompt[:, i:i + 1].contiguous()), r.feed(torch.tensor([i])))
        if i == 0:
            _sync(env)
            first_s = time.perf_counter() - t0
    tokens, steps = [], []
    for s in range(CHECK_NEW):
        steps.append(logits[:, -1].float().cpu())
        nxt = logits[:, -1:].argmax(-1)
        tokens.append(nxt.cpu())
        logits = r.step(r.feed(nxt), r.feed(torch.tensor([prompt.shape[1] + s])))
    return torch.cat(tokens, 1), steps, first_s


def check(tokens: torch.Tensor, steps: list, ref: dict, dtype: torch.dtype) -> dict:
    """Tokens against eager's. At the first step they differ (both saw the same tokens until
    then), a pick within two roundings of eager's best logit is a near tie, not a wrong answer."""
    want, want_steps = ref["tokens"], ref["steps"]
    out = {"tokens_equal_eager": bool(torch.equal(tokens, want)),
           "logit_err": float((steps[0] - want_steps[0]).abs().max() / want_steps[0].abs().max().clamp_min(1e-6))}
    differ = (tokens != want).any(0).nonzero()
    if len(differ):
        k = int(differ[0])
        rows = (tokens[:, k] != want[:, k]).nonzero()[:, 0]
        best = want_steps[k][rows].max(-1).values
        picked = want_steps[k][rows, tokens[rows, k]]
        tol = 2 * torch.finfo(dtype).eps * best.abs()
        out.update(first_diverging_step=k, near_tie=bool(((best - picked) <= tol).all()))
    return out


def time_decode(r: Runner, batch: int, cache: int, env: Env) -> float:
    """ms per decode step at cache_position cache // 2, the argmax fed back on the device: the median
    of samples of STEPS back-to-back steps (a generation loop does not wait between steps either)."""
    state = {"ids": r.feed(torch.zeros(batch, 1, dtype=torch.long))}
    pos = r.feed(torch.tensor([cache // 2]))

    def one():
        state["ids"] = r.feed(r.pick(r.step(state["ids"], pos)[:, -1:]))

    return time_host(one, repeat=env.repeat, warmup=5, inner=STEPS) * 1e3


def time_prefill(r: Runner, batch: int, prompt: int, vocab: int, env: Env) -> tuple[float, float]:
    """(first call seconds, median seconds) of a forward over `prompt` tokens from position 0."""
    ids = r.feed(torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(1)))
    pos = r.feed(torch.arange(prompt))
    t0 = time.perf_counter()
    r.prefill(ids, pos)
    _sync(env)
    first = time.perf_counter() - t0
    return first, time_host(lambda: r.prefill(ids, pos), repeat=env.prefill_repeat, warmup=2)


def _sync(env: Env) -> None:
    if env.cuda:
        torch.cuda.synchronize()


def _mib(env: Env, base: int) -> tuple[float | None, float | None]:
    """(allocated, reserved) peak MiB since the last reset, above `base`."""
    if not env.cuda:
        return None, None
    return (torch.cuda.max_memory_allocated() - base) / 2**20, (torch.cuda.max_memory_reserved() - base) / 2**20


def _load_peak(env: Env, base: int) -> float | None:
    """Peak MiB above `base` while the runner was made (weights uploaded; ferry: its dry runs and
    the kernels timed at load), then the peak counter restarts: the run's peaks come after."""
    peak = _mib(env, base)[0]
    if env.cuda:
        torch.cuda.reset_peak_memory_stats()
    return peak


def measure(r: Runner, key: dict, prompts: list[int], vocab: int, env: Env, base: int, ref: dict,
            loaded_at: int | None = None):
    """One runner's decode row and prefill rows; `ref` holds eager's greedy tokens and logits.
    `loaded_at`: the trace mark at the end of the load (--memory-owners), or None."""
    batch, cache = key["batch"], key["cache"]
    prompt = torch.randint(0, vocab, (batch, CHECK_PROMPT), generator=torch.Generator().manual_seed(0))
    tokens, steps, first_s = greedy(r, prompt, env)
    if key["runner"] == "eager":
        ref.update(tokens=tokens, steps=steps)
    ms = time_decode(r, batch, cache, env)
    peak, reserved = _mib(env, base)
    decode_owners = peak_owners(env, loaded_at)
    row = {**key, "ms_per_token": ms, "tokens_per_s": batch / ms * 1e3, "peak_mib": peak, "reserved_mib": reserved,
           "compile_s": r.compile_s, "load_s": r.load_s, "first_call_s": first_s, "tokens": tokens.tolist(),
           "notes": r.notes, "file_mb": r.file_bytes and r.file_bytes / 2**20}
    if decode_owners is not None:
        row["decode_peak_owners"] = decode_owners
    if "tokens" in ref and key["runner"] != "eager":
        row.update(check(tokens, steps, ref, env.dtype))
    if key["runner"] == "compile":  # torch.compile skips CUDA graphs (mutated inputs, CPU ops) with a log line only
        row["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
    pre = []
    for p in prompts:
        if r.prefill is None:
            pre.append({**key, "prompt": p, "not_run": r.no_prefill})
            continue
        first_p, s = time_prefill(r, batch, p, vocab, env)
        pre.append({**key, "prompt": p, "ms": s * 1e3, "tokens_per_s": batch * p / s, "first_call_s": first_p})
    row["peak_with_prefill_mib"], row["reserved_with_prefill_mib"] = _mib(env, base)
    return row, pre


def bound_row(model, key: dict, bandwidth: float, env: Env) -> dict:
    """Time to read every weight and the whole static KV cache once at `bandwidth`."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    weights = weight_bytes_read(model)
    kv = 2 * c.num_hidden_layers * key["batch"] * c.num_key_value_heads * key["cache"] * head_dim * env.dtype.itemsize
    ms = (weights + kv) / bandwidth * 1e3
    return {**key, "ms_per_token": ms, "tokens_per_s": key["batch"] / ms * 1e3, "weight_bytes": weights,
            "kv_bytes": kv, "bandwidth_gbps": bandwidth / 1e9}


# ---------------------------------------------------------------- one configuration


def _record_owners(env: Env, on: bool) -> None:
    """With --memory-owners: record where each GPU allocation was made (Python frames), from now on."""
    if on and env.cuda:
        torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")


def memory_owners(env: Env, on: bool, top: int = 8) -> list | None:
    """The memory allocated now in blocks of 1 MiB or more, summed by the innermost frame outside
    this benchmark and outside Python's own modules that made it: [[frame, MiB, blocks]], largest
    first. Weights show up as their upload; anything else held is what a runner keeps."""
    if not (on and env.cuda):
        return None
    owners: dict = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and block["size"] >= 2**20:
                where = allocated_by(block.get("frames", []))
                o = owners.setdefault(where, [where, 0.0, 0])
                o[1] += block["size"] / 2**20
                o[2] += 1
    return sorted(owners.values(), key=lambda o: -o[1])[:top]


def trace_length(env: Env, on: bool) -> int | None:
    """With --memory-owners: how many allocation events are recorded so far (a mark in the trace)."""
    if not (on and env.cuda):
        return None
    return len(torch.cuda.memory._snapshot()["device_traces"][env.device.index or 0])


def peak_owners(env: Env, since: int | None, top: int = 8) -> list | None:
    """The blocks of 1 MiB or more allocated after trace event `since` and live at the highest point
    of allocated memory after it, summed by `allocated_by`: what made a phase's peak, where
    `memory_owners` shows only what is held at its end. [[frame, MiB, blocks]], largest first."""
    if since is None:
        return None
    trace = torch.cuda.memory._snapshot()["device_traces"][env.device.index or 0]
    live: dict = {}
    total = peak = 0
    at_peak: dict = {}
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (i, event)
            total += event["size"]
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])[1]["size"]
        else:
            continue
        if i >= since and total > peak:
            peak, at_peak = total, {a: e for a, (j, e) in live.items() if j >= since and e["size"] >= 2**20}
    owners: dict = {}
    for event in at_peak.values():
        where = allocated_by(event.get("frames", []))
        o = owners.setdefault(where, [where, 0.0, 0])
        o[1] += event["size"] / 2**20
        o[2] += 1
    return sorted(owners.values(), key=lambda o: -o[1])[:top]


def run_config(name, model, batch, cache, prompts, runners, env: Env, bandwidth: float, rows, pre, save,
               owners: bool = False):
    """Every runner at one (model, batch, cache length): appends decode rows and prefill rows,
    saved after each runner (what is measured survives a time limit)."""
    fits = [p for p in prompts if p <= cache]
    ref, built = {}, {}
    for runner in runners:
        key = {"model": name, "batch": batch, "cache": cache, "runner": runner}
        if runner == "bound":
            rows.append(bound_row(model, key, bandwidth, env))
            save()
            continue
        r = None
        try:
            base = _fresh(env)
            _record_owners(env, owners)
            r = make_runner(runner, model, batch, cache, fits, env, built)
            load_peak = _load_peak(env, base)
            row, p = measure(r, key, fits, model.config.vocab_size, env, base, ref, trace_length(env, owners))
            row["load_peak_mib"] = load_peak
            row["memory_owners"] = memory_owners(env, owners)
            rows.append(row)
            pre += p
        except Exception as e:  # noqa: BLE001 - one runner failing must not lose the others' rows
            error = f"{type(e).__name__}: {str(e)[:400]}"
            print(f"{name} batch {batch} cache {cache} {runner}: FAILED {error}", flush=True)
            rows.append({**key, "error": error})
        finally:
            if owners and env.cuda:
                torch.cuda.memory._record_memory_history(enabled=None)  # also when the runner failed
            if r is not None:
                r.close()
            del r
            _fresh(env)
        save()
        print(f"done {name} batch {batch} cache {cache} {runner}", flush=True)
    built.clear()


# ---------------------------------------------------------------- report and main


def _f(x, digits=3):
    return "-" if x is None else round(x, digits)


def _check_cell(r: dict) -> str:
    if "tokens_equal_eager" not in r:
        return "-"
    err = f", logit err {r['logit_err']:.2g}"
    if r["tokens_equal_eager"]:
        return "yes" + err
    return f"no: {'near tie' if r['near_tie'] else 'differs'} at step {r['first_diverging_step']}" + err


def report(rows, pre, settings: dict, out: str) -> None:
    bounds = {(r["model"], r["batch"], r["cache"]): r["ms_per_token"] for r in rows if r["runner"] == "bound"}
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["model"], r["batch"], r["cache"], r["runner"], "FAILED", r["error"][:80]] + [""] * 9)
            continue
        bound = bounds.get((r["model"], r["batch"], r["cache"]))
        lines.append([r["model"], r["batch"], r["cache"], r["runner"], _f(r["ms_per_token"]), _f(r["tokens_per_s"], 1),
                      _f(bound and r["ms_per_token"] / bound, 2), _f(r.get("load_peak_mib"), 1),
                      _f(r.get("peak_mib"), 1), _f(r.get("reserved_mib"), 1), _f(r.get("peak_with_prefill_mib"), 1),
                      _f(r.get("compile_s"), 1),
                      _f(r.get("load_s") if r.get("load_s") is not None else r.get("first_call_s"), 2),
                      _f(r.get("file_mb"), 1), _check_cell(r)])
    print(table(f"Decode at cache_position L//2 (ms per step of B tokens; {settings['device']}, {settings['dtype']})",
                ["model", "B", "cache L", "runner", "ms/token", "tok/s", "vs bound", "load peak MiB", "peak MiB", "reserved MiB",
                 "peak w/ prefill MiB", "compile s", "load / 1st call s", "file MiB", "tokens = eager"], lines))
    plines = [[p["model"], p["batch"], p["cache"], p["prompt"], p["runner"]]
              + (["not run", "", ""] if "not_run" in p else [_f(p["ms"]), _f(p["tokens_per_s"], 0), _f(p["first_call_s"], 2)])
              for p in pre]
    print()
    print(table("Prefill (one forward over the prompt from position 0)",
                ["model", "B", "cache L", "prompt", "runner", "ms", "tokens/s", "1st call s"], plines))
    for runner, why in dict.fromkeys((p["runner"], p["not_run"]) for p in pre if "not_run" in p):
        print(f"- {runner}: prefill not run: {why}")
    for r in rows:
        if r.get("memory_owners"):
            print()
            print(table(f"GPU memory held after the run: {r['model']} B={r['batch']} L={r['cache']} {r['runner']}",
                        ["allocated by", "MiB", "blocks"], [[w, _f(m, 1), n] for w, m, n in r["memory_owners"]]))
        if r.get("decode_peak_owners") is not None:
            print()
            print(table(f"Made after the load, live at the decode peak: {r['model']} B={r['batch']} L={r['cache']} "
                        f"{r['runner']}", ["allocated by", "MiB", "blocks"],
                        [[w, _f(m, 1), n] for w, m, n in r["decode_peak_owners"]]))
    print(f"wrote {write_json(out, {'settings': settings, 'decode': rows, 'prefill': pre})}")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (the issue's grid: 1,8)")
    p.add_argument("--cache", default="1024", help="static cache lengths L (the issue's grid: 128,1024,4096)")
    p.add_argument("--prompt", default="128,512", help="prefill prompt lengths, those <= L run (grid: 128,512,2048)")
    p.add_argument("--runners", default=",".join(RUNNERS))
    p.add_argument("--repeat", type=int, default=50, help="timed decode steps per runner")
    p.add_argument("--quant", default="none", choices=("none", "int8", "int8-dynamic", "int4"),
                   help="torchao quantization of every linear (weight-only; int8-dynamic: int8 activations too) and of "
                        "the token embedding (eager and compile run torchao's own path)")
    p.add_argument("--inductor-config", action="append", default=[], metavar="KEY=VALUE",
                   help="an experiment: set torch._inductor.config.KEY (a Python literal) for every compile of the "
                        "run (not coordinate_descent_*: ferry sets those per delegate, choices/gemv.py)")
    p.add_argument("--torchao-inductor-config", choices=("on", "off"), default="on",
                   help="torchao's set_inductor_config for --quant (on, its default: coordinate-descent tuning, every "
                        "direction, for every later compile in the process, torch.compile's included; off: none)")
    p.add_argument("--last-position", action="store_true",
                   help="a prefill computes the last position's logits only, as generation needs: ferry compiles with "
                        "CompileConfig(last_position_only=['prefill']); eager and torch.compile get logits_to_keep=1")
    p.add_argument("--split-kv", choices=("timed", "off"), default="timed",
                   help="a decode step's attention: ferry's split-KV kernels where timed faster at load (ferry's "
                        "default, ferry/ops/split_kv.py), or SDPA's kernels always (off: for an A/B)")
    p.add_argument("--combo-kernels", choices=COMBO_CHOICES, default="reductions",
                   help="a decode graph's independent kernels launched together by Inductor: reductions too where "
                        "Inductor times a combination faster at compile (reductions: ferry's default, "
                        "backends/inductor.py COMBINE_REDUCTIONS), pointwise kernels only (pointwise: older results say "
                        "'on'), or each alone (off: an A/B)")
    p.add_argument("--fuse-norms", choices=("on", "off", "all"), default="on",
                   help="a norm whose row only a one-row product reads computed inside that product's reduction "
                        "(on: ferry's default, choices/gemv.py FUSE_NORMS, products of up to FUSED_NORM_OUTPUTS "
                        "outputs; all: the head too), or in a kernel of its own (off)")
    p.add_argument("--time-regions", choices=("on", "off"), default="on",
                   help="a one-row product timed with the norm before it and the pointwise ops after it that its "
                        "reduction would take in (on: ferry's default, choices/gemv.py TIME_REGIONS), or alone (off)")
    p.add_argument("--steady-tuning", choices=("on", "off"), default="on",
                   help="Inductor's block-size candidates for a decode step timed back to back in a replayed graph, "
                        "over copies of their arguments past L2 (on: ferry's default, choices/kernel_tuning.py "
                        "STEADY), or by Inductor's own timing of one launch (off)")
    p.add_argument("--split-slices", choices=("on", "off"), default="on",
                   help="a merged product read as equal slices (gate and up) as one reduction per slice, which Inductor "
                        "fuses with SiLU(gate) * up (on: ferry's default, choices/gemv.py SPLIT_EQUAL_SLICES), or one "
                        "reduction over the stacked weight (off: for an A/B)")
    p.add_argument("--rms-norms", choices=("on", "off"), default="on",
                   help="an RMS norm written out op by op as one ferry::rms_norm, its one-pass kernel timed at load in "
                        "a captured plan (on: ferry's default, choices/norms.py RMS), or left op by op (off: an A/B)")
    p.add_argument("--memory-owners", action="store_true",
                   help="list what holds the GPU memory allocated after each runner's run, by the code that allocated it")
    p.add_argument("--tiny", action="store_true", help="tiny models in float32 on the CPU, ferry on 'emu:0'")
    p.add_argument("--out", default=None, help="name of the JSON file under bench/results (default llm; llm_smoke with --tiny)")
    args = p.parse_args()
    for flag, known in (("models", MODELS), ("runners", RUNNERS)):
        unknown = set(getattr(args, flag).split(",")) - set(known)
        if unknown:
            p.error(f"--{flag}: unknown {', '.join(sorted(unknown))} (known: {', '.join(known)})")
    return args


def main():
    args = parse_args()
    for item in args.inductor_config:
        key, _, value = item.partition("=")
        setattr(torch._inductor.config, key, ast.literal_eval(value))
    set_combo_kernels(args.combo_kernels)
    gemv.SPLIT_EQUAL_SLICES = args.split_slices == "on"
    gemv.FUSE_NORMS = args.fuse_norms != "off"
    gemv.TIME_REGIONS = args.time_regions == "on"
    kernel_tuning.STEADY = args.steady_tuning == "on"
    norms.RMS = args.rms_norms == "on"
    gemv.FUSED_NORM_OUTPUTS = 1 << 62 if args.fuse_norms == "all" else gemv.FUSED_NORM_OUTPUTS
    if args.split_kv == "off":
        split_kv.available = lambda: False  # the choice is then never offered: SDPA's kernels run
    if not args.tiny and not torch.cuda.is_available():
        print("llm: skipped: no CUDA device; --tiny runs the ferry code paths on the emulated device")
        return
    env = Env(tiny=args.tiny, ferry_device="emu:0" if args.tiny else "cuda:0",
              device=torch.device("cpu" if args.tiny else "cuda:0"),
              dtype=torch.float32 if args.tiny else torch.bfloat16,
              repeat=min(args.repeat, 10) if args.tiny else args.repeat, prefill_repeat=3 if args.tiny else 10,
              quant=args.quant, last_position=args.last_position, torchao_tuning=args.torchao_inductor_config == "on")
    settings = {"last_position_only": env.last_position, "torchao_inductor_config": args.torchao_inductor_config,
                "device": env.ferry_device, "inductor_config": args.inductor_config, "split_kv": args.split_kv,
                "combo_kernels": args.combo_kernels, "split_slices": args.split_slices, "fuse_norms": args.fuse_norms,
                "rms_norms": args.rms_norms,
                "time_regions": args.time_regions, "steady_tuning": args.steady_tuning,
                "ferry_inductor_tuning": "per delegate (choices/gemv.py settings): coordinate descent in the usual "
                                         "directions for a static decode step with a one-row reduction or quantized "
                                         "product, otherwise none; the process's coordinate_descent_* keys ignored",
                "dtype": str(env.dtype).removeprefix("torch."), "tiny": env.tiny,
                "quant": env.quant,
                "decode_position": "cache_position = L // 2 for every timed step (a static cache: attention reads "
                                   "all L slots whatever the position)",
                "decode_pick": "eager, compile: torch's argmax; ferry: ferry.runtime.sampling.greedy (what "
                               "ferry.generate runs)",
                "decode_timing": f"median of {env.repeat} samples of {STEPS} back-to-back steps, CUDA synchronised "
                                 "at both ends of a sample",
                "memory": "load peak: while the runner is made; peak: from then on, through the check and the "
                          "timed decode steps; peak w/ prefill: through the prefills too (MiB above what was "
                          "allocated before the runner)",
                "check": f"{CHECK_PROMPT} prompt tokens fed one at a time, then {CHECK_NEW} greedy tokens",
                "prefill": "one forward over P tokens from position 0, for each P <= L; ferry: a method exported "
                           "with a dynamic prompt length (2 to the longest P), sharing the decode method's cache"}
    emulated = emulated_device(num_devices=1) if env.tiny else contextlib.nullcontext()
    out, rows, pre = args.out or result_name("llm", args.tiny), [], []
    save = lambda: write_json(out, {"settings": settings, "decode": rows, "prefill": pre, "partial": True})
    if env.tiny:
        torch.set_num_threads(1)  # smoke numbers only; one thread is steadier on a small, shared CPU
    with emulated, torch.no_grad():
        settings["bandwidth_gbps"] = copy_bandwidth(env) / 1e9
        _fresh(env)
        for name in args.models.split(","):
            model = build_model(name, env)
            label = name if env.quant == "none" else f"{name}-{env.quant}"
            for batch in map(int, args.batch.split(",")):
                for cache in map(int, args.cache.split(",")):
                    run_config(label, model, batch, cache, [int(x) for x in args.prompt.split(",")],
                               args.runners.split(","), env, settings["bandwidth_gbps"] * 1e9, rows, pre, save,
                               args.memory_owners)
            del model
    report(rows, pre, settings, out)


if __name__ == "__main__":
    main()

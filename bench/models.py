"""Real models on the GPU: ferry against eager PyTorch and torch.compile, side by side in one run.

Models (random weights, no downloads): torchvision ResNet-18, ResNet-50, MobileNetV3-Large,
ConvNeXt-Tiny, ViT-B/16, EfficientNet-B0, Swin-T and RegNetY-1.6GF; transformers BERT-base and
DistilBERT (encoders), a T5 encoder (6 layers, 512 wide), GPT-2 (6 layers, 512 wide, decoder),
Llama and Qwen2 (4 layers, 512 wide, decoders). Each at batch 1 and a serving batch.

Runners, everything on cuda:0:
- eager: the model on the GPU (`model.cuda()`);
- compile / compile-ro: `torch.compile(model)` and `torch.compile(model, mode="reduce-overhead")`;
- ferry / ferry-graphs: `ferry.compile(export(model), OpSupportPartitioner("cuda:0"))`, run by
  `ferry.Module(program)` and `ferry.Module(program, cuda_graphs=True)`.
- eager-graphs (not run by default): eager's kernels captured by hand in one CUDA graph
  (`torch.cuda.graph`), the time of its kernels alone: no runner that launches the same kernels
  can be faster. Run it in a process of its own (`--runners eager,eager-graphs`, one model per
  process): in the all-models loop, once interleaved with other runners, it has hit CUDA errors
  (illegal address, device-side assert) from one model on, not yet explained;
- ferry-inductor / ferry-inductor-graphs: ferry with `backend_id="inductor"` (delegates
  compiled by Inductor when the program loads: that time is in the load column), without and
  with CUDA graphs;
- ferry-traced (not run by default): ferry without its inference rewrites
  (`CompileConfig(fuse_for_inference=False)`), to show what they give.

I/O: `device` — inputs already on the GPU, outputs left there (ferry: both skip flags);
`host` — CPU tensors in and out, end to end (eager and torch.compile: `.cuda()` / `.cpu()`).

Each row: median ms per call after warm-up (TF32 off, every runner in one process, all of a
model's runners timed in interleaved rounds so that a noisy host's slow spells hit each alike), the
ratio to eager, the peak of GPU memory the runner allocated (weights, activations, workspaces,
cuBLAS's per stream included: `torch.cuda.max_memory_allocated` from an empty GPU); for ferry,
how much of that loading allocated (weights and the planned arena; the rest is what kernels
allocate per call); for ferry and torch.compile, the compile and load (first call) seconds; for
ferry, the program file's size. Targets (issue 12): ferry no slower than eager on every model
(device I/O, no graphs); with graphs at batch 1, at most half of eager's time; peak memory no
higher than eager's. `--isolate SECONDS` measures each model and batch in a process of its own.

`--device cpu` runs eager and ferry on the CPU instead (a transformer block with attention
kept whole): the CPU target is "no slower than eager".
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_json  # noqa: E402

import ferry  # noqa: E402
from ferry.choices.decisions import DECISIONS  # noqa: E402

# ---------------------------------------------------------------- the models


def _tv(name):
    def build(batch):
        import torchvision

        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None).eval()
        head = getattr(getattr(model, "heads", None), "head", None)
        if head is not None:  # torchvision starts ViT's head at zero: every logit 0, rel_err trivially 0
            torch.nn.init.normal_(head.weight, std=0.02)
        return model, (torch.randn(batch, 3, 224, 224),)

    return build


class _LM(torch.nn.Module):
    """A transformers model called with input ids; returns its main tensor."""

    def __init__(self, model, key):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, ids):
        out = self.model(input_ids=ids) if self.key == "last_hidden_state" else self.model(input_ids=ids, use_cache=False)
        return getattr(out, self.key)


def _hf(config_name, model_name, key, seq=128, **cfg):
    def build(batch):
        import transformers

        config = getattr(transformers, config_name)(**cfg)
        torch.manual_seed(0)
        model = _LM(getattr(transformers, model_name)(config).eval(), key)
        return model.eval(), (torch.randint(0, cfg.get("vocab_size", 1000), (batch, seq)),)

    return build


class AttentionBlock(torch.nn.Module):
    """A pre-norm transformer block whose attention is scaled_dot_product_attention."""

    def __init__(self, dim=256, heads=4, hidden=1024):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def _block(batch):
    torch.manual_seed(0)
    return AttentionBlock().eval(), (torch.randn(batch, 128, 256),)


MODELS = {
    "block": (_block, 8),
    "resnet18": (_tv("resnet18"), 32),
    "resnet50": (_tv("resnet50"), 8),
    "mobilenet_v3_large": (_tv("mobilenet_v3_large"), 32),
    "convnext_tiny": (_tv("convnext_tiny"), 8),
    "vit_b_16": (_tv("vit_b_16"), 4),
    "bert": (_hf("BertConfig", "BertModel", "last_hidden_state", vocab_size=30522), 8),
    "gpt2": (_hf("GPT2Config", "GPT2LMHeadModel", "logits", seq=64, n_layer=6, n_embd=512, n_head=8,
                 vocab_size=50257, bos_token_id=0, eos_token_id=0), 8),
    "llama": (_hf("LlamaConfig", "LlamaForCausalLM", "logits", hidden_size=512, intermediate_size=1408,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
                  max_position_embeddings=512), 8),
    # the rows issue 35 measured, beyond the ones above
    "efficientnet_b0": (_tv("efficientnet_b0"), 8),
    "swin_t": (_tv("swin_t"), 8),
    "regnet_y_1_6gf": (_tv("regnet_y_1_6gf"), 8),
    "distilbert": (_hf("DistilBertConfig", "DistilBertModel", "last_hidden_state", vocab_size=30522), 8),
    "qwen2": (_hf("Qwen2Config", "Qwen2ForCausalLM", "logits", hidden_size=512, intermediate_size=1408,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                  max_position_embeddings=512), 8),
    "t5_encoder": (_hf("T5Config", "T5EncoderModel", "last_hidden_state", vocab_size=32128, d_model=512, d_ff=2048,
                       num_layers=6, num_heads=8), 8),
}


# ---------------------------------------------------------------- timing and memory


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, repeat, warmup=5) -> float:
    """Median ms per call, synchronised around each sample."""
    return _time_interleaved([fn], device, repeat, rounds=1, warmup=warmup)[0][1]


def _fresh_gpu(device, workspaces=True):
    """Free what earlier runners left, cuBLAS's per-stream workspaces included (32 MiB each on an
    H200; torch.compile's reduce-overhead frees them too): every runner's peak then counts the
    workspaces its own calls need, whichever runner went before. Not the workspaces once a runner
    that captured a CUDA graph is alive (`workspaces=False`): its GEMMs replay into them."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None and workspaces:
            clear()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def _at_load_mib(module, device) -> float | None:
    """What ferry allocated on the GPU at load (weights and the planned arena, from the program):
    the rest of its peak is what kernels allocate per call (functional results, workspaces)."""
    if module is None or device.type != "cuda":
        return None
    from ferry.aot.compile import device_bytes

    return device_bytes(module.program).get(ferry.Device("cuda", device.index or 0), 0) / 2**20


def _peak_mib(device, base) -> float | None:
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _reserved_mib(device, base) -> float | None:
    """The peak of what the caching allocator held from the GPU (freed blocks it keeps
    included): nearer what the process takes of the GPU than the allocated peak."""
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_reserved() - base) / 2**20


# ---------------------------------------------------------------- runners


def _eager_like(model, x, device, io, compile_mode):
    """eager or torch.compile: (call, setup seconds) with the model's weights on `device`."""
    m = model.to(device)
    t0 = time.perf_counter()
    if compile_mode is not None:
        m = torch.compile(m, mode=compile_mode, dynamic=False)
    xd = x.to(device)
    if io == "device":
        def call():
            with torch.no_grad():
                return m(xd)
    else:
        def call():
            with torch.no_grad():
                return m(x.to(device)).cpu()
    call()
    _sync(device)
    return call, time.perf_counter() - t0


def _eager_graphed(model, x, device, io):
    """Eager's kernels captured once in a CUDA graph by hand (`torch.cuda.graph`) and replayed:
    the time of eager's kernels alone, the floor for any runner that launches the same kernels."""
    m = model.to(device)
    t0 = time.perf_counter()
    xd = x.to(device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            m(xd)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = m(xd)

    def call(_model=m):  # the graph replays into the model's weights: they must outlive it
        if io == "host":
            xd.copy_(x)
            graph.replay()
            return out.cpu()
        graph.replay()
        return out

    call()
    _sync(device)
    return call, time.perf_counter() - t0


def _ferry_program(model, x, device, io, fuse=True, backend="torch"):
    t0 = time.perf_counter()
    ep = torch.export.export(model.cpu(), (x,))
    skip = io == "device" and device.type != "cpu"
    cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(skip, skip), fuse_for_inference=fuse)
    part = ferry.OpSupportPartitioner(str(device) if device.type != "cpu" else "cpu", backend_id=backend)
    program = ferry.compile(ep, part if device.type != "cpu" or backend != "torch" else None, cfg)
    return program, time.perf_counter() - t0


def _file_mib(program, built: dict, key: str) -> float:
    """The size of the program file (weights, graph, plan), once per program."""
    if key not in built:
        built[key] = len(ferry.program.program_to_bytes(program)) / 2**20
    return built[key]


def _ferry(program, x, device, io, graphs):
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        module = ferry.Module(program, cuda_graphs=graphs, outputs="view")
        module.load_method()
    arg = x.to(device) if io == "device" else x
    module(arg)
    _sync(device)
    return (lambda: module(arg)), time.perf_counter() - t0, module


def side_by_side(name, batch, device):
    """For the profiling scripts: model `name` at `batch` on `device` (TF32 off, device I/O),
    as (ferry program, eager call, ferry call, ferry module)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, (x,) = MODELS[name][0](batch)
    program, _ = _ferry_program(model, x, device, "device")
    model = model.to(device)
    xd = x.to(device)

    def eager():
        with torch.no_grad():
            return model(xd)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call, _, module = _ferry(program, x, device, "device", False)
    return program, eager, call, module


def timed_side_by_side(name, batch, device, repeat=30):
    """side_by_side, after printing eager's and ferry's median ms per call (the profiling scripts' header)."""
    program, eager, call, module = side_by_side(name, batch, device)
    print(f"=== {name} batch {batch}: eager {_time(eager, device, repeat):.3f} ms, "
          f"ferry {_time(call, device, repeat):.3f} ms")
    return program, eager, call, module


def _check(got, want):
    got = got if isinstance(got, torch.Tensor) else got[0]
    return float((got.float().cpu() - want.float()).abs().max() / (want.float().abs().max() + 1e-6))


# ---------------------------------------------------------------- one model


def run_model(name, batch, device, runners, ios, repeat):
    """Every runner of one model and batch. Each is built and measured for memory on its own
    (its own copy of the weights, counted in its peak); then all are timed in interleaved
    rounds, so a slow spell of a noisy host falls on every runner alike."""
    build, _ = MODELS[name]
    model, (x,) = build(batch)
    with torch.no_grad():
        want = model.to(device)(x.to(device)).cpu()
    model.cpu()
    rows = []
    for io in ios:
        built, live = {}, []
        for runner in runners:
            try:
                graphs = any(r["runner"] in _CAPTURING for r, _, _ in live)
                row, call, module = _one_runner(name, batch, io, runner, copy.deepcopy(model), x, want, device, built,
                                                workspaces=not graphs)
                live.append((row, call, module))
            except Exception as e:  # noqa: BLE001 - one runner failing must not lose the others' rows
                print(f"{name} batch {batch} {io} {runner}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append({"model": name, "batch": batch, "io": io, "runner": runner,
                             "error": f"{type(e).__name__}: {str(e)[:300]}"})
        for (row, call, _), timed in zip(live, _time_interleaved([c for _, c, _ in live], device, repeat)):
            row.update(timed)
            row["rel_err_after"] = _check(call(), want)  # still right after the timed calls of every runner
            rows.append(row)
        for _, _, module in live:
            if module is not None:
                module.close()
        del live
        torch._dynamo.reset()
    return rows


def _after_switch(samples: list[float], per_round: int) -> dict:
    """A round's first call follows the other runners' calls (their weights in the GPU's cache,
    theirs the last kernels launched): its median apart, and the spread of the calls after it.
    (ResNet-50, host I/O, 2026-12-04: the first call of each round took 1.5-1.8 ms where the
    others took 1.2; at 5 calls a round that made the p90.)"""
    firsts = samples[::per_round]
    rest = [t for i, t in enumerate(samples) if i % per_round]
    if per_round < 2 or len(rest) < 2:
        return {}
    p10, median, p90 = _spread(rest)
    return {"after_switch_ms": statistics.median(firsts), "steady_p10_ms": p10, "steady_ms": median,
            "steady_p90_ms": p90}


def _time_interleaved(calls, device, repeat, rounds=6, warmup=5) -> list[dict]:
    """For each of `calls`, sampled round-robin in `rounds` rounds: p10, median and p90 ms (the
    spread shows a slow mode that a median hides; issue: a p90 above 1.25x the median), every
    sample in call order with the time Python's garbage collector ran in it (is it the cause?),
    and the first call of each round apart from the rest (`_after_switch`)."""
    for call in calls:
        for _ in range(warmup):
            call()
    samples: list[list[float]] = [[] for _ in calls]
    collecting: list[list[float]] = [[] for _ in calls]
    per_round = max(1, repeat // rounds)
    with _GcClock() as gc_clock:
        for _ in range(rounds):
            for call, out, in_gc in zip(calls, samples, collecting):
                for _ in range(per_round):
                    _sync(device)
                    gc_clock.total = 0.0
                    t = time.perf_counter()
                    call()
                    _sync(device)
                    out.append((time.perf_counter() - t) * 1e3)
                    in_gc.append(gc_clock.total * 1e3)
    return [{**dict(zip(("p10_ms", "ms", "p90_ms"), _spread(times))), "samples_ms": [round(t, 4) for t in times],
             "gc_ms": [round(t, 4) for t in in_gc], **_after_switch(times, per_round)}
            for times, in_gc in zip(samples, collecting)]


class _GcClock:
    """Seconds Python's garbage collector ran since `total` was last zeroed (gc.callbacks)."""

    def __enter__(self):
        self.total, self._start = 0.0, 0.0
        gc.callbacks.append(self._on)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on)

    def _on(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start


def _spread(samples: list[float]) -> tuple[float, float, float]:
    deciles = statistics.quantiles(samples, n=10) if len(samples) > 1 else samples * 9
    return deciles[0], statistics.median(samples), deciles[-1]


_CAPTURING = ("eager-graphs", "compile-ro", "ferry-graphs", "ferry-inductor-graphs")


def _one_runner(name, batch, io, runner, model, x, want, device, built, workspaces=True):
    """Build one runner on its own copy of the model: (row without its time, call, ferry module)."""
    base = _fresh_gpu(device, workspaces)
    reserved = torch.cuda.memory_reserved() if device.type == "cuda" else 0
    module, file_mib = None, None
    if runner in ("eager", "compile", "compile-ro"):
        mode = {"eager": None, "compile": "default", "compile-ro": "reduce-overhead"}[runner]
        call, setup = _eager_like(model, x, device, io, mode)
        build_s = None
    elif runner == "eager-graphs":
        call, setup = _eager_graphed(model, x, device, io)
        build_s = None
    elif runner.startswith("ferry-inductor"):  # delegates compiled by Inductor at load (its time is in load_s)
        if "inductor" not in built:
            built["inductor"], built["inductor_s"] = _ferry_program(model, x, device, io, backend="inductor")
        call, setup, module = _ferry(built["inductor"], x, device, io, runner == "ferry-inductor-graphs")
        build_s = built["inductor_s"]
        file_mib = _file_mib(built["inductor"], built, "inductor_mib")
    elif runner == "ferry-traced":  # the traced ops, without aot/fuse.py's inference rewrites
        traced, build_s = _ferry_program(model, x, device, io, fuse=False)
        call, setup, module = _ferry(traced, x, device, io, False)
    else:
        if "program" not in built:
            built["program"], built["compile_s"] = _ferry_program(model, x, device, io)
        call, setup, module = _ferry(built["program"], x, device, io, runner == "ferry-graphs")
        build_s = built["compile_s"]
        file_mib = _file_mib(built["program"], built, "program_mib")
    for _ in range(3):
        call()
    err = _check(call(), want)
    row = {"model": name, "batch": batch, "io": io, "runner": runner, "peak_mib": _peak_mib(device, base),
           "peak_reserved_mib": _reserved_mib(device, reserved),
           "compile_s": build_s, "load_s": setup, "rel_err": err, "at_load_mib": _at_load_mib(module, device),
           "file_mib": file_mib}
    if module is not None and runner in ("ferry", "ferry-graphs"):  # what its GEMMs and attention run as
        row["decisions"] = [dataclasses.asdict(d) | {"taken": d.taken} for d in DECISIONS.values(timed=True)]
    return row, call, module


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batches", default="1,serving", help="comma-separated; 'serving' is each model's serving batch")
    p.add_argument("--runners", default="eager,compile,compile-ro,ferry,ferry-graphs")
    p.add_argument("--io", default="device,host")
    p.add_argument("--repeat", type=int, default=60, help="timed calls per runner, in 6 interleaved rounds")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="models", help="name of the JSON file written under bench/results")
    p.add_argument("--isolate", type=float, default=0, metavar="SECONDS",
                   help="each model and batch in its own process, stopped after SECONDS: a CUDA fault or a "
                        "slow first compile then costs that model's rows only")
    p.add_argument("--smoke", action="store_true", help="the attention block at batch 1, few calls")
    args = p.parse_args()
    if args.smoke:
        args.models, args.batches, args.repeat = "block", "1", 6
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    on_cpu = ("eager", "compile", "ferry", "ferry-inductor")
    runners = [r for r in args.runners.split(",") if device.type == "cuda" or r in on_cpu]
    rows = []
    for name in args.models.split(","):
        for b in args.batches.split(","):
            batch = MODELS[name][1] if b == "serving" else int(b)
            if args.isolate:
                rows += _in_child(name, batch, runners, args)
                write_json(args.out, {"rows": rows, "partial": True})
                continue
            try:
                rows += run_model(name, batch, device, runners, args.io.split(","), args.repeat)
            except Exception as e:  # noqa: BLE001 - one model failing must not lose the others' rows
                print(f"{name} batch {batch}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append({"model": name, "batch": batch, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"done {name} batch {batch}", flush=True)
            write_json(args.out, {"rows": rows, "partial": True})  # what is measured survives a time limit
    report(rows, args.out)


def _in_child(name, batch, runners, args) -> list[dict]:
    """One model and batch measured by a child process of this script: its rows, or one error row."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--models", name, "--batches", str(batch), "--runners", ",".join(runners),
               "--io", args.io, "--repeat", str(args.repeat), "--device", args.device, "--out", "part"]
        try:
            code = subprocess.run(cmd, env={**os.environ, "FERRY_BENCH_OUT": tmp}, timeout=args.isolate).returncode
            why = f"the child process exited with {code}"
        except subprocess.TimeoutExpired:
            why = f"not done in {args.isolate:g} s"
        part = Path(tmp) / "part.json"
        rows = json.loads(part.read_text())["rows"] if part.exists() else []
    if not rows:
        print(f"{name} batch {batch}: FAILED {why}", flush=True)
        return [{"model": name, "batch": batch, "error": why}]
    return rows


def report(rows, out):
    eager = {(r["model"], r["batch"], r["io"]): r["ms"] for r in rows if r.get("runner") == "eager"}
    eager_mem = {(r["model"], r["batch"], r["io"]): r["peak_mib"] for r in rows if r.get("runner") == "eager"}
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["model"], r["batch"], r.get("io", "-"), r.get("runner", "-"), "FAILED", r["error"][:60],
                          "", "", "", "", "", "", "", "", ""])
            continue
        key = (r["model"], r["batch"], r["io"])
        ratio = r["ms"] / eager[key] if key in eager else float("nan")
        mem = r["peak_mib"]
        at_load = r.get("at_load_mib")
        mem_ratio = mem / eager_mem[key] if mem is not None and eager_mem.get(key) else None
        spread = "-" if r.get("p10_ms") is None else f"{r['p10_ms']:.3g} / {r['p90_ms']:.3g}"
        steady = "-" if r.get("steady_p90_ms") is None else f"{r['steady_p90_ms']:.3g} / {r['after_switch_ms']:.3g}"
        lines.append([r["model"], r["batch"], r["io"], r["runner"], round(r["ms"], 3), spread, steady, round(ratio, 2),
                      "-" if mem is None else round(mem, 1), "-" if mem_ratio is None else round(mem_ratio, 2),
                      "-" if r.get("peak_reserved_mib") is None else round(r["peak_reserved_mib"], 1),
                      "-" if at_load is None else round(at_load, 1),
                      "-" if r["compile_s"] is None else round(r["compile_s"], 1), round(r["load_s"], 2),
                      "-" if r.get("file_mib") is None else round(r["file_mib"], 1)])
    print(table("Real models (median ms per call; ratio to eager)",
                ["model", "batch", "I/O", "runner", "ms", "p10 / p90", "steady p90 / after a switch", "vs eager",
                 "peak MiB", "peak vs eager",
                 "reserved peak MiB", "of it at load MiB", "compile s", "load/first call s", "file MiB"], lines))
    path = write_json(out, {"rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

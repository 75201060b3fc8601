"""`ferry generate FILE`: generate tokens with a compiled decoder and print them with the timings.

Its flags and its run are here, cli.py registers them with the other commands. This module imports
nothing from cli.py (cli.py imports it), so cli.py hands in its progress printer and device check.
Mistakes on the command line are ferry ConfigError / InputError: one line, exit status 2.
"""

from __future__ import annotations

import math
import os

from ferry.errors import ConfigError, InputError


def add_generate_parser(sub, count):
    """The `generate` subcommand's flags (`count`: the CLI's positive-integer type)."""
    g = sub.add_parser("generate", help="generate tokens with a compiled decoder; print them, the speed and memory")
    g.add_argument("file")
    g.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, e.g. 1,2,3 (rows of a batch split by ';')")
    g.add_argument("--prompt", metavar="TEXT", help="prompt text, tokenized with --tokenizer")
    g.add_argument("--tokenizer", metavar="DIR", help="a local Hugging Face tokenizer folder (nothing is downloaded)")
    g.add_argument("--max-new-tokens", type=count, default=32, help="tokens to add to each row (default 32)")
    g.add_argument("--do-sample", action="store_true", help="sample instead of taking the most likely token")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1)")
    g.add_argument("--top-k", type=count, default=None, help="sample from the K most likely tokens")
    g.add_argument("--top-p", type=float, default=None, help="sample from the most likely tokens of total probability P")
    g.add_argument("--seed", type=int, default=None, help="seed of the sampling generator (reproducible draws)")
    g.add_argument("--stop-ids", metavar="IDS", help="a row stops at any of these ids (default: the tokenizer's "
                   "end-of-sequence token, if any)")
    g.add_argument("--cuda-graphs", action="store_true", help="capture each device segment as a CUDA graph")
    g.add_argument("--method", default=None, help="one method doing prefill and decode (default: 'prefill' and "
                   "'decode' when the program has both, else 'forward')")
    g.add_argument("--prefill", default="prefill", help="name of the prefill method (default prefill)")
    g.add_argument("--decode", default="decode", help="name of the decode method (default decode)")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="time the first call too (by default a short untimed generation binds plans and graphs)")
    return g


def run_generate(args, stage, check_devices, progress=None) -> int:
    """`stage(name)`: a context printing progress; `check_devices(program, path)`: the device types
    of the program, each usable here; `progress`: bars for loading and tokens (cli_progress.py)."""
    import ferry

    rows, tokenizer = _prompt(args)
    stops = _stop_ids(args, tokenizer)
    with stage(f"load {args.file}"):
        program = ferry.load_program(args.file)
        types = check_devices(program, args.file)
        module = ferry.Module(program, cuda_graphs=args.cuda_graphs, progress=progress)
    options = dict(method=args.method, prefill=args.prefill, decode=args.decode, do_sample=args.do_sample,
                   stop_tokens=stops, progress=progress, **_sampling(args))
    with module:
        if args.warmup:
            graphs = ", capture CUDA graphs" if args.cuda_graphs else ""
            with stage(f"first call (untimed): load each method, bind its plans{graphs}"):
                ferry.generate(module, rows, min(3, args.max_new_tokens), **options)
        result = ferry.generate(module, rows, args.max_new_tokens, **options)
    for line in report(result, tokenizer, types):
        print(line)
    return 0


def _sampling(args) -> dict:
    """The sampling flags given (left out, generate's defaults apply and greedy accepts them)."""
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
    given = {k: v for k, v in given.items() if v is not None}
    if given and not args.do_sample:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ConfigError(f"{flags} shape sampling: add --do-sample (without it the most likely token is taken)")
    return given


def parse_ids(text: str, flag: str) -> list[list[int]]:
    """'1,2,3' -> [[1, 2, 3]]; rows of a batch separated by ';' ('1,2;3,4')."""
    rows = []
    for row in text.split(";"):
        try:
            ids = [int(t) for t in row.replace(" ", "").split(",") if t]
        except ValueError:
            raise InputError(f"{flag} takes comma-separated integer token ids (rows split by ';'), got {text[:60]!r}") \
                from None
        if not ids:
            raise InputError(f"{flag}: a row has no token ids in {text[:60]!r}")
        rows.append(ids)
    return rows


def _prompt(args):
    """(prompt rows, tokenizer or None), from --prompt-ids or --prompt with --tokenizer."""
    if (args.prompt_ids is None) == (args.prompt is None):
        raise ConfigError("give the prompt as --prompt-ids 1,2,3 or as --prompt TEXT with --tokenizer DIR (one of them)")
    if args.prompt_ids is not None:
        if args.tokenizer is not None:
            raise ConfigError("--tokenizer goes with --prompt (text); --prompt-ids are tokens already")
        rows = parse_ids(args.prompt_ids, "--prompt-ids")
        if len({len(r) for r in rows}) > 1:
            raise InputError(f"--prompt-ids rows have {sorted({len(r) for r in rows})} tokens: rows of a batch must "
                             "have one length (the program has no padding mask)")
        return rows, None
    if args.tokenizer is None:
        raise ConfigError("--prompt needs --tokenizer DIR (a local Hugging Face tokenizer folder), or pass --prompt-ids")
    tokenizer = load_tokenizer(args.tokenizer)
    ids = tokenizer(args.prompt)["input_ids"]
    if not ids:
        raise InputError(f"--prompt {args.prompt[:40]!r} has no tokens with the tokenizer of {args.tokenizer}")
    return [list(ids)], tokenizer


def load_tokenizer(path: str):
    """A tokenizer from a local folder, through transformers; nothing is downloaded."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("--prompt needs the transformers package to read the tokenizer (pip install "
                          "transformers), or pass token ids with --prompt-ids") from None
    if not os.path.isdir(path):
        raise ConfigError(f"--tokenizer {path}: not a folder; give a local Hugging Face tokenizer folder "
                          "(tokenizer.json / tokenizer_config.json; nothing is downloaded)")
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--tokenizer {path}: no tokenizer could be read from it ({first})") from None


def _stop_ids(args, tokenizer) -> list[int]:
    """--stop-ids, else the tokenizer's end-of-sequence token, else none."""
    if args.stop_ids is not None:
        if ";" in args.stop_ids:
            raise InputError("--stop-ids is one comma-separated list (every row stops at any of them)")
        return parse_ids(args.stop_ids, "--stop-ids")[0]
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else []


def report(result, tokenizer, device_types) -> list[str]:
    """The tokens (or text) of each row, then prefill and decode speed and peak device memory."""
    lines = []
    for i, row in enumerate(result.tokens.tolist()):
        label = f"row {i}: " if result.tokens.shape[0] > 1 else ""
        if tokenizer is None:
            prompt, new = row[:result.prompt_len], row[result.prompt_len:]
            lines.append(f"{label}{','.join(map(str, prompt))} | {','.join(map(str, new))}")
        else:
            lines.append(f"{label}{tokenizer.decode(row, skip_special_tokens=True)!r}")
    rows, new = result.tokens.shape[0], result.tokens.shape[1] - result.prompt_len
    lines.append(f"prefill: {result.prompt_len} tokens x {rows} row(s) in {result.prefill_s * 1e3:.2f} ms, "
                 f"{result.prefill_tokens_per_s:,.1f} tokens/s")
    per = result.decode_ms_per_token
    lines.append(f"decode: {new} new token(s) per row, {result.decode_steps} step(s), "
                 + (f"{per:.3f} ms/token" if not math.isnan(per) else "n/a ms/token (no decode step)"))
    lines.append(f"peak device memory: {peak_memory(device_types)}")
    return lines


def peak_memory(device_types) -> str:
    """torch's peak on each CUDA device (what ferry's allocator took included); the emulated
    device's peak from its counters; n/a for a program on the CPU alone."""
    parts = []
    if "cuda" in device_types:
        import torch

        for i in range(torch.cuda.device_count()):
            parts.append(f"cuda:{i} {torch.cuda.max_memory_allocated(i) / 2**20:.1f} MiB")
    for t in sorted(device_types - {"cpu", "cuda"}):
        from ferry.runtime import get_allocator

        peak = getattr(get_allocator(t), "peak_live_bytes", None)
        parts.append(f"{t} {peak / 2**20:.1f} MiB (emulated)" if peak is not None else f"{t} n/a")
    return ", ".join(parts) if parts else "n/a (no CUDA device)"

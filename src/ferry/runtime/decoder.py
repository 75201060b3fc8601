"""What ferry.generate reads from a program before it runs: which methods take the prompt and the
decode steps, how each is called (read from its input metadata, never guessed from a call), and
how many positions the program's KV cache holds.

A decoder method takes (input_ids [batch, seq] integers, cache_position [seq] integers), in either
order, and returns logits [batch, seq, vocab] (or [batch, vocab]) as its first output: the
signature of transformers' TorchExportableModuleForDecoderOnlyLM export. `seq` is fixed (1: one
token per call) or dynamic (a torch.export.Dim: the prompt in one call). ExecuTorch's form, a
dynamic `seq` with a [1] start position, is read too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ferry.errors import ConfigError, InputError
from ferry.program.schema import TensorMeta, TensorValue

__all__ = ["TokenStep", "cache_capacity", "check_fits", "check_prefill", "integer_dtype", "plan_methods",
           "read_token_step"]

_HINT = ("ferry.generate calls a method with (input_ids [batch, seq] integers, cache_position [seq] integers) and "
         "reads logits [batch, seq, vocab] from its first output; export the model with transformers' "
         "TorchExportableModuleForDecoderOnlyLM (input_ids=..., cache_position=...)")

# mutable buffers holding keys by position: transformers' static cache ('key_cache_0') and
# ExecuTorch's llama ('layers.0.attention.kv_cache.k_cache'), laid out [..., positions, head_dim]
_KEY_CACHE = re.compile(r"(?:^|[._])(?:key|k)_cache(?:$|[._0-9])")


@dataclass(frozen=True)
class TokenStep:
    """How one method takes tokens. `width`: tokens per call when fixed, None when dynamic (up to
    `bound`, and at least `least`: the minimum above 2 it was exported with, else 0).
    `start_only`: the position input is the first position ([1]), not one per token."""

    name: str
    ids_at: int
    ids: TensorMeta
    pos: TensorMeta
    logits: TensorMeta
    width: int | None
    bound: int
    start_only: bool
    least: int = 0

    @property
    def vocab(self) -> int:
        return self.logits.shape[-1]

    def positions(self, start: int, count: int) -> torch.Tensor:
        """The host position input of a call taking `count` tokens from position `start`."""
        pos = torch.tensor([start]) if self.start_only else torch.arange(start, start + count)
        return pos.to(self.pos.dtype)

    def inputs(self, ids, pos) -> list:
        return [ids, pos] if self.ids_at == 0 else [pos, ids]


def _describe(m: TensorMeta) -> str:
    dims = ", ".join(f"<={n}" if dyn else str(n) for n, dyn in zip(m.shape, m.dynamic))
    return f"{str(m.dtype).removeprefix('torch.')}[{dims}] on {m.device}"


def integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def read_token_step(module, name: str) -> TokenStep:
    """How `name` takes tokens, or a ConfigError saying what the method takes instead."""
    meta = module.method_meta(name)
    ins = [meta.input_meta(i) for i in range(meta.num_inputs())]
    out = meta.output_meta(0) if meta.num_outputs() else None
    got = f"it takes ({', '.join(map(_describe, ins))}) -> {_describe(out) if out else 'nothing'}"
    ranks = [len(m.shape) for m in ins]
    if sorted(ranks) != [1, 2] or not all(integer_dtype(m.dtype) for m in ins):
        raise ConfigError(f"method {name!r} does not take a decoder step's inputs: {got}. {_HINT}")
    if out is None or not out.dtype.is_floating_point or len(out.shape) not in (2, 3):
        raise ConfigError(f"method {name!r} does not return logits first: {got}. {_HINT}")
    ids_at = ranks.index(2)
    ids, pos = ins[ids_at], ins[1 - ids_at]
    dynamic, n = ids.dynamic[1], ids.shape[1]
    per_token = pos.shape[0] == n and pos.dynamic[0] == dynamic
    start_only = not per_token and pos.shape[0] == 1 and not pos.dynamic[0]
    if not (per_token or start_only):
        raise ConfigError(f"method {name!r}: cache_position must have one entry per token of input_ids (or be the "
                          f"start position, [1]): {got}. {_HINT}")
    program = getattr(module, "program", None)  # (a stand-in for a Module may have none: no minimum known)
    minimums = program.method(name).size_minimums if program is not None else []
    least = max((low for i, d, low in minimums if i == ids_at and d == 1), default=0)
    return TokenStep(name, ids_at, ids, pos, out, None if dynamic else n, n, start_only, least)


def plan_methods(module, method: str | None, prefill: str, decode: str) -> tuple[TokenStep, TokenStep]:
    """(the method taking the prompt, the method taking one token per decode step)."""
    names = list(module.method_names())
    if method is not None:
        if method not in names:
            raise ConfigError(f"the program has no method {method!r}; its methods: {', '.join(names)}")
        first = step = read_token_step(module, method)
    elif prefill in names and decode in names:
        first, step = read_token_step(module, prefill), read_token_step(module, decode)
    elif "forward" in names:
        first = step = read_token_step(module, "forward")
    elif decode in names:  # an encoder–decoder's decoder (its encode method runs first)
        first = step = read_token_step(module, decode)
    else:
        raise ConfigError(f"the program's methods are {', '.join(names)}: ferry.generate runs 'forward', or "
                          f"{prefill!r} and {decode!r}, or {decode!r} alone; name them with method= or "
                          "prefill=/decode=")
    if step.width not in (None, 1):
        raise ConfigError(f"method {step.name!r} takes exactly {step.width} tokens per call, but a decode step feeds "
                          "one: export it with input_ids of length 1 or a dynamic length (torch.export.Dim)")
    _check_agree(first, step)
    return first, step


def _check_agree(first: TokenStep, step: TokenStep) -> None:
    """Prefill and decode hand tokens to each other: one batch, one vocabulary."""
    if first is step:
        return
    facts = [("batch", first.ids.shape[0], step.ids.shape[0]), ("vocabulary", first.vocab, step.vocab),
             ("logits device", first.logits.device, step.logits.device)]
    for what, a, b in facts:
        if a != b:
            raise ConfigError(f"methods {first.name!r} and {step.name!r} disagree on the {what} ({a} and {b}): "
                              "compile prefill and decode from one model with one batch size")


def cache_capacity(module, names) -> tuple[int, str] | None:
    """(positions, buffer name) of the smallest key cache among the methods' mutable buffers, or
    None when no buffer is named like one (transformers' 'key_cache_N', ExecuTorch's 'k_cache')."""
    program = getattr(module, "program", None)
    found = None
    for name in dict.fromkeys(names):
        if program is None or name not in program.methods:
            continue
        method = program.method(name)
        for mb in method.mutable_buffers:
            v = method.values[mb.value]
            if _KEY_CACHE.search(mb.name) and isinstance(v, TensorValue) and len(v.shape) >= 2:
                if found is None or v.shape[-2] < found[0]:
                    found = (v.shape[-2], mb.name)
    return found


def check_fits(prompt_len: int, max_new_tokens: int, capacity: tuple[int, str] | None) -> None:
    """Every token but the last one is written into the cache: prompt + new - 1 positions."""
    if capacity is None:
        return
    size, where = capacity
    need = prompt_len + max_new_tokens - 1
    if need <= size:
        return
    fix = (f"ask for at most {size - prompt_len + 1} new tokens" if prompt_len <= size
           else f"shorten the prompt to at most {size} tokens")
    raise InputError(f"a prompt of {prompt_len} tokens and {max_new_tokens} new tokens needs {need} cache positions "
                     f"(every token but the last is fed back), but the program's KV cache holds {size} ({where}): "
                     f"{fix}, or export the model with a larger max_cache_len")


def check_prefill(first: TokenStep, prompt_len: int) -> None:
    """A method of fixed width > 1 takes the prompt in whole calls only; a dynamic one, in calls
    of `bound` tokens, none of them below its minimum (refused before any writes the cache)."""
    if first.width not in (None, 1) and prompt_len % first.width:
        raise InputError(f"method {first.name!r} takes exactly {first.width} tokens per call and the prompt has "
                         f"{prompt_len}: pass a prompt of a multiple of {first.width} tokens, or export the prefill "
                         "method with a dynamic length (torch.export.Dim)")
    last = prompt_len % first.bound or first.bound  # the prompt is fed in calls of `bound` tokens
    if first.width is None and last < first.least:
        raise InputError(f"method {first.name!r} takes at least {first.least} tokens per call (its export's minimum) "
                         f"and a prompt of {prompt_len} fed {first.bound} at a time ends with a call of {last}: pass a "
                         f"prompt whose length leaves no such call, or export the method with a smaller minimum")

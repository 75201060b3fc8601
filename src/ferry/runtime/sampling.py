"""Picking the next token from logits, on the device the logits are on.

Greedy is an argmax (`greedy`: in two passes over a long vocabulary). Sampling applies
temperature, then top-k, then top-p to the logits and draws one token per row with
torch.multinomial: the order and the arithmetic of transformers' TemperatureLogitsWarper,
TopKLogitsWarper and TopPLogitsWarper followed by its sampling step, so that a generator seeded
as torch's global one draws the tokens transformers' `generate` draws.
Nothing here reads a value back to the host.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ferry.choices import timing
from ferry.choices.decisions import DECISIONS
from ferry.errors import ConfigError

__all__ = ["Sampling", "by_rows", "greedy", "make_generator"]

_CHUNKS = (128, 2048)  # the lengths a first pass may reduce: enough rows to fill the GPU, short enough to be quick
FAMILY = "greedy pick"
FORMS = ("argmax", "two passes")


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy (`do_sample=False`) or drawn at `temperature` from
    the `top_k` most likely tokens whose probabilities add up to `top_p`."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise ConfigError(f"do_sample must be True or False, got {self.do_sample!r}")
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t > 0 and math.isfinite(t)):
            raise ConfigError(f"temperature must be a finite number > 0, got {t!r} (greedy decoding is do_sample=False)")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"top_k must be an int >= 1 or None, got {k!r}")
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ConfigError(f"top_p must be a number in (0, 1] or None, got {p!r}")
        if not self.do_sample and (t != 1.0 or k is not None or p is not None):
            raise ConfigError("temperature, top_k and top_p shape sampling: pass do_sample=True with them "
                              "(greedy decoding takes the most likely token and ignores them)")

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """[batch, vocab] logits -> [batch] int64 token ids, on the logits' device."""
        if not self.do_sample:
            return greedy(logits)
        scores = self.filtered(logits.float())
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)

    def filtered(self, scores: torch.Tensor) -> torch.Tensor:
        """Temperature, then top-k, then top-p: the tokens left out get -inf."""
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.top_p is not None and self.top_p < 1.0:
            ascending, order = torch.sort(scores, descending=False)
            drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - self.top_p
            drop[..., -1:] = False  # the most likely token always stays
            scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
        return scores


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)`: on a GPU, in two passes where that is faster there (`_passes`), with the
    same index on ties (the first) and NaNs (the first): the maximum of each row of the split
    vocabulary, then the row holding the first of them."""
    chunk = _passes(logits) if logits.device.type == "cuda" else None  # the CPU: one pass is quick
    return logits.argmax(dim=-1) if chunk is None else by_rows(logits, chunk)


def _passes(logits: torch.Tensor) -> int | None:
    """The row length of the two passes where they take less GPU time than argmax, else None;
    timed once per shape, dtype and GPU of the logits, and kept (`DECISIONS`). On an H200
    (`bench/greedy_pick.py`) torch's argmax over Llama 3's 128,256 tokens took 26.6 µs and two
    passes 11.9, but over Qwen3's 151,936 8.7 against 11.2: no length rule holds."""
    chunk = _chunk(logits.shape[-1])
    if chunk is None:
        return None  # nothing to split by
    key = (FAMILY, tuple(logits.shape), logits.dtype, str(logits.device))

    def decide():
        x = logits.detach()
        with timing.on(logits.device):  # its events and queued waits on the logits' GPU
            times = timing.time_both(lambda: x.argmax(dim=-1), lambda: by_rows(x, chunk))
        shape = f"{'x'.join(map(str, logits.shape))} in rows of {chunk}"
        return timing.decision(FAMILY, "aten.argmax", shape, logits.device, logits.dtype, FORMS, times)

    made = DECISIONS.get(key, decide, may_decide=False)  # each call: only the lookup
    if made is None and not timing.capturing(logits.device):  # inside a capture nothing is timed
        made = DECISIONS.get(key, decide)
    return chunk if made is not None and made.taken else None


def by_rows(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """`greedy`'s two passes, the vocabulary split into rows of `chunk` tokens (a divisor of it)."""
    rows = logits.reshape(*logits.shape[:-1], logits.shape[-1] // chunk, chunk)
    best, where = rows.max(dim=-1)
    row = best.argmax(dim=-1, keepdim=True)
    return (row * chunk + where.gather(-1, row)).squeeze(-1)


@functools.lru_cache(maxsize=64)
def _chunk(vocab: int) -> int | None:
    """The divisor of `vocab` in _CHUNKS nearest its square root (two passes of like length), or None."""
    low, high = _CHUNKS
    fits = [d for d in range(low, min(high, vocab // 2) + 1) if vocab % d == 0]
    return min(fits, key=lambda d: abs(d * d - vocab)) if fits else None


def make_generator(generator: torch.Generator | None, seed: int | None, device: torch.device) -> torch.Generator | None:
    """The random generator sampling draws from, on the logits' device: the caller's, a fresh
    one seeded with `seed`, or None (torch's default generator of that device)."""
    if generator is not None and seed is not None:
        raise ConfigError("pass a generator or a seed, not both")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        return torch.Generator(device=device).manual_seed(seed)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise ConfigError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        where = generator.device
        if where.type != device.type or (None not in (where.index, device.index) and where.index != device.index):
            raise ConfigError(f"the generator is on {where}, but the logits are on {device}: sampling "
                              f"draws where the logits are; pass torch.Generator(device='{device}')")
    return generator

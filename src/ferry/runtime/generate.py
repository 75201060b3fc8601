"""ferry.generate: the generation loop over a compiled decoder (prefill, then one decode step
per new token), with the next token picked on the device that holds the logits.

What crosses to the host. The prompt goes to the program's input device once. Each decode step
copies the picked token into the decode method's input on the device and advances the position
input in place there; tokens collect in a tensor on the logits' device and come back to the host
once, at the end. A step reads nothing back unless the caller asks: `on_token` (streaming) copies
each step's tokens to the host, one wait per step. With stop tokens, the loop reads "has every
row stopped?" every `check_stop_every` steps (default 8): each read is a host wait that drains
the device's queue, and checking every k steps runs at most k - 1 steps past the last row's stop.
Those steps are trimmed, so the tokens returned do not depend on k; only time does. Without stop
tokens the loop never waits before the end. A program compiled without the skip flags takes
and returns host tensors each call; that is the program's copy, not the loop's.

State. The KV cache is the model's: mutable buffers of the program, held by the Module.
Generation starts at cache position 0 and overwrites the cache from there; a static cache masks
every position at or past the one being written (by cache_position), so what an earlier
generation left beyond the prompt is never read. Calls of one Module therefore must not
interleave two generations (a Module refuses concurrency > 1 and micro-batches for a program
with state). Prefill and decode methods compiled together share that
cache (one set of mutable buffers); methods compiled apart would not.

Stopping. A row that emits one of `stop_tokens` is finished: from then on it emits that token
again (its pad), as transformers' generate does with pad_token_id = eos_token_id, and the loop
ends when every row has finished or after `max_new_tokens`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ferry.device import CPU, Device
from ferry.errors import ConfigError, InputError
from ferry.program.states import program_states
from ferry.progress import Progress, checked, tell
from ferry.runtime.decoder import TokenStep, cache_capacity, check_fits, check_prefill, integer_dtype, plan_methods
from ferry.runtime.devices.tensor import clone_to, device_of
from ferry.runtime.sampling import Sampling, make_generator

__all__ = ["Generation", "generate"]


@dataclass(frozen=True)
class Generation:
    """What ferry.generate returns. `tokens`: [batch, prompt + new] int64 on the CPU, the prompt
    first; a row that stopped early is padded with its stop token. `prefill_s`: seconds from the
    first prefill call until the first new token was picked (the device waited for). `decode_s`:
    seconds of the `decode_steps` decode calls that followed, each adding one token per row."""

    tokens: torch.Tensor
    prompt_len: int
    prefill_s: float
    decode_s: float
    decode_steps: int

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_len:]

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens of every row taken per second."""
        return self.tokens.shape[0] * self.prompt_len / self.prefill_s if self.prefill_s > 0 else math.inf

    @property
    def decode_ms_per_token(self) -> float:
        """Milliseconds per decode step (one token for each row); nan without a decode step."""
        return self.decode_s / self.decode_steps * 1e3 if self.decode_steps else math.nan


def generate(module, input_ids, max_new_tokens: int, *, method: str | None = None, prefill: str = "prefill",
             decode: str = "decode", encoder_inputs=None, encode: str = "encode", do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, generator: torch.Generator | None = None, seed: int | None = None,
             stop_tokens: Iterable[int] | int = (), on_token: Callable[[torch.Tensor], object] | None = None,
             check_stop_every: int = 8, max_length: int | None = None,
             progress: Progress | None = None) -> Generation:
    """Generate up to `max_new_tokens` tokens after `input_ids` ([batch, prompt] or [prompt]).

    Methods: `method` names one method doing both prefill and decode; else `prefill` and `decode`
    when the program has both, else 'forward', else `decode` alone. An encoder–decoder (Whisper:
    ferry.seq2seq) runs its `encode` method on `encoder_inputs` (a tensor or a list of them, such
    as log-mel features) first; `input_ids` are then the decoder's prompt. A method whose input_ids length is dynamic takes the
    prompt in one call (calls of its bound, for a longer one); a fixed length of 1 takes it token by
    token. Inputs go where the method's metadata places them (device tensors for a program compiled
    with skip_h2d_for_method_inputs). `max_length` is the number of cache positions when the
    program's buffers do not say (read from a mutable buffer named like 'key_cache').

    Greedy by default; `do_sample=True` draws with `temperature`, `top_k`, `top_p` from `generator`
    or a fresh one seeded with `seed` (else torch's default generator), on the logits' device.
    `on_token(tokens)` gets each step's [batch] tokens on the CPU, in order (one host wait per step);
    `progress(task, done, total, unit)` hears of each step issued, without a wait (ferry/progress.py).
    The module docstring says what crosses to the host and how the KV cache is treated."""
    sampling = Sampling(do_sample, temperature, top_k, top_p)
    first, step = plan_methods(module, method, prefill, decode)
    prompt = _prompt(input_ids, first)
    _check_count(max_new_tokens, "max_new_tokens")
    _check_count(check_stop_every, "check_stop_every")
    if max_length is not None:
        _check_count(max_length, "max_length")
    capacity = (max_length, "max_length") if max_length is not None else cache_capacity(module, (first.name, step.name))
    check_fits(prompt.shape[1], max_new_tokens, capacity)
    check_prefill(first, prompt.shape[1])
    _check_last_chunk(module, first, prompt)
    stops = _stop_ids(stop_tokens, first.vocab)
    if on_token is not None and not callable(on_token):
        raise ConfigError(f"on_token must be a callable taking each step's tokens, got {type(on_token).__name__}")
    if not do_sample and (generator is not None or seed is not None):
        raise ConfigError("a generator or seed draws samples: pass do_sample=True with it (greedy decoding draws none)")
    rng = make_generator(generator, seed, step.logits.device.to_torch()) if do_sample else None
    encoding = _encoder_call(module, encode, encoder_inputs, (first.name, step.name))
    for name in dict.fromkeys((first.name, step.name)):
        module.load_method(name)  # allocation at load, not inside the timed prefill
    if encoding is not None:
        encoding()
    loop = _Loop(module, first, step, sampling, rng, stops, on_token, check_stop_every, checked(progress))
    return loop.run(prompt, max_new_tokens)


class _Loop:
    """One generation's state on the logits' device: the new tokens, which rows have stopped, and
    each stopped row's pad."""

    def __init__(self, module, first: TokenStep, step: TokenStep, sampling: Sampling, rng, stops: tuple[int, ...],
                 on_token, check_every: int, progress: Progress | None = None):
        self.module, self.first, self.step, self.sampling, self.rng = module, first, step, sampling, rng
        self.progress = progress
        self.on_token, self.every = on_token, check_every
        self.device = step.logits.device.to_torch()
        self.stops = torch.tensor(stops, dtype=torch.int64, device=self.device) if stops else None

    def run(self, prompt: torch.Tensor, max_new: int) -> Generation:
        rows = prompt.shape[0]
        self.new = torch.empty(rows, max_new, dtype=torch.int64, device=self.device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=self.device)
        self.pad = torch.zeros(rows, dtype=torch.int64, device=self.device)
        start = time.perf_counter()
        token = self._take(self._prefill(prompt), 0)
        _synchronize(self.device)
        prefilled = time.perf_counter()
        feed, made = _Slots(self.step, rows, prompt.shape[1]), 1
        tell(self.progress, "generate", made, max_new, "token")
        while made < max_new and not self._all_stopped(made):
            token = self._take(feed.call(self.module, token), made)
            made += 1
            tell(self.progress, "generate", made, max_new, "token")
        if made < max_new:  # every row stopped: the task is done at fewer tokens
            tell(self.progress, "generate", made, made, "token")
        _synchronize(self.device)
        done = time.perf_counter()
        return Generation(self._tokens(prompt, made), prompt.shape[1], prefilled - start, done - prefilled, made - 1)

    def _prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """The last position's logits after the whole prompt went in."""
        sig, length = self.first, prompt.shape[1]
        if sig.width is None:  # dynamic length: the prompt in calls of up to `bound` tokens
            for s in range(0, length, sig.bound):
                e = min(length, s + sig.bound)
                ids = _place(prompt[:, s:e].to(sig.ids.dtype), sig.ids.device)
                outs = self.module.run_method(sig.name, sig.inputs(ids, _place(sig.positions(s, e - s), sig.pos.device)))
            return _last(outs)
        feed, on_device = _Slots(sig, prompt.shape[0], 0), _place(prompt.to(sig.ids.dtype), sig.ids.device)
        for s in range(0, length, sig.width):
            logits = feed.call(self.module, on_device[:, s:s + sig.width])
        return logits

    def _take(self, logits: torch.Tensor, i: int) -> torch.Tensor:
        """Pick token `i` of every row on the logits' device; a finished row repeats its stop token."""
        token = self.sampling.pick(logits, self.rng)
        if self.stops is not None:
            token = torch.where(self.finished, self.pad, token)
            newly = torch.isin(token, self.stops) & ~self.finished
            self.pad = torch.where(newly, token, self.pad)
            self.finished |= newly
        self.new[:, i] = token
        if self.on_token is not None:
            self.on_token(token.cpu())
        return token

    def _all_stopped(self, made: int) -> bool:
        """Read back only when stop tokens were given, and then every `every` steps (every step
        when streaming: the host waited for the step already)."""
        if self.stops is None or (self.on_token is None and made % self.every):
            return False
        return bool(self.finished.all())

    def _tokens(self, prompt: torch.Tensor, made: int) -> torch.Tensor:
        """Prompt and new tokens on the CPU (the loop's one transfer back), cut after the step where
        the last row stopped: steps run past it while nobody looked are not part of the answer."""
        new = self.new[:, :made].cpu()
        if self.stops is not None:
            hit = torch.isin(new, self.stops.cpu())
            ends = torch.where(hit.any(dim=1), hit.int().argmax(dim=1) + 1, made)
            new = new[:, :int(ends.max())]
        return torch.cat([prompt, new], dim=1)


class _Slots:
    """A fixed-width method's inputs, kept on their devices across calls: the next ids are copied
    in there and the position advances in place, so a call sends nothing from the host."""

    def __init__(self, sig: TokenStep, rows: int, start: int):
        self.sig, self.width = sig, sig.width or 1
        self.ids = _place(torch.zeros(rows, self.width, dtype=sig.ids.dtype), sig.ids.device)
        self.pos = _place(sig.positions(start, self.width), sig.pos.device)

    def call(self, module, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids.reshape(self.ids.shape))
        outs = module.run_method(self.sig.name, self.sig.inputs(self.ids, self.pos))
        self.pos.add_(self.width)
        return _last(outs)


def _last(outs) -> torch.Tensor:
    """The last position's logits, [batch, vocab]."""
    logits = outs[0]
    return logits[:, -1, :] if logits.dim() == 3 else logits


def _encoder_call(module, encode: str, encoder_inputs, decoder: tuple[str, ...]) -> Callable[[], object] | None:
    """The `encode` call on `encoder_inputs`, each placed where the method takes it (checked now,
    run once the decoder's methods are loaded); None without encoder inputs, where the decoder
    reads no state only `encode` writes (it would read an encoding of nothing, or of an earlier
    generation's audio)."""
    if encoder_inputs is None:
        filled = _filled_only_by(module, encode, decoder)
        if filled:
            raise ConfigError(f"this program's decoder reads what its {encode!r} method writes ({', '.join(filled[:2])}"
                              f"{', ...' if len(filled) > 2 else ''}): pass the encoder's input as encoder_inputs= "
                              "(log-mel features for a speech model), on every generation")
        return None
    if encode not in module.method_names():
        raise ConfigError(f"encoder_inputs are given, but the program has no method {encode!r} to take them; its "
                          f"methods: {', '.join(module.method_names())} (name it with encode=)")
    inputs = list(encoder_inputs) if isinstance(encoder_inputs, (list, tuple)) else [encoder_inputs]
    meta = module.method_meta(encode)
    if len(inputs) != meta.num_inputs() or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise InputError(f"method {encode!r} takes {meta.num_inputs()} tensor(s); encoder_inputs gave "
                         f"{', '.join(type(t).__name__ for t in inputs)}")
    placed = [t if device_of(t) == meta.input_meta(i).device else _place(_to_host(t), meta.input_meta(i).device)
              for i, t in enumerate(inputs)]
    module.load_method(encode)
    return lambda: module.run_method(encode, placed)


def _filled_only_by(module, encode: str, decoder: tuple[str, ...]) -> list[str]:
    """The state `decoder`'s methods read and never write, which `encode` writes."""
    if encode not in module.method_names():
        return []
    return [s.name for s in program_states(module.program.methods).values()
            if encode in s.updated_by and set(decoder) & set(s.methods) and not set(decoder) & set(s.updated_by)]


def _check_last_chunk(module, sig: TokenStep, prompt: torch.Tensor) -> None:
    """A dynamic prefill takes a long prompt in calls of `bound` tokens and a shorter last one:
    its inputs are checked (export's guards on the length, say an even one) before the first
    call writes the cache, so a refused prompt leaves the cache as it was."""
    length, parts = prompt.shape[1], getattr(module, "parts", None)
    last = length % sig.bound
    if sig.width is not None or length <= sig.bound or not last or parts is None:
        return
    start = length - last
    ids = _place(prompt[:, start:].to(sig.ids.dtype), sig.ids.device)
    parts(sig.name, sig.inputs(ids, _place(sig.positions(start, last), sig.pos.device)))


def _place(t: torch.Tensor, device: Device) -> torch.Tensor:
    """A host tensor made the caller's input on `device` (its own memory there)."""
    return t.contiguous() if device.is_cpu else clone_to(t.contiguous(), device)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    where = device_of(t)
    if where.is_cpu:
        return t
    return t.cpu() if t.device.type != "cpu" else clone_to(t, CPU)


def _synchronize(device: torch.device) -> None:
    """Wait for the device, so that a time read after this counts its work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_count(value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be an int >= 1, got {value!r}")


def _prompt(input_ids, sig: TokenStep) -> torch.Tensor:
    """The prompt as a [batch, prompt] int64 host tensor, checked against the method's batch and
    vocabulary (an id past it would index outside the embedding, on a GPU a device-side assert)."""
    try:
        t = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InputError(f"input_ids must be a tensor or lists of token ids of equal length: {e}") from None
    t = _to_host(t)
    t = t.unsqueeze(0) if t.dim() == 1 else t
    if t.dim() != 2 or 0 in t.shape or not integer_dtype(t.dtype):
        raise InputError(f"input_ids must be integer token ids, [batch, prompt] or [prompt], not empty; got "
                         f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
    rows, want, dynamic = t.shape[0], sig.ids.shape[0], sig.ids.dynamic[0]
    if rows != want and not (dynamic and rows <= want):
        limit = f"at most {want}" if dynamic else f"{want}"
        raise InputError(f"the prompt has {rows} rows but method {sig.name!r} takes a batch of {limit}: pass that many "
                         f"rows, or export the model with batch_size={rows}")
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= sig.vocab:
        raise InputError(f"input_ids hold token {lo if lo < 0 else hi}, outside the program's vocabulary (ids 0.."
                         f"{sig.vocab - 1}): make the prompt with this model's tokenizer")
    return t.to(torch.int64)


def _stop_ids(stop_tokens, vocab: int) -> tuple[int, ...]:
    if stop_tokens is None:
        return ()
    if isinstance(stop_tokens, torch.Tensor):
        stop_tokens = stop_tokens.reshape(-1).tolist()
    ids = (stop_tokens,) if isinstance(stop_tokens, int) else tuple(stop_tokens)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise InputError(f"stop token {t!r} is not a token id of this program (ids 0..{vocab - 1}): pass the "
                             "ids of this model's tokenizer")
    return tuple(dict.fromkeys(ids))

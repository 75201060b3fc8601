"""The greedy pick (ferry/runtime/sampling.py): its two passes over a long vocabulary pick the index
torch's argmax picks, ties and NaNs included, on random logits of every vocabulary length a model
family uses; on a GPU they are used where timing says they are faster (a fake clock on the CPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ferry.choices.decisions import DECISIONS
from ferry.runtime import sampling

VOCABS = [128256, 151936, 32000, 50257, 51865, 256000]  # Llama 3, Qwen2/3, Llama 2, GPT-2, Whisper, Gemma


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_passes_pick_argmaxs_token_on_random_logits(vocab, dtype):
    chunk = sampling._chunk(vocab)
    assert chunk is not None and vocab % chunk == 0 and 128 <= chunk <= 2048
    g = torch.Generator().manual_seed(vocab)
    for batch in (1, 3):
        logits = torch.randn(batch, vocab, generator=g).to(dtype)
        assert torch.equal(sampling.by_rows(logits, chunk), logits.argmax(-1))
        assert torch.equal(sampling.by_rows(logits[:, None], chunk), logits[:, None].argmax(-1))  # [batch, 1, vocab]


def test_ties_and_nans_go_to_the_first_as_argmax_has_them():
    vocab, chunk = 32000, 160
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g).to(torch.bfloat16)
    logits[0, [5, 7000, 31999]] = 100.0  # a tie across rows of the first pass
    logits[1, [200, 161]] = 100.0  # a tie, the later index in an earlier position
    logits[2, [9000, 9001, 30000]] = float("nan")  # NaN wins argmax: the first one
    logits[3] = float("-inf")  # all -inf: index 0
    want = logits.argmax(-1)
    assert want.tolist() == [5, 161, 9000, 0]
    assert torch.equal(sampling.by_rows(logits, chunk), want)


def test_a_vocabulary_with_no_divisor_to_split_by_keeps_one_pass():
    assert sampling._chunk(131071) is None  # a prime
    assert sampling._chunk(100) is None  # too short to split
    logits = torch.randn(2, 131071)
    assert torch.equal(sampling.greedy(logits), logits.argmax(-1))


@pytest.mark.parametrize("times, two_passes", [((26.6, 11.9), True), ((8.7, 11.2), False), ((3.0, 1.5), False)])
def test_two_passes_are_kept_where_timed_faster_once_per_shape(monkeypatch, times, two_passes):
    """Llama 3's and Qwen3's times on an H200; the last saves half but under 2 µs (three more launches)."""
    from ferry.choices import timing

    DECISIONS.forget()
    timed = []
    monkeypatch.setattr(timing, "capturing", lambda device: False)
    monkeypatch.setattr(timing, "on", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(timing, "time_both", lambda first, second: timed.append((first(), second())) or times)
    logits = torch.randn(2, 128256).to(torch.bfloat16)
    try:
        for _ in range(3):
            assert sampling._passes(logits) == (334 if two_passes else None)
        assert len(timed) == 1 and all(torch.equal(a, logits.argmax(-1)) for a in timed[0])  # both forms: argmax's
        (made,) = DECISIONS.values(timed=True)
        assert made.family == sampling.FAMILY and made.taken is two_passes and made.times_us == times
        assert sampling._passes(logits[:1]) is not None or not two_passes  # another shape: timed again
        assert len(timed) == 2
    finally:
        DECISIONS.forget()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("vocab", VOCABS)
def test_on_the_gpu_greedy_picks_argmaxs_token(vocab):
    g = torch.Generator(device="cuda").manual_seed(vocab)
    for batch in (1, 8):
        logits = torch.randn(batch, vocab, device="cuda", generator=g).to(torch.bfloat16)
        logits[0, vocab // 3] = logits[0, vocab - 1] = logits.max() + 1  # a tie in separate rows
        assert torch.equal(sampling.greedy(logits), logits.argmax(-1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_the_two_passes_pick_argmaxs_token_ties_and_nans_included():
    """The two passes themselves on CUDA (greedy may have kept argmax): ties across rows, NaNs,
    all -inf, a [batch, 1, vocab] and a non-contiguous input."""
    vocab = 32000
    chunk = sampling._chunk(vocab)
    logits = torch.randn(5, vocab, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    logits = logits.to(torch.bfloat16)
    logits[0, [5, 7000, 31999]] = 100.0
    logits[1, [200, 161]] = 100.0
    logits[2, [9000, 9001, 30000]] = float("nan")
    logits[3] = float("-inf")
    for x in (logits, logits[:, None], logits.t().contiguous().t()):
        assert torch.equal(sampling.by_rows(x, chunk), x.argmax(-1))

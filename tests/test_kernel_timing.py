"""The timing behind the kernel choices (runtime/kernel_timing.py), on a fake GPU whose events
read a fake host clock: a run the host launches slower than the GPU's queued wait lasts is timed
again behind a longer wait, so a form of many small launches is not timed at the host's pace."""

import pytest
import torch

from ferry.runtime import kernel_timing


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU whose `_sleep` of n cycles lasts n ns from its launch, on a fake clock that each
    launched 'kernel' advances by its host time; events stamp that clock, and an event is done
    once the wait queued before it has ended."""
    clock, sleeps, waiting_until = [0.0], [], [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = 0.0

        def record(self):
            self.t = clock[0]

        def query(self):
            return clock[0] >= waiting_until[0]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3  # ms

    def sleep(cycles):
        sleeps.append(cycles)
        waiting_until[0] = clock[0] + cycles * 1e-9

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", sleep)

    def kernel(us):
        def run():
            clock[0] += us * 1e-6
        return run
    return kernel, sleeps


def test_a_run_launched_slower_than_the_wait_is_timed_behind_a_longer_one(fake_gpu):
    kernel, sleeps = fake_gpu
    quick, slow = kernel(1.0), kernel(100.0)  # 10 calls of the slow one take 1 ms to queue: longer than 0.5 ms
    assert kernel_timing.time_both(quick, slow) == pytest.approx((1.0, 100.0))
    first = kernel_timing._QUEUE_CYCLES
    assert sleeps == [first, first, 4 * first] + [4 * first] * 4  # the longer wait kept for the later rounds


def test_a_host_slower_than_the_longest_wait_is_timed_at_its_pace(fake_gpu):
    kernel, sleeps = fake_gpu
    kernel_timing.time_both(kernel(1.0), kernel(20_000.0))  # 200 ms of launches
    assert max(sleeps) == kernel_timing._MAX_QUEUE_CYCLES


def test_faster_needs_a_tenth_and_two_microseconds():
    assert kernel_timing.faster(100.0, 89.0) and not kernel_timing.faster(100.0, 91.0)
    assert not kernel_timing.faster(10.0, 8.5) and kernel_timing.faster(20.0, 17.5)


def test_the_summary_says_what_load_chose_of_each_kind(timed, monkeypatch):
    from ferry import fused_kernels
    from ferry.runtime import attention_choice, conv_choice, kernel_choices

    assert kernel_choices.summary() == []
    monkeypatch.setattr(fused_kernels, "_cudnn_takes", lambda *args: True)
    q = torch.randn(1, 2, 5, 4)
    attention_choice.chosen(attention_choice.SDPA, [q, q, q], {}, False)
    conv = [torch.randn(1, 8, 3, 3), torch.randn(6, 8, 1, 1), torch.randn(6), [1, 1], [0, 0], [1, 1], 1]
    conv_choice.chosen(fused_kernels.CONV_RELU, conv)
    timed.times = (10.0, 9.5)
    conv_choice.chosen(fused_kernels.CONV_RELU, [torch.randn(1, 8, 4, 4), *conv[1:]])
    assert kernel_choices.summary() == [
        "attention (captured plans): 1 of 1 timed at load are faster as GEMMs and a softmax (largest saving: "
        "attention 1x2x5x4 float32, 100.0 -> 40.0 µs)",
        "1x1 convolutions of one image (captured plans): 1 of 2 timed at load are faster as one GEMM (largest saving: "
        "6x8x9 float32, 100.0 -> 40.0 µs)"]

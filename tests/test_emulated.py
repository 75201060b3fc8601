"""The emulated device: explicit registration, counters, checks, injected failures."""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch

from ferry.device import Device
from ferry.errors import AllocationError, DeviceError
from ferry.runtime.devices import emulated as emulated_mod
from ferry.runtime.devices.allocator import DeviceMemoryBuffer, get_allocator, register_allocator
from ferry.runtime.devices.emulated import AllocationRecord, CopyRecord, EmulatedAllocator, emulated_device


def random_bytes(n):
    return torch.randint(0, 256, (n,), dtype=torch.uint8)


# ---------------------------------------------------------------------------------------
# registration


def test_importing_does_not_register_anything():
    assert emulated_mod.EmulatedAllocator is EmulatedAllocator
    assert get_allocator("emu") is None


def test_emulated_device_registers_and_unregisters():
    assert get_allocator("emu") is None
    with emulated_device() as a:
        assert isinstance(a, EmulatedAllocator)
        assert get_allocator("emu") is a
        assert Device.parse("emu:1") == Device("emu", 1)
    assert get_allocator("emu") is None
    with pytest.raises(ValueError):
        Device.parse("emu:1")


def test_emulated_device_unregisters_on_error_and_gives_a_fresh_allocator():
    with pytest.raises(RuntimeError):
        with emulated_device("emx") as first:
            first.allocate(8, 0)
            raise RuntimeError("test body failed")
    assert get_allocator("emx") is None
    with emulated_device("emx") as second:
        assert second is not first
        assert second.allocations == 0


def test_emulated_device_refuses_to_shadow_a_registered_device(emu):
    with pytest.raises(ValueError, match="already registered"):
        with emulated_device():
            pass  # pragma: no cover
    assert get_allocator("emu") is emu


# ---------------------------------------------------------------------------------------
# counters


def test_allocation_counters_and_records(emu):
    a = emu.allocate(100, 0)
    b = emu.allocate(300, 1, alignment=1024)
    assert emu.allocations == 2 and emu.deallocations == 0
    assert emu.live_bytes == 400 and emu.peak_live_bytes == 400 and emu.live_allocations == 2
    assert emu.allocated == [
        AllocationRecord(100, 0, 256, a.data_ptr()),
        AllocationRecord(300, 1, 1024, b.data_ptr()),
    ]
    assert b.data_ptr() % 1024 == 0
    emu.deallocate(a, 0)
    assert emu.deallocations == 1 and emu.live_bytes == 300 and emu.peak_live_bytes == 400
    assert emu.freed == [AllocationRecord(100, 0, 256, a.data_ptr())]
    emu.deallocate(b, 1)
    assert emu.live_bytes == 0 and emu.live_allocations == 0


def test_fresh_memory_is_filled_with_a_marker_byte(emu):
    mem = emu.allocate(64, 0)
    assert torch.all(mem == 0xA5)
    with emulated_device("emz", fill=None) as raw:
        assert raw.allocate(8, 0).numel() == 8


def test_copy_counters_records_and_data(emu):
    host = random_bytes(40)
    d0 = emu.allocate(64, 0)
    d1 = emu.allocate(64, 1)
    emu.copy_host_to_device(d0, host, 40, 0)
    emu.copy_device_to_device(d1, d0, 40, 1, 0)
    back = torch.zeros(64, dtype=torch.uint8)
    emu.copy_device_to_host(back, d1, 24, 1)
    assert torch.equal(d0[:40], host) and torch.equal(d1[:40], host)
    assert torch.equal(back[:24], host[:24]) and torch.all(back[24:] == 0)
    assert emu.copies == [
        CopyRecord("h2d", 40, 0),
        CopyRecord("d2d", 40, 1, 0),
        CopyRecord("d2h", 24, 1),
    ]
    assert emu.copy_counts == {"h2d": 1, "d2h": 1, "d2d": 1}
    assert emu.copy_bytes == {"h2d": 40, "d2h": 24, "d2d": 40}
    assert emu.copy_summary() == {"h2d": (1, 40), "d2h": (1, 24), "d2d": (1, 40)}
    assert emu.supports_device_to_device


def test_zero_byte_copy_is_not_counted(emu):
    d = emu.allocate(16, 0)
    emu.copy_host_to_device(d, random_bytes(16), 0, 0)
    assert emu.copies == [] and emu.copy_counts["h2d"] == 0


def test_reset_counters_keeps_live_memory(emu):
    mem = emu.allocate(32, 0)
    emu.copy_host_to_device(mem, random_bytes(32), 32, 0)
    emu.reset_counters()
    assert emu.allocations == 0 and emu.copies == [] and emu.allocated == []
    assert emu.copy_counts == {"h2d": 0, "d2h": 0, "d2d": 0}
    assert emu.live_bytes == 32 and emu.device_index_of(mem) == 0
    emu.deallocate(mem, 0)
    assert emu.deallocations == 1 and emu.live_bytes == 0


def test_counters_are_exact_under_threads(emu):
    n_threads, rounds = 8, 50
    barrier = threading.Barrier(n_threads)

    def worker(i):
        barrier.wait()
        for _r in range(rounds):
            mem = emu.allocate(16 + i, i % 2)
            emu.copy_host_to_device(mem, random_bytes(16 + i), 16 + i, i % 2)
            emu.deallocate(mem, i % 2)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert emu.allocations == emu.deallocations == n_threads * rounds
    assert emu.copy_counts["h2d"] == n_threads * rounds
    assert emu.copy_bytes["h2d"] == rounds * sum(16 + i for i in range(n_threads))
    assert emu.live_bytes == 0 and emu.live_allocations == 0


# ---------------------------------------------------------------------------------------
# device indices and ownership


def test_device_index_of_answers_from_live_ranges(emu):
    m0 = emu.allocate(64, 0)
    m1 = emu.allocate(64, 1)
    assert emu.device_index_of(m0) == 0
    assert emu.device_index_of(m1) == 1
    assert emu.device_index_of(m1[63:]) == 1  # last byte
    assert emu.device_index_of(m0[8:16].view(torch.float32)) == 0
    assert emu.device_index_of(torch.randn(16)) is None
    assert emu.device_index_of(m0[:0]) is None
    assert emu.device_index_of("not a tensor") is None
    emu.deallocate(m1, 1)
    assert emu.device_index_of(m1) is None


def test_index_limits_and_current_device(emu):
    with pytest.raises(ValueError, match=r"emu:2 does not exist.*2 device"):
        emu.allocate(8, 2)
    with pytest.raises(ValueError):
        emu.allocate(8, -2)
    emu.current_device = 1
    mem = emu.allocate(8, -1)
    assert emu.allocated[-1].index == 1
    assert emu.device_index_of(mem) == 1


def test_copy_into_memory_it_does_not_own_is_rejected(emu):
    host = random_bytes(16)
    with pytest.raises(DeviceError, match="dst is not emu memory"):
        emu.copy_host_to_device(torch.empty(16, dtype=torch.uint8), host, 16, 0)
    assert emu.copies == []


def test_copy_with_the_wrong_index_is_rejected(emu):
    m0 = emu.allocate(16, 0)
    with pytest.raises(DeviceError, match="dst is emu:0 memory, not emu:1"):
        emu.copy_host_to_device(m0, random_bytes(16), 16, 1)
    with pytest.raises(DeviceError, match="src is emu:0 memory, not emu:1"):
        emu.copy_device_to_host(torch.empty(16, dtype=torch.uint8), m0, 16, 1)


def test_host_side_must_not_be_device_memory(emu):
    m0 = emu.allocate(16, 0)
    m1 = emu.allocate(16, 0)
    with pytest.raises(DeviceError, match="src is emu:0 memory, not host memory"):
        emu.copy_host_to_device(m0, m1, 16, 0)
    with pytest.raises(DeviceError, match="dst is emu:0 memory, not host memory"):
        emu.copy_device_to_host(m1, m0, 16, 0)


def test_copy_running_past_the_allocation_is_rejected(emu):
    big = emu.allocate(64, 0)
    assert emu.live_bytes == 64
    # a view that claims 32 bytes but starts 48 bytes into a 64-byte allocation
    host = random_bytes(64)
    view = big[48:]
    with pytest.raises(ValueError):  # the public method sees the view is only 16 bytes
        emu.copy_host_to_device(view, host, 32, 0)
    # internal: the backend hook itself, past the public method's check: 32 bytes from 48 bytes into 64
    with pytest.raises(ValueError, match="32 bytes at .* run past the end of the 64-byte emu:0 allocation"):
        emu._copy_h2d(view, host[:32], 32, 0)
    assert emu.copies == []


def test_double_free_and_foreign_free_are_errors(emu):
    mem = emu.allocate(32, 0)
    emu.deallocate(mem, 0)
    with pytest.raises(DeviceError, match="double free"):
        emu.deallocate(mem, 0)
    with pytest.raises(DeviceError, match="not a live emu allocation"):
        emu.deallocate(torch.empty(32, dtype=torch.uint8), 0)
    other = emu.allocate(32, 1)
    with pytest.raises(DeviceError, match="allocation on emu:1, freed as 32 bytes on emu:0"):
        emu.deallocate(other, 0)
    assert emu.deallocations == 1


def test_zero_byte_allocations_are_tracked(emu):
    a = emu.allocate(0, 1)
    b = emu.allocate(0, 1)
    assert emu.live_allocations == 2 and emu.live_bytes == 0
    emu.deallocate(a, 1)
    emu.deallocate(b, 1)
    with pytest.raises(DeviceError, match="double free"):
        emu.deallocate(a, 1)
    assert emu.allocations == 2 and emu.deallocations == 2


# ---------------------------------------------------------------------------------------
# injected failures


def test_fail_allocation_fails_exactly_the_kth(emu):
    emu.fail_allocation(3)
    first = emu.allocate(8, 0)
    second = emu.allocate(8, 0)
    with pytest.raises(AllocationError, match=r"allocation of 8 bytes on emu:1 failed: out of memory"):
        emu.allocate(8, 1)
    fourth = emu.allocate(8, 1)
    assert emu.allocations == 3 and emu.failed_allocations == 1
    assert [r.data_ptr for r in emu.allocated] == [m.data_ptr() for m in (first, second, fourth)]
    assert emu.live_bytes == 24


def test_fail_allocation_next(emu):
    emu.fail_allocation()
    with pytest.raises(AllocationError):
        DeviceMemoryBuffer.create(16, "emu:0")
    with DeviceMemoryBuffer.create(16, "emu:0") as buf:
        assert emu.device_index_of(buf.memory) == 0


@pytest.mark.parametrize("k", [0, -1, 1.0, True])
def test_fail_allocation_rejects_bad_k(emu, k):
    with pytest.raises(ValueError):
        emu.fail_allocation(k)


def test_failed_allocation_lets_a_loader_clean_up(emu):
    """What Module loading does: allocate each planned buffer; on failure free all so far."""
    sizes = [64, 128, 256, 512]
    emu.fail_allocation(3)
    with pytest.raises(AllocationError, match="256 bytes on emu:0"):
        with contextlib.ExitStack() as stack:
            for size in sizes:
                stack.enter_context(DeviceMemoryBuffer.create(size, "emu:0"))
    assert emu.allocations == 2 and emu.deallocations == 2
    assert sorted(r.nbytes for r in emu.freed) == [64, 128]
    assert emu.live_bytes == 0


def test_fail_copy(emu):
    mem = emu.allocate(16, 0)
    emu.fail_copy(2)
    emu.copy_host_to_device(mem, random_bytes(16), 16, 0)
    with pytest.raises(DeviceError, match="host-to-device copy of 16 bytes to emu:0 failed: copy failure injected"):
        emu.copy_host_to_device(mem, random_bytes(16), 16, 0)
    emu.copy_host_to_device(mem, random_bytes(16), 16, 0)
    assert emu.copy_counts["h2d"] == 2


def test_capacity_limits_live_bytes_per_index():
    with emulated_device(capacity=100) as emu:
        a = emu.allocate(60, 0)
        emu.allocate(60, 1)  # another index has its own capacity
        with pytest.raises(AllocationError, match="out of memory: 60 of 100 bytes in use, 50 more"):
            emu.allocate(50, 0)
        emu.deallocate(a, 0)
        emu.allocate(100, 0)
        assert emu.failed_allocations == 1


def test_buffers_on_emulated_memory_are_freed_by_gc(emu):
    buf = DeviceMemoryBuffer.create(128, Device("emu", 1), alignment=512)
    ptr = buf.memory.data_ptr()
    assert ptr % 512 == 0 and emu.allocated == [AllocationRecord(128, 1, 512, ptr)]
    del buf
    gc.collect()
    assert emu.freed == [AllocationRecord(128, 1, 512, ptr)]
    assert emu.live_bytes == 0


def test_explicit_registration_works_too():
    a = EmulatedAllocator("emy")
    register_allocator(a)
    try:
        with DeviceMemoryBuffer.create(8, "emy:3") as buf:
            assert a.device_index_of(buf.memory) == 3
    finally:
        from ferry.runtime.devices.allocator import unregister_allocator

        assert unregister_allocator("emy") is a
    assert a.allocations == 1 and a.deallocations == 1


def test_records_are_bounded_but_counters_count_everything():
    with emulated_device(log_limit=5) as emu:
        src = torch.randn(4)
        for _ in range(20):
            buf = DeviceMemoryBuffer.create(16, "emu:0")
            emu.copy_host_to_device(buf.memory, src.view(torch.uint8), 16, 0)
            buf.close()
        assert len(emu.copies) == 5 and len(emu.allocated) == 5 and len(emu.freed) == 5
        assert emu.copy_counts["h2d"] == 20 and emu.allocations == 20 and emu.deallocations == 20

"""DeviceAllocator (validation + context), the registry, and DeviceMemoryBuffer."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from ferry.alignment import default_alignment
from ferry.device import Device
from ferry.errors import AllocationError, DeviceError
from ferry.runtime.devices.allocator import (
    DeviceAllocator,
    DeviceMemoryBuffer,
    allocate_aligned,
    get_allocator,
    register_allocator,
    registered_device_types,
    unregister_allocator,
)


class RecordingAllocator(DeviceAllocator):
    """A minimal backend: host memory, and a log of every hook call."""

    default_alignment = 128

    def __init__(self, device_type="mockdev"):
        self.device_type = device_type
        self.calls = []
        self.fail_with = None  # exception the next hook call raises
        self.bad_result = None  # what _allocate returns instead of real memory

    def _maybe_fail(self):
        if self.fail_with is not None:
            exc, self.fail_with = self.fail_with, None
            raise exc

    def _allocate(self, nbytes, index, alignment):
        self.calls.append(("allocate", nbytes, index, alignment))
        self._maybe_fail()
        if self.bad_result is not None:
            return self.bad_result
        return allocate_aligned(nbytes, alignment)

    def _deallocate(self, memory, index):
        self.calls.append(("deallocate", memory.data_ptr(), memory.numel(), index))
        self._maybe_fail()

    def _copy_h2d(self, dst, src, nbytes, index):
        self.calls.append(("h2d", dst.numel(), src.numel(), nbytes, index))
        self._maybe_fail()
        dst.copy_(src)

    def _copy_d2h(self, dst, src, nbytes, index):
        self.calls.append(("d2h", dst.numel(), src.numel(), nbytes, index))
        self._maybe_fail()
        dst.copy_(src)

    def calls_named(self, name):
        return [c for c in self.calls if c[0] == name]


@pytest.fixture
def mock():
    a = RecordingAllocator()
    register_allocator(a)
    try:
        yield a
    finally:
        if get_allocator(a.device_type) is a:
            unregister_allocator(a.device_type)


def random_bytes(n):
    return torch.randint(0, 256, (n,), dtype=torch.uint8)


# ---------------------------------------------------------------------------------------
# registry


def test_register_then_get_returns_the_same_allocator():
    a = RecordingAllocator("regtest")
    assert get_allocator("regtest") is None
    register_allocator(a)
    try:
        assert get_allocator("regtest") is a
        assert "regtest" in registered_device_types()
    finally:
        assert unregister_allocator("regtest") is a
    assert get_allocator("regtest") is None
    assert "regtest" not in registered_device_types()


def test_lookup_of_unregistered_type_is_none():
    assert get_allocator("no-such-device") is None
    assert unregister_allocator("no-such-device") is None


def test_second_registration_names_type_and_existing_allocator(mock):
    other = RecordingAllocator("mockdev")
    with pytest.raises(ValueError) as info:
        register_allocator(other)
    msg = str(info.value)
    assert "'mockdev'" in msg
    assert repr(mock) in msg
    assert "unregister_allocator" in msg
    assert get_allocator("mockdev") is mock  # the first one stays


def test_registering_the_same_instance_twice_is_also_an_error(mock):
    with pytest.raises(ValueError, match="already registered"):
        register_allocator(mock)


def test_cpu_cannot_be_registered():
    with pytest.raises(ValueError, match="'cpu'"):
        register_allocator(RecordingAllocator("cpu"))
    assert get_allocator("cpu") is None


@pytest.mark.parametrize("bad", [object(), None, "emu", RecordingAllocator])
def test_registering_a_non_allocator_is_a_type_error(bad):
    with pytest.raises(TypeError, match="DeviceAllocator"):
        register_allocator(bad)


@pytest.mark.parametrize("kind", ["", "Emu", "emu:0", " emu", 3])
def test_device_type_must_be_a_plain_lowercase_name(kind):
    a = RecordingAllocator()
    a.device_type = kind
    with pytest.raises(ValueError, match="device_type"):
        register_allocator(a)


def test_registered_device_types_are_sorted_and_feed_device_parse():
    b, a = RecordingAllocator("zz-dev"), RecordingAllocator("aa-dev")
    with pytest.raises(ValueError):
        Device.parse("aa-dev:2")
    register_allocator(b)
    register_allocator(a)
    try:
        types = registered_device_types()
        assert types == tuple(sorted(types))
        assert {"aa-dev", "zz-dev"} <= set(types)
        assert Device.parse("AA-DEV:2") == Device("aa-dev", 2)
    finally:
        unregister_allocator("aa-dev")
        unregister_allocator("zz-dev")
    with pytest.raises(ValueError):
        Device.parse("aa-dev:2")


def test_registry_is_thread_safe_under_concurrent_use():
    n_threads, rounds = 8, 200
    errors = []
    barrier = threading.Barrier(n_threads)

    def worker(i):
        kind = f"thread-dev-{i}"
        mine = RecordingAllocator(kind)
        barrier.wait()
        try:
            for _ in range(rounds):
                register_allocator(mine)
                assert get_allocator(kind) is mine
                assert kind in registered_device_types()
                assert unregister_allocator(kind) is mine
                assert get_allocator(kind) is None
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert not any(t.startswith("thread-dev-") for t in registered_device_types())


def test_concurrent_registration_of_one_type_has_exactly_one_winner():
    n_threads = 16
    barrier = threading.Barrier(n_threads)
    wins, losses = [], []
    candidates = [RecordingAllocator("race-dev") for _ in range(n_threads)]

    def worker(a):
        barrier.wait()
        try:
            register_allocator(a)
            wins.append(a)
        except ValueError:
            losses.append(a)

    threads = [threading.Thread(target=worker, args=(a,)) for a in candidates]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(wins) == 1 and len(losses) == n_threads - 1
        assert get_allocator("race-dev") is wins[0]
    finally:
        unregister_allocator("race-dev")


# ---------------------------------------------------------------------------------------
# DeviceAllocator public methods


def test_allocate_forwards_arguments_and_returns_aligned_uint8(mock):
    mem = mock.allocate(1000, 3, 512)
    assert mock.calls == [("allocate", 1000, 3, 512)]
    assert mem.dtype == torch.uint8 and mem.shape == (1000,)
    assert mem.data_ptr() % 512 == 0


def test_allocate_uses_default_alignment(mock):
    mock.allocate(10, 0)
    assert mock.calls == [("allocate", 10, 0, RecordingAllocator.default_alignment)]


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(nbytes=-1, index=0), ValueError),
        (dict(nbytes=1.5, index=0), TypeError),
        (dict(nbytes=True, index=0), TypeError),
        (dict(nbytes=8, index=-1), ValueError),
        (dict(nbytes=8, index="0"), TypeError),
        (dict(nbytes=8, index=0, alignment=3), ValueError),
        (dict(nbytes=8, index=0, alignment=0), ValueError),
        (dict(nbytes=8, index=0, alignment=-4), ValueError),
        (dict(nbytes=8, index=0, alignment=2.0), TypeError),
    ],
)
def test_allocate_rejects_bad_arguments_before_calling_the_backend(mock, kwargs, exc):
    with pytest.raises(exc):
        mock.allocate(**kwargs)
    assert mock.calls == []


def test_allocate_wraps_backend_errors_with_size_and_device(mock):
    cause = RuntimeError("out of memory")
    mock.fail_with = cause
    with pytest.raises(AllocationError) as info:
        mock.allocate(4096, 1)
    assert str(info.value) == "allocation of 4096 bytes on mockdev:1 failed: out of memory"
    assert info.value.__cause__ is cause


@pytest.mark.parametrize(
    "bad, why",
    [
        (torch.empty(64, dtype=torch.float32), "float32"),
        (torch.empty(63, dtype=torch.uint8), "63 bytes"),
        (torch.empty(8, 8, dtype=torch.uint8), "shape"),
        (bytearray(64), "bytearray"),
    ],
)
def test_allocate_rejects_a_backend_result_that_breaks_the_contract(mock, bad, why):
    mock.bad_result = bad
    with pytest.raises(AllocationError, match=why):
        mock.allocate(64, 0, alignment=1)
    if isinstance(bad, torch.Tensor):  # handed back so nothing leaks
        assert len(mock.calls_named("deallocate")) == 1


def test_allocate_rejects_misaligned_memory(mock):
    base = allocate_aligned(200, 256)
    mock.bad_result = base[1:101]
    with pytest.raises(AllocationError, match="not aligned to 256"):
        mock.allocate(100, 0, alignment=256)


def test_allocate_zero_bytes(mock):
    mem = mock.allocate(0, 0)
    assert mem.numel() == 0 and mem.dtype == torch.uint8


def test_copies_forward_exactly_nbytes_and_move_the_data(mock):
    host = random_bytes(100)
    dev = mock.allocate(128, 2)
    mock.copy_host_to_device(dev, host, 100, 2)
    assert torch.equal(dev[:100], host)
    back = torch.zeros(100, dtype=torch.uint8)
    mock.copy_device_to_host(back, dev, 60, 2)
    assert torch.equal(back[:60], host[:60])
    assert torch.all(back[60:] == 0)
    assert mock.calls_named("h2d") == [("h2d", 100, 100, 100, 2)]
    assert mock.calls_named("d2h") == [("d2h", 60, 60, 60, 2)]


def test_copies_accept_contiguous_tensors_of_any_dtype(mock):
    src = torch.randn(4, 5)
    dev = mock.allocate(80, 0)
    mock.copy_host_to_device(dev, src, 80, 0)
    assert torch.equal(dev.view(torch.float32).view(4, 5), src)


def test_zero_byte_copies_do_not_reach_the_backend(mock):
    dev = mock.allocate(16, 0)
    mock.copy_host_to_device(dev, random_bytes(16), 0, 0)
    mock.copy_device_to_host(random_bytes(16), dev, 0, 0)
    assert mock.calls_named("h2d") == [] and mock.calls_named("d2h") == []


def test_copy_larger_than_either_side_is_rejected_without_backend_call(mock):
    dev = mock.allocate(16, 0)
    with pytest.raises(ValueError, match=r"17 bytes.*dst has 16 bytes, src has 32 bytes"):
        mock.copy_host_to_device(dev, random_bytes(32), 17, 0)
    with pytest.raises(ValueError, match=r"dst has 32 bytes, src has 16 bytes"):
        mock.copy_device_to_host(random_bytes(32), dev, 20, 0)
    assert mock.calls_named("h2d") == [] and mock.calls_named("d2h") == []


def test_copy_rejects_non_contiguous_and_bad_arguments(mock):
    dev = mock.allocate(64, 0)
    with pytest.raises(ValueError, match="contiguous"):
        mock.copy_host_to_device(dev, torch.randn(4, 4).t(), 64, 0)
    with pytest.raises(TypeError):
        mock.copy_host_to_device(dev, bytearray(64), 64, 0)
    with pytest.raises(ValueError):
        mock.copy_host_to_device(dev, random_bytes(64), -1, 0)
    with pytest.raises(ValueError):
        mock.copy_host_to_device(dev, random_bytes(64), 8, -1)
    assert mock.calls_named("h2d") == []


def test_copy_errors_name_direction_bytes_and_device(mock):
    dev = mock.allocate(16, 1)
    mock.fail_with = RuntimeError("bus error")
    with pytest.raises(DeviceError) as info:
        mock.copy_host_to_device(dev, random_bytes(16), 16, 1)
    assert str(info.value) == "host-to-device copy of 16 bytes to mockdev:1 failed: bus error"
    assert isinstance(info.value.__cause__, RuntimeError)
    mock.fail_with = RuntimeError("bus error")
    with pytest.raises(DeviceError, match="device-to-host copy of 8 bytes from mockdev:1 failed: bus error"):
        mock.copy_device_to_host(random_bytes(16), dev, 8, 1)


def test_device_to_device_is_optional(mock):
    assert not mock.supports_device_to_device
    dev = mock.allocate(16, 0)
    with pytest.raises(DeviceError, match="mockdev does not support device-to-device copies"):
        mock.copy_device_to_device(dev, dev.clone(), 16, 1, 0)


def test_deallocate_errors_are_device_errors(mock):
    mem = mock.allocate(32, 0)
    mock.fail_with = RuntimeError("invalid pointer")
    with pytest.raises(DeviceError, match="deallocation of 32 bytes on mockdev:0 failed: invalid pointer"):
        mock.deallocate(mem, 0)
    with pytest.raises(TypeError):
        mock.deallocate("not memory", 0)


def test_default_device_index_of_is_none(mock):
    mem = mock.allocate(32, 0)
    assert mock.device_index_of(mem) is None


def test_missing_hooks_surface_as_allocation_errors():
    class Bare(DeviceAllocator):
        device_type = "bare"

    with pytest.raises(AllocationError, match="does not implement _allocate"):
        Bare().allocate(8, 0)


def test_normalize_index_hook_can_accept_minus_one():
    class Current(RecordingAllocator):
        def _normalize_index(self, index):
            return 5 if index == -1 else super()._normalize_index(index)

    a = Current("current-dev")
    a.allocate(8, -1)
    assert a.calls == [("allocate", 8, 5, 128)]


# ---------------------------------------------------------------------------------------
# DeviceMemoryBuffer


def test_buffer_allocates_once_and_frees_once_with_the_same_memory(mock):
    buf = DeviceMemoryBuffer.create(300, Device("mockdev", 1))
    assert mock.calls == [("allocate", 300, 1, 128)]
    assert buf.nbytes == 300 and buf.device == Device("mockdev", 1) and not buf.closed
    ptr = buf.memory.data_ptr()
    buf.close()
    buf.close()
    assert buf.closed
    assert mock.calls_named("deallocate") == [("deallocate", ptr, 300, 1)]
    with pytest.raises(ValueError, match="closed"):
        _ = buf.memory


def test_buffer_context_manager_frees_once(mock):
    with DeviceMemoryBuffer.create(64, "mockdev:0") as buf:
        ptr = buf.memory.data_ptr()
        assert mock.calls_named("deallocate") == []
    assert mock.calls_named("deallocate") == [("deallocate", ptr, 64, 0)]
    buf.close()
    assert len(mock.calls_named("deallocate")) == 1


def test_buffer_context_manager_frees_on_exception(mock):
    with pytest.raises(KeyError):
        with DeviceMemoryBuffer.create(64, "mockdev:0"):
            raise KeyError("boom")
    assert len(mock.calls_named("deallocate")) == 1


def test_buffer_is_freed_once_by_garbage_collection(mock):
    buf = DeviceMemoryBuffer.create(48, Device("mockdev", 2))
    ptr = buf.memory.data_ptr()
    del buf
    gc.collect()
    assert mock.calls_named("deallocate") == [("deallocate", ptr, 48, 2)]
    gc.collect()
    assert len(mock.calls_named("deallocate")) == 1


def test_buffer_frees_through_its_own_allocator_after_unregistration(mock):
    buf = DeviceMemoryBuffer.create(16, Device("mockdev", 0))
    unregister_allocator("mockdev")
    buf.close()
    assert len(mock.calls_named("deallocate")) == 1


def test_buffer_for_unregistered_type_says_how_to_register():
    with pytest.raises(DeviceError) as info:
        DeviceMemoryBuffer.create(64, Device("ghost", 0))
    msg = str(info.value)
    assert "'ghost'" in msg
    assert "register one with ferry.runtime.register_allocator(...)" in msg


def test_buffer_alignment_is_forwarded_and_respected(mock):
    buf = DeviceMemoryBuffer.create(100, Device("mockdev", 0), alignment=512)
    assert mock.calls == [("allocate", 100, 0, 512)]
    assert buf.memory.data_ptr() % 512 == 0
    assert buf.alignment == 512
    buf.close()


@pytest.mark.parametrize("alignment", [0, 3, 100, -8])
def test_buffer_invalid_alignment_is_rejected(mock, alignment):
    with pytest.raises(ValueError, match="power of two"):
        DeviceMemoryBuffer.create(100, Device("mockdev", 0), alignment=alignment)
    assert mock.calls == []


def test_buffer_allocation_failure_carries_size_and_device(mock):
    mock.fail_with = MemoryError("device is full")
    with pytest.raises(AllocationError) as info:
        DeviceMemoryBuffer.create(4096, Device("mockdev", 1))
    assert "4096 bytes" in str(info.value)
    assert "mockdev:1" in str(info.value)
    assert "device is full" in str(info.value)
    assert mock.calls_named("deallocate") == []


@pytest.mark.parametrize("alignment", [None, 1, 64, 4096])
def test_host_buffer_is_aligned_plain_memory(alignment):
    buf = DeviceMemoryBuffer.create(1000, Device("cpu"), alignment=alignment)
    mem = buf.memory
    assert mem.device.type == "cpu" and mem.dtype == torch.uint8 and mem.shape == (1000,)
    assert mem.data_ptr() % (alignment or default_alignment("cpu")) == 0
    data = random_bytes(1000)
    mem.copy_(data)  # usable memory
    assert torch.equal(buf.memory, data)
    buf.close()
    assert buf.closed


def test_host_buffer_pin_memory_is_ignored_without_cuda():
    buf = DeviceMemoryBuffer.create(64, "cpu", pin_memory=True)
    assert buf.pinned == torch.cuda.is_available()
    assert buf.memory.is_pinned() == torch.cuda.is_available()


def test_host_buffer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="power of two"):
        DeviceMemoryBuffer.create(64, "cpu", alignment=48)
    with pytest.raises(ValueError):
        DeviceMemoryBuffer.create(-1, "cpu")


def test_zero_byte_buffers(mock):
    with DeviceMemoryBuffer.create(0, "cpu") as host:
        assert host.nbytes == 0 and host.memory.numel() == 0
    with DeviceMemoryBuffer.create(0, "mockdev:0") as dev:
        assert dev.memory.numel() == 0
    assert len(mock.calls_named("allocate")) == 1
    assert len(mock.calls_named("deallocate")) == 1

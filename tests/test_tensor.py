"""device_of, make_tensor and clone_to over the emulated device."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.device import CPU, Device
from ferry.errors import AllocationError, DeviceError
from ferry.runtime.devices.allocator import DeviceMemoryBuffer
from ferry.runtime.devices.emulated import AllocationRecord, CopyRecord, emulated_device
from ferry.runtime.devices.tensor import buffer_of, clone_to, device_of, make_tensor

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
SHAPES = [(), (0, 3), (10_000,), (2, 3, 4)]



def random_tensor(shape, dtype):
    """Fresh random values (never all zeros for more than a handful of elements)."""
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape) * 100).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype)


def nbytes_of(t):
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------
# device_of


def test_device_of_plain_cpu_tensor_is_cpu(emu):
    assert device_of(torch.randn(3)) == CPU


def test_device_of_emulated_memory(emu):
    with DeviceMemoryBuffer.create(64, "emu:1") as buf:
        t = make_tensor(buf.memory, (4, 4), torch.float32, "emu:1")
        assert device_of(t) == Device("emu", 1)
        assert device_of(t[2:]) == Device("emu", 1)
        assert device_of(buf.memory) == Device("emu", 1)
    assert device_of(t) == CPU  # freed: no longer emulated memory


def test_device_of_forgets_memory_once_the_allocator_is_gone():
    with emulated_device() as emu:
        mem = emu.allocate(16, 0)
        assert device_of(mem) == Device("emu", 0)
    assert device_of(mem) == CPU


def test_device_of_rejects_non_tensors_and_unknown_torch_devices():
    with pytest.raises(TypeError):
        device_of([1, 2])
    with pytest.raises(ValueError, match="meta"):
        device_of(torch.empty(3, device="meta"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_of_cuda_tensor():  # pragma: no cover - GPU only
    n = torch.cuda.device_count()
    assert device_of(torch.empty(1, device=f"cuda:{n - 1}")) == Device("cuda", n - 1)


# ---------------------------------------------------------------------------------------
# make_tensor


def test_make_tensor_shares_memory(emu):
    with DeviceMemoryBuffer.create(256, "emu:0") as buf:
        t = make_tensor(buf.memory, (3, 5), torch.float32, Device("emu", 0), offset=16)
        assert t.shape == (3, 5) and t.dtype == torch.float32 and t.is_contiguous()
        assert t.data_ptr() == buf.memory.data_ptr() + 16
        values = torch.randn(3, 5)
        t.copy_(values)
        assert torch.equal(buf.memory[16 : 16 + 60].view(torch.float32).view(3, 5), values)
        buf.memory[16:20] = torch.tensor([1.5], dtype=torch.float32).view(torch.uint8)
        assert t[0, 0].item() == 1.5


def test_make_tensor_on_host_memory():
    with DeviceMemoryBuffer.create(40, "cpu") as buf:
        t = make_tensor(buf.memory, [5], torch.int64, "cpu")
        assert t.data_ptr() == buf.memory.data_ptr()
        assert device_of(t) == CPU


@pytest.mark.parametrize("shape", [(), (0, 3), (0,)])
def test_make_tensor_scalar_and_empty_shapes(emu, shape):
    with DeviceMemoryBuffer.create(8, "emu:0") as buf:
        t = make_tensor(buf.memory, shape, torch.float64, "emu:0")
        assert t.shape == shape
        assert device_of(t) == Device("emu", 0)  # empty ones remember the device they were made for
        if shape == ():
            t.fill_(2.25)
            assert buf.memory.view(torch.float64).item() == 2.25


def test_make_tensor_too_small_memory_names_the_numbers(emu):
    with DeviceMemoryBuffer.create(64, "emu:0") as buf:
        with pytest.raises(ValueError) as info:
            make_tensor(buf.memory, (4, 4), torch.float32, "emu:0", offset=8)
        msg = str(info.value)
        assert "64 bytes at offset 8" in msg and "through byte 72" in msg and "only 64 bytes" in msg
        make_tensor(buf.memory, (4, 4), torch.float32, "emu:0")  # fits exactly at offset 0


def test_make_tensor_misaligned_offset(emu):
    with DeviceMemoryBuffer.create(64, "emu:0") as buf:
        with pytest.raises(ValueError, match=r"offset 6 is not a multiple of the torch.float32 element size \(4 bytes\)"):
            make_tensor(buf.memory, (2,), torch.float32, "emu:0", offset=6)
        assert make_tensor(buf.memory, (2,), torch.int16, "emu:0", offset=6).data_ptr() == buf.memory.data_ptr() + 6


def test_make_tensor_checks_the_device(emu):
    with DeviceMemoryBuffer.create(16, "emu:1") as buf:
        with pytest.raises(ValueError, match="lives on emu:1, not on emu:0"):
            make_tensor(buf.memory, (4,), torch.float32, "emu:0")
        with pytest.raises(ValueError, match="lives on emu:1, not on cpu:0"):
            make_tensor(buf.memory, (4,), torch.float32, "cpu")
    with pytest.raises(ValueError, match="lives on cpu:0, not on emu:0"):
        make_tensor(torch.zeros(16, dtype=torch.uint8), (4,), torch.float32, "emu:0")


@pytest.mark.parametrize(
    "memory, shape, dtype, offset, exc",
    [
        (torch.zeros(16), (4,), torch.float32, 0, ValueError),  # not uint8
        (torch.zeros(4, 4, dtype=torch.uint8), (4,), torch.float32, 0, ValueError),  # not 1-D
        (torch.zeros(16, dtype=torch.uint8), (-1,), torch.float32, 0, ValueError),
        (torch.zeros(16, dtype=torch.uint8), (4,), torch.float32, -4, ValueError),
        (torch.zeros(16, dtype=torch.uint8), (4,), "float32", 0, TypeError),
        (b"0123456789abcdef", (4,), torch.float32, 0, TypeError),
    ],
)
def test_make_tensor_rejects_bad_arguments(memory, shape, dtype, offset, exc):
    with pytest.raises(exc):
        make_tensor(memory, shape, dtype, "cpu", offset)


# ---------------------------------------------------------------------------------------
# clone_to


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clone_round_trip_counts_every_call(emu, dtype, shape):
    x = random_tensor(shape, dtype)
    n = nbytes_of(x)

    on_dev = clone_to(x, "emu:0")
    assert device_of(on_dev) == Device("emu", 0)
    assert on_dev.shape == x.shape and on_dev.dtype == dtype
    assert torch.equal(on_dev, x)
    assert emu.allocations == 1 and emu.allocated[0].nbytes == n and emu.allocated[0].index == 0
    assert emu.copies == ([CopyRecord("h2d", n, 0)] if n else [])

    back = clone_to(on_dev, "cpu")
    assert device_of(back) == CPU
    assert torch.equal(back, x)
    assert back.data_ptr() != x.data_ptr() or n == 0
    assert emu.allocations == 1  # the host copy does not touch the device allocator
    assert emu.copies == ([CopyRecord("h2d", n, 0), CopyRecord("d2h", n, 0)] if n else [])


def test_clone_large_tensor_values_survive(emu):
    x = torch.randn(10_000)
    y = clone_to(clone_to(x, "emu:1"), "cpu")
    assert torch.equal(y, x)
    assert emu.copy_bytes == {"h2d": 40_000, "d2h": 40_000, "d2d": 0}


def test_clone_to_second_device_uses_its_index(emu):
    x = random_tensor((7, 3), torch.float32)
    y = clone_to(x, Device("emu", 1))
    assert device_of(y) == Device("emu", 1)
    assert emu.allocated == [AllocationRecord(84, 1, 256, y.data_ptr())]
    assert emu.copies == [CopyRecord("h2d", 84, 1)]
    z = clone_to(y, "cpu")
    assert emu.copies[-1] == CopyRecord("d2h", 84, 1)  # source index for d2h
    assert torch.equal(z, x)


def test_device_to_device_is_one_direct_copy(emu):
    x = random_tensor((5, 5), torch.int32)
    a = clone_to(x, "emu:0")
    emu.reset_counters()
    b = clone_to(a, "emu:1")
    assert device_of(b) == Device("emu", 1)
    assert emu.allocations == 1 and emu.allocated[0].index == 1
    assert emu.copies == [CopyRecord("d2d", 100, 1, 0)]
    assert torch.equal(b, x)


def test_clone_between_device_types_goes_through_host(emu):
    x = random_tensor((3, 3), torch.float16)
    a = clone_to(x, "emu:1")
    with emulated_device("emb") as emb:
        b = clone_to(a, "emb:0")
        assert device_of(b) == Device("emb", 0)
        assert torch.equal(b, x)
        assert emb.copies == [CopyRecord("h2d", 18, 0)]
        assert emu.copies[-1] == CopyRecord("d2h", 18, 1)
        del b
        gc.collect()
        assert emb.deallocations == 1


@pytest.mark.parametrize("target", ["cpu", "emu:0"])
def test_same_device_clone_is_refused(emu, target):
    x = random_tensor((4,), torch.float32)
    if target != "cpu":
        x = clone_to(x, target)
        emu.reset_counters()
    with pytest.raises(ValueError, match=r"already on .*use tensor.clone\(\)"):
        clone_to(x, target)
    assert emu.allocations == 0 and emu.copies == []


def test_clone_result_owns_its_memory_and_frees_it_once(emu):
    x = random_tensor((6, 4), torch.float32)
    y = clone_to(x, "emu:0")
    buf = buffer_of(y)
    assert isinstance(buf, DeviceMemoryBuffer) and buf.device == Device("emu", 0)
    ptr = y.data_ptr()
    del buf
    del y
    gc.collect()
    assert emu.freed == [AllocationRecord(96, 0, 256, ptr)]
    assert emu.live_bytes == 0
    gc.collect()
    assert emu.deallocations == 1


def test_views_of_a_clone_keep_its_memory_alive(emu):
    x = random_tensor((6, 4), torch.float32)
    y = clone_to(x, "emu:0")
    row = y[2]
    flat = y.view(-1)
    del y
    gc.collect()
    assert emu.deallocations == 0
    assert device_of(row) == Device("emu", 0)
    assert torch.equal(row, x[2])
    del row, flat
    gc.collect()
    assert emu.deallocations == 1 and emu.live_bytes == 0


def test_two_clones_make_two_allocations(emu):
    x = random_tensor((8,), torch.int64)
    a, b = clone_to(x, "emu:0"), clone_to(x, "emu:0")
    assert emu.allocations == 2 and a.data_ptr() != b.data_ptr()
    assert emu.copies == [CopyRecord("h2d", 64, 0)] * 2
    b.add_(1)
    assert torch.equal(a, x) and torch.equal(b, x + 1)


def test_clone_does_not_alias_its_source(emu):
    x = random_tensor((16,), torch.float32)
    y = clone_to(x, "emu:0")
    keep = x.clone()
    x.mul_(3).add_(1)
    assert torch.equal(y, keep)


def test_non_contiguous_input_is_made_contiguous(emu):
    x = random_tensor((4, 6), torch.float32)
    y = clone_to(x.t(), "emu:0")
    assert y.is_contiguous() and y.shape == (6, 4)
    assert torch.equal(y, x.t())
    assert emu.copies == [CopyRecord("h2d", 96, 0)]


def test_non_contiguous_device_input_is_staged_on_its_device(emu):
    x = random_tensor((4, 6), torch.float64)
    d = clone_to(x, "emu:1")
    emu.reset_counters()
    back = clone_to(d[:, ::2], "cpu")
    assert torch.equal(back, x[:, ::2])
    # a staging buffer on emu:1 for the contiguous copy, then one d2h of exactly 12 doubles
    assert emu.allocations == 1 and emu.allocated[0].index == 1 and emu.deallocations == 1
    assert emu.copies == [CopyRecord("d2h", 96, 1)]


def test_conjugate_views_are_resolved(emu):
    x = random_tensor((5,), torch.complex64)
    y = clone_to(x.conj(), "emu:0")
    assert torch.equal(y, x.conj().resolve_conj())
    assert not y.is_conj()


def test_zero_byte_tensor_makes_no_copy(emu):
    x = torch.empty(0, 3)
    y = clone_to(x, "emu:1")
    assert y.shape == (0, 3)
    assert emu.copies == [] and emu.allocations == 1
    del y
    gc.collect()
    assert emu.deallocations == 1


def test_clone_to_unregistered_device():
    with pytest.raises(ValueError, match="unknown device type"):
        clone_to(torch.randn(3), "ghost:0")
    with pytest.raises(DeviceError, match="register one with ferry.runtime.register_allocator"):
        clone_to(torch.randn(3), Device("ghost", 0))


def test_clone_allocation_failure_propagates(emu):
    emu.fail_allocation()
    with pytest.raises(AllocationError, match="allocation of 12 bytes on emu:0 failed"):
        clone_to(random_tensor((3,), torch.float32), "emu:0")
    assert emu.live_bytes == 0 and emu.copies == []


def test_clone_copy_failure_frees_the_new_buffer(emu):
    emu.fail_copy()
    with pytest.raises(DeviceError, match="host-to-device copy of 20 bytes to emu:1 failed"):
        clone_to(random_tensor((5,), torch.int32), "emu:1")
    gc.collect()
    assert emu.allocations == 1 and emu.deallocations == 1 and emu.live_bytes == 0


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    dtype=st.sampled_from(DTYPES),
    index=st.integers(0, 1),
)
def test_round_trip_property(shape, dtype, index):
    with emulated_device(num_devices=2) as emu:
        x = random_tensor(tuple(shape), dtype)
        n = nbytes_of(x)
        y = clone_to(clone_to(x, Device("emu", index)), "cpu")
        assert torch.equal(y, x) and y.shape == x.shape and y.dtype == x.dtype
        assert emu.copy_summary()["h2d"] == ((1, n) if n else (0, 0))
        assert emu.copy_summary()["d2h"] == ((1, n) if n else (0, 0))
        gc.collect()
        assert emu.live_bytes == 0 and emu.allocations == emu.deallocations == 1


@pytest.mark.parametrize("perm", [(0, 1, 2), (0, 2, 1), (2, 0, 1), (1, 2, 0)])
def test_dense_strides_carry_a_layout_to_another_size(perm):
    """A value's permuted layout, carried to other sizes (a micro-batch's rows), is eager's there."""
    from ferry.layout import dense_strides_like

    like = torch.empty(2, 5, 6).permute(*perm)
    eager = torch.empty(7, 5, 6).permute(*perm)
    assert dense_strides_like(eager.shape, like.stride()) == eager.stride()

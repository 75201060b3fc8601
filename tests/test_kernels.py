"""The et_copy run-time kernels (ferry.runtime.stages.kernels.CopyKernel), on the emulated device.

Mirrors the reference's portable-kernel tests (REFERENCE-BEHAVIORS H, I): one allocator call of
exactly the tensor's bytes, device index from the device side, resize within the planned
capacity, and every check made before the allocator is called.
"""

from __future__ import annotations

import pytest
import torch

from ferry.device import CPU, Device
from ferry.errors import DeviceError, FerryError, InputError
from ferry.runtime import emulated_device
from ferry.runtime.devices.emulated import CopyRecord
from ferry.runtime.devices.tensor import device_of, make_tensor
from ferry.runtime.stages.kernels import CopyKernel

EMU0, EMU1 = Device("emu", 0), Device("emu", 1)



def dev_tensor(emu, shape, dtype=torch.float32, index=0, values=None):
    """A tensor in emulated device memory (allocated directly, so no copy is counted)."""
    nbytes = 1
    for s in shape:
        nbytes *= s
    nbytes *= dtype.itemsize
    t = make_tensor(emu.allocate(nbytes, index), shape, dtype, Device("emu", index))
    if values is not None:
        t.copy_(values)  # host-backed memory: a plain write, not an allocator copy
    return t


def host_random(*shape):
    return torch.randn(*shape)


# ---------------------------------------------------------------------------------------
# one allocator call of exactly the tensor's bytes


@pytest.mark.parametrize("direction, src_dev, dst_dev, shape, record", [
    pytest.param("h2d", CPU, EMU0, (4,), CopyRecord("h2d", 16, 0), id="h2d-one-copy-of-16-bytes-to-index-0"),
    pytest.param("h2d", CPU, EMU0, (2, 3), CopyRecord("h2d", 24, 0), id="h2d-2x3-is-24-bytes"),
    pytest.param("d2h", EMU0, CPU, (4,), CopyRecord("d2h", 16, 0), id="d2h-mirror-one-copy-from-source-index"),
    pytest.param("h2d", CPU, EMU1, (4,), CopyRecord("h2d", 16, 1), id="h2d-index-comes-from-the-destination"),
    pytest.param("d2h", EMU1, CPU, (2, 2), CopyRecord("d2h", 16, 1), id="d2h-index-comes-from-the-source"),
    pytest.param("d2d", EMU0, EMU1, (3, 2), CopyRecord("d2d", 24, 1, src_index=0), id="d2d-is-one-device-to-device-copy"),
])
def test_one_allocator_copy_of_exactly_the_tensors_bytes(emu, direction, src_dev, dst_dev, shape, record):
    """Random values copied by one allocator call of the tensor's bytes, to the device index of the
    device side (the destination's for h2d and d2d), into `out` itself, allocating nothing."""
    values = host_random(*shape)
    src = values if src_dev.is_cpu else dev_tensor(emu, shape, index=src_dev.index, values=values)
    out = torch.full(shape, float("nan")) if dst_dev.is_cpu else dev_tensor(emu, shape, index=dst_dev.index)
    emu.reset_counters()
    result = CopyKernel(direction, src_dev, dst_dev, record.nbytes)(src, out)
    assert result is out
    assert emu.copies == [record]
    assert emu.allocations == 0
    assert torch.equal(out, values)
    assert device_of(out) == dst_dev


@pytest.mark.parametrize("dtype", [torch.float16, torch.int32, torch.int64, torch.bool])
def test_h2d_other_dtypes_copy_their_bytes(emu, dtype):
    src = (torch.randn(5) * 10).to(dtype)
    out = dev_tensor(emu, (5,), dtype)
    emu.reset_counters()
    CopyKernel("h2d", CPU, EMU0, out.numel() * out.element_size())(src, out)
    assert emu.copies == [CopyRecord("h2d", 5 * dtype.itemsize, 0)]
    assert torch.equal(out, src)


def test_non_contiguous_host_source_is_copied_by_value(emu):
    src = host_random(3, 4).t()
    assert not src.is_contiguous()
    out = dev_tensor(emu, (4, 3))
    emu.reset_counters()
    CopyKernel("h2d", CPU, EMU0, 48)(src, out)
    assert emu.copies == [CopyRecord("h2d", 48, 0)]
    assert torch.equal(out, src)


# ---------------------------------------------------------------------------------------
# resizing within the planned capacity


def test_out_is_resized_down_within_planned_capacity(emu):
    src = host_random(4)
    out = dev_tensor(emu, (8,))
    ptr = out.data_ptr()
    emu.reset_counters()
    CopyKernel("h2d", CPU, EMU0, 32)(src, out)
    assert out.shape == (4,)
    assert out.data_ptr() == ptr  # still the planned memory
    assert emu.copies == [CopyRecord("h2d", 16, 0)]
    assert torch.equal(out, src)


def test_d2h_out_resized_down_within_capacity(emu):
    values = host_random(3)
    src = dev_tensor(emu, (3,), values=values)
    out = torch.zeros(8)
    emu.reset_counters()
    CopyKernel("d2h", EMU0, CPU, 32)(src, out)
    assert out.shape == (3,)
    assert emu.copies == [CopyRecord("d2h", 12, 0)]
    assert torch.equal(out, values)


def test_source_bigger_than_capacity_fails_before_any_allocator_call(emu):
    before = host_random(2)
    out = dev_tensor(emu, (2,), values=before)
    emu.reset_counters()
    with pytest.raises(InputError, match="16 bytes"):
        CopyKernel("h2d", CPU, EMU0, 8)(host_random(4), out)
    assert emu.copies == []
    assert out.shape == (2,)
    assert torch.equal(out, before)


def test_unplanned_out_never_grows(emu):
    """No planned capacity: `out` was made at its bound, so a bigger source is an error, with no copy."""
    before = host_random(4)
    out = dev_tensor(emu, (4,), values=before)
    ptr = out.data_ptr()
    emu.reset_counters()
    with pytest.raises(FerryError):
        CopyKernel("h2d", CPU, EMU0, None)(host_random(8), out)
    assert emu.copies == []
    assert out.shape == (4,) and out.data_ptr() == ptr
    assert torch.equal(out, before)


def test_zero_byte_copy_makes_no_allocator_call(emu):
    src = torch.empty(0, 3)
    out = dev_tensor(emu, (0, 3))
    emu.reset_counters()
    assert CopyKernel("h2d", CPU, EMU0, 0)(src, out) is out
    assert emu.copies == [] and emu.copy_counts["h2d"] == 0


def test_zero_element_source_resizes_out_without_a_copy(emu):
    out = dev_tensor(emu, (8,))
    emu.reset_counters()
    CopyKernel("h2d", CPU, EMU0, 32)(torch.empty(0), out)
    assert out.shape == (0,)
    assert emu.copies == []


# ---------------------------------------------------------------------------------------
# checks


@pytest.mark.parametrize(
    "direction, src, dst",
    [
        ("h2d", CPU, CPU),  # h2d needs a device destination
        ("h2d", EMU0, EMU1),  # ... and a host source
        ("d2h", CPU, CPU),
        ("d2h", EMU0, EMU1),
        ("d2d", EMU0, EMU0),  # same device: nothing to move
        ("d2d", CPU, EMU0),
        ("d2d", EMU0, CPU),
    ],
)
def test_wrong_direction_is_a_device_error(emu, direction, src, dst):
    with pytest.raises(DeviceError, match=f"_{direction}_copy"):
        CopyKernel(direction, src, dst, None)
    assert emu.copies == []


@pytest.mark.parametrize("direction, src, dst", [("h2d", CPU, Device("npu", 0)), ("d2h", Device("npu", 1), CPU)])
def test_missing_allocator_is_a_device_error_naming_the_type(emu, direction, src, dst):
    with pytest.raises(DeviceError, match="'npu'"):
        CopyKernel(direction, src, dst, None)


def test_missing_allocator_after_unregistering():
    with emulated_device() as emu:
        pass
    with pytest.raises(DeviceError, match="'emu'"):
        CopyKernel("h2d", CPU, EMU0, None)
    assert emu.copies == []


def test_d2d_between_device_types_is_refused():
    with emulated_device("emu") as a, emulated_device("emx") as b:
        with pytest.raises(DeviceError):
            CopyKernel("d2d", Device("emu", 0), Device("emx", 0), None)
        assert a.copies == [] and b.copies == []


def test_dtype_mismatch_is_an_error_before_any_allocator_call(emu):
    out = dev_tensor(emu, (4,), torch.float32)
    emu.reset_counters()
    with pytest.raises(FerryError, match="dtype"):
        CopyKernel("h2d", CPU, EMU0, 16)(torch.arange(4, dtype=torch.int32), out)
    with pytest.raises(FerryError, match="dtype"):
        CopyKernel("d2h", EMU0, CPU, 16)(out, torch.zeros(4, dtype=torch.float64))
    assert emu.copies == []


def test_non_contiguous_device_source_is_refused_without_allocating(emu):
    src = dev_tensor(emu, (3, 4), values=host_random(3, 4)).t()
    emu.reset_counters()
    with pytest.raises(FerryError, match="strides .* would allocate device memory"):
        CopyKernel("d2h", EMU0, CPU, 48)(src, torch.zeros(4, 3))
    assert emu.copies == [] and emu.allocations == 0


def test_copy_failure_is_a_device_error_with_the_size(emu):
    out = dev_tensor(emu, (4,))
    kernel = CopyKernel("h2d", CPU, EMU0, 16)
    emu.reset_counters()
    emu.fail_copy(1)
    with pytest.raises(DeviceError, match="16 bytes"):
        kernel(host_random(4), out)
    src = host_random(4)
    kernel(src, out)  # the kernel works again once the failure is gone
    assert torch.equal(out, src)
    assert emu.copies == [CopyRecord("h2d", 16, 0)]


def test_kernel_reuse_moves_fresh_data_each_call(emu):
    """A kernel is bound once at load and called per execution."""
    out = dev_tensor(emu, (6,))
    back = torch.zeros(6)
    up, down = CopyKernel("h2d", CPU, EMU0, 24), CopyKernel("d2h", EMU0, CPU, 24)
    emu.reset_counters()
    for _ in range(3):
        src = host_random(6)
        up(src, out)
        down(out, back)
        assert torch.equal(back, src)
    assert emu.copy_summary() == {"h2d": (3, 72), "d2h": (3, 72), "d2d": (0, 0)}
    assert emu.allocations == 0


def test_a_fast_path_is_checked_once_per_op_and_argument_metadata(monkeypatch):
    """Binding a model's identical layers, or a dynamic method at each new shape, asks the meta
    check once per signature; other shapes or expectations are checked again."""
    from ferry.runtime.stages import kernels

    cache: dict = {}
    monkeypatch.setattr(kernels, "_FAST_CHECKED", cache)
    op = torch.ops.aten.relu.default
    meta = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    fns = [kernels.fast_functional(op, [meta(2, 3)], {}, [((2, 3), torch.float32)]) for _ in range(3)]
    assert fns[0] is torch._C._VariableFunctions.relu and len(set(map(id, fns))) == 1 and len(cache) == 1
    assert kernels.fast_functional(op, [meta(4, 3)], {}, [((4, 3), torch.float32)]) is not None and len(cache) == 2
    assert kernels.fast_functional(op, [meta(4, 3)], {}, [((5, 3), torch.float32)]) is None  # wrong expectation
    assert len(cache) == 3

"""ferry.Device: parsing, printing, hashing, immutability."""

from __future__ import annotations

import dataclasses

import pytest

from ferry import Device
from ferry.device import CPU, known_device_types
from ferry.runtime import emulated_device


@pytest.mark.parametrize(
    "text, expected",
    [
        ("cuda:1", Device("cuda", 1)),
        ("cuda:0", Device("cuda", 0)),
        ("CUDA:0", Device("cuda", 0)),
        ("Cuda:2", Device("cuda", 2)),
        (" cuda ", Device("cuda", 0)),
        ("cuda", Device("cuda", 0)),
        ("cpu", Device("cpu", 0)),
        ("CPU", Device("cpu", 0)),
        ("\tcuda:3\n", Device("cuda", 3)),
        ("cuda:12", Device("cuda", 12)),
    ],
)
def test_parse(text, expected):
    d = Device.parse(text)
    assert d == expected
    assert (d.type, d.index) == (expected.type, expected.index)


def test_parse_cpu_has_index_zero():
    assert Device.parse("cpu").index == 0
    assert Device.parse("cpu") == CPU
    assert Device.parse("cpu").is_cpu and not Device.parse("cuda:0").is_cpu


def test_parse_accepts_a_device():
    d = Device("cuda", 1)
    assert Device.parse(d) is d


def test_unknown_type_lists_known_types():
    with pytest.raises(ValueError) as e:
        Device.parse("tpu:0")
    msg = str(e.value)
    assert "tpu" in msg
    assert "cpu" in msg and "cuda" in msg


@pytest.mark.parametrize("text", ["cuda:x", "cuda:1.5", "cuda:", "cuda:-1", "cpu:-3", "cuda:1:2", "cuda: one"])
def test_bad_index(text):
    with pytest.raises(ValueError):
        Device.parse(text)


@pytest.mark.parametrize("text", ["", "   ", ":0"])
def test_empty_type(text):
    with pytest.raises(ValueError):
        Device.parse(text)


def test_not_a_string():
    with pytest.raises(ValueError):
        Device.parse(0)


def test_constructor_rejects_negative_and_non_int_index():
    with pytest.raises(ValueError):
        Device("cuda", -1)
    with pytest.raises(ValueError):
        Device("cuda", "1")
    with pytest.raises(ValueError):
        Device("cuda", True)
    with pytest.raises(ValueError):
        Device("", 0)


def test_str():
    assert str(Device("cuda", 1)) == "cuda:1"
    assert str(Device.parse("cpu")) == "cpu:0"
    assert str(Device.parse(" CUDA:2 ")) == "cuda:2"


@pytest.mark.parametrize("text", ["cpu", "cuda:0", "cuda:7"])
def test_str_round_trips(text):
    d = Device.parse(text)
    assert Device.parse(str(d)) == d


def test_hashable_and_equal_by_value():
    a, b, c = Device.parse("cuda:1"), Device("cuda", 1), Device("cuda", 0)
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c, CPU}) == 3
    assert {a: "x"}[b] == "x"


def test_immutable():
    d = Device("cuda", 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.index = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.type = "cpu"
    assert d == Device("cuda", 0)


def test_to_torch_at_the_edge():
    import torch

    assert Device.parse("cuda:1").to_torch() == torch.device("cuda", 1)
    assert CPU.to_torch() == torch.device("cpu")


def test_registered_allocator_makes_a_type_known():
    with pytest.raises(ValueError):
        Device.parse("emu:0")
    with emulated_device():
        assert "emu" in known_device_types()
        assert Device.parse("EMU:1") == Device("emu", 1)
        assert Device.parse("emu").to_torch().type == "cpu"  # emulated memory is host memory
    with pytest.raises(ValueError) as e:
        Device.parse("emu:0")
    assert "emu" not in known_device_types()
    assert "cuda" in str(e.value)

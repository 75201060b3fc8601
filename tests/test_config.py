"""CompileConfig / PropagateDeviceConfig: bools or per-method dicts, and what compile does with them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ferry
from ferry import CompileConfig, CompileError, OpSupportPartitioner, PropagateDeviceConfig
from ferry.node_meta import get_device
from models import Add, AddChain, count_copies, export, fresh_inputs, small


@pytest.fixture(scope="module")
def eps():
    return {"prefill": export(Add(), small()), "decode": export(AddChain(), small())}


PART = OpSupportPartitioner("cuda:0")


def counts(program, method):
    r = ferry.copy_report(program, method)
    return r.count("h2d"), r.count("d2h"), r.count("d2d")


def test_defaults():
    pd = PropagateDeviceConfig()
    assert pd.for_method("forward") == (False, False)
    c = CompileConfig()
    assert c.enable_non_cpu_memory_planning is True
    assert c.propagate_for("anything") == PropagateDeviceConfig()


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PropagateDeviceConfig().skip_h2d_for_method_inputs = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        CompileConfig().enable_non_cpu_memory_planning = False


def test_bool_flags_apply_to_every_method():
    pd = PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=False)
    assert pd.for_method("prefill") == (True, False)
    assert pd.for_method("decode") == (True, False)


def test_dict_flags_per_method_missing_is_false():
    pd = PropagateDeviceConfig(skip_h2d_for_method_inputs={"decode": True, "prefill": False},
                               skip_d2h_for_method_outputs={"prefill": True})
    assert pd.for_method("decode") == (True, False)
    assert pd.for_method("prefill") == (False, True)
    assert pd.for_method("other") == (False, False)


def test_propagate_device_dict_missing_method_gets_defaults():
    special = PropagateDeviceConfig(True, True)
    c = CompileConfig(propagate_device={"decode": special})
    assert c.propagate_for("decode") is special
    assert c.propagate_for("prefill") == PropagateDeviceConfig()


@pytest.mark.parametrize("value", [{"forward": 1}, {"forward": "yes"}, {"forward": None}, {"forward": {"x": True}}])
def test_non_bool_in_a_dict_is_a_compile_error(value, eps):
    with pytest.raises(CompileError, match="skip_h2d_for_method_inputs"):
        PropagateDeviceConfig(skip_h2d_for_method_inputs=value).for_method("forward")
    with pytest.raises(CompileError):
        cfg = CompileConfig(propagate_device=PropagateDeviceConfig(skip_d2h_for_method_outputs=value))
        ferry.compile({"forward": eps["prefill"]}, PART, cfg)


@pytest.mark.parametrize("value", [1, "true", None, [True]])
def test_non_bool_flag_is_a_compile_error(value):
    with pytest.raises(CompileError):
        PropagateDeviceConfig(skip_d2h_for_method_outputs=value).for_method("forward")


def test_propagate_device_of_wrong_type_is_a_compile_error(eps):
    with pytest.raises(CompileError):
        CompileConfig(propagate_device={"prefill": {"skip_h2d_for_method_inputs": True}}).propagate_for("prefill")
    with pytest.raises(CompileError):
        CompileConfig(propagate_device=True).propagate_for("prefill")
    with pytest.raises(CompileError):
        ferry.compile(eps, PART, CompileConfig(propagate_device={"decode": True}))


def test_compile_two_methods_with_defaults(eps):
    program = ferry.compile(eps, PART)
    assert set(program.methods) == {"prefill", "decode"}
    assert counts(program, "prefill") == (2, 1, 0)
    assert counts(program, "decode") == (2, 1, 0)


def test_compile_with_per_method_flags(eps):
    cfg = CompileConfig(propagate_device=PropagateDeviceConfig(
        skip_h2d_for_method_inputs={"decode": True},
        skip_d2h_for_method_outputs={"prefill": True},
    ))
    program = ferry.compile(eps, PART, cfg)
    assert counts(program, "prefill") == (2, 0, 0)
    assert counts(program, "decode") == (0, 1, 0)


def test_compile_with_per_method_configs(eps):
    cfg = CompileConfig(propagate_device={"decode": PropagateDeviceConfig(True, True)})
    program = ferry.compile(eps, PART, cfg)
    assert counts(program, "prefill") == (2, 1, 0)
    assert counts(program, "decode") == (0, 0, 0)
    reports = ferry.copy_report(program)
    assert set(reports) == {"prefill", "decode"}
    assert reports["decode"].rows == ()


def test_legacy_mode_has_no_copies(eps):
    program = ferry.compile(eps, PART, CompileConfig(enable_non_cpu_memory_planning=False))
    assert counts(program, "prefill") == (0, 0, 0)
    assert counts(program, "decode") == (0, 0, 0)


def test_skip_flag_with_legacy_mode_is_an_error(eps):
    cfg = CompileConfig(enable_non_cpu_memory_planning=False,
                        propagate_device=PropagateDeviceConfig(skip_h2d_for_method_inputs={"decode": True}))
    with pytest.raises(ValueError, match="enable_non_cpu_memory_planning"):
        ferry.compile(eps, PART, cfg)


def test_place_reads_the_method_name(eps):
    cfg = CompileConfig(propagate_device=PropagateDeviceConfig(skip_h2d_for_method_inputs={"decode": True}))
    lp_prefill = ferry.place(eps["decode"], PART, cfg, method="prefill")
    lp_decode = ferry.place(eps["decode"], PART, cfg, method="decode")
    assert count_copies(lp_prefill.graph_module)["h2d"] == 2
    assert count_copies(lp_decode.graph_module)["h2d"] == 0
    for p in lp_decode.placeholders():
        assert str(get_device(p)) == "cuda:0"
    x, y = fresh_inputs(small())
    torch.testing.assert_close(lp_decode(x, y), AddChain()(x, y))


def test_compile_rejects_bad_method_dicts(eps):
    with pytest.raises(CompileError):
        ferry.compile({}, PART)
    with pytest.raises(CompileError):
        ferry.compile({"not an identifier": eps["prefill"]}, PART)
    with pytest.raises(CompileError):
        ferry.compile({"forward": Add()}, PART)

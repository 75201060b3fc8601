"""The storage facts a program states, and the load stage that reads them: alignment in
real addresses, one slot per value, all-or-nothing allocation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import ferry
from ferry.errors import AllocationError, ProgramError
from ferry.program import TensorValue, validate_program
from ferry.program.footprint import call_bytes, load_bytes
from ferry.program.schema import upload_key
from ferry.runtime.devices import slab as slab_module
from ferry.runtime.devices.limits import allocated_by_load
from ferry.runtime.stages.load import load_memory
from models import Add, Owners, fresh_inputs, loaded_bytes, small, transformer_block
from test_load_slab import no_slab


def _planned(program, method="forward"):
    m = program.method(method)
    return [vid for vid, v in enumerate(m.values) if isinstance(v, TensorValue) and v.storage == "planned"]


@pytest.mark.parametrize("alloc", [True, False])
def test_emit_states_the_storage_of_every_tensor(alloc):
    cfg = ferry.CompileConfig(alloc_graph_input=alloc, alloc_graph_output=alloc)
    m = ferry.compile(torch.export.export(Owners(), small()), None, cfg).method("forward")
    outs = [m.tensor(v).storage for v in m.outputs]
    assert outs == ["planned" if alloc else "output", "view", "constant", "runtime"]
    assert [m.tensor(v).storage for v in m.inputs] == ["planned" if alloc else "input"] * 2
    for v in m.values:
        if isinstance(v, TensorValue):
            assert (v.storage == "planned") == (v.plan is not None)
            assert (v.storage == "view") == (v.alias_of is not None)


def test_device_inputs_and_outputs_are_caller_owned_and_unread_outputs_scratch():
    cfg = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(True, True))
    m = ferry.compile(torch.export.export(Add(), small()), ferry.OpSupportPartitioner("cuda:0"), cfg).method("forward")
    assert [m.tensor(v).storage for v in m.inputs] == ["input", "input"]
    assert [m.tensor(v).storage for v in m.outputs] == ["output"]
    class TopValues(nn.Module):
        def forward(self, x):
            return torch.topk(x, 2).values * 2  # topk.values writes indices nobody reads

    m = ferry.compile(torch.export.export(TopValues(), (torch.randn(4, 8),))).method("forward")
    assert "scratch" in {v.storage for v in m.values if isinstance(v, TensorValue)}  # the unread indices


@pytest.mark.parametrize("storage, change, message", [
    ("planned", dict(plan=None), "storage 'planned' needs a plan entry"),
    ("runtime", dict(storage="planned"), "storage 'planned' needs a plan entry"),
    ("planned", dict(storage="output"), "storage 'output' cannot have a plan entry"),
    ("constant", dict(storage="runtime"), "storage 'runtime' cannot have a constant segment"),
    ("view", dict(storage="planned", plan=None), "storage 'planned' needs a plan entry"),
    ("planned", dict(storage="input", plan=None), "storage 'input' but it is not a method input"),
])
def test_storage_that_contradicts_the_program_is_refused(storage, change, message):
    program = ferry.compile(torch.export.export(Owners(), small()))
    m = program.method("forward")
    vid = next(i for i, v in enumerate(m.values)
               if isinstance(v, TensorValue) and v.storage == storage and i not in m.inputs)
    m.values[vid] = dataclasses.replace(m.values[vid], **change)
    with pytest.raises(ProgramError, match=message):
        validate_program(program)


@pytest.mark.parametrize("alignment", [None, 512, 4096])
def test_planned_tensors_are_aligned_in_real_addresses(emu, alignment):
    """The planner aligns offsets within a buffer; the buffer is allocated at that alignment,
    so every planned tensor's address is aligned, not only its offset."""
    model, example = transformer_block()
    cfg = ferry.CompileConfig(alignment=alignment)
    program = ferry.compile(torch.export.export(model, example), ferry.OpSupportPartitioner("emu:0",
                            exclude=["aten.softmax"]), cfg)
    m = program.method("forward")
    want = {"cpu": 64, "emu": 256} if alignment is None else {"cpu": alignment, "emu": alignment}
    assert {b.device.type: b.alignment for b in m.buffers[1:]} == want
    mem = load_memory(program.segments, m)
    try:
        ptrs = [(m.tensor(v).device.type, mem.slots[v].data_ptr()) for v in _planned(program) if m.tensor(v).nbytes]
        assert ptrs and all(p % want[t] == 0 for t, p in ptrs)
    finally:
        mem.close()
    module = ferry.Module(program)
    (x,) = fresh_inputs(example, 3)
    torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)


def test_load_fills_one_slot_per_value_and_fixes_what_does_not_change(emu):
    program = ferry.compile(torch.export.export(Owners(), small()))
    m = program.method("forward")
    mem = load_memory(program.segments, m)
    try:
        for vid, v in enumerate(m.values):
            if isinstance(v, TensorValue) and v.storage in ("planned", "constant"):
                assert mem.fixed[vid] and isinstance(mem.slots[vid], torch.Tensor)
            elif isinstance(v, TensorValue) and v.storage in ("input", "output", "runtime"):
                assert not mem.fixed[vid] and mem.slots[vid] is None
    finally:
        mem.close()


def test_a_failed_allocation_frees_everything_loaded_so_far(emu):
    model, example = transformer_block()
    program = ferry.compile(torch.export.export(model, example), ferry.OpSupportPartitioner("emu:0"))
    emu.fail_allocation(1)
    with pytest.raises(AllocationError):
        load_memory(program.segments, program.method("forward"))
    assert emu.live_allocations == 0


@pytest.mark.parametrize("fails", [False, True])
def test_a_load_hands_back_what_the_caching_allocator_kept(emu, monkeypatch, fails):
    """Once a method is loaded (or its load failed), the CUDA caching allocator's unused blocks go
    back to the driver: faked here, as the load's transients (dry runs, timed kernels) are the
    GPU's (tests/test_cuda.py checks the memory on one)."""
    model, example = transformer_block()
    module = ferry.Module(ferry.compile(torch.export.export(model, example), ferry.OpSupportPartitioner("emu:0")))
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(emu.live_allocations))
    if fails:  # no slab (its one allocation failed), then its first piece on its own
        monkeypatch.setattr(slab_module, "Slab", no_slab)
        emu.fail_allocation(1)
        with pytest.raises(AllocationError):
            module.load_method("forward")
        assert emptied == [0]  # after the failed load freed what it had
    module.load_method("forward")
    assert emptied[-1] > 0 and len(emptied) == 1 + fails  # the method's buffers kept, emptied once per load
    module.load_method("forward")  # loaded already: nothing allocated, nothing to hand back
    assert len(emptied) == 1 + fails
    torch.testing.assert_close(module(*example), model(*example))


def test_delegates_work_in_one_arena_per_device(emu):
    """Each delegate's working memory is a value of the method, planned in its device's arena
    and alive only while the delegate runs: delegates on one device share it with each other
    and with the method. Loading allocates one buffer per device (and the weights)."""
    pytest.importorskip("transformers")
    from models import gpt2_lm

    model, example = gpt2_lm()
    part = ferry.OpSupportPartitioner("emu:0", exclude=["aten.scaled_dot_product_attention"])
    program = ferry.compile(torch.export.export(model, example), part)
    m = program.method("forward")
    assert len(program.delegates) >= 3
    assert [str(b.device) for b in m.buffers[1:]] == ["cpu:0", "emu:0"]
    scratch = [s for ins in m.instructions for s in getattr(ins, "scratch", ())]
    assert len(scratch) == len(program.delegates)
    own = sum(b.size for d in program.delegates
              for b in ferry.load_program(program.segments[d.payload], segments=program.segments).method("forward").buffers[1:])
    arena = m.buffers[2].size
    assert arena < own + sum(m.tensor(v).nbytes for v in range(len(m.values)) if isinstance(m.values[v], TensorValue)
                             and m.tensor(v).device.type == "emu" and m.tensor(v).storage == "planned" and v not in scratch)
    # a weight two delegates read (GPT-2's tied embedding and head) is uploaded once
    uploads = {upload_key(v): v.nbytes for d in program.delegates
               for v in ferry.load_program(program.segments[d.payload], segments=program.segments).method("forward").values
               if isinstance(v, TensorValue) and v.storage == "constant"}
    weights = sum(uploads.values())
    emu.reset_counters()
    module = ferry.Module(program)
    module.load_method()
    # nothing else (no buffer of a delegate's own) but each weight's alignment (256 bytes on emu:
    # the position ids folded at compile time are a few bytes)
    assert arena + weights <= emu.live_bytes < arena + weights + 256 * len(uploads)
    ids = torch.randint(0, 256, example[0].shape)
    with torch.no_grad():
        torch.testing.assert_close(module(ids), model(ids), atol=1e-4, rtol=1e-4)


def test_a_memory_limit_is_checked_before_anything_is_allocated(emu):
    model, example = transformer_block()
    program = ferry.compile(torch.export.export(model, example), ferry.OpSupportPartitioner("emu:0"))
    used = loaded_bytes(emu, program)
    asked = load_bytes(program, program.method("forward"))[ferry.Device("emu")]  # the pieces, without padding
    need = allocated_by_load(program, program.method("forward"))[ferry.Device("emu")]  # each aligned in the slab
    assert asked < need == used  # a limit counts what the load allocates, padding included
    emu.reset_counters()
    for limit in (need - 1, {"emu:0": need - 1}, {"emu": "1KiB"}):
        with pytest.raises(AllocationError, match=r"needs [\d,]+ bytes on emu:0(, [\d,]+ of them for a call's "
                                                  r"results)?, over the limit .* nothing was allocated"):
            ferry.Module(program, max_memory=limit).load_method()
        assert emu.allocations == 0
    with pytest.raises(AllocationError, match="3 sets of"):
        ferry.Module(program, max_memory={"emu:0": need * 2}, concurrency=3).load_method()
    # what a call allocates besides (results of kernels with no out variant: tests/test_call_caps.py)
    per_call = call_bytes(program, program.method("forward")).get(ferry.Device("emu"), 0)
    ok = ferry.Module(program, max_memory={"emu:0": need + per_call, "cpu": "1GiB"})
    (x,) = fresh_inputs(example, 1)
    torch.testing.assert_close(ok(x), model(x), atol=1e-5, rtol=1e-4)
    assert emu.live_bytes == used
    with pytest.raises(ValueError, match="size like '20GiB'"):
        ferry.Module(program, max_memory="lots")


@pytest.mark.parametrize("limit", ["9" * 400, "9" * 30 + "GiB", 2**61, -1, "1e400GiB", True, {"emu:0": "9" * 400}])
def test_an_absurd_memory_limit_is_a_config_error(emu, limit):
    """Sizes past 1 EiB, negative ones and huge digit strings are a ConfigError in one line, not an
    OverflowError from float arithmetic."""
    program = ferry.compile(torch.export.export(Add(), small()), ferry.OpSupportPartitioner("emu:0"))
    with pytest.raises(ferry.ConfigError) as info:
        ferry.Module(program, max_memory=limit)
    assert len(str(info.value)) < 200 and "\n" not in str(info.value)


def test_a_misspelled_device_in_a_memory_limit_is_refused(emu):
    """A key that names no device of the program would mean no cap at all: it is refused, listing
    the program's devices; the right key (or its type, or '*') caps."""
    program = ferry.compile(torch.export.export(Add(), small()), ferry.OpSupportPartitioner("emu:0"))
    for key in ("emu:1", "cuda:0", "emu0", "gpu"):
        with pytest.raises(ferry.ConfigError, match=r"does not use; its devices: cpu:0, emu:0"):
            ferry.Module(program, max_memory={key: "1GiB"})
    for key in ("emu:0", "emu", "cpu", "*"):
        with pytest.raises(AllocationError, match="over the limit"):
            ferry.Module(program, max_memory={key: 1}).load_method()


def test_a_huge_buffer_in_a_file_is_refused_under_a_limit(emu):
    program = ferry.compile(torch.export.export(Add(), small()))
    m = program.method("forward")
    m.buffers[1] = dataclasses.replace(m.buffers[1], size=2**40)
    with pytest.raises(AllocationError, match=r"needs 1,099,511,627,\d{3} bytes on cpu:0"):  # (and a call's outputs)
        ferry.Module(program, max_memory="64MiB").load_method()

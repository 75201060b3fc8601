"""A table computed row by row from weights, then gathered by `embedding` (a quantized
embedding's dequantization), is computed only for the rows gathered, and int4 values are stored
two to a byte (aot/gathered_rows.py): the same numbers as eager, bit for bit, from a file that
holds half the bytes, at every prompt length of a dynamic program."""

from __future__ import annotations

import pytest
import torch

import ferry
from ferry.aot.gathered_rows import gather_rows_first
from ferry.aot.lower import _drop_export_time_checks, functional_aten

VOCAB, DIM, GROUP = 40, 32, 8


class QuantizedEmbedding(torch.nn.Module):
    """int4 values per group of GROUP columns, with a scale and a zero point per group."""

    def __init__(self, low: int = -8, high: int = 7):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("q", torch.randint(low, high + 1, (VOCAB, DIM), generator=g, dtype=torch.int8))
        self.register_buffer("scale", torch.rand(VOCAB, DIM // GROUP, 1, generator=g) + 0.5)
        self.register_buffer("zero", torch.randint(-2, 3, (VOCAB, DIM // GROUP, 1), generator=g).float())

    def forward(self, ids):
        table = ((self.q.view(VOCAB, DIM // GROUP, GROUP).float() - self.zero) * self.scale).view(VOCAB, DIM)
        return torch.nn.functional.embedding(ids, table.to(torch.bfloat16)) * 3


SEQ = torch.export.Dim("seq", max=24)


def exported(model):
    return torch.export.export(model, (torch.randint(0, VOCAB, (2, 5)),), dynamic_shapes=({1: SEQ},))


@pytest.mark.parametrize("placement", ["cpu", "emu"])
def test_rows_gathered_first_equal_eager_bit_for_bit(emu, placement):
    model = QuantizedEmbedding()
    part = ferry.OpSupportPartitioner("emu:0") if placement == "emu" else None
    module = ferry.Module(ferry.compile(exported(model), part))
    for seq in (1, 7, 24, 3):
        ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seq))
        assert torch.equal(module(ids), model(ids))


def test_the_int4_table_is_stored_two_to_a_byte_and_never_computed_whole():
    model = QuantizedEmbedding()
    program = ferry.compile(exported(model))
    method = program.method("forward")
    constants = [v for v in method.values if getattr(v, "constant", None) is not None]
    assert any(v.dtype == "uint8" and tuple(v.shape) == (VOCAB, DIM // 2) for v in constants)
    assert not any(v.dtype == "int8" and tuple(v.shape) == (VOCAB, DIM) for v in constants)
    whole = [v for v in method.values if tuple(getattr(v, "shape", ())) == (VOCAB, DIM)]
    assert whole == []  # no value the size of the table: only the gathered rows are computed


def gathers(ep) -> list[str]:
    """What each embedding of `ep` gathers from: a weight's name, or the op computing its table."""
    names = {s.arg.name: s.target for s in ep.graph_signature.input_specs}
    tables = [n.args[0] for n in ep.graph.nodes if n.target is torch.ops.aten.embedding.default]
    tables = [t.args[0] if t.target is torch.ops.aten.view.default else t for t in tables]  # a 3-d weight as 2-d
    return sorted(names.get(t.name, str(t.target)) for t in tables)


def test_int8_values_outside_int4_stay_one_to_a_byte():
    model = QuantizedEmbedding(-100, 100)
    ep = functional_aten(exported(model))
    assert gathers(ep) == ["q", "scale", "zero"]  # rows gathered first, the data not packed
    assert {**ep.state_dict, **ep.constants}["q"].dtype == torch.int8
    module = ferry.Module(ferry.compile(exported(model)))
    ids = torch.randint(0, VOCAB, (2, 9))
    assert torch.equal(module(ids), model(ids))


def test_a_table_also_read_whole_is_left_as_it_is():
    class Tied(QuantizedEmbedding):
        def forward(self, ids):
            table = (self.q.float() * self.scale.view(VOCAB, -1)[:, :1])
            return torch.nn.functional.embedding(ids, table) @ table.t()  # the table read whole too

    model = Tied()
    ep = functional_aten(exported(model))
    assert gathers(ep) == ["aten.mul.Tensor"]
    ids = torch.randint(0, VOCAB, (2, 6))
    torch.testing.assert_close(ferry.Module(ferry.compile(exported(model)))(ids), model(ids))


def test_rewrite_is_reported_once_per_gather():
    ep = exported(QuantizedEmbedding()).run_decompositions({})
    _drop_export_time_checks(ep.graph_module)
    assert [r.kind for r in gather_rows_first(ep)] == ["rows gathered first"]
    assert gather_rows_first(ep) == []  # nothing left to gather first


def test_the_callers_exported_program_keeps_its_weights():
    model = QuantizedEmbedding()
    ep = exported(model)
    before = {k: (v.dtype, tuple(v.shape)) for k, v in {**ep.state_dict, **ep.constants}.items()}
    ferry.compile(ep)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in {**ep.state_dict, **ep.constants}.items()} == before
    ids = torch.randint(0, VOCAB, (2, 4))
    assert torch.equal(ep.module()(ids), model(ids))


def test_methods_compiled_together_store_the_packed_table_once():
    """torch unwraps a weight per method; the packed bytes are one tensor, one segment of the file."""
    model = QuantizedEmbedding()
    program = ferry.compile({"prefill": exported(model), "decode": exported(model)})
    q = (model.q.to(torch.int16) & 15).to(torch.uint8)
    packed = bytes((q[:, 0::2] | (q[:, 1::2] << 4)).flatten().tolist())
    assert [bytes(s) for s in program.segments].count(packed) == 1
    ids = torch.randint(0, VOCAB, (2, 5))
    module = ferry.Module(program)
    assert torch.equal(module.run_method("decode", [ids])[0], model(ids))


def test_rows_picked_by_index_select_are_gathered_first_too():
    class Picked(QuantizedEmbedding):
        def forward(self, ids):
            table = ((self.q.view(VOCAB, DIM // GROUP, GROUP).float() - self.zero) * self.scale).view(VOCAB, DIM)
            return table.index_select(0, ids.flatten()) + 1

    model = Picked()
    ep = torch.export.export(model, (torch.randint(0, VOCAB, (2, 5)),), dynamic_shapes=({1: SEQ},))
    assert gathers(functional_aten(ep)) == ["q", "scale", "zero"]
    module = ferry.Module(ferry.compile(ep))
    for seq in (2, 9):
        ids = torch.randint(0, VOCAB, (2, seq))
        assert torch.equal(module(ids), model(ids))


def test_a_dequantize_with_scales_not_given_per_row_equals_eager():
    """torchao reads a 1-d scale of `dequantize_affine` by its own layout: such a table is computed
    whole, never gathered as if the scale broadcast over its rows."""
    torchao = pytest.importorskip("torchao")  # noqa: F841 - registers torch.ops.torchao

    class OneDScale(QuantizedEmbedding):
        def forward(self, ids):
            scale = self.scale.view(VOCAB, -1)[:, 0].contiguous()  # [VOCAB]: one per row, 1-d
            table = torch.ops.torchao.dequantize_affine(self.q, [1, DIM], scale, None, torch.int8, -8, 7)
            return torch.nn.functional.embedding(ids, table)

    model = OneDScale()
    ep = exported(model)
    assert gathers(functional_aten(ep)) == ["torchao.dequantize_affine.default"]
    module = ferry.Module(ferry.compile(ep))
    ids = torch.randint(0, VOCAB, (2, 7))
    assert torch.equal(module(ids), model(ids))


class Updated(QuantizedEmbedding):
    """`decode` reads a table `refresh` writes: the table is state, neither packed nor rewritten."""

    def forward(self, ids):
        return super().forward(ids)

    def refresh(self, ids):
        self.q.copy_(self.q.flip(0))
        return ids + 1


def test_a_table_another_method_updates_is_read_as_that_method_left_it():
    model = Updated()
    ids = torch.randint(0, VOCAB, (2, 5))
    decode, refresh = (torch.export.export(_Call(model, name), (ids,)) for name in ("forward", "refresh"))
    assert gathers(functional_aten(decode)) == ["model.q", "model.scale", "model.zero"]  # alone: packed
    assert gathers(functional_aten(decode, frozenset({"model.q"}))) == ["model.q", "model.scale", "model.zero"]
    program = ferry.compile({"decode": decode, "refresh": refresh})
    module = ferry.Module(program)
    assert torch.equal(module.run_method("decode", [ids])[0], model(ids))
    module.run_method("refresh", [ids])
    model.refresh(ids)
    assert torch.equal(module.run_method("decode", [ids])[0], model(ids))


class _Call(torch.nn.Module):
    """`model.<name>` as the forward of a module sharing the model's buffers."""

    def __init__(self, model, name):
        super().__init__()
        self.model, self.name = model, name

    def forward(self, *args):
        return getattr(self.model, self.name)(*args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tables_packed_on_two_devices_are_two_tensors():
    from ferry.aot.gathered_rows import _pack

    q = QuantizedEmbedding().q
    on_cpu, on_gpu = _pack(q), _pack(q.cuda())
    assert on_cpu.device.type == "cpu" and on_gpu.device.type == "cuda"
    assert _pack(q.clone()) is on_cpu and _pack(q.cuda()) is on_gpu  # same values, same device: one tensor

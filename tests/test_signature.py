"""A method's signature in the program file (program/signature.py, aot/signature.py, the codec):
read from torch.export's tree specs, written as plain JSON and read back equal, and every hostile
edit of it refused with a ProgramError when the file is loaded, never a crash or a wrong result."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import ferry
from edits import metadata_of, rebuild
from ferry.errors import ProgramError
from ferry.program.signature import MAX_TREE_DEPTH, Signature, Tree


class Model(torch.nn.Module):
    def forward(self, x, ys, limit: float, *, mask):
        return {"out": (x + ys[0]).clamp(max=limit) * mask, "n": None}, [ys[1]]


def export(limit=1.5):
    x = torch.randn(3)
    return torch.export.export(Model(), (x, [torch.randn(3), torch.randn(3)], limit), {"mask": torch.randn(3)})


def signature_json(data: bytes):
    meta = metadata_of(data)
    return meta, meta["methods"][0]["signature"]


def test_read_from_the_export_and_saved_equal(tmp_path):
    program = ferry.compile(export(math.inf))
    sig = program.method("forward").signature
    assert sig.arg_names == ("x", "ys", "limit")
    assert [t.kind for t in sig.args.items] == ["value", "list", "constant"]
    assert sig.args.items[2].value == math.inf  # written as 'inf', read back a float
    assert sig.kwargs.keys == ("mask",)
    assert sig.outputs.kind == "tuple" and sig.outputs.items[0].keys == ("out", "n")
    assert sig.inputs.count() == 4 and sig.inputs.count("constant") == 1 and sig.outputs.count() == 3
    program.save(tmp_path / "m.ferry")
    assert ferry.load_program(tmp_path / "m.ferry").method("forward").signature == sig


def _hostile(tmp_path, edit):
    program = ferry.compile(export())
    program.save(tmp_path / "m.ferry")
    data = (tmp_path / "m.ferry").read_bytes()
    meta, sig = signature_json(data)
    edit(sig)
    (tmp_path / "bad.ferry").write_bytes(rebuild(data, meta))
    return tmp_path / "bad.ferry"


def _drop_a_leaf(sig):
    sig["inputs"][3]["n"] -= 1  # the list `ys` loses its second tensor
    del sig["inputs"][5]


def _deep(sig):
    depth = 10 * MAX_TREE_DEPTH
    sig["outputs"] = [{"kind": "list", "n": 1}] * depth + [{"kind": "tuple", "n": 2}, {"kind": "dict", "n": 2, "keys":
                     ["out", "n"]}, {"kind": "value"}, {"kind": "none"}, {"kind": "list", "n": 1}, {"kind": "value"}]


HOSTILE = {
    "a leaf fewer than the method's inputs": (_drop_a_leaf, "the method has 4"),
    "an unknown kind": (lambda s: s["outputs"][-1].update(kind="code"), "expected one of"),
    "more items declared than nodes": (lambda s: s["outputs"][0].update(n=9), "run out"),
    "nodes after the tree": (lambda s: s["outputs"].append({"kind": "none"}), "more follow"),
    "keys unlike the items": (lambda s: s["outputs"][1].update(keys=["out"]), "1 keys for 2 items"),
    "repeated keys": (lambda s: s["outputs"][1].update(keys=["out", "out"]), "keys repeat"),
    "a value leaf with items": (lambda s: (s["outputs"][2].update(n=1), s["outputs"].insert(3, {"kind": "none"})),
                                "has no items"),
    "nested past the limit": (_deep, f"nested deeper than {MAX_TREE_DEPTH}"),
    "a node with no type": (lambda s: s["outputs"][1].update(kind="node"), "names its type"),
    "a node whose context is no JSON": (lambda s: s["outputs"][1].update(kind="node", type="collections.OrderedDict",
                                                                          context="[" * 100000), "not valid JSON"),
    "a named tuple's field no identifier": (lambda s: s["outputs"][1].update(kind="namedtuple", type="a.P",
                                                                             keys=["out", "x; import os"]),
                                            "identifiers"),
    "the keywords not a dict": (lambda s: s["inputs"][-2].update(kind="list", keys=[]), "keywords' dict"),
    "argument names for other arguments": (lambda s: s.update(arg_names=["x"]), "1 argument names for 3"),
    "a node's context unlike its type": (lambda s: s["outputs"][1].update(kind="node", type="collections.OrderedDict",
                                                                         context="5"), "does not fit"),
    "a node's keys unlike its context": (lambda s: s["outputs"][1].update(kind="node", type="collections.OrderedDict",
                                                                           context='["n", "out"]'), "disagree"),
    "a constant holding a list": (lambda s: s["inputs"][6].update(const={"type": "const", "kind": "ints",
                                                                         "value": [1]}), "expected one of none"),
    "a constant without its value": (lambda s: s["inputs"][6].pop("const"), "only a constant, holds"),
    "a type name past the limit": (lambda s: s["outputs"][1].update(kind="namedtuple", type="." * 100000,
                                                                     keys=["out", "n"]), "type name of 100000"),
    "a result declared constant": (lambda s: s["outputs"][-1].update(kind="constant", const={"type": "const",
                                   "kind": "int", "value": 1}), "never a constant"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_signature_is_refused_at_load(tmp_path, case):
    edit, says = HOSTILE[case]
    path = _hostile(tmp_path, edit)
    with pytest.raises(ProgramError) as e:
        ferry.Module(path)
    assert says in str(e.value)


def test_the_file_keeps_no_signature_for_a_structure_that_is_no_data():
    class Box:
        def __init__(self, value):
            self.value = value

    pytree.register_pytree_node(Box, lambda b: ([b.value], {1, 2}), lambda v, c: Box(v[0]),
                                serialized_type_name="test_signature.Box")

    class Boxed(torch.nn.Module):
        def forward(self, x):
            return Box(x * 2)

    try:
        ep = torch.export.export(Boxed(), (torch.randn(2),))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            program = ferry.compile(ep)
    finally:
        pytree._deregister_pytree_node(Box)
    assert program.method("forward").signature is None
    assert any("is not JSON" in str(w.message) and "flat tensors" in str(w.message) for w in caught)
    x = torch.randn(2)
    torch.testing.assert_close(ferry.Module(program)(x), x * 2)  # flat, as before signatures


def test_an_old_file_without_a_signature_runs_flat(tmp_path):
    program = ferry.compile(export())
    program.save(tmp_path / "m.ferry")
    data = (tmp_path / "m.ferry").read_bytes()
    meta = metadata_of(data)
    del meta["methods"][0]["signature"]
    (tmp_path / "old.ferry").write_bytes(rebuild(data, meta))
    module = ferry.Module(tmp_path / "old.ferry")
    x, y0, y1, mask = (torch.randn(3) for _ in range(4))
    got = module(x, y0, y1, mask)
    torch.testing.assert_close(got[0], (x + y0).clamp(max=1.5) * mask)
    with pytest.raises(ferry.InputError, match="keeps no signature"):
        module(x, [y0, y1], 1.5, mask=mask)


def test_trees_count_their_leaves_in_order():
    t = Tree("tuple", (Tree("value"), Tree("list", (Tree("constant", value=2), Tree("value"))), Tree("none")))
    assert [leaf.kind for leaf in t.leaves()] == ["value", "constant", "value"]
    assert t.count() == 2 and t.count("constant") == 1


class Difference(torch.nn.Module):
    def forward(self, x, *, y):
        return x - y


def test_one_tensor_given_for_two_inputs_at_export_is_said():
    """torch.export traces one tensor object given for x and y as one input: the program computes
    y - y for every call. ferry cannot undo it, so compile says so and how to avoid it."""
    x = torch.randn(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = ferry.compile(torch.export.export(Difference(), (x,), {"y": x}))
        apart = ferry.compile(torch.export.export(Difference(), (x,), {"y": x.clone()}))
    said = [str(w.message) for w in caught if "were one tensor at export" in str(w.message)]
    assert len(said) == 1 and "inputs 'x' and 'y'" in said[0]
    a, b = torch.randn(4), torch.randn(4)
    assert torch.equal(ferry.Module(merged)(a, y=b), torch.zeros(4))  # what torch.export made of it
    torch.testing.assert_close(ferry.Module(apart)(a, y=b), a - b)


def test_a_type_named_by_a_file_is_found_without_importing_or_running_code(tmp_path):
    """A file naming types in a module nobody imported, or through an object that is no module
    or class, loads without importing anything or touching that object; each result comes back
    plain, with a warning."""
    import sys

    import ferry.runtime.stages.call_tree as call_tree

    program = ferry.compile(export())
    m = program.method("forward")
    outs = m.signature.outputs
    names = ["xml.dom.minidom.Node", "torch.distributed.reduce_op.SUM.Missing"]
    nodes = tuple(Tree("node", (t,), ("k",), name, '["k"]') for t, name in zip(outs.items, names))
    m.signature = Signature(m.signature.inputs, Tree("tuple", nodes), m.signature.arg_names)
    program.save(tmp_path / "m.ferry")
    before = set(sys.modules)
    touched = []
    probe = type("Probe", (), {"__getattribute__": lambda self, name: touched.append(name)})()
    call_tree.torch.__dict__["_ferry_probe"] = probe
    try:
        assert call_tree._find_type("torch._ferry_probe.anything") is None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = ferry.Module(tmp_path / "m.ferry")
    finally:
        del call_tree.torch.__dict__["_ferry_probe"]
    assert touched == [] and set(sys.modules) - before == set()
    assert sum("comes back as a dict" in str(w.message) for w in caught) == 2
    x, y0, y1, mask = (torch.randn(3) for _ in range(4))
    got = module(x, [y0, y1], 1.5, mask=mask)
    torch.testing.assert_close(got[0]["k"]["out"], (x + y0).clamp(max=1.5) * mask)

"""Calling a program as the model is called (runtime/stages/call_tree.py): keyword arguments,
nested lists and dicts in, the model's own result structure out (dicts, tuples, named tuples,
transformers' ModelOutput, None and ints), through a saved file, compared with eager and with
`ep.module()` on fresh random inputs. Calls that do not fit the exported signature are InputErrors
that say what the signature is, and the module stays usable."""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch

import ferry
from ferry.errors import InputError
from ferry.program.signature import Tree

Pair = collections.namedtuple("Pair", "total rest")


class Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, ys, *, mask, bias):
        h = self.lin(x) * mask + ys[0] - ys[1]
        return {"h": h, "pair": Pair(h.sum(), (x + bias["b"],)), "none": None}


def rand(*shape):
    return torch.randn(*shape)


def example():
    return (rand(3, 4), [rand(3, 4), rand(3, 4)]), {"mask": rand(3, 4), "bias": {"b": rand(3, 4)}}


def saved(ep, tmp_path, name="m.ferry", **kw):
    path = tmp_path / name
    ferry.compile(ep, **kw).save(path)
    return ferry.Module(path)


def assert_same_tree(got, want):
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same_tree(got[k], want[k])
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_tree(g, w)
    else:
        assert got == want


@pytest.fixture(scope="module")
def nested_ep():
    torch.manual_seed(0)
    model = Nested().eval()
    args, kwargs = example()
    return model, torch.export.export(model, args, kwargs)


def test_keywords_nested_inputs_and_structured_results_equal_eager(nested_ep, tmp_path):
    model, ep = nested_ep
    module = saved(ep, tmp_path)
    for _ in range(2):
        (x, ys), kw = example()
        want = model(x, ys, **kw)
        assert_same_tree(module(x, ys, **kw), want)
        assert_same_tree(module(x, ys, bias=kw["bias"], mask=kw["mask"]), want)  # keywords in any order
        assert_same_tree(module(x=x, ys=tuple(ys), **kw), want)  # positional parameters by name
        assert_same_tree(module.call("forward", x, ys, **kw), want)
        assert_same_tree(module(x, ys, **kw), ep.module()(x, ys, **kw))
        assert isinstance(module(x, ys, **kw)["pair"], Pair)  # the process's own named tuple


def test_the_flat_inputs_are_taken_as_before(nested_ep, tmp_path):
    model, ep = nested_ep
    module = saved(ep, tmp_path)
    (x, ys), kw = example()
    flat = module.run_method("forward", [x, *ys, kw["mask"], kw["bias"]["b"]])
    assert_same_tree(module(x, *ys, kw["mask"], kw["bias"]["b"]), module(x, ys, **kw))
    torch.testing.assert_close(flat[0], model(x, ys, **kw)["h"])


@pytest.mark.parametrize("call, says", [
    (lambda m, x, ys, kw: m(x, ys, mask=kw["mask"]), "missing keyword argument(s) 'bias'"),
    (lambda m, x, ys, kw: m(x, ys, **kw, scale=2.0), "unexpected keyword argument(s) 'scale'"),
    (lambda m, x, ys, kw: m(x, ys[:1], **kw), "ys takes 2 items, got 1"),
    (lambda m, x, ys, kw: m(x, ys, mask=kw["mask"], bias={"c": x}), "bias takes the keys ['b'], got ['c']"),
    (lambda m, x, ys, kw: m(x, ys, x=x, **kw), "'x' is given by position and by name"),
    (lambda m, x, ys, kw: m(ys=ys, **kw), "argument 'x' is missing"),
    (lambda m, x, ys, kw: m(x, ys, ys, **kw), "takes 2 positional argument(s), got 3"),
])
def test_a_call_unlike_the_export_says_what_it_takes(nested_ep, tmp_path, call, says):
    model, ep = nested_ep
    module = saved(ep, tmp_path)
    (x, ys), kw = example()
    with pytest.raises(InputError) as e:
        call(module, x, ys, kw)
    assert says in str(e.value)
    if "positional" in says or "items" in says or "keys" in says or "keyword" in says:
        assert "forward(x, ys: [T, T], *, mask, bias: {'b': T}) -> {'h': T" in str(e.value)
    assert_same_tree(module(x, ys, **kw), model(x, ys, **kw))  # still usable


class Fixed(torch.nn.Module):
    def forward(self, x, scale: float, flag: bool = True):
        return (x * scale if flag else x,)


def test_arguments_fixed_at_export_are_checked_each_call(tmp_path):
    x = rand(5)
    ep = torch.export.export(Fixed(), (x, 3.0), {"flag": True})
    module = saved(ep, tmp_path)
    assert module.method_meta().num_inputs() == 1  # the constants are no inputs of the method
    y = rand(5)
    assert_same_tree(module(y, 3.0, flag=True), Fixed()(y, 3.0, flag=True))  # a 1-tuple, as eager
    assert_same_tree(module(y, 3, flag=True), Fixed()(y, 3, flag=True))  # 3 == 3.0, as eager takes it
    for bad in ((y, 4.0), (y, True)):
        with pytest.raises(InputError, match="fixed to 3.0 at export"):
            module(*bad, flag=True)
    with pytest.raises(InputError, match="flag was fixed to True"):
        module(y, 3.0, flag=False)
    with pytest.raises(InputError, match="missing keyword argument"):
        module(y)  # the tensors alone would skip the fixed arguments' check


class Constants(torch.nn.Module):
    def forward(self, x):
        return [x * 2, (x + 1,)], None, 3


def test_results_keep_none_and_ints_and_one_tuples(tmp_path):
    x = rand(2, 3)
    module = saved(torch.export.export(Constants(), (x,)), tmp_path)
    y = rand(2, 3)
    assert_same_tree(module(y), Constants()(y))


def test_model_output_comes_back_as_its_class(tmp_path):
    transformers = pytest.importorskip("transformers")
    out_type = transformers.modeling_outputs.BaseModelOutput

    class Encoder(torch.nn.Module):
        def forward(self, x):
            return out_type(last_hidden_state=x.tanh(), hidden_states=(x, x * 2))

    x = rand(2, 3)
    module = saved(torch.export.export(Encoder(), (x,)), tmp_path)
    y = rand(2, 3)
    got, want = module(y), Encoder()(y)
    assert type(got) is out_type
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state)
    torch.testing.assert_close(got["hidden_states"][1], want.hidden_states[1])
    assert got.attentions is None


def test_a_type_this_process_lacks_comes_back_plain_with_one_warning(nested_ep, tmp_path):
    model, ep = nested_ep
    program = ferry.compile(ep)
    m = program.method("forward")
    outs = m.signature.outputs  # a dict: h, pair (named tuple), none
    missing = dataclasses.replace(outs.items[1], type="nowhere.Missing")
    node = Tree("node", (outs.items[0],), ("h",), "nowhere.Output", '["h"]')
    renamed = dataclasses.replace(outs, items=(node, missing, outs.items[2]))
    m.signature = dataclasses.replace(m.signature, outputs=renamed)
    program.save(tmp_path / "m.ferry")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = ferry.Module(tmp_path / "m.ferry")
        module.load_method()
    said = [str(w.message) for w in caught if "nowhere.Output" in str(w.message)]
    assert len(said) == 1 and "comes back as a dict" in said[0] and "`import nowhere`" in said[0]
    (x, ys), kw = example()
    got, want = module(x, ys, **kw), model(x, ys, **kw)
    assert got["h"] == {"h": got["h"]["h"]} and torch.equal(got["h"]["h"], module(x, ys, **kw)["h"]["h"])
    torch.testing.assert_close(got["h"]["h"], want["h"])
    assert got["pair"]._fields == ("total", "rest") and type(got["pair"]) is not Pair  # a named tuple like it
    torch.testing.assert_close(got["pair"].total, want["pair"].total)


def test_methods_are_called_by_name_with_their_keywords(tmp_path):
    class Two(torch.nn.Module):
        def forward(self, x, *, y):
            return x - y

    x = rand(4)
    program = ferry.compile({"forward": torch.export.export(Fixed(), (x, 2.0)),
                             "sub": torch.export.export(Two(), (x,), {"y": rand(4)})})
    module = ferry.Module(program)
    a, b = rand(4), rand(4)
    torch.testing.assert_close(module.call("sub", a, y=b), a - b)
    torch.testing.assert_close(module.call("sub", x=a, y=b), a - b)
    with pytest.raises(ferry.UnknownMethodError):
        module.call("nope", a)


def test_transformers_decoder_export_is_called_with_its_keywords():
    """transformers' ExecuTorch recipe exports input_ids and cache_position as keywords: ferry's
    module takes them as ep.module() does, step after step of one cache."""
    pytest.importorskip("transformers")
    from test_generate import export

    ep = export("llama", 1, False)
    module, reference = ferry.Module(ferry.compile(ep)), ep.module()
    tokens = torch.randint(0, 64, (1, 4))
    for i in range(4):
        kw = {"input_ids": tokens[:, i:i + 1], "cache_position": torch.tensor([i])}
        torch.testing.assert_close(module(**kw), reference(**kw))


def test_on_the_emulated_device_with_results_kept_there(nested_ep, emu, tmp_path):
    model, ep = nested_ep
    keep = ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)
    module = saved(ep, tmp_path, partitioner=ferry.OpSupportPartitioner("emu:0"),
                   config=ferry.CompileConfig(propagate_device=keep))
    (x, ys), kw = example()
    on = lambda t: ferry.runtime.clone_to(t, "emu:0")  # noqa: E731
    got = module(on(x), [on(y) for y in ys], mask=on(kw["mask"]), bias={"b": on(kw["bias"]["b"])})
    want = model(x, ys, **kw)
    assert ferry.runtime.device_of(got["h"]) == ferry.Device.parse("emu:0")
    torch.testing.assert_close(ferry.runtime.clone_to(got["h"], "cpu"), want["h"])
    torch.testing.assert_close(ferry.runtime.clone_to(got["pair"].rest[0], "cpu"), want["pair"].rest[0])


class Keywords(torch.nn.Module):
    def forward(self, x, a, b):
        return x + 2 * a - b


def test_keywords_exported_out_of_order_are_matched_by_name(tmp_path):
    """Exported with b before a: by name each lands where it belongs; by position the tensors
    are taken in the program's order, and the call says so once."""
    x, a, b = rand(3), rand(3), rand(3)
    module = saved(torch.export.export(Keywords(), (x,), {"b": b, "a": a}), tmp_path)
    x, a, b = rand(3), rand(3), rand(3)
    want = Keywords()(x, a, b)
    torch.testing.assert_close(module(x, a=a, b=b), want)
    torch.testing.assert_close(module(x=x, b=b, a=a), want)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(module(x, b, a), want)  # the program's order: x, b, a
        module(x, b, a)
    said = [str(w.message) for w in caught if "by position" in str(w.message)]
    assert len(said) == 1 and "(b, a)" in said[0] and "Pass them by name" in said[0]


class Scaled(torch.nn.Module):
    def forward(self, scale: float, x, y):
        return x * scale + y


def test_a_fixed_argument_first_keeps_the_dynamic_sizes_of_the_inputs_after_it(tmp_path):
    n = torch.export.Dim("n", min=2, max=64)
    ep = torch.export.export(Scaled(), (2.0, rand(4, 3), rand(4, 3)), dynamic_shapes=(None, {0: n}, {0: n}))
    module = saved(ep, tmp_path)
    for rows in (7, 3, 9):
        x, y = rand(rows, 3), rand(rows, 3)
        torch.testing.assert_close(module(2.0, x, y), Scaled()(2.0, x, y))
    with pytest.raises(InputError, match=r"input 0 \('x'\) dim 0 is 7, input 1 \('y'\) dim 0 is 6"):
        module(2.0, rand(7, 3), rand(6, 3))


class Mode(torch.nn.Module):
    def forward(self, x, mode: str):
        return x.exp() if mode == "inf" else x


def test_a_string_constant_stays_a_string_through_the_file(tmp_path):
    x = rand(3)
    module = saved(torch.export.export(Mode(), (x, "inf")), tmp_path)
    torch.testing.assert_close(module(x, "inf"), x.exp())
    with pytest.raises(InputError, match="fixed to 'inf'"):
        module(x, float("inf"))


@dataclasses.dataclass
class Batch:
    a: torch.Tensor | None
    b: torch.Tensor | None
    c: torch.Tensor | None


def test_a_dataclass_argument_must_set_the_fields_it_set_at_export(tmp_path):
    class Reads(torch.nn.Module):
        def forward(self, x, batch):
            return x + batch.a - batch.c

    torch.utils._pytree.register_dataclass(Batch)
    try:
        t, x = rand(3), rand(3)
        module = saved(torch.export.export(Reads(), (x, Batch(t, None, rand(3)))), tmp_path)
        a, c = rand(3), rand(3)
        torch.testing.assert_close(module(x, Batch(a, None, c)), x + a - c)
        with pytest.raises(InputError, match="unlike the one at export"):
            module(x, Batch(a, c, None))
    finally:
        torch.utils._pytree._deregister_pytree_node(Batch)


def test_a_transformers_causal_lm_takes_its_mask_by_name_and_returns_its_output_class(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    mask = torch.ones(2, 5, dtype=torch.long)
    module = saved(torch.export.export(model, (torch.randint(0, 64, (2, 5)),), {"attention_mask": mask}), tmp_path)
    ids = torch.randint(0, 64, (2, 5))
    mask[1, :2] = 0  # left padding in the second row
    got, want = module(ids, attention_mask=mask), model(ids, attention_mask=mask)
    assert type(got) is type(want)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)


def test_inspect_shows_how_a_method_is_called(nested_ep):
    from ferry.views.text import program_json, program_summary

    program = ferry.compile(nested_ep[1])
    said = "forward(x, ys: [T, T], *, mask, bias: {'b': T}) -> {'h': T, 'pair': Pair(T, (T,)), 'none': T}"
    assert f"called as {said}" in program_summary(program)
    assert program_json(program)["methods"]["forward"]["called_as"] == said


def test_a_wrong_tensor_is_named_as_at_export(nested_ep, tmp_path):
    model, ep = nested_ep
    module = saved(ep, tmp_path)
    (x, ys), kw = example()
    with pytest.raises(InputError, match=r"input 3 \('mask'\) of 'forward' must be float32, got float64"):
        module(x, ys, mask=kw["mask"].double(), bias=kw["bias"])
    with pytest.raises(InputError, match=r"input 1 \('ys_0'\) of 'forward' must have shape \(3, 4\), got \(3, 5\)"):
        module(x, [rand(3, 5), ys[1]], **kw)

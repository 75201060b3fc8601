"""A decode step's residual adds stay out of its products' reductions (choices/epilogues.py): the
rule on Inductor's scheduler nodes, and a delegate compiled with it, equal to eager."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import sympy
import torch
from torch._inductor.choices import InductorChoices
from torch._inductor.virtualized import V

import ferry
from ferry.choices import epilogues, gemv


def _node(reduction: bool, outputs, elements, names=(), reads=(), group=None):
    return SimpleNamespace(is_reduction=lambda: reduction, group=("cpu", group or (outputs, elements)),
                           get_buffer_names=lambda: set(names), read_writes=SimpleNamespace(
                               reads=[SimpleNamespace(name=n) for n in reads]))


@pytest.mark.parametrize("form", ["C++", "Triton"])
@pytest.mark.parametrize(("consumer", "apart"), [
    ((["buf0", "buf5"], (64,)), True),  # the residual, another kernel's buffer
    ((["buf0"], (64,)), False),  # a cast of the outputs
    ((["buf0", "bias"], (64,)), False),  # a bias: a constant
    ((["buf0", "arg0_1"], (64,)), False),  # a graph input
    ((["buf0", "buf5"], (8, 64)), False),  # more elements than outputs: not an epilogue
])
def test_only_a_pointwise_consumer_reading_a_computed_buffer_is_kept_apart(form, consumer, apart):
    """Scheduler nodes as Inductor groups them: a tuple of sizes each (C++), or their products (Triton)."""
    reads, sizes = consumer

    def part(*dims):
        return tuple(dims) if form == "C++" else sympy.Integer(int(torch.tensor(dims).prod()) if dims else 1)

    product = _node(True, part(64), part(128), ["buf0"])
    with V.set_graph_handler(SimpleNamespace(graph_inputs={"arg0_1": None}, constants={"bias": None})):
        assert epilogues.residual_epilogue(product, _node(False, part(*sizes), part(), ["buf1"], reads)) is apart
        # a reduction of its own is no epilogue; nor are a norm's consumers (one output), nor a
        # symbolic count, nor a combo kernel's one-part group
        assert not epilogues.residual_epilogue(product, _node(True, part(64), part(32), ["buf1"], reads))
        for producer in (_node(True, part(1), part(64), ["buf0"]),
                         _node(True, (sympy.Symbol("s0"),), part(128), ["buf0"]),
                         _node(True, None, None, ["buf0"], group=((sympy.Symbol("combo_kernel"),),))):
            assert not epilogues.residual_epilogue(producer, _node(False, part(*sizes), part(), ["buf1"], reads))


hookable = pytest.mark.skipif(not epilogues._hookable(), reason="this torch asks no choices about vertical fusions")


@pytest.fixture
def slot(monkeypatch):
    """This thread's Inductor choices slot, unset for the test and after it."""
    from torch._inductor import virtualized

    key = virtualized._choices._key
    monkeypatch.delattr(virtualized.threadlocal, key, raising=False)
    yield lambda: getattr(virtualized.threadlocal, key, None)
    monkeypatch.delattr(virtualized.threadlocal, key, raising=False)


@hookable
def test_this_threads_choices_are_left_as_found(slot):
    with epilogues.residuals_apart() as apart:
        assert apart and isinstance(slot(), epilogues.ResidualsApart)
        with epilogues.residuals_apart() as nested:  # (an Inductor compile inside another)
            assert nested and isinstance(slot(), epilogues.ResidualsApart)
        assert isinstance(slot(), epilogues.ResidualsApart)
    assert slot() is None  # unset again: a choices class set later still takes effect
    default = InductorChoices()
    with V.set_choices_handler(default):
        with pytest.raises(RuntimeError), epilogues.residuals_apart():
            raise RuntimeError("a failed compile")
        assert slot() is default


@hookable
def test_the_process_keeps_choices_of_its_own(slot):
    class Mine(InductorChoices):
        pass

    with torch._inductor.config.patch(inductor_choices_class=Mine), epilogues.residuals_apart() as apart:
        assert not apart and slot() is None
    mine = Mine()
    with V.set_choices_handler(mine), epilogues.residuals_apart() as apart:
        assert not apart and slot() is mine


class Block(torch.nn.Module):
    """Two sub-layers of a decoder at one row: each adds a product to the residual stream, which
    the next RMSNorm reads. The first adds to the input; the second to what the first computed."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.v = torch.nn.Linear(hidden, hidden, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, hidden, bias=False)
        self.norms = torch.nn.ModuleList([torch.nn.RMSNorm(hidden, eps=1e-6) for _ in range(3)])

    def forward(self, x):
        h = x + self.o(torch.tanh(self.v(self.norms[0](x))))
        h = h + self.down(self.norms[1](h))
        return self.norms[2](h), h


@hookable
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_decode_step_keeps_its_residual_add_out_of_the_products_reduction(monkeypatch, slot, dynamic):
    """On the CPU, products 'timed' by a fake clock to be reductions (as a GPU's would be): the
    step is compiled with ResidualsApart, which keeps the add after the o product out of its
    reduction; a graph of dynamic sizes keeps Inductor's own choices. Both equal eager."""
    monkeypatch.setattr(gemv, "TIMED_ON", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(gemv, "measure", lambda w, b, reduction: (10.0, 5.0))
    kept, seen = [], []
    rule = epilogues.residual_epilogue

    def spy(node1, node2):
        kept.append(rule(node1, node2))
        return kept[-1]

    monkeypatch.setattr(epilogues, "residual_epilogue", spy)
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Choices(CustomGraphPass):
        def __call__(self, graph):
            seen.append(type(V.choices))

        def uuid(self):
            return None  # never cached: every compile lowers

    torch.manual_seed(3)
    model = Block().to(torch.bfloat16).eval()
    example = torch.randn(1, 4 if dynamic else 1, 64, dtype=torch.bfloat16)
    rows = torch.export.Dim("rows", min=1, max=8)
    ep = torch.export.export(model, (example,), dynamic_shapes=({1: rows},) if dynamic else None)
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("cpu", backend_id="inductor")))
    with torch._inductor.config.patch(post_grad_custom_post_pass=Choices(), force_disable_caches=True):
        for n in ([3, 8] if dynamic else [1, 1]):
            x = torch.randn(1, n, 64, dtype=torch.bfloat16)
            want = model(x)
            got = module(x)
            for g, w in zip(got, want):
                assert torch.allclose(g.float(), w.float(), rtol=2 ** -6, atol=2 ** -6 * w.abs().max().item())
    assert seen == [InductorChoices if dynamic else epilogues.ResidualsApart]
    assert (True in kept) is not dynamic  # the add after o, kept apart; nothing asked in a dynamic graph
    assert not isinstance(slot(), epilogues.ResidualsApart)  # the process's choices are back


def test_the_choices_are_in_inductors_cache_key_by_their_codes_version():
    if not epilogues.cache_options():
        pytest.skip("this torch keys no cache on a choices class's uuid")
    with torch._inductor.config.patch(epilogues.cache_options()):
        portable = torch._inductor.config.save_config_portable()
    assert portable["inductor_choices_class"] == epilogues.ResidualsApart().uuid()
    assert epilogues.ResidualsApart().uuid().endswith(epilogues._VERSION) and len(epilogues._VERSION) == 16



@pytest.mark.cuda
@hookable
def test_a_llama_decode_step_on_the_gpu_adds_its_residuals_outside_the_products(monkeypatch):
    """A tiny Llama's decode step with its products as tuned reductions (forced, as timing would
    choose at a real model's sizes): no reduction kernel of a product also adds the residual
    (but the first layer's, whose residual is the embedding's lookup, read from its table), and
    the logits are eager's within bf16 tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import transformers
    from torch._inductor.utils import run_and_get_code
    from transformers.integrations import executorch

    monkeypatch.setattr(gemv, "measure", lambda w, b, reduction: (10.0, 5.0))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).cuda().eval()
    model.generation_config.cache_implementation = "static"
    with torch.no_grad():
        recipe = executorch.TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=32)
        ids, position = torch.tensor([[7]], device="cuda"), torch.tensor([0], device="cuda")
        ep = recipe.export(input_ids=ids, cache_position=position)
        want = ep.module()(input_ids=ids, cache_position=position).float()
    keep = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(True, True))
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0", backend_id="inductor"), keep))
    with torch._inductor.config.patch(force_disable_caches=True):
        _, codes = run_and_get_code(module.load_method)
    got = module(ids, position).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert _products(codes) and not _fused(codes), _products(codes)
    # the control: Inductor's own choices fuse some add into a product at these sizes
    monkeypatch.setattr(epilogues, "residuals_apart", contextlib.nullcontext)
    module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0", backend_id="inductor"), keep))
    with torch._inductor.config.patch(force_disable_caches=True):
        _, codes = run_and_get_code(module.load_method)
    assert _fused(codes), _products(codes)


def _products(codes: list[str]) -> list[str]:
    """The reduction kernels (looped or persistent) of one-row products in Inductor's code."""
    import re

    kernels = {k for code in codes for k in re.findall(r"def (triton_(?:red|per)_fused_\w+)\(", code)}
    return sorted(k for k in kernels if "_mul_sum_" in k)


def _fused(codes: list[str]) -> list[str]:
    """Those that add something besides (the embedding's lookup aside: a residual read from its table)."""
    return [k for k in _products(codes) if "_add_" in k and "embedding" not in k]


@hookable
def test_where_torch_keys_no_cache_by_uuid_the_rule_still_applies_without_the_option(monkeypatch, slot):
    """torch 2.11 has the hook but pickles a choices class into its cache key, and patches its
    config for every thread: there the option is left out, and the rule still applies."""
    monkeypatch.setattr(torch._inductor.config, "_cache_config_factory_keys", [])
    assert epilogues.cache_options() == {}
    with epilogues.residuals_apart() as apart:
        assert apart and isinstance(slot(), epilogues.ResidualsApart)

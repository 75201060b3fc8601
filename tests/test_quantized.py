"""Weight-only quantized models from torchao through ferry: int8 weights (Int8WeightOnlyConfig)
compiled, saved, loaded and generating what torchao's eager model generates; the file holds the
packed weights and their scales, not the float weights; `ferry inspect` shows each quantized
weight's scheme and bytes; a corrupted scale is refused. int4 (`_weight_int4pack_mm`, a CUDA
kernel only) on the GPU."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import ferry
from ferry.aot import kernel_limits
from ferry.errors import ProgramError
from ferry.views.text import program_json, program_summary
from test_kernel_limits import CudaIntMmLimits
from test_model_families import Compiled, token_ids

torchao = pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")
executorch = pytest.importorskip("transformers.integrations.executorch")
from torchao.quantization import (  # noqa: E402
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    quantize_,
)
from torchao.quantization.granularity import PerGroup  # noqa: E402

CACHE, PROMPT, NEW = 48, 8, 24
PREFILL = torch.export.Dim("prefill", max=16)
# weights larger than transformers' default (0.02), so a tiny random model's greedy tokens vary
CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)


@functools.cache
def llama(quantized: bool, embedding: bool = False, activations: bool = False, dtype=torch.float32):
    """`embedding`: the token embedding too, int4 in groups of 32 (ExecuTorch's `--qembedding 4w`).
    `activations`: torchao's int8 dynamic-activation variant (each row of activations quantized
    per call, an int8 x int8 product) in place of weight-only int8."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(dtype).eval()
    model.generation_config.cache_implementation = "static"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if quantized:
            quantize_(model, Int8DynamicActivationInt8WeightConfig() if activations else Int8WeightOnlyConfig())
        if embedding:
            quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
                      filter_fn=lambda m, fqn: isinstance(m, torch.nn.Embedding))
    return model


@functools.cache
def exported(quantized: bool, embedding: bool = False, activations: bool = False, dtype=torch.float32):
    recipe = executorch.TorchExportableModuleForDecoderOnlyLM(llama(quantized, embedding, activations, dtype), batch_size=1,
                                                              max_cache_len=CACHE)
    with torch.no_grad():
        return recipe.export(input_ids=torch.zeros(1, 3, dtype=torch.long), cache_position=torch.arange(3),
                             dynamic_shapes={"input_ids": {1: PREFILL}, "cache_position": {0: PREFILL}})


@pytest.mark.parametrize("placement", ["cpu", "emu-io"])
def test_int8_llama_generates_what_torchao_eager_generates(emu, tmp_path, placement):
    prompt = token_ids((1, PROMPT), 3) % CONFIG["vocab_size"]
    with torch.no_grad():
        want = llama(True).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                                    do_sample=False)
    assert len(set(want[0, PROMPT:].tolist())) >= 6, want  # varied enough that a wrong weight would show
    run = Compiled(exported(True), placement, tmp_path / "int8.ferry")
    got = ferry.generate(run.module, prompt, NEW)
    assert got.tokens.tolist() == want.tolist()


@pytest.mark.parametrize("placement", ["cpu", "emu-io"])
def test_int8_dynamic_activations_generate_what_the_exported_program_generates(emu, tmp_path, placement):
    """torchao's int8 dynamic-activation variant exports as its own ops (`choose_qparams_affine`,
    `quantize_affine`) around an `_int_mm`: they are placed and run like ATen's. Quantizing each
    activation row turns eager's float rounding into steps of a quantum, so torchao eager's own
    generation parts from its exported graph's on near ties. The tokens and the prompt's logits
    are checked against the exported program run by PyTorch (on an AMD EPYC host torchao
    quantizes the activations to uint8, and its eager logits part from its exported graph's by
    a quantum there, 0.064), and against torchao eager's within 5% of its largest logit."""
    prompt = token_ids((1, PROMPT), 4) % CONFIG["vocab_size"]
    ep = exported(True, activations=True)
    with torch.no_grad():
        eager_logits = llama(True, activations=True)(prompt).logits
        want_logits = ep.module()(input_ids=prompt, cache_position=torch.arange(PROMPT))
        want = greedy_by_pytorch(ep.module(), prompt, NEW)
    assert len(set(want[0, PROMPT:].tolist())) >= 6, want
    run = Compiled(ep, placement, tmp_path / "int8da.ferry")
    got_logits = run(prompt, torch.arange(PROMPT))[0]
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    assert (got_logits - eager_logits).abs().max() <= 0.05 * eager_logits.abs().max()
    assert ferry.generate(run.module, prompt, NEW).tokens.tolist() == want.tolist()
    records = run.module.program.method("forward").quantized_weights
    assert len(records) == 7 * CONFIG["num_hidden_layers"] + 1
    assert {r.scheme for r in records} == {"torchao Int8Tensor"}


def test_int8_dynamic_activations_under_the_inductor_backend_run_with_ferrys_own(emu):
    """Inductor (torch 2.13, CPU) compiled torchao's int8 product at a decode step to wrong values
    (errors of 1e5): a partition holding `_int_mm` runs with ferry's own backend, said in a
    warning, and the tokens are the exported program's."""
    prompt = token_ids((1, PROMPT), 4) % CONFIG["vocab_size"]
    ep = exported(True, activations=True)
    with torch.no_grad():
        want = greedy_by_pytorch(ep.module(), prompt, NEW)
    with pytest.warns(UserWarning, match="_int_mm"):
        program = ferry.compile(ep, ferry.OpSupportPartitioner("emu:0", backend_id="inductor"))
    assert ferry.generate(ferry.Module(program.to_bytes()), prompt, NEW).tokens.tolist() == want.tolist()


def test_int8_dynamic_activations_with_rows_padded_as_for_cuda(emu, tmp_path, monkeypatch):
    """The rows CUDA's `_int_mm` needs (aot/kernel_limits.py), padded on the emulated device as on
    CUDA: a decode step's one row and a prefill of any length, the prefill's length still dynamic;
    the exported program's tokens."""
    monkeypatch.setattr(kernel_limits, "FITTED_ON", frozenset({"cuda", "emu"}))
    prompt = token_ids((1, PROMPT), 4) % CONFIG["vocab_size"]
    ep = exported(True, activations=True)
    if any(n.target is torch.ops.aten._int_mm.default and n.args[0].meta["val"].dtype == torch.uint8
           for n in ep.graph.nodes):
        pytest.skip("torchao's export quantizes activations to uint8 on this CPU: CUDA's _int_mm takes int8 "
                    "only, and ferry refuses that placement at compile time")
    with torch.no_grad():
        want = greedy_by_pytorch(ep.module(), prompt, NEW)
    run = Compiled(ep, "emu-io", tmp_path / "int8da.ferry")
    kernels = [k.split(".")[0] for k in delegate_kernels(run.module.program)]
    products = 7 * CONFIG["num_hidden_layers"] + 1
    assert kernels.count("aten::_int_mm") == kernels.count("aten::full") == products  # each on zero rows appended
    with CudaIntMmLimits() as limits:  # every product run had the rows CUDA's kernel takes
        got = ferry.generate(run.module, prompt, NEW).tokens
    assert limits.calls >= products * NEW and got.tolist() == want.tolist()


def greedy_by_pytorch(step, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy tokens of an exported program's module run by PyTorch: the prompt, then one token a call."""
    ids = prompt
    logits = step(input_ids=prompt, cache_position=torch.arange(prompt.shape[1], device=prompt.device))
    for _ in range(new):
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], 1)
        logits = step(input_ids=ids[:, -1:], cache_position=torch.tensor([ids.shape[1] - 1], device=prompt.device))
    return ids


@pytest.mark.parametrize("placement", ["cpu", "emu-io"])
def test_an_int4_embedding_is_gathered_packed_and_generates_as_torchao(emu, tmp_path, placement):
    """The embedding's rows are dequantized after the gather, from int4 values stored two to a
    byte (aot/gathered_rows.py): torchao eager's tokens, at every prefill length."""
    prompt = token_ids((1, PROMPT), 5) % CONFIG["vocab_size"]
    with torch.no_grad():
        want = llama(True, True).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                                          do_sample=False)
    assert len(set(want[0, PROMPT:].tolist())) >= 6, want
    run = Compiled(exported(True, True), placement, tmp_path / "int4emb.ferry")
    assert ferry.generate(run.module, prompt, NEW).tokens.tolist() == want.tolist()
    records = {r.name: r for r in run.module.program.method("forward").quantized_weights}
    embed = records["model.model.embed_tokens.weight"]
    vocab, hidden = CONFIG["vocab_size"], CONFIG["hidden_size"]
    assert embed.parts["qdata"] == f"uint8[{vocab}, {hidden // 2}] (int4, two per byte)"
    assert embed.nbytes < vocab * hidden  # under a byte a weight, scales and zero points included


INT4_PRODUCTS = ("aten::_weight_int4pack_mm", "aten::_weight_int4pack_mm_for_cpu")


def delegate_kernels(program, method="forward") -> list[str]:
    return [i.kernel for d in program.delegates
            for i in ferry.load_program(program.segments[d.payload], segments=program.segments).method(method).instructions
            if hasattr(i, "kernel")]


def int4_products(program, method="forward") -> int:
    """How many int4 products the program's delegates run per call of `method`."""
    return sum(k.split(".")[0] in INT4_PRODUCTS for k in delegate_kernels(program, method))


@functools.cache
def cpu_int4_llama():
    """bf16, every linear int4 in groups of 64 for tinygemm's CPU kernel (`_weight_int4pack_mm_for_cpu`)."""
    prototype = pytest.importorskip("torchao.prototype.quantization.int4", reason="torchao's CPU int4 tiles")
    PrototypeInt4WeightOnlyConfig = prototype.PrototypeInt4WeightOnlyConfig

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**CONFIG, "hidden_size": 128, "intermediate_size": 256})
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.cache_implementation = "static"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=64))
    recipe = executorch.TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE)
    with torch.no_grad():
        ep = recipe.export(input_ids=torch.zeros(1, 3, dtype=torch.long), cache_position=torch.arange(3),
                           dynamic_shapes={"input_ids": {1: PREFILL}, "cache_position": {0: PREFILL}})
    return model, ep


def test_int4_projections_of_one_input_run_as_one_product_and_generate_as_torchao(emu, tmp_path):
    """q/k/v and gate/up each one int4 product over their packed tiles and scales stacked at
    compile time (4 products a layer where torchao's model makes 7); prefill at every length and
    decode give torchao eager's greedy tokens; the file holds the stacked tiles in place of the
    separate ones, not beside them."""
    model, ep = cpu_int4_llama()
    prompt = token_ids((1, PROMPT), 7) % CONFIG["vocab_size"]
    with torch.no_grad():
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False)
    assert len(set(want[0, PROMPT:].tolist())) >= 6, want
    partitioner = ferry.OpSupportPartitioner("emu:0")
    merged = ferry.compile(ep, partitioner)
    apart = ferry.compile(ep, partitioner, ferry.CompileConfig(fuse_for_inference=False))
    layers = CONFIG["num_hidden_layers"]
    assert (int4_products(merged), int4_products(apart)) == (4 * layers + 1, 7 * layers + 1)
    merged.save(tmp_path / "merged.ferry")
    apart.save(tmp_path / "apart.ferry")
    assert (tmp_path / "merged.ferry").stat().st_size <= (tmp_path / "apart.ferry").stat().st_size
    assert ferry.generate(ferry.Module(tmp_path / "merged.ferry"), prompt, NEW).tokens.tolist() == want.tolist()


class PaddedInt4Projections(torch.nn.Module):
    """Three int4 products off one input as torchao's CUDA path traces them: each its own 2-D
    view, cast and zero padding of the input (K 96 padded to 128), then a slice of its columns.
    `k_pad`: the value k's padding holds (not 0: k reads another input, and must stay apart)."""

    def __init__(self, k_pad=0.0):
        super().__init__()
        self.k_pad = k_pad
        g = torch.Generator().manual_seed(5)
        for name, n in (("q", 128), ("k", 64), ("v", 64)):
            values = torch.randint(0, 16, (n, 128), generator=g, dtype=torch.int32)
            self.register_buffer(f"{name}_packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 2))
            scales = torch.stack([torch.rand(2, n, generator=g) * 0.1 + 0.01, torch.randn(2, n, generator=g) * 0.1], -1)
            self.register_buffer(f"{name}_scales", scales.to(torch.bfloat16))

    def project(self, x, name):
        pad = self.k_pad if name == "k" else 0.0
        rows = torch.nn.functional.pad(x.reshape(-1, 96).to(torch.bfloat16), (0, 32), value=pad)
        packed, scales = getattr(self, f"{name}_packed"), getattr(self, f"{name}_scales")
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, 64, scales)
        return y[:, : scales.shape[1]].reshape(*x.shape[:-1], scales.shape[1])

    def forward(self, x):
        return self.project(x, "q") * 2 + torch.cat([self.project(x, "k"), self.project(x, "v")], -1)


@pytest.mark.parametrize("k_pad,products", [(0.0, 1), (1.0, 2)])
def test_int4_products_of_one_input_through_their_own_views_and_padding_are_merged(emu, k_pad, products):
    model = PaddedInt4Projections(k_pad).eval()
    ep = torch.export.export(model, (torch.randn(2, 3, 96, dtype=torch.bfloat16),))
    program = ferry.compile(ep, ferry.OpSupportPartitioner("emu:0"))
    assert int4_products(program) == products
    module = ferry.Module(program)
    for _ in range(2):
        x = torch.randn(2, 3, 96, dtype=torch.bfloat16)
        torch.testing.assert_close(module(x), model(x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("widths,scaled,stacks", [((128, 64, 64), 1, True), ((32, 16, 16), 1, False),
                                                  ((64, 32, 32), 1, False), ((64, 32, 32), 0.005, False)])
def test_int4_products_are_merged_only_where_the_stacked_product_is_the_separate_ones(widths, scaled, stacks):
    """tinygemm's CPU tiles hold rows in blocks of 64: stacked at other widths, the product's rows
    land in the wrong columns. The check a merge passes first tells the two apart on the kernel,
    also where the wrong columns are small beside the first projection's (`scaled`: the scales of
    all but the first)."""
    from ferry.choices.projections import _same_products

    g = torch.Generator().manual_seed(3)
    packs = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, 128), generator=g, dtype=torch.int32), 2) for n in widths]
    scales = [(torch.randn(2, n, 2, generator=g) * (1 if i == 0 else scaled)).to(torch.bfloat16)
              for i, n in enumerate(widths)]
    assert _same_products(torch.ops.aten._weight_int4pack_mm_for_cpu.default, torch.bfloat16, packs, scales, 64,
                          torch.cat(packs), torch.cat(scales, 1)) is stacks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_projections_of_one_input_run_as_one_product(emu, tmp_path, dtype):
    """torchao's int8 linear exports as `mm(x, int8 weight cast) * per-row scales` (in bf16 the
    fp32 scales cast first): q/k/v and gate/up each become one such product over their int8
    weights and scales stacked at compile time (4 products a layer where there were 7), stored in
    place of the separate ones; the generation test above runs the merged program against
    torchao eager."""
    partitioner = ferry.OpSupportPartitioner("emu:0")
    merged = ferry.compile(exported(True, dtype=dtype), partitioner)
    apart = ferry.compile(exported(True, dtype=dtype), partitioner, ferry.CompileConfig(fuse_for_inference=False))
    layers = CONFIG["num_hidden_layers"]
    mms = lambda p: sum(k.split(".")[0] == "aten::mm" for k in delegate_kernels(p))  # noqa: E731
    assert (mms(merged), mms(apart)) == (4 * layers + 1, 7 * layers + 1)
    merged.save(tmp_path / "merged.ferry")
    apart.save(tmp_path / "apart.ferry")
    assert (tmp_path / "merged.ferry").stat().st_size <= (tmp_path / "apart.ferry").stat().st_size
    module, prompt = ferry.Module(tmp_path / "merged.ferry"), token_ids((1, PROMPT), 9) % CONFIG["vocab_size"]
    with torch.no_grad():
        want = llama(True, dtype=dtype)(prompt).logits
        unmerged = ferry.Module(tmp_path / "apart.ferry").forward(prompt, torch.arange(PROMPT))
    got = module.forward(prompt, torch.arange(PROMPT))
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:  # the same products, sliced: the separate program's values exactly, eager's within bf16
        assert torch.equal(got, unmerged)
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2 * want.abs().max().item())


def test_the_file_holds_int8_weights_and_inspect_names_them(tmp_path):
    q = ferry.compile(exported(True))
    full = ferry.compile(exported(False))
    q.save(tmp_path / "q.ferry")
    full.save(tmp_path / "f.ferry")
    q_size, f_size = (tmp_path / "q.ferry").stat().st_size, (tmp_path / "f.ferry").stat().st_size
    linear = sum(p.numel() for n, p in llama(False).named_parameters() if "proj" in n)
    # every projection shrank from 4 bytes to 1 a weight (plus a scale per row)
    assert f_size - q_size >= 0.7 * 3 * linear, (q_size, f_size)
    records = ferry.load_program(tmp_path / "q.ferry").method("forward").quantized_weights
    names = {r.name for r in records}
    assert {"model.model.layers.0.self_attn.q_proj.weight", "model.model.layers.1.mlp.down_proj.weight", "model.lm_head.weight"} <= names
    assert len(records) == 7 * 2 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
    up = next(r for r in records if r.name == "model.model.layers.0.mlp.up_proj.weight")
    assert (up.scheme, up.dtype, up.shape) == ("torchao Int8Tensor", "float32", (128, 64))
    assert up.parts["qdata"] == "int8[128, 64]" and up.parts["scale"] == "float32[128, 1]"
    assert up.nbytes == 128 * 64 + 128 * 4 + 128
    text = program_summary(q, instructions=False)
    assert "quantized weights: 15" in text and "model.model.layers.0.mlp.up_proj.weight: torchao Int8Tensor" in text
    assert program_json(q)["methods"]["forward"]["quantized_weights"][0]["scheme"] == "torchao Int8Tensor"


def test_a_corrupted_scale_is_refused(tmp_path):
    program = ferry.compile(exported(True))
    path = tmp_path / "q.ferry"
    program.save(path)
    data = bytearray(path.read_bytes())
    scale = next(bytes(s) for s in program.segments if len(s) == 128 * 4)  # an up_proj's per-row scales
    at = bytes(data).index(scale)
    data[at + 5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ProgramError, match="does not match its SHA-256 checksum"):
        ferry.load_program(path, verify=True)


def gpu_llama(config):
    """The test's Llama in bf16 on the GPU, quantized with torchao's `config`."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**CONFIG, "hidden_size": 128, "intermediate_size": 256})).to(torch.bfloat16).cuda().eval()
    model.generation_config.cache_implementation = "static"
    quantize_(model, config)
    return model


def gpu_program(model, backend: str = "torch"):
    """transformers' export of `model` (a prompt of up to 16 tokens, or one), compiled for cuda:0
    with inputs and outputs kept there."""
    with torch.no_grad():
        recipe = executorch.TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE)
        ep = recipe.export(input_ids=torch.zeros(1, 3, dtype=torch.long, device="cuda"),
                           cache_position=torch.arange(3, device="cuda"),
                           dynamic_shapes={"input_ids": {1: PREFILL}, "cache_position": {0: PREFILL}})
    keep = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(
        skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True))
    return ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0", backend_id=backend), keep)


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_quantized_llama_on_the_gpu_as_torchao_eager(scheme):
    """bf16 on the GPU. int4 weights packed for `_weight_int4pack_mm` (K a multiple of 128): ferry's
    torch backend runs the kernel torchao's eager model runs, and 32 greedy tokens match. int8:
    torchao's eager CUDA path rounds otherwise than the dequantize-then-`mm` graph it exports, so a
    tiny random model's near-tied tokens part after a few steps; the prompt's logits are compared,
    within bf16 tolerance (2% of the largest logit)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torchao.quantization import Int4WeightOnlyConfig

    model = gpu_llama(Int8WeightOnlyConfig() if scheme == "int8"
                      else Int4WeightOnlyConfig(group_size=64, int4_packing_format="tile_packed_to_4d"))
    if scheme == "int4":  # the embedding too, its rows gathered before they are dequantized
        quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
                  filter_fn=lambda m, fqn: isinstance(m, torch.nn.Embedding))
    prompt = (token_ids((1, PROMPT), 3) % CONFIG["vocab_size"]).cuda()
    with torch.no_grad():
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False)
        want_logits = model(prompt).logits
    program = gpu_program(model)
    records = {r.name: r for r in program.method("forward").quantized_weights}
    if scheme == "int4":
        assert records["model.model.embed_tokens.weight"].parts["qdata"].endswith("(int4, two per byte)")
        # q/k/v and gate/up merged: the stacked tiles passed the check on tinygemm's own kernel
        assert int4_products(program) == 4 * CONFIG["num_hidden_layers"] + 1
        got = ferry.generate(ferry.Module(program.to_bytes(), cuda_graphs=True), prompt, 32)
        assert got.tokens.tolist() == want.tolist()
    else:  # q/k/v and gate/up merged, as on the CPU
        mms = sum(k.split(".")[0] == "aten::mm" for k in delegate_kernels(program))
        assert mms == 4 * CONFIG["num_hidden_layers"] + 1
        logits = ferry.Module(program.to_bytes()).forward(prompt, torch.arange(PROMPT, device="cuda"))
        scale = want_logits.abs().max().item()
        torch.testing.assert_close(logits.float(), want_logits.float(), rtol=0, atol=2e-2 * scale)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "inductor"])
def test_int8_dynamic_activations_run_on_the_gpu_at_one_row(backend):
    """CUDA's `_int_mm` refuses 16 rows or fewer, so torchao's dynamic-activation model fails in
    eager at a decode step (and at a short prompt); ferry pads the int8 rows (exact) and
    generates. Checked by teacher forcing: eager, over the whole generated sequence at once (31
    rows, which it can run), ranks each token ferry picked as its top one, within bf16 tolerance.
    With the inductor backend the partitions holding `_int_mm` run with ferry's own (see the CPU test)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = gpu_llama(Int8DynamicActivationInt8WeightConfig())
    prompt = (token_ids((1, PROMPT), 3) % CONFIG["vocab_size"]).cuda()
    program = gpu_program(model, backend)
    got = ferry.generate(ferry.Module(program.to_bytes(), cuda_graphs=True), prompt, 24).tokens
    assert len(set(got[0, PROMPT:].tolist())) >= 6, got
    got = got.cuda()  # (generate returns its tokens on the host)
    with torch.no_grad():
        logits = model(got[:, :-1]).logits[0, PROMPT - 1:].float()  # the logits each new token was picked from
    picked = logits.gather(1, got[0, PROMPT:, None]).squeeze(1)
    assert bool((picked >= logits.max(1).values - 2e-2 * logits.abs().max()).all()), (picked, logits.max(1).values)


def test_ferry_inspect_on_the_command_line_lists_the_quantized_weights(tmp_path):
    import contextlib
    import io

    from ferry.cli import main

    path = tmp_path / "q.ferry"
    ferry.compile(exported(True)).save(path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["inspect", str(path)])
    assert rc in (0, None)
    assert "quantized weights: 15" in out.getvalue()
    assert "model.lm_head.weight: torchao Int8Tensor, float32[96, 64]" in out.getvalue()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_head_keeping_the_last_position_runs_on_one_row_per_sequence(kind):
    """`last_position_only` with a quantized lm_head (torchao's int8 `mm` and scale, tinygemm's
    CPU int4 product, each between two views): the positions are cut before the product, which
    then takes one row; the prefill equals the exported program's last row at every length."""
    from ferry.aot.last_position import keep_last_position
    from ferry.aot.lower import functional_aten

    ep = exported(True) if kind == "int8" else cpu_int4_llama()[1]
    lowered = functional_aten(ep)
    keep_last_position(lowered, "forward")
    node = lowered.graph.output_node().args[0][-1]
    while node.target not in (torch.ops.aten.mm.default, torch.ops.aten._weight_int4pack_mm_for_cpu.default):
        node = node.args[0]
    assert node.args[0].meta["val"].shape[0] == 1  # the head's rows: one, not the prompt's
    module = ferry.Module(ferry.compile(ep, None, ferry.CompileConfig(last_position_only="forward")))
    eager = ep.module()
    for n in (9, 3, 16):
        ids = token_ids((1, n), n) % CONFIG["vocab_size"]
        with torch.no_grad():
            want = eager(input_ids=ids, cache_position=torch.arange(n))[:, -1:]
        got = module(ids, torch.arange(n))
        assert got.shape == want.shape == (1, 1, CONFIG["vocab_size"])
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.cuda
def test_an_int8_decode_step_on_the_gpu_is_tuned_and_its_products_read_the_int8_weights():
    """A decode step of int8 weights (a one-row `mm` of each weight cast to bf16) is compiled with
    ferry's tuning whatever the process's config says (here torchao's set_inductor_config is off),
    under which Inductor makes each product one reduction over the int8 weight: no cuBLAS `mm`, no
    dequantized copy. Its logits equal eager's within bf16 tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch._inductor.utils import run_and_get_code

    with torch._inductor.config.patch(coordinate_descent_tuning=False, force_disable_caches=True):
        model = gpu_llama(Int8WeightOnlyConfig(set_inductor_config=False))
        with torch.no_grad():
            recipe = executorch.TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE)
            ep = recipe.export(input_ids=torch.zeros(1, 1, dtype=torch.long, device="cuda"),
                               cache_position=torch.tensor([0], device="cuda"))
        keep = ferry.CompileConfig(propagate_device=ferry.PropagateDeviceConfig(
            skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True))
        module = ferry.Module(ferry.compile(ep, ferry.OpSupportPartitioner("cuda:0", backend_id="inductor"), keep))
        _, codes = run_and_get_code(module.load_method)
    cublas = [_around(c, "extern_kernels.mm(") for c in codes if "extern_kernels.mm(" in c]
    assert not cublas, "\n\n".join(cublas)  # (untuned, Inductor leaves each one-row `mm` to cuBLAS)
    # each product a Triton reduction (persistent at these sizes), none a template or a library call
    assert any("triton_per" in c or "triton_red" in c for c in codes) and not any("triton_tem" in c for c in codes)
    ids = (token_ids((1, 1), 5) % CONFIG["vocab_size"]).cuda()
    with torch.no_grad():
        want = ep.module()(input_ids=ids, cache_position=torch.tensor([0], device="cuda")).float()
    got = module(ids, torch.tensor([0], device="cuda")).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def _around(code: str, needle: str, before: int = 40) -> str:
    """The lines of generated code before each `needle`: the source nodes Inductor names for it."""
    lines = code.splitlines()
    return "\n---\n".join("\n".join(lines[max(0, i - before):i + 1]) for i, line in enumerate(lines) if needle in line)

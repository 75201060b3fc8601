"""Real models users already have: torchvision ResNet-18 and MobileNetV3-Small (random weights,
no download) and a transformers decoder from a small random config, each with an op forced to
the CPU. On the emulated device here, on a real GPU under the `cuda` marker."""

from __future__ import annotations

import pytest
import torch

import ferry
from ferry.runtime import emulated_device


def _resnet18():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return tv.models.resnet18(weights=None).eval(), (torch.randn(1, 3, 64, 64),), ["aten.max_pool2d"]


def _mobilenet_v3_small():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return tv.models.mobilenet_v3_small(weights=None).eval(), (torch.randn(1, 3, 64, 64),), ["aten.add"]


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def _llama_decoder():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = _Logits(transformers.LlamaForCausalLM(cfg).eval())
    return model, (torch.randint(0, 256, (1, 16)),), ["aten.silu"]


MODELS = {"resnet18": _resnet18, "mobilenet_v3_small": _mobilenet_v3_small, "llama_decoder": _llama_decoder}


def _fresh(example):
    x = example[0]
    return (torch.randint(0, 256, x.shape),) if x.dtype == torch.int64 else (torch.randn_like(x),)


def _check(name, device, tmp_path):
    model, example, exclude = MODELS[name]()
    ep = torch.export.export(model, example)
    program = ferry.compile(ep, ferry.OpSupportPartitioner(device, exclude=exclude))
    report = ferry.copy_report(program, "forward")
    # the forced-CPU op sits between device partitions: data comes back and goes up again
    assert report.count("d2h") >= 1 and report.count("h2d") >= 2
    program.save(tmp_path / f"{name}.ferry")
    module = ferry.Module(tmp_path / f"{name}.ferry")
    for _ in range(2):
        inputs = _fresh(example)
        with torch.no_grad():
            want = model(*inputs)
        got = module(*inputs).cpu()
        if device.startswith("cuda"):
            # other kernels (cuDNN, cuBLAS) sum in another order: compare relative to the output's size,
            # which for randomly initialised deep nets is large
            err = ((got.double() - want.double()).norm() / want.double().norm()).item()
            assert err < 1e-4, f"relative error {err:.2e}"
        else:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_on_emulated_device(name, tmp_path):
    with emulated_device():
        _check(name, "emu:0", tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_on_gpu(name, tmp_path):
    prev = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # compare in full fp32
    try:
        _check(name, "cuda:0", tmp_path)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev

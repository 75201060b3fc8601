"""transformers architectures through ferry, against eager: every config of CONFIG_MAPPING that builds
at a tiny size (random weights with noise on every parameter, nothing downloaded), exported and
compiled for emu-io (all on emu:0, skip flags), cpu and emu (CPU inputs and outputs), saved, loaded
and called three times (the export inputs, fresh ones, a right-padded mask). Not run by CI (about
75 minutes on 2 cores); its 2026-12-06 run: 230 architectures equal, 0 wrong; its evening run of
the 266 names of SPECS: 262 equal, 0 wrong; again on 2026-12-07 after the
residual-norm and RMS-norm rewrites, in 18 minutes (README).

    PYTHONPATH=src:tests python tests/arch_sweep.py [names...]   (default: every name in SPECS;
    results merged into arch_results.json in the working directory)

env: SWEEP_TIMEOUT (s per model, default 180), SWEEP_REDO=1 (rerun names already in the json)
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.utils._pytree as pytree
import transformers
from transformers.models.auto import modeling_auto as MA
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import ferry
from ferry.device import Device
from ferry.errors import FerryError
from ferry.runtime import EmulatedAllocator, clone_to, device_of, register_allocator

RESULTS = os.environ.get("SWEEP_RESULTS", "arch_results.json")  # (in the working directory)
TIMEOUT = int(os.environ.get("SWEEP_TIMEOUT", 180))
EMU0 = Device("emu", 0)
PLACEMENTS = os.environ.get("SWEEP_PLACEMENTS", "emu-io,cpu,emu").split(",")
VOCAB = 128
SEQ = 12
RTOL = ATOL = 1e-4
torch.set_num_threads(1)

KEEP_ON_DEVICE = ferry.CompileConfig(
    propagate_device=ferry.PropagateDeviceConfig(skip_h2d_for_method_inputs=True, skip_d2h_for_method_outputs=True)
)

# generic tiny values; each is passed only where the config's __init__ (or attribute_map) has the name
GENERIC = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, max_position_embeddings=128, head_dim=8, type_vocab_size=2,
    n_layer=2, n_embd=32, n_head=4, n_positions=128, n_inner=64, n_ctx=128,
    d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=64, decoder_ffn_dim=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_ff=64, d_kv=8,
    ffn_dim=64, moe_intermediate_size=32, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
    n_routed_experts=4, shared_expert_intermediate_size=32, n_shared_experts=1, num_shared_experts=1,
    image_size=32, patch_size=8, num_channels=3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    decoder_start_token_id=0,
)


def S(kind, model=None, **cfg):
    return dict(kind=kind, model=model, cfg=cfg)


# name -> spec. kind: enc (input_ids+mask), causal, s2s, vision, whisper_enc, audio (input_values), dual
SPECS = {
    # encoders
    "bert": S("enc"), "roberta": S("enc"), "xlm-roberta": S("enc"), "electra": S("enc", embedding_size=32),
    "deberta-v2": S("enc"), "deberta": S("enc"), "distilbert": S("enc", dim=32, n_layers=2, n_heads=4, hidden_dim=64),
    "albert": S("enc", embedding_size=32), "modernbert": S("enc", global_attn_every_n_layers=2, local_attention=8),
    "camembert": S("enc"), "mpnet": S("enc"), "roformer": S("enc", embedding_size=32), "megatron-bert": S("enc"),
    "convbert": S("enc", embedding_size=32), "data2vec-text": S("enc"), "ernie": S("enc"), "nomic_bert": S("enc"),
    "eurobert": S("enc"), "xlm-roberta-xl": S("enc"), "roberta-prelayernorm": S("enc"), "squeezebert": S("enc", embedding_size=32),
    "funnel": S("enc", block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=64),
    "mobilebert": S("enc", embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32, num_feedforward_networks=1),
    "fnet": S("enc"), "canine": S("enc"),
    # decoders
    "llama": S("causal"), "mistral": S("causal", sliding_window=8), "mixtral": S("causal"), "qwen2": S("causal"),
    "qwen2_moe": S("causal", shared_expert_intermediate_size=32), "qwen3": S("causal"), "qwen3_moe": S("causal"),
    "phi": S("causal"), "phi3": S("causal"), "gemma": S("causal"), "gemma2": S("causal", sliding_window=8),
    "gemma3_text": S("causal", sliding_window=8), "falcon": S("causal"), "gpt_neox": S("causal"), "gptj": S("causal", rotary_dim=4),
    "opt": S("causal", word_embed_proj_dim=32), "bloom": S("causal"), "stablelm": S("causal"), "olmo": S("causal"),
    "olmo2": S("causal"), "cohere": S("causal"), "granite": S("causal"), "smollm3": S("causal"),
    "deepseek_v3": S("causal", first_k_dense_replace=1, n_group=1, topk_group=1),
    "gpt2": S("causal"), "gpt_neo": S("causal", attention_types=[[["global", "local"], 1]], window_size=8),
    "codegen": S("causal", rotary_dim=4), "gpt_bigcode": S("causal"), "starcoder2": S("causal"), "olmoe": S("causal"),
    "granitemoe": S("causal"), "phimoe": S("causal"), "helium": S("causal"), "glm": S("causal"), "glm4": S("causal"),
    "cohere2": S("causal", sliding_window=8), "exaone4": S("causal", sliding_window=8), "nemotron": S("causal"),
    "persimmon": S("causal"), "biogpt": S("causal"), "xglm": S("causal"), "mpt": S("causal"),
    "qwen3_next": S("causal"), "ministral": S("causal"), "seed_oss": S("causal"), "gpt_oss": S("causal", sliding_window=8),
    "gemma3n_text": S("causal"), "lfm2": S("causal"), "mamba": S("causal"), "recurrent_gemma": S("causal"),
    # encoder-decoders
    "t5": S("s2s"), "mt5": S("s2s"), "bart": S("s2s"), "marian": S("s2s"), "pegasus": S("s2s"), "mbart": S("s2s"),
    "blenderbot": S("s2s"), "m2m_100": S("s2s"), "umt5": S("s2s"), "longt5": S("s2s"), "plbart": S("s2s"),
    # vision
    "vit": S("vision"), "deit": S("vision"), "beit": S("vision", use_relative_position_bias=True),
    "swin": S("vision", embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, patch_size=4),
    "swinv2": S("vision", embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, patch_size=4),
    "convnext": S("vision", hidden_sizes=[16, 32], depths=[1, 1], num_stages=2),
    "convnextv2": S("vision", hidden_sizes=[16, 32], depths=[1, 1], num_stages=2),
    "resnet": S("vision", embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1]),
    "mobilenet_v2": S("vision", depth_multiplier=0.35),
    "mobilenet_v1": S("vision", depth_multiplier=0.25),
    "efficientnet": S("vision", width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320),
    "regnet": S("vision", embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8),
    "dinov2": S("vision"), "data2vec-vision": S("vision"),
    "segformer": S("vision", num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                   patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], decoder_hidden_size=32),
    "detr": S("vision", model="DetrModel", use_timm_backbone=False, use_pretrained_backbone=False,
              backbone_config={"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [16, 32],
                               "depths": [1, 1], "out_features": ["stage2"]},
              num_queries=8, encoder_layers=1, decoder_layers=1),
    "levit": S("vision", hidden_sizes=[32, 48], num_attention_heads=[2, 2], depths=[1, 1], key_dim=[8, 8],
               down_ops=[["Subsample", 8, 2, 4, 2, 2]], mlp_ratio=[2, 2], attention_ratio=[2, 2], image_size=64, patch_size=16),
    "poolformer": S("vision", hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2, patch_sizes=[7, 3],
                    strides=[4, 2], padding=[2, 1], pool_size=3),
    "mobilevit": S("vision", hidden_sizes=[32, 32, 32], neck_hidden_sizes=[8, 8, 16, 16, 16, 32, 64], image_size=64, patch_size=2),
    "vit_msn": S("vision"), "ijepa": S("vision"), "dinov2_with_registers": S("vision"),
    "bit": S("vision", embedding_size=32, hidden_sizes=[128, 256], depths=[1, 1], layer_type="bottleneck"),
    "cvt": S("vision", embed_dim=[16, 32], num_heads=[1, 2], depth=[1, 1], patch_sizes=[7, 3], patch_stride=[4, 2],
             patch_padding=[2, 1], mlp_ratio=[2.0, 2.0], attention_drop_rate=[0.0, 0.0], drop_rate=[0.0, 0.0],
             drop_path_rate=[0.0, 0.0], qkv_bias=[True, True], cls_token=[False, True], qkv_projection_method=["dw_bn", "dw_bn"],
             kernel_qkv=[3, 3], padding_kv=[1, 1], stride_kv=[2, 2], padding_q=[1, 1], stride_q=[1, 1]),
    "focalnet": S("vision", embed_dim=16, depths=[1, 1], focal_levels=[2, 2], focal_windows=[3, 3], patch_size=4),
    "pvt_v2": S("vision", hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2, sr_ratios=[2, 1],
                patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2]),
    # audio
    "whisper": S("whisper_enc", num_mel_bins=16, max_source_positions=16, max_target_positions=32),
    "wav2vec2": S("audio", conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3], num_conv_pos_embeddings=16,
                  num_conv_pos_embedding_groups=4),
    "hubert": S("audio", conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3], num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=4),
    "wavlm": S("audio", conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3], num_conv_pos_embeddings=16,
               num_conv_pos_embedding_groups=4, num_buckets=32, max_bucket_distance=64),
    "data2vec-audio": S("audio", conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3], num_conv_pos_embeddings=5,
                        num_conv_pos_embedding_groups=4, conv_pos_kernel_size=5, num_conv_pos_embeddings_layers=1),
    "audio-spectrogram-transformer": S("ast", num_mel_bins=16, max_length=32, patch_size=8, frequency_stride=8, time_stride=8),
    # multimodal dual encoders
    "clip": S("dual"), "siglip": S("dual"), "siglip2": S("dual2"),
}

for _n in ["llama", "mistral", "qwen3", "gemma3_text", "phi3", "bert", "vit", "whisper", "clip", "bart", "gpt2", "modernbert", "t5"]:
    SPECS[_n + "@eager"] = dict(SPECS[_n], attn="eager")
for _n in ["bert", "llama", "t5", "vit", "gpt2", "resnet", "swin", "convnext", "clip", "bart", "qwen3", "mistral",
           "modernbert", "wav2vec2", "segformer", "deit", "dinov2", "gemma3_text", "distilbert", "roberta", "whisper",
           "phi3", "electra", "mobilenet_v2", "beit", "siglip", "opt", "falcon", "gpt_neox", "mixtral"]:
    SPECS[_n + "@hs"] = dict(SPECS[_n], hs=True)  # every layer's hidden states (and attention maps) out too
for _n in ["bert", "llama", "vit", "bart", "gpt2", "t5", "whisper", "clip", "qwen3", "roberta"]:
    SPECS[_n + "@hs_attn"] = dict(SPECS[_n], hs=True, attn="eager", attentions=True)
for _n in ["bert", "roberta", "xlm-roberta", "electra", "distilbert", "modernbert", "albert", "deberta-v2", "llama",
           "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi", "phi3", "gemma", "gemma2",
           "gemma3_text", "falcon", "gpt_neox", "gptj", "opt", "bloom", "stablelm", "olmo", "olmo2", "cohere",
           "granite", "smollm3", "gpt2", "deepseek_v3", "starcoder2", "t5", "mt5", "bart", "marian", "pegasus",
           "cohere2", "gpt_oss", "exaone4"]:
    SPECS[_n + "@dyn"] = dict(SPECS[_n], dyn=True)
for _n, _s in list(SPECS.items()):
    if _s["kind"] == "causal" and "@" not in _n:
        SPECS[_n + "@ids"] = dict(_s, kind="causal_ids")


def add_generic():
    """Every other config name with a causal-LM, seq2seq, image-classification or masked-LM model, generic tiny config."""
    for name in sorted(CONFIG_MAPPING.keys()):
        if name in SPECS:
            continue
        if name in MA.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            SPECS[name] = S("causal")
        elif name in MA.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES and name in MA.MODEL_MAPPING_NAMES:
            SPECS[name] = S("s2s")
        elif name in MA.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
            SPECS[name] = S("vision")
        elif name in MA.MODEL_FOR_MASKED_LM_MAPPING_NAMES and name in MA.MODEL_MAPPING_NAMES:
            SPECS[name] = S("enc")


SUB = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
           max_position_embeddings=64, image_size=32, patch_size=8, projection_dim=32)


def accepted(cls):
    try:
        params = set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        params = set()
    return params | set(getattr(cls, "attribute_map", {}) or {})


def make_config(name, spec):
    cls = CONFIG_MAPPING[name.split("@")[0]]
    ok = accepted(cls)
    amap = getattr(cls, "attribute_map", {}) or {}
    kw = {}
    for k, v in GENERIC.items():
        if k in ok:
            kw[amap.get(k, k)] = v
    if "qk_rope_head_dim" in ok:  # multi-head latent attention: head_dim is the rope part
        kw.update(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, num_key_value_heads=4)
        for k, v in dict(kv_lora_rank=16, q_lora_rank=16).items():
            if k in ok:
                kw[k] = v
    for k, v in spec["cfg"].items():
        kw[amap.get(k, k)] = v
    if spec["kind"] in ("dual", "dual2"):
        tc, vc = dict(SUB), dict(SUB)
        tc.pop("image_size"), tc.pop("patch_size"), vc.pop("vocab_size")
        tc.pop("projection_dim"), vc.pop("projection_dim")
        if spec["kind"] == "dual2":
            vc.pop("image_size")
            vc["num_patches"] = 16
        kw = dict(text_config=tc, vision_config=vc)
        if "projection_dim" in ok:
            kw["projection_dim"] = 32
    cfg = cls(**kw)
    for k in ("use_cache",):
        if hasattr(cfg, k):
            setattr(cfg, k, False)
    if spec.get("attn"):
        cfg._attn_implementation = spec["attn"]
    return cfg


def pick_model_class(name, kind, spec):
    name = name.split("@")[0]
    if spec["model"]:
        return getattr(transformers, spec["model"])
    table = {
        "causal": [MA.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES],
        "vision": [MA.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES, MA.MODEL_MAPPING_NAMES],
    }.get(kind, [MA.MODEL_MAPPING_NAMES])
    for mapping in table:
        if name in mapping:
            cls_name = mapping[name]
            if isinstance(cls_name, (tuple, list)):
                cls_name = cls_name[0]
            return getattr(transformers, cls_name)
    raise KeyError(f"no model class for {name} ({kind})")


def perturb(model, seed=0):
    """Inits leave biases 0, norm weights 1 and batch-norm statistics trivial, which hides a dropped
    bias or a wrong fold: every float parameter gets noise, batch norms non-trivial statistics."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel():
                scale = 0.05 if p.dim() <= 1 else 0.02
                p.add_(torch.randn(p.shape, generator=g) * scale)
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)


class Wrap(torch.nn.Module):
    """Positional tensors in, a flat tuple of tensors out."""

    def __init__(self, model, names, extra):
        super().__init__()
        self.model, self.names, self.extra = model, names, extra

    def forward(self, *tensors):
        out = self.model(**dict(zip(self.names, tensors)), **self.extra)
        if isinstance(out, transformers.utils.ModelOutput):
            out = out.to_tuple()
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return tuple(leaves)


class WhisperEnc(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.enc = model.get_encoder()
        self.extra = {}

    def forward(self, input_features):
        out = self.enc(input_features, return_dict=False, **self.extra)
        if not self.extra:
            return out[0]
        return tuple(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


def build(name):
    spec = SPECS[name]
    kind = spec["kind"]
    cfg = make_config(name, spec)
    cls = pick_model_class(name, kind, spec)
    with torch.device("meta"):  # a config that stays big (sub-configs at their defaults) is skipped, not built
        n_params = sum(p.numel() for p in cls(cfg).parameters())
    if n_params > 20_000_000:
        raise TooBig(f"{n_params / 1e6:.0f}M parameters with the tiny overrides (sub-configs at default sizes)")
    torch.manual_seed(0)
    model = cls(cfg).eval().float()
    perturb(model)
    V = getattr(cfg, "vocab_size", None) or VOCAB

    def ids(shape):
        return ("ids", shape, V)

    extra = dict(return_dict=False)
    if kind in ("enc",):
        names, inputs = ["input_ids", "attention_mask"], [ids((2, SEQ)), ("ones", (2, SEQ))]
    elif kind == "causal_ids":  # no attention mask: transformers builds the causal (sliding) mask itself
        names, inputs = ["input_ids"], [ids((2, SEQ))]
        extra["use_cache"] = False
    elif kind == "causal":
        names, inputs = ["input_ids", "attention_mask"], [ids((2, SEQ)), ("ones", (2, SEQ))]
        extra["use_cache"] = False
    elif kind == "s2s":
        names = ["input_ids", "attention_mask", "decoder_input_ids"]
        inputs = [ids((2, SEQ)), ("ones", (2, SEQ)), ("ids", (2, 8), V, "dec")]
        extra["use_cache"] = False
    elif kind == "vision":
        H = getattr(cfg, "image_size", 32)
        H = H if isinstance(H, int) else H[0]
        H = 64 if name in ("detr", "mobilenet_v2", "mobilenet_v1", "efficientnet", "regnet", "resnet", "bit", "convnext", "convnextv2", "cvt", "poolformer", "pvt_v2", "segformer", "focalnet") else H
        names, inputs = ["pixel_values"], [("randn", (2, 3, H, H))]
    elif kind == "whisper_enc":
        model = WhisperEnc(model)
        names, inputs, extra = None, [("randn", (2, cfg.num_mel_bins, 2 * cfg.max_source_positions))], None
    elif kind == "audio":
        names, inputs = ["input_values"], [("randn", (2, 400))]
    elif kind == "ast":
        names, inputs = ["input_values"], [("randn", (2, cfg.max_length, cfg.num_mel_bins))]
    elif kind in ("dual", "dual2"):
        tc = cfg.text_config
        H = getattr(cfg.vision_config, "image_size", 32)
        names = ["input_ids", "pixel_values", "attention_mask"]
        inputs = [("ids", (2, 8), tc.vocab_size), ("randn", (2, 3, H, H)), ("ones", (2, 8))]
        if kind == "dual2":  # siglip2: patchified pixels + mask + spatial shapes
            p = cfg.vision_config.patch_size
            n = cfg.vision_config.num_patches
            names = ["input_ids", "pixel_values", "pixel_attention_mask", "spatial_shapes"]
            inputs = [("ids", (2, 8), tc.vocab_size), ("randn", (2, n, 3 * p * p)), ("ones_long", (2, n)),
                      ("const", torch.tensor([[4, 4], [4, 4]]))]
    else:
        raise ValueError(kind)
    if spec.get("hs"):
        if extra is None:  # the whisper encoder wrapper
            model.extra = dict(output_hidden_states=True, output_attentions=bool(spec.get("attentions")))
        else:
            extra["output_hidden_states"] = True
            if spec.get("attentions"):
                extra["output_attentions"] = True
    module = model if names is None else Wrap(model, names, extra)
    return module.eval(), inputs, cfg


def resize(item, seq, dec):
    """The input spec at another sequence length (dim 1 of token inputs; the decoder's own length)."""
    if item[0] in ("ids", "ones") and len(item[1]) == 2:
        L = dec if item[-1] == "dec" else seq
        return (item[0], (item[1][0], L), *item[2:])
    return item


def dynamic_shapes(inputs):
    seq = torch.export.Dim("seq", min=2, max=32)
    dec = torch.export.Dim("dec", min=2, max=32)
    out = []
    for item in inputs:
        if item[0] in ("ids", "ones") and len(item[1]) == 2:
            out.append({1: dec if item[-1] == "dec" else seq})
        else:
            out.append(None)
    return tuple(out)


def materialize(inputs, seed, pad=False, seq=None, dec=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    if seq is not None:
        inputs = [resize(i, seq, dec) for i in inputs]
    for item in inputs:
        kind = item[0]
        if kind == "ids":
            out.append(torch.randint(3, item[2], item[1], generator=g))
        elif kind == "ones":
            m = torch.ones(item[1], dtype=torch.long)
            if pad:  # right padding on the last row: the mask is a real input, not a constant
                m[-1, -4:] = 0
            out.append(m)
        elif kind == "ones_long":
            out.append(torch.ones(item[1], dtype=torch.long))
        elif kind == "randn":
            out.append(torch.randn(item[1], generator=g))
        elif kind == "const":
            out.append(item[1].clone())
    return tuple(out)


class TooBig(Exception):
    pass


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout(f"over {TIMEOUT} s")


def tail(exc, n=6):
    n = max(n, 12) if "error above occurred" in str(exc) else n
    lines = traceback.format_exception(exc)
    text = "".join(lines).strip().splitlines()
    return "\n".join(text[-n:])


def where(exc):
    """The innermost ferry frame of a traceback (file:line function)."""
    tb = exc.__traceback__
    best = None
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        if "/ferry/" in f:
            best = f"{f.split('/src/')[-1]}:{tb.tb_lineno} {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return best


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def compare(got, want):
    """(ok, max abs diff, message)"""
    got, want = as_tuple(got), as_tuple(want)
    if len(got) != len(want):
        return False, float("inf"), f"{len(got)} outputs, eager has {len(want)}"
    worst, msg = 0.0, ""
    ok = True
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, float("inf"), f"output {i}: {tuple(a.shape)} {a.dtype} vs eager {tuple(b.shape)} {b.dtype}"
        if a.is_floating_point():
            d = (a.double() - b.double()).abs()
            d = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(d), d)
            m = float(d.max()) if d.numel() else 0.0
        else:
            m = float((a.long() - b.long()).abs().max()) if a.numel() else 0.0
        worst = max(worst, m)
        try:
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
        except AssertionError as e:
            ok = False
            msg = msg or f"output {i} {tuple(a.shape)}: " + str(e).splitlines()[0] + f" (max abs diff {m:.3g})"
    return ok, worst, msg


# ops kept on the CPU in the "split-io" placement: many small device partitions with copies between them
SPLIT_EXCLUDE = ["aten.softmax", "aten.layer_norm", "aten.gelu", "aten.silu", "aten.embedding", "aten.conv2d",
                 "aten.scaled_dot_product_attention", "aten.rms_norm", "aten.tanh", "aten.cat"]


def partitioner_for(placement):
    if placement == "cpu":
        return None
    if placement == "emua-io":  # the asynchronous emulated device: work queued on streams, as on a GPU
        return ferry.OpSupportPartitioner("emua:0")
    if placement == "split-io":
        return ferry.OpSupportPartitioner("emu:0", exclude=SPLIT_EXCLUDE)
    if placement == "inductor-io":
        return ferry.OpSupportPartitioner("emu:0", backend_id="inductor")
    return ferry.OpSupportPartitioner("emu:0")


def run_placement(ep, placement, calls, tmpdir):
    partitioner = partitioner_for(placement)
    cfg = KEEP_ON_DEVICE if placement.endswith("-io") else None
    t0 = time.time()
    program = ferry.compile(ep, partitioner, cfg)
    path = os.path.join(tmpdir, f"{placement}.ferry")
    program.save(path)
    module = ferry.Module(path)
    meta = module.method_meta("forward")
    devices = [meta.input_meta(i).device for i in range(meta.num_inputs())]
    results = []
    for inputs, want in calls:
        args = [t if str(d).startswith("cpu") else clone_to(t, d) for t, d in zip(inputs, devices)]
        outs = as_tuple(module(*args))
        outs = tuple(o if str(device_of(o)).startswith("cpu") else clone_to(o, "cpu") for o in outs)
        results.append(compare(outs, want))
    return results, time.time() - t0, sum(str(d).startswith("emu") for d in devices)


def sweep_one(name):
    rec = dict(name=name)
    t0 = time.time()
    try:
        module, inputs, cfg = build(name)
        x0, x1 = materialize(inputs, 0), materialize(inputs, 1)
        padded = any(i[0] == "ones" for i in inputs)
        x2 = materialize(inputs, 2, pad=True) if padded else None
        dyn = SPECS[name].get("dyn")
        extra_calls = []
        with torch.no_grad():
            want0, want1 = as_tuple(module(*x0)), as_tuple(module(*x1))
            want2 = as_tuple(module(*x2)) if padded else None
            if dyn:  # other lengths, in changing order, the padded mask at a short length too
                for k, (L, D) in enumerate([(5, 3), (20, 14), (3, 2), (SEQ, 8)]):
                    xk = materialize(inputs, 10 + k, pad=(k == 1 and padded), seq=L, dec=D)
                    extra_calls.append((xk, as_tuple(module(*xk))))
    except Timeout:
        raise
    except Exception as e:
        rec.update(status="build failed", error=tail(e, 3))
        return rec
    rec["outputs"] = [list(t.shape) for t in want0]
    try:
        with torch.no_grad():
            ep = torch.export.export(module, x0, strict=False, dynamic_shapes=(dynamic_shapes(inputs),) if dyn else None)
    except Timeout:
        raise
    except Exception as e:
        rec.update(status="export failed", error=tail(e, 3))
        return rec
    # torch.export's own program against eager (separates export bugs from ferry's)
    try:
        epm = ep.module()
        rec["ep_module_diff"] = [compare(as_tuple(epm(*x)), w)[1] for x, w in ((x0, want0), (x1, want1))]
        if padded:
            rec["ep_module_diff_padded"] = compare(as_tuple(epm(*x2)), want2)[1]
    except Exception as e:
        rec["ep_module_diff"] = f"ep.module() raised {type(e).__name__}: {str(e)[:200]}"
    rec["placements"] = {}
    worst = "equal"
    order = {"equal": 0, "ferry refused": 1, "WRONG": 2, "non-ferry exception": 3}
    for placement in PLACEMENTS:
        p = {}
        try:
            with tempfile.TemporaryDirectory() as tmp:
                calls = [(x0, want0), (x1, want1)] + ([(x2, want2)] if padded else []) + extra_calls
                res, secs, n_emu_in = run_placement(ep, placement, calls, tmp)
            p["seconds"] = round(secs, 1)
            p["emu_inputs"] = n_emu_in
            p["max_diff"] = max(r[1] for r in res[:2])
            if padded:
                p["padded_diff"] = res[2][1]
            if extra_calls:
                p["dynamic_diffs"] = [r[1] for r in res[-len(extra_calls):]]
            if all(r[0] for r in res):
                p["status"] = "equal"
            else:
                p["status"] = "WRONG"
                p["message"] = next(r[2] for r in res if not r[0])
                labels = ["export inputs", "fresh inputs"] + (["fresh, padded mask"] if padded else []) + \
                    [f"dynamic size #{k}" for k in range(len(extra_calls))]
                p["wrong_calls"] = [labels[i] for i, r in enumerate(res) if not r[0]]
        except Timeout:
            raise
        except FerryError as e:
            p.update(status="ferry refused", error_class=type(e).__name__, message=str(e)[:1500], where=where(e))
        except Exception as e:
            p.update(status="non-ferry exception", error_class=type(e).__name__, traceback=tail(e, 12), where=where(e))
        rec["placements"][placement] = p
        if order[p["status"]] > order[worst]:
            worst = p["status"]
    rec["status"] = worst
    rec["seconds"] = round(time.time() - t0, 1)
    return rec


def main():
    register_allocator(EmulatedAllocator())
    register_allocator(EmulatedAllocator("emua", asynchronous=True))
    if sys.argv[1:] == ["--generic"]:
        before = set(SPECS)
        add_generic()
        names = [n for n in SPECS if n not in before]
    else:
        names = sys.argv[1:] or list(SPECS)
    results = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            results = json.load(f)
    signal.signal(signal.SIGALRM, _alarm)
    for name in names:
        if name in results and not os.environ.get("SWEEP_REDO"):
            continue
        if name.split("@")[0] not in CONFIG_MAPPING:
            results[name] = dict(name=name, status="build failed", error="not in CONFIG_MAPPING")
            continue
        print(f"--- {name}", flush=True)
        signal.alarm(TIMEOUT)
        t0 = time.time()
        try:
            rec = sweep_one(name)
        except Timeout:
            rec = dict(name=name, status="timeout", seconds=TIMEOUT)
        except Exception as e:  # a bug of this script
            rec = dict(name=name, status="sweep error", error=tail(e, 8))
        finally:
            signal.alarm(0)
        rec.setdefault("seconds", round(time.time() - t0, 1))
        results[name] = rec
        summary = rec["status"]
        for pl, p in rec.get("placements", {}).items():
            summary += f" | {pl}: {p['status']}" + (f" {p.get('max_diff', 0):.2g}" if "max_diff" in p else "") + \
                (f" {p.get('error_class')}: {p.get('message', p.get('traceback', ''))[-300:]}" if "error_class" in p else "")
        if "error" in rec:
            summary += " | " + rec["error"].splitlines()[-1][:300]
        print(f"{name}: {summary} ({rec['seconds']} s)", flush=True)
        with open(RESULTS, "w") as f:
            json.dump(results, f, indent=1, default=str)
    table(results)


def table(results):
    counts = {}
    print(f"\n{'arch':32} {'status':20} {'emu-io':28} {'cpu':28} {'emu (cpu I/O)':28} ep.module diff")
    for name, r in results.items():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
        cells = []
        for pl in ("emu-io", "cpu", "emu"):
            p = r.get("placements", {}).get(pl)
            if p is None:
                cells.append("-")
            elif "max_diff" in p:
                cells.append(f"{p['status']} {p['max_diff']:.2g}")
            else:
                cells.append(f"{p['status']} ({p.get('error_class')})")
        epd = r.get("ep_module_diff", "")
        if isinstance(epd, list):
            epd = f"{max(epd):.2g}"
        print(f"{name:32} {r['status']:20} {cells[0]:28} {cells[1]:28} {cells[2]:28} {str(epd)[:40]}")
    print("\ncounts:", json.dumps(counts))


if __name__ == "__main__":
    if sys.argv[1:] == ["--table"]:
        with open(RESULTS) as f:
            table(json.load(f))
    else:
        main()

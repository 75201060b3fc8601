"""Export recipe for encoder–decoder speech models (Whisper's shape): `encode` and `decode`.

transformers' Seq2Seq ExecuTorch recipe feeds the encoder's output to every decode step, which
projects it into cross-attention keys and values again at every token. Here `encode` runs the
encoder once and writes each decoder layer's cross-attention keys and values into buffers; `decode`
reads them (and its own static self-attention cache) and never sees the encoder's output. The
two are exported from one object and compiled together, so they share those buffers as the
program's state (aot/compile.py): the encoder's work stays where it was computed, on the GPU
for a program placed there, and `ferry.generate(..., encoder_inputs=features)` runs the pair.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["EncoderDecoderExport"]


class EncoderDecoderExport(nn.Module):
    """`model`: a transformers (>= 5) encoder–decoder whose decoder layers attend to the encoder through
    `encoder_attn` (WhisperForConditionalGeneration). `frames`: the encoder's output length (1500
    for Whisper's 30 s of audio); `max_cache_len`: decoder positions."""

    def __init__(self, model, *, batch_size: int = 1, max_cache_len: int = 448, frames: int | None = None):
        super().__init__()
        from transformers.cache_utils import EncoderDecoderCache, StaticCache

        self.model = model.eval()
        config = model.config
        self.frames = frames or config.max_source_positions
        self.heads = config.decoder_attention_heads
        self.head_dim = config.d_model // self.heads
        dtype, device = model.dtype, model.device
        self_cache = StaticCache(config=config, max_cache_len=max_cache_len)
        self_cache.early_initialization(batch_size, self.heads, self.head_dim, dtype, device)
        cross_cache = StaticCache(config=config, max_cache_len=self.frames)
        cross_cache.early_initialization(batch_size, self.heads, self.head_dim, dtype, device)
        self.cache = EncoderDecoderCache(self_cache, cross_cache)
        layers: list = [*zip(self_cache.layers, cross_cache.layers)]  # static layers: keys and values
        for i, (mine, cross) in enumerate(layers):
            self.register_buffer(f"key_cache_{i}", mine.keys, persistent=False)
            self.register_buffer(f"value_cache_{i}", mine.values, persistent=False)
            self.register_buffer(f"cross_key_{i}", cross.keys, persistent=False)
            self.register_buffer(f"cross_value_{i}", cross.values, persistent=False)
        self.batch_size = batch_size

    def encode(self, input_features: torch.Tensor) -> torch.Tensor:
        """Log-mel features [batch, mels, 2 * frames] -> the encoder's output, with every decoder
        layer's cross-attention keys and values written into the cache."""
        hidden = self.model.get_encoder()(input_features).last_hidden_state
        shape = (hidden.shape[0], -1, self.heads, self.head_dim)
        for i, layer in enumerate(self.model.get_decoder().layers):
            attn = layer.encoder_attn
            self.get_buffer(f"cross_key_{i}").copy_(attn.k_proj(hidden).view(shape).transpose(1, 2))
            self.get_buffer(f"cross_value_{i}").copy_(attn.v_proj(hidden).view(shape).transpose(1, 2))
        return hidden

    def decode(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """Decoder tokens [batch, n] at `cache_position` -> logits [batch, n, vocab]."""
        for layer in self.cache.self_attention_cache.layers:
            written = getattr(layer, "cumulative_length", None)  # (transformers >= 5: positions written)
            if isinstance(written, torch.Tensor):
                written.copy_(cache_position[0])
        for i in range(len(self.cache.cross_attention_cache.layers)):
            self.cache.is_updated[i] = True  # the keys and values encode wrote: never projected here
        # the decoder attends across only where it is given encoder states; their values are unused
        # (the cache holds the projections), so one frame of zeros stands for them
        stand_in = torch.zeros(input_ids.shape[0], 1, self.model.config.d_model, dtype=self.model.dtype,
                               device=input_ids.device)
        out = self.model.get_decoder()(input_ids=input_ids, encoder_hidden_states=stand_in,
                                       past_key_values=self.cache, cache_position=cache_position, use_cache=True)
        return self.model.proj_out(out.last_hidden_state)

    def export(self, input_features: torch.Tensor, *, strict: bool = True) -> dict:
        """{"encode": ..., "decode": ...} exported programs, to compile together (one program).
        Non-strict export lifts the cache tensors decode reads through the cache object as
        constants; compile reads each as the buffer it is (aot/lifted_state.py)."""
        ids = torch.zeros(self.batch_size, 1, dtype=torch.long, device=input_features.device)
        with torch.no_grad():
            pos = torch.tensor([0], device=input_features.device)
            return {"encode": torch.export.export(_Method(self, "encode"), (), {"input_features": input_features},
                                                  strict=strict),
                    "decode": torch.export.export(_Method(self, "decode"), (),
                                                  {"input_ids": ids, "cache_position": pos}, strict=strict)}


class _Method(nn.Module):
    """One method of the recipe as a module's forward: both share the recipe's buffers by name."""

    def __init__(self, recipe: EncoderDecoderExport, name: str):
        super().__init__()
        self.recipe, self.name = recipe, name

    def forward(self, **kwargs):  # (keywords: the program is called by the recipe's own names)
        return getattr(self.recipe, self.name)(**kwargs)

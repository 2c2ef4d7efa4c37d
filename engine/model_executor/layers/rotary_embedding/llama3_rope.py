"""Llama 3's RoPE frequency rescaling for long contexts.

vLLM twin: ``vllm/model_executor/layers/rotary_embedding/llama3_rope.py``
(``Llama3RotaryEmbedding``).
Read it for ``rope_type: "llama3"`` in config.json: wavelengths shorter than
``orig_max_position / high_freq_factor`` keep their frequency, those longer
than ``orig_max_position / low_freq_factor`` are slowed down by
``scaling_factor``, and the band in between blends the two linearly.
Only ``_compute_inv_freq`` differs from plain RoPE.
Sessions: 04.
"""

from __future__ import annotations

import math

import torch

from engine.model_executor.layers.rotary_embedding.base import RotaryEmbedding


class Llama3RotaryEmbedding(RotaryEmbedding):
    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        scaling_factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        orig_max_position: int,
    ) -> None:
        # Set before super().__init__, which builds the cache through _compute_inv_freq.
        self.scaling_factor = scaling_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.orig_max_position = orig_max_position
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq(base)
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = self.orig_max_position / self.low_freq_factor  # longer: slow down
        high_freq_wavelen = self.orig_max_position / self.high_freq_factor  # shorter: keep
        if self.low_freq_factor != self.high_freq_factor:
            # 0 at the low-frequency edge, 1 at the high-frequency edge.
            smooth = (self.orig_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
        else:
            smooth = torch.zeros_like(inv_freq)
        blended = (1 - smooth) * inv_freq / self.scaling_factor + smooth * inv_freq
        return torch.where(
            wavelen < high_freq_wavelen,
            inv_freq,
            torch.where(wavelen > low_freq_wavelen, inv_freq / self.scaling_factor, blended),
        )

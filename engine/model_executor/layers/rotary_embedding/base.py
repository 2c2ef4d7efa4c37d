"""Rotary position embedding (RoPE) with a precomputed cos/sin table.

vLLM twin: ``vllm/model_executor/layers/rotary_embedding/base.py``
(``RotaryEmbedding``) and ``common.py`` (the rotation itself).
Read it for how positions enter the model: nothing is added to the hidden
states; instead each query/key head vector is rotated pairwise by an angle
``position * inv_freq[i]``. ``cos_sin_cache`` holds ``[cos | sin]`` for every
position up to ``max_position_embeddings``, so ``forward`` is one
``index_select`` by the step's flattened ``positions`` plus elementwise math.
Sessions: 04.

A ``CustomOp`` registered as ``"rotary_embedding"``. ``forward_native`` is the
torch code below and returns query and key as new tensors; ``forward_cuda``
calls the Triton kernel ``rotary_embedding`` from ``engine/_custom_ops.py``,
which rotates ``query`` and ``key`` *in place* (one launch for both, instead
of ~15 small torch ops) and returns the same tensors -- vLLM's contract.

Simpler than vLLM: no ``RotaryEmbeddingBase`` split, no FlashInfer/AITER rope
kernels; the CPU runs the torch code (vLLM has a CPU C++ kernel).
"""

from __future__ import annotations

import torch

from engine._cpu_ops import cpu_kernels
from engine.model_executor.custom_op import CustomOp
from engine.model_executor.layers import cpu_fused


def apply_rotary_emb(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool
) -> torch.Tensor:
    """Rotate ``x: [T, heads, rotary_dim]`` by ``cos, sin: [T, rotary_dim / 2]``.

    Neox style pairs element ``i`` with ``i + rotary_dim/2`` (two halves);
    GPT-J style pairs neighbours ``2i`` and ``2i+1`` (interleaved).
    """
    cos = cos.unsqueeze(-2).to(x.dtype)  # [T, 1, rotary_dim / 2], broadcast over heads
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


@CustomOp.register("rotary_embedding")
class RotaryEmbedding(CustomOp):
    """Plain RoPE: ``inv_freq[i] = base ** (-2i / rotary_dim)``."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if rotary_dim > head_size or rotary_dim % 2 != 0:
            raise ValueError(
                f"rotary_dim must be even and <= head_size ({head_size}), got {rotary_dim}"
            )
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.dtype = dtype
        cache = self._compute_cos_sin_cache().to(dtype)
        # Not persistent: rebuilt from the config, never read from a checkpoint.
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim
        return 1.0 / (base**exponents)  # [rotary_dim / 2]

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.base)
        t = torch.arange(self.max_position_embeddings, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)  # [max_pos, rotary_dim / 2]: angle per (position, pair)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, rotary_dim]

    def forward_native(
        self,
        positions: torch.Tensor,  # [T] int64, one position per flattened token
        query: torch.Tensor,  # [T, num_heads * head_size]
        key: torch.Tensor | None = None,  # [T, num_kv_heads * head_size]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = positions.flatten()
        num_tokens = positions.shape[0]
        self._match_cos_sin_cache_device(query)
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return self._rotate(query, cos, sin, num_tokens), (
            None if key is None else self._rotate(key, cos, sin, num_tokens)
        )

    def forward_cuda(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, num_heads * head_size] (or [T, num_heads, head_size])
        key: torch.Tensor | None = None,  # [T, num_kv_heads * head_size]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from engine import _custom_ops as ops

        self._match_cos_sin_cache_device(query)
        # In place: query and key (views of the qkv output) are rotated where they lie.
        ops.rotary_embedding(
            positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox_style
        )
        return query, key

    def forward_cpu(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, num_heads * head_size]
        key: torch.Tensor | None = None,  # [T, num_kv_heads * head_size]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if query.dtype != torch.float32 or (key is not None and key.dtype != torch.float32):
            return self.forward_native(positions, query, key)
        self._match_cos_sin_cache_device(query)
        kernels = cpu_kernels()
        if (
            kernels is not None
            and self.cos_sin_cache.dtype == torch.float32
            and all(
                t.stride(-1) == 1 and (t.dim() == 2 or t.is_contiguous())
                for t in (query, key)
                if t is not None
            )
        ):
            # csrc/cpu/pos_encoding.cpp: one in-place call for q and k.
            kernels.rotary_embedding(
                positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox_style
            )
            return query, key
        # In place, like forward_cuda, with ~12 torch ops instead of ~30 (bit-identical).
        cpu_fused.rotary_embedding_(
            positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox_style
        )
        return query, key

    def _match_cos_sin_cache_device(self, query: torch.Tensor) -> None:
        # Models are built on their device; this only fires for a module built
        # on one device and called on another.
        if self.cos_sin_cache.device != query.device:
            self.cos_sin_cache = self.cos_sin_cache.to(query.device)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_tokens: int):
        shape = x.shape
        heads = (
            x.numel() // max(num_tokens, 1) // self.head_size
        )  # explicit: -1 is ambiguous at T=0
        x = x.view(num_tokens, heads, self.head_size)  # [T, heads, head_size]
        # Only the first rotary_dim features rotate (partial RoPE); the rest pass.
        x_rot = apply_rotary_emb(x[..., : self.rotary_dim], cos, sin, self.is_neox_style)
        return torch.cat((x_rot, x[..., self.rotary_dim :]), dim=-1).reshape(shape)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
            f"is_neox_style={self.is_neox_style}"
        )

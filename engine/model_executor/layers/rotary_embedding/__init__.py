"""``get_rope``: build (and share) the rotary embedding a config asks for.

vLLM twin: ``vllm/model_executor/layers/rotary_embedding/__init__.py``
(``get_rope``).
Read it for how ``rope_parameters`` from config.json picks the RoPE variant
(``rope_type``), its base (``rope_theta``) and how much of each head rotates
(``partial_rotary_factor``), and for the module cache: every layer of a model
asks for the same RoPE, so all of them share one module and one cos/sin table.
Sessions: 04.

Simpler than vLLM: two variants, ``"default"`` and ``"llama3"``; any other
``rope_type`` (yarn, dynamic NTK, mrope...) is rejected with an error.
Different from vLLM: the cache lasts for the build of one model
(``initialize_model`` empties it). vLLM's lasts for the process, which serves
one engine; here engines come and go in one process (notebooks, tests), and
a module shared between a compiled and an eager model would carry one
model's custom-op choice into the other and keep its cos/sin table alive.
The signature is vLLM's at the pinned commit (older vLLM took ``rotary_dim``,
``base`` and ``rope_scaling`` separately; they now live in ``rope_parameters``).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from engine.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

SUPPORTED_ROPE_TYPES = ("default", "llama3")

_ROPE_DICT: dict[tuple[Any, ...], RotaryEmbedding] = {}


def get_rope(
    head_size: int,
    max_position: int,
    is_neox_style: bool = True,
    rope_parameters: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding:
    if dtype is None:
        dtype = torch.get_default_dtype()
    rope_parameters = dict(rope_parameters or {})
    base = float(rope_parameters.get("rope_theta", 10000.0))
    rope_type = rope_parameters.get("rope_type", "default")
    partial_rotary_factor = rope_parameters.get("partial_rotary_factor", 1.0)
    if not 0.0 < partial_rotary_factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial_rotary_factor}")
    rotary_dim = int(rope_parameters.get("rope_dim") or head_size * partial_rotary_factor)

    # Lists become tuples so the parameters can be part of the cache key.
    params_key = tuple(
        sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rope_parameters.items())
    )
    device = torch.get_default_device()
    key = (head_size, rotary_dim, max_position, is_neox_style, params_key, dtype, device)
    if key in _ROPE_DICT:
        return _ROPE_DICT[key]

    if rope_type == "default":
        rotary_emb = RotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style, dtype
        )
    elif rope_type == "llama3":
        try:
            rotary_emb = Llama3RotaryEmbedding(
                head_size,
                rotary_dim,
                max_position,
                base,
                is_neox_style,
                dtype,
                scaling_factor=float(rope_parameters["factor"]),
                low_freq_factor=float(rope_parameters["low_freq_factor"]),
                high_freq_factor=float(rope_parameters["high_freq_factor"]),
                orig_max_position=int(rope_parameters["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ValueError(
                f"rope_type 'llama3' needs rope parameter {e.args[0]!r}; got {rope_parameters}"
            ) from None
    else:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported by Glassbox; "
            f"supported rope types: {list(SUPPORTED_ROPE_TYPES)}"
        )
    _ROPE_DICT[key] = rotary_emb
    return rotary_emb


def clear_rope_cache() -> None:
    """Forget the shared modules: the next model builds its own."""
    _ROPE_DICT.clear()


__all__ = [
    "get_rope",
    "clear_rope_cache",
    "RotaryEmbedding",
    "Llama3RotaryEmbedding",
    "SUPPORTED_ROPE_TYPES",
]

"""A tiny EAGLE-1 head checkpoint for a tiny target, laid out as published ones.

``yuhuili/EAGLE-LLaMA3-Instruct-8B`` and its kind hold a Llama ``config.json``
(one hidden layer, the target's sizes) and tensors named ``fc.weight``,
``layers.0.*`` (no input norm in layer 0) and, in some, ``embed_tokens.weight``
-- no ``model.`` prefix, no final norm, no LM head. Weights are random.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def save_tiny_eagle_checkpoint(
    path: Path,
    target_config: dict[str, Any],
    seed: int = 0,
    with_embed: bool = False,
    scale: float = 0.2,
) -> Path:
    """Write an EAGLE-1 head for a target of ``target_config`` into ``path``."""
    hidden = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    kv_heads = target_config.get("num_key_value_heads", heads)
    head_dim = target_config.get("head_dim") or hidden // heads
    inter = target_config["intermediate_size"]
    vocab = target_config["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": target_config["max_position_embeddings"],
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6),
        "rope_theta": target_config.get("rope_theta", 10000.0),
        "bos_token_id": target_config.get("bos_token_id", 1),
        "eos_token_id": target_config.get("eos_token_id", 2),
    }
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    p = "layers.0."
    tensors = {
        "fc.weight": rand(hidden, 2 * hidden),
        p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": rand(inter, hidden),
        p + "mlp.up_proj.weight": rand(inter, hidden),
        p + "mlp.down_proj.weight": rand(hidden, inter),
        p + "post_attention_layernorm.weight": torch.ones(hidden),
    }
    if with_embed:
        tensors["embed_tokens.weight"] = rand(vocab, hidden)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path

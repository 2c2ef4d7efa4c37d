"""Qwen2, written with Glassbox's layers (inference only, HF checkpoint names).

vLLM twin: ``vllm/model_executor/models/qwen2.py``.
Read it next to ``llama.py``: the decoder is the same; what differs is
configuration -- q/k/v projections always carry a bias (``o_proj`` doesn't),
the RoPE base defaults to 1e6, ``head_dim`` is ``hidden_size / num_heads``,
and a tied LM head *is* the embedding module (vLLM assigns
``lm_head = model.embed_tokens`` here, where Llama ties a ``ParallelLMHead``).
Qwen3 reuses the MLP, the decoder layer (through ``make_attention``), the
model body and the causal-LM wrapper (through ``model_cls``), as vLLM does.
Sessions: 04.

``glassbox_config.quant_config`` reaches every linear layer and the
vocabulary (FP8; GGUF files are loaded for Llama only). LoRA wraps the
projections from outside (engine/lora/).

Simpler than vLLM: no pipeline parallelism, dual-chunk attention, sliding
windows or encoder-only variant.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.compilation.decorators import support_torch_compile
from engine.distributed.parallel_state import get_tensor_model_parallel_world_size
from engine.model_executor.layers.activation import SiluAndMul
from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.layernorm import RMSNorm
from engine.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
)
from engine.model_executor.layers.logits_processor import LogitsProcessor
from engine.model_executor.layers.rotary_embedding import get_rope
from engine.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from engine.model_executor.models.utils import (
    AutoWeightsLoader,
    get_rope_parameters,
    load_stacked_weights,
    make_layers,
    maybe_prefix,
)

if TYPE_CHECKING:
    from engine.config import GlassboxConfig
    from engine.model_executor.layers.quantization import QuantizationConfig

QWEN_DEFAULT_ROPE_THETA = 1_000_000.0


class Qwen2MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(
                f"hidden_act must be 'silu' (the only activation supported), got {hidden_act!r}"
            )
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size] * 2,
            bias=False,
            prefix=f"{prefix}.gate_up_proj",
            quant_config=quant_config,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=False,
            prefix=f"{prefix}.down_proj",
            quant_config=quant_config,
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)  # [T, 2 * inter]
        x = self.act_fn(gate_up)  # [T, inter]
        x, _ = self.down_proj(x)  # [T, hidden]
        return x


class Qwen2Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        rope_parameters: dict[str, Any],
        *,
        glassbox_config: GlassboxConfig,
        max_position: int = 4096 * 32,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = num_heads
        self.num_heads = divide(num_heads, tp_size)  # this rank's query heads
        self.total_num_kv_heads = num_kv_heads
        # Fewer KV heads than ranks: each rank keeps one (QKVParallelLinear replicates it).
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.head_dim = hidden_size // num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5

        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=True,
            prefix=f"{prefix}.qkv_proj",
            quant_config=glassbox_config.quant_config,
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            hidden_size,
            bias=False,
            prefix=f"{prefix}.o_proj",
            quant_config=glassbox_config.quant_config,
        )
        self.rotary_emb = get_rope(
            self.head_dim, max_position=max_position, rope_parameters=rope_parameters
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            glassbox_config=glassbox_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)  # [T, (H + 2 * H_kv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)  # [T, H * D]
        output, _ = self.o_proj(attn_output)
        return output


class Qwen2DecoderLayer(nn.Module):
    def __init__(
        self, config: dict[str, Any], glassbox_config: GlassboxConfig, prefix: str = ""
    ) -> None:
        super().__init__()
        self.hidden_size = config["hidden_size"]
        eps = config.get("rms_norm_eps", 1e-6)
        self.self_attn = self.make_attention(config, glassbox_config, f"{prefix}.self_attn")
        self.mlp = Qwen2MLP(
            self.hidden_size,
            config["intermediate_size"],
            config.get("hidden_act", "silu"),
            prefix=f"{prefix}.mlp",
            quant_config=glassbox_config.quant_config,
        )
        self.input_layernorm = RMSNorm(self.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(self.hidden_size, eps=eps)

    @staticmethod
    def make_attention(
        config: dict[str, Any], glassbox_config: GlassboxConfig, prefix: str
    ) -> nn.Module:
        """The one piece a Qwen variant swaps (Qwen3: q/k norm, explicit head_dim)."""
        return Qwen2Attention(
            hidden_size=config["hidden_size"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            rope_parameters=get_rope_parameters(config, default_theta=QWEN_DEFAULT_ROPE_THETA),
            glassbox_config=glassbox_config,
            max_position=config.get("max_position_embeddings", 4096 * 32),
            prefix=prefix,
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


@support_torch_compile
class Qwen2Model(nn.Module):
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(
        self,
        *,
        glassbox_config: GlassboxConfig,
        prefix: str = "",
        decoder_layer_type: type[nn.Module] = Qwen2DecoderLayer,
    ) -> None:
        super().__init__()
        config = glassbox_config.model_config.hf_config
        self.config = config
        self.prefix = prefix
        self.vocab_size = config["vocab_size"]
        self.embed_tokens = VocabParallelEmbedding(
            config["vocab_size"],
            config["hidden_size"],
            prefix=f"{prefix}.embed_tokens",
            quant_config=glassbox_config.quant_config,
        )
        self.layers = make_layers(
            config["num_hidden_layers"],
            lambda prefix: decoder_layer_type(
                config=config, glassbox_config=glassbox_config, prefix=prefix
            ),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config["hidden_size"], eps=config.get("rms_norm_eps", 1e-6))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T]
        positions: torch.Tensor,  # [T]
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        hidden_states = (
            inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        )
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_stacked_weights(self, weights, self.stacked_params_mapping, self.prefix)


class Qwen2ForCausalLM(nn.Module):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # The model body; Qwen3ForCausalLM swaps in Qwen3Model.
    model_cls: type[nn.Module] = Qwen2Model

    def __init__(self, *, glassbox_config: GlassboxConfig, prefix: str = "") -> None:
        super().__init__()
        config = glassbox_config.model_config.hf_config
        self.config = config
        self.model = self.model_cls(
            glassbox_config=glassbox_config, prefix=maybe_prefix(prefix, "model")
        )
        if config.get("tie_word_embeddings", False):
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(
                config["vocab_size"],
                config["hidden_size"],
                prefix=maybe_prefix(prefix, "lm_head"),
                quant_config=glassbox_config.quant_config,
            )
        self.logits_processor = LogitsProcessor(config["vocab_size"])

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)  # [N, vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(
            self,
            skip_prefixes=["lm_head."] if self.config.get("tie_word_embeddings", False) else None,
        )
        return loader.load_weights(weights)

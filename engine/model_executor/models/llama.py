"""Llama, written with Glassbox's layers (inference only, HF checkpoint names).

vLLM twin: ``vllm/model_executor/models/llama.py``.
Read it for the shape of every vLLM decoder model:
  * the batch is flat: ``input_ids`` and ``positions`` are ``[T]`` with the
    tokens of all scheduled requests concatenated (no padding, no batch dim);
    only the ``Attention`` layer knows where one request ends (forward context);
  * q/k/v come out of one fused ``qkv_proj`` matmul and gate/up out of one
    ``gate_up_proj``; ``load_weights`` maps HF's separate tensors into them;
  * residual connections go through the norms (``RMSNorm(x, residual)``), so a
    layer returns ``(hidden_states, residual)`` and the final norm adds the
    last residual;
  * ``forward`` returns hidden states ``[T, hidden]``; ``compute_logits`` is a
    separate call on the few rows that sample (one per request).
Sessions: 04 (worker), 05 (attention).

``glassbox_config.quant_config`` reaches every linear layer and the
vocabulary (``quant_config=``), as in vLLM. A GGUF Llama keeps llama.cpp's
q/k row order, whose rotary pairs are adjacent features (GPT-J style), so
its RoPE runs with ``is_neox_style=False`` instead of the rows being
permuted back (vLLM does the same).

LoRA wraps the projections from outside (engine/lora/), as vLLM's does.

Simpler than vLLM: no pipeline parallelism, Eagle hooks or encoder-only
variant; the HF config is read as a plain dict.
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


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        quant_config: QuantizationConfig | None = None,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(
                f"hidden_act must be 'silu' (the only activation supported), got {hidden_act!r}"
            )
        # W_gate and W_up stacked: [2 * intermediate, hidden].
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size] * 2,
            bias=bias,
            prefix=f"{prefix}.gate_up_proj",
            quant_config=quant_config,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            prefix=f"{prefix}.down_proj",
            quant_config=quant_config,
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)  # [T, 2 * inter]
        x = self.act_fn(gate_up)  # [T, inter]
        x, _ = self.down_proj(x)  # [T, hidden]
        return x


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: dict[str, Any],
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        glassbox_config: GlassboxConfig,
        quant_config: QuantizationConfig | None = None,
        max_position_embeddings: int = 8192,
        bias: bool = False,
        bias_o_proj: bool = False,
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
        self.head_dim = config.get("head_dim") or hidden_size // num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.max_position_embeddings = max_position_embeddings

        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=bias,
            prefix=f"{prefix}.qkv_proj",
            quant_config=quant_config,
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            hidden_size,
            bias=bias_o_proj,
            prefix=f"{prefix}.o_proj",
            quant_config=quant_config,
        )
        # llama.cpp's q/k rows pair adjacent features (see the module docstring).
        is_gguf = quant_config is not None and quant_config.get_name() == "gguf"
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=max_position_embeddings,
            is_neox_style=not (is_gguf and config.get("model_type", "llama") == "llama"),
            rope_parameters=get_rope_parameters(config),
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
        output, _ = self.o_proj(attn_output)  # [T, hidden]
        return output


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        prefix: str = "",
        config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        config = config or glassbox_config.model_config.hf_config
        self.hidden_size = config["hidden_size"]
        # attention_bias covers q/k/v and o_proj; InternLM-style "bias" too.
        attention_bias = bool(config.get("attention_bias", False) or config.get("bias", False))
        bias_o_proj = attention_bias
        if "qkv_bias" in config:  # internlm3: bias on q/k/v only
            attention_bias = bool(config["qkv_bias"])
        self.self_attn = LlamaAttention(
            config,
            hidden_size=self.hidden_size,
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            glassbox_config=glassbox_config,
            quant_config=glassbox_config.quant_config,
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            bias=attention_bias,
            bias_o_proj=bias_o_proj,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = LlamaMLP(
            self.hidden_size,
            config["intermediate_size"],
            config.get("hidden_act", "silu"),
            quant_config=glassbox_config.quant_config,
            bias=bool(config.get("mlp_bias", False)),
            prefix=f"{prefix}.mlp",
        )
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(self.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(self.hidden_size, eps=eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # residual is None only for layer 0 (nothing to add yet).
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        # The MLP output is not yet added to residual: the next norm does it.
        return hidden_states, residual


@support_torch_compile
class LlamaModel(nn.Module):
    # HF checkpoint tensor -> (fused parameter, shard id in it)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(
        self,
        *,
        glassbox_config: GlassboxConfig,
        prefix: str = "",
        layer_type: type[nn.Module] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        config = glassbox_config.model_config.hf_config
        self.config = config
        self.prefix = prefix
        self.vocab_size = config["vocab_size"]
        self.embed_tokens = VocabParallelEmbedding(
            self.vocab_size,
            config["hidden_size"],
            prefix=f"{prefix}.embed_tokens",
            quant_config=glassbox_config.quant_config,
        )
        self.layers = make_layers(
            config["num_hidden_layers"],
            lambda prefix: layer_type(glassbox_config=glassbox_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config["hidden_size"], eps=config.get("rms_norm_eps", 1e-6))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T]
        positions: torch.Tensor,  # [T]
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden], instead of input_ids
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


class LlamaForCausalLM(nn.Module):
    # Which HF tensors each fused parameter packs (vLLM uses it for LoRA/quant).
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(
        self,
        *,
        glassbox_config: GlassboxConfig,
        prefix: str = "",
        layer_type: type[nn.Module] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        config = glassbox_config.model_config.hf_config
        self.config = config
        self.model = LlamaModel(
            glassbox_config=glassbox_config,
            prefix=maybe_prefix(prefix, "model"),
            layer_type=layer_type,
        )
        self.lm_head = ParallelLMHead(
            config["vocab_size"],
            config["hidden_size"],
            prefix=maybe_prefix(prefix, "lm_head"),
            quant_config=glassbox_config.quant_config,
        )
        if config.get("tie_word_embeddings", False):
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(
            config["vocab_size"], scale=config.get("logit_scale", 1.0)
        )

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
        # [N, hidden] -> [N, vocab]; N = rows that sample this step.
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(
            self,
            # A tied head has no tensor of its own (some checkpoints still store one).
            skip_prefixes=["lm_head."] if self.config.get("tie_word_embeddings", False) else None,
        )
        return loader.load_weights(weights)

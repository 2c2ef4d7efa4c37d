"""Qwen3 (dense), written with Glassbox's layers.

vLLM twin: ``vllm/model_executor/models/qwen3.py``.
Read it for what Qwen3 changes relative to Qwen2: an RMSNorm over each query
and key head (``q_norm``/``k_norm``, over ``head_dim``) *before* RoPE, no q/k/v
bias by default (``attention_bias``), and an explicit ``head_dim`` that may
differ from ``hidden_size / num_heads``.

What vLLM's ``qwen3.py`` takes from ``qwen2.py`` is two names: the MLP
(``Qwen2MLP``, imported as ``Qwen3MLP``) and ``Qwen2Model``, which its
``Qwen3Model`` subclasses, passing ``decoder_layer_type=Qwen3DecoderLayer``:
the embedding, the stack of layers, the final norm and the loading of the
stacked q/k/v and gate/up weights are Qwen2's. ``Qwen3Attention``,
``Qwen3DecoderLayer`` (an ``nn.Module`` of its own that repeats Qwen2's
norm, attention, norm, MLP order) and ``Qwen3ForCausalLM`` (its own LM head
and ``load_weights``, whose ``AutoWeightsLoader`` hands the body's weights to
``Qwen2Model.load_weights``) are classes of vLLM's ``qwen3.py``. Glassbox
reuses more: its ``Qwen3DecoderLayer`` subclasses ``Qwen2DecoderLayer`` and
only swaps the attention (``make_attention``), and its ``Qwen3ForCausalLM``
subclasses ``Qwen2ForCausalLM`` with ``model_cls = Qwen3Model``; the layers
compute the same as vLLM's.

On CUDA the q/k norms and RoPE run as one kernel, ``fused_qk_norm_rope``
(``engine/_custom_ops.py``), in place on the qkv output. vLLM reaches the same
op through a torch.compile pass that rewrites the graph
(``vllm/compilation/passes/fusion/qk_norm_rope_fusion.py``); Glassbox has no
compile passes, so ``Qwen3Attention.forward`` calls it directly.

In vLLM at 52a31cc a dense Qwen3 runs on model runner V2
(``vllm/v1/worker/gpu/``) by default: ``Qwen3ForCausalLM`` is the one entry
of ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`` (``vllm/config/vllm.py``; not
for MoE or quantized checkpoints, and ``VLLM_USE_V2_MODEL_RUNNER`` overrides
it). Glassbox's runner mirrors V1 (``vllm/v1/worker/gpu_model_runner.py``).
Sessions: 04.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.distributed.parallel_state import get_tensor_model_parallel_world_size
from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.layernorm import RMSNorm
from engine.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear, divide
from engine.model_executor.layers.rotary_embedding import get_rope
from engine.model_executor.models.qwen2 import (
    QWEN_DEFAULT_ROPE_THETA,
    Qwen2DecoderLayer,
    Qwen2ForCausalLM,
    Qwen2Model,
)
from engine.model_executor.models.utils import get_rope_parameters

if TYPE_CHECKING:
    from engine.config import GlassboxConfig


class Qwen3Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        rope_parameters: dict[str, Any],
        *,
        glassbox_config: GlassboxConfig,
        max_position: int = 4096 * 32,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-6,
        qkv_bias: bool = False,
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
        self.head_dim = head_dim or hidden_size // num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5

        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=qkv_bias,
            prefix=f"{prefix}.qkv_proj",
            quant_config=glassbox_config.quant_config,
        )
        # [H * D] -> hidden: with an explicit head_dim, H * D need not equal hidden.
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
        self.q_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)
        self._use_fused_qk_norm_rope: bool | None = None  # decided on first use

    @property
    def use_fused_qk_norm_rope(self) -> bool:
        # The fused kernel stands in for both custom ops, so it needs both enabled
        # (not under Inductor, whose default custom_ops "none" fuses the plain torch).
        # Decided once, like a CustomOp's dispatch: after support_torch_compile has
        # applied custom_ops, and not again on every forward.
        if self._use_fused_qk_norm_rope is None:
            enabled = self.q_norm.is_enabled() and self.rotary_emb.is_enabled()
            self._use_fused_qk_norm_rope = enabled
        return self._use_fused_qk_norm_rope

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)  # [T, (H + 2 * H_kv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # views of qkv
        if qkv.is_cuda and qkv.dtype == self.q_norm.weight.dtype and self.use_fused_qk_norm_rope:
            from engine import _custom_ops as ops

            # One launch: per-head RMSNorm of q and k, then RoPE, in place on
            # qkv (so the q and k views above see the result).
            ops.fused_qk_norm_rope(
                qkv,
                self.num_heads,
                self.num_kv_heads,
                self.num_kv_heads,
                self.head_dim,
                self.q_norm.variance_epsilon,
                self.q_norm.weight,
                self.k_norm.weight,
                self.rotary_emb.cos_sin_cache,
                self.rotary_emb.is_neox_style,
                positions,
            )
        else:
            # Per-head RMSNorm: view as [T, heads, D], normalise over D, flatten back.
            q_by_head = self.q_norm(q.reshape(*q.shape[:-1], self.num_heads, self.head_dim))
            q = q_by_head.view(q.shape)
            k_by_head = self.k_norm(k.reshape(*k.shape[:-1], self.num_kv_heads, self.head_dim))
            k = k_by_head.view(k.shape)
            q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)  # [T, H * D]
        output, _ = self.o_proj(attn_output)  # [T, hidden]
        return output


class Qwen3DecoderLayer(Qwen2DecoderLayer):
    """Qwen2's decoder layer with Qwen3's attention."""

    @staticmethod
    def make_attention(
        config: dict[str, Any], glassbox_config: GlassboxConfig, prefix: str
    ) -> nn.Module:
        return Qwen3Attention(
            hidden_size=config["hidden_size"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            rope_parameters=get_rope_parameters(config, default_theta=QWEN_DEFAULT_ROPE_THETA),
            glassbox_config=glassbox_config,
            max_position=config.get("max_position_embeddings", 4096 * 32),
            head_dim=config.get("head_dim"),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            qkv_bias=bool(config.get("attention_bias", False)),
            prefix=prefix,
        )


class Qwen3Model(Qwen2Model):
    def __init__(self, *, glassbox_config: GlassboxConfig, prefix: str = "") -> None:
        super().__init__(
            glassbox_config=glassbox_config, prefix=prefix, decoder_layer_type=Qwen3DecoderLayer
        )


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    model_cls = Qwen3Model

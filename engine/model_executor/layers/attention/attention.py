"""The ``Attention`` layer: the one place a model touches the paged KV cache.

vLLM twin: ``vllm/model_executor/layers/attention/attention.py`` (``Attention``).
Read it for the hand-off between model code and attention backends:
  * at construction the layer asks the selector for a backend class and builds
    that backend's ``impl``; its ``prefix`` (e.g.
    ``"model.layers.0.self_attn.attn"``) becomes ``layer_name``, the key the
    model runner uses for this layer's KV cache tensor and metadata;
  * after KV allocation the model runner binds ``self.kv_cache``
    (``[2, num_blocks, block_size, num_kv_heads, head_size]``);
  * ``get_kv_cache_spec`` tells the KV cache manager what one block of this
    layer costs;
  * ``forward(q, k, v)`` calls the custom op
    ``torch.ops.glassbox.unified_attention_with_output(q, k, v, out, layer_name)``;
    the op finds the layer and this step's metadata in the forward context by
    ``layer_name`` and lets ``impl`` write the new K/V into the cache and
    attend. The model's ``forward(input_ids, positions)`` never sees a block
    table.
Why a custom op: to torch.compile it is one opaque node that writes ``out``.
Dynamo does not trace into the backend's Python (which changes with every
step's metadata), and the compiler splits the model's graph at these nodes
(``CompilationConfig.splitting_ops``): everything between two attentions
becomes one piece that can be fused and captured in a piecewise CUDA graph.
Sessions: 05 (attention), 04 (worker binds the cache), 06 (compilation).

Simpler than vLLM: no KV-cache quantization scales, sliding windows, KV
sharing, and the KV write is part of the attention op (vLLM splits it into
``unified_kv_cache_update`` for some backends).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.forward_context import get_forward_context
from engine.utils.torch_utils import DTYPE_TO_STR, direct_register_custom_op
from engine.v1.kv_cache_interface import FullAttentionSpec

if TYPE_CHECKING:
    from engine.config import GlassboxConfig
    from engine.v1.attention.backend import AttentionBackend


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        glassbox_config: GlassboxConfig,
        prefix: str,
        attn_backend: type[AttentionBackend] | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a positive multiple of "
                f"num_kv_heads ({num_kv_heads})"
            )
        if not prefix:
            raise ValueError(
                "Attention needs its layer name as prefix, e.g. 'model.layers.0.self_attn.attn'"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_name = prefix
        # Models are built under the model dtype as torch's default (see the
        # model loader); the KV cache uses the same dtype.
        self.dtype = torch.get_default_dtype()
        if attn_backend is None:
            from engine.v1.attention.selector import get_attn_backend

            attn_backend = get_attn_backend(glassbox_config)
        self.attn_backend = attn_backend
        self.impl = attn_backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads)
        # Bound by the model runner once the KV cache is allocated.
        self.kv_cache: torch.Tensor | None = None
        # Where the custom op finds this layer (through the forward context).
        layers = glassbox_config.compilation_config.static_forward_context
        if prefix in layers:
            raise ValueError(f"duplicate attention layer name {prefix!r}")
        layers[prefix] = self

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads * head_size]
        key: torch.Tensor,  # [T, num_kv_heads * head_size]
        value: torch.Tensor,  # [T, num_kv_heads * head_size]
    ) -> torch.Tensor:  # [T, num_heads * head_size]
        num_tokens = query.shape[0]
        output = torch.empty(
            num_tokens, self.num_heads * self.head_size, dtype=query.dtype, device=query.device
        )
        torch.ops.glassbox.unified_attention_with_output(
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
            value.view(num_tokens, self.num_kv_heads, self.head_size),
            output.view(num_tokens, self.num_heads, self.head_size),  # written in place
            self.layer_name,
        )
        return output

    def _get_layer_metadata(self, attn_metadata: dict[str, Any]) -> Any:
        try:
            return attn_metadata[self.layer_name]
        except KeyError:
            raise KeyError(
                f"no attention metadata for layer {self.layer_name!r}; the forward context has "
                f"{sorted(attn_metadata)[:4]}{'...' if len(attn_metadata) > 4 else ''}"
            ) from None

    def get_attn_backend(self) -> type[AttentionBackend]:
        return self.attn_backend

    def get_kv_cache_spec(self, glassbox_config: GlassboxConfig) -> FullAttentionSpec:
        if self.dtype not in DTYPE_TO_STR:
            raise ValueError(
                f"KV cache dtype must be one of {list(DTYPE_TO_STR.values())}, got {self.dtype}"
            )
        return FullAttentionSpec(
            block_size=glassbox_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=DTYPE_TO_STR[self.dtype],
        )

    def extra_repr(self) -> str:
        return (
            f"layer_name={self.layer_name!r}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"scale={self.scale:.4g}, "
            f"backend={self.impl.__class__.__name__}"
        )


def unified_attention_with_output(
    query: torch.Tensor,  # [T, num_heads, head_size]
    key: torch.Tensor,  # [T, num_kv_heads, head_size]
    value: torch.Tensor,  # [T, num_kv_heads, head_size]
    output: torch.Tensor,  # [T, num_heads, head_size], written
    layer_name: str,
) -> None:
    forward_context = get_forward_context()
    try:
        layer = forward_context.no_compile_layers[layer_name]
    except KeyError:
        raise KeyError(
            f"attention layer {layer_name!r} is not in the forward context; pass the "
            "GlassboxConfig the model was built with to set_forward_context"
        ) from None
    if forward_context.attn_metadata is None:
        # Profiling / dummy run: no KV cache exists yet, nothing to attend over.
        output.zero_()
        return
    metadata = layer._get_layer_metadata(forward_context.attn_metadata)
    # Under piecewise graphs the tensors carry padding rows past the batch's
    # tokens; attention reads and writes only the real ones.
    n = getattr(metadata, "num_actual_tokens", query.shape[0])
    if n < query.shape[0]:
        query, key, value, output = query[:n], key[:n], value[:n], output[:n]
    layer.impl.forward(layer, query, key, value, layer.kv_cache, metadata, output)


def unified_attention_with_output_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """What the compiler sees while tracing: the op changes no shape."""
    return


direct_register_custom_op(
    "unified_attention_with_output",
    unified_attention_with_output,
    mutates_args=["output"],
    fake_impl=unified_attention_with_output_fake,
)

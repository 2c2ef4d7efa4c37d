"""GGUF: llama.cpp's quantized weights, kept quantized in memory.

vLLM twin: ``vllm/model_executor/layers/quantization/gguf.py``
(``GGUFConfig``, ``GGUFLinearMethod``, ``GGUFEmbeddingMethod``,
``fused_mul_mat_gguf``, ``apply_gguf_embedding``).
Read it for the three levels of base_config.py on one scheme:

  Config  ``GGUFConfig``: every linear layer and the vocabulary are GGUF,
          except the modules whose GGUF tensors are plain floats
          (``unquantized_modules``, filled by the loader from the file);
  Method  ``GGUFLinearMethod.create_weights`` registers ``qweight`` (the raw
          blocks, ``uint8``) and ``qweight_type`` (which block format) instead
          of ``weight``; the loader hands each q/k/v or gate/up shard to the
          fused layer's weight loader, which keeps them aside until
          ``process_weights_after_loading`` stacks their rows;
  Kernel  ``fused_mul_mat_gguf``: dequantize (gguf_kernels.py: torch, Triton on
          CUDA), then matmul.
          The embedding dequantizes only the looked-up rows.

A fused layer's shards may come in different formats (q in Q4_1, v in Q8_0 is
common in llama.cpp files); then each is dequantized on its own and the rows
are concatenated. Sessions: 06 (quantization).

Simpler than vLLM: formats Q4_0, Q4_1, Q8_0 (and F32/F16/BF16 tensors); no
fused MMVQ/MMQ kernels (the whole weight is dequantized each call, so memory
stays small but a CPU step is slower than the float model's); no MoE.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from engine.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from engine.model_executor.layers.quantization.gguf_kernels import (
    DEQUANT_TYPES,
    UNQUANTIZED_TYPES,
    ggml_dequantize,
    ggml_dequantize_rows,
    ggml_type_name,
)


class GGUFConfig(QuantizationConfig):
    def __init__(self, unquantized_modules: list[str] | None = None) -> None:
        # Module names (``model.layers.0.mlp.down_proj``) stored as plain floats.
        self.unquantized_modules = list(unquantized_modules or [])

    def __repr__(self) -> str:
        return f"GGUFConfig(unquantized_modules={self.unquantized_modules})"

    def get_name(self) -> str:
        return "gguf"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from engine.model_executor.layers.linear import LinearBase
        from engine.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        if any(prefix == m or prefix.endswith("." + m) for m in self.unquantized_modules):
            return None
        if isinstance(layer, LinearBase):
            return GGUFLinearMethod(self)
        if isinstance(layer, VocabParallelEmbedding):
            return GGUFEmbeddingMethod(self)
        return None


def fused_mul_mat_gguf(x: torch.Tensor, qweight: torch.Tensor, qweight_type: int) -> torch.Tensor:
    """``x [T, in] @ W.T`` for a GGUF ``W [out, in]`` stored as ``qweight``."""
    if qweight_type in UNQUANTIZED_TYPES:
        return x @ qweight.T
    out_features = qweight.shape[0]
    in_features = x.shape[-1]
    weight = ggml_dequantize(qweight, qweight_type, out_features, in_features, x.dtype)
    return F.linear(x, weight)


def apply_gguf_embedding(
    x: torch.Tensor, qweight: torch.Tensor, qweight_type: int, hidden_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``x`` (token ids) of a GGUF table ``[vocab, hidden_size]``."""
    if qweight_type in UNQUANTIZED_TYPES:
        return F.embedding(x, qweight).to(dtype)
    return ggml_dequantize_rows(qweight, x, qweight_type, hidden_size, dtype)


class GGUFLinearMethod(QuantizeMethodBase):
    def __init__(self, quant_config: GGUFConfig) -> None:
        self.quant_config = quant_config

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        self.params_dtype = params_dtype
        # Empty until process_weights_after_loading: the byte width of a row
        # depends on the format, known only once the file is read.
        qweight = Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        qweight.tensor_shape = (sum(output_partition_sizes), input_size_per_partition)
        qweight.is_gguf_weight = True
        qweight.data_container = {}  # shard id (None: unfused) -> raw rows
        layer.register_parameter("qweight", qweight)
        qweight_type = Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        qweight_type.is_gguf_weight_type = True
        qweight_type.shard_weight_type = {}  # shard id -> GGML type
        layer.register_parameter("qweight_type", qweight_type)
        for param in (qweight, qweight_type):
            for key, value in extra_weight_attrs.items():
                setattr(param, key, value)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Stack the shards' rows in the layer's order (q, k, v / gate, up)."""
        qweight, types = layer.qweight, layer.qweight_type.shard_weight_type
        container: dict = qweight.data_container
        order = sorted(container, key=_shard_order)
        name = getattr(layer, "prefix", "") or type(layer).__name__
        if not order or any(s not in types for s in order):
            raise ValueError(f"{name}: the GGUF file has no quantized tensor (or format) for it")
        shard_types = [types[s] for s in order]
        for t in shard_types:
            if t not in DEQUANT_TYPES | UNQUANTIZED_TYPES:
                raise ValueError(
                    f"{name}: GGUF format {ggml_type_name(t)} is not supported "
                    "(Q4_0, Q4_1, Q8_0, F32, F16, BF16 are)"
                )
        device = qweight.device
        if len(set(shard_types)) == 1:
            data = (
                torch.cat([container[s] for s in order]) if len(order) > 1 else container[order[0]]
            )
            layer.qweight = Parameter(data.to(device), requires_grad=False)
            layer.gguf_shards = [(layer.qweight, shard_types[0])]
        else:  # mixed formats: one dequantize per shard, rows concatenated
            layer.qweight = Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            layer.gguf_shards = [
                (Parameter(container[s].to(device), requires_grad=False), t)
                for s, t in zip(order, shard_types, strict=True)
            ]
        rows = sum(w.shape[0] for w, _ in layer.gguf_shards)
        if rows != qweight.tensor_shape[0]:
            raise ValueError(
                f"{name}: the GGUF tensors hold {rows} output rows, the layer has "
                f"{qweight.tensor_shape[0]}"
            )
        layer.qweight.tensor_shape = qweight.tensor_shape
        container.clear()

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if len(layer.gguf_shards) == 1:
            out = fused_mul_mat_gguf(x, *layer.gguf_shards[0])
        else:
            out = torch.cat([fused_mul_mat_gguf(x, w, t) for w, t in layer.gguf_shards], dim=-1)
        if bias is not None:
            out = out + bias
        return out


def _shard_order(shard: Any) -> int:
    """q, k, v and 0, 1 (gate, up) in the order their rows are stacked."""
    if shard is None:
        return 0
    return {"q": 0, "k": 1, "v": 2}.get(shard, shard) if isinstance(shard, str) else int(shard)


class GGUFEmbeddingMethod(GGUFLinearMethod):
    """The vocabulary: ``embedding`` for input ids; ``apply`` (inherited) when
    the table is also the LM head (tied embeddings)."""

    def embedding(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        ((qweight, qweight_type),) = layer.gguf_shards
        hidden_size = layer.qweight.tensor_shape[1]
        return apply_gguf_embedding(x, qweight, qweight_type, hidden_size, self.params_dtype)

"""Token embedding and LM head, with vocabulary padding and weight tying.

vLLM twin: ``vllm/model_executor/layers/vocab_parallel_embedding.py``
(``VocabParallelEmbedding``, ``ParallelLMHead``).
Read it for three things:
  * the table is padded to a multiple of ``DEFAULT_VOCAB_PADDING_SIZE`` (64)
    rows so it splits evenly across tensor-parallel ranks; the padding rows
    are zero after loading and the logits processor cuts them off again;
  * ``ParallelLMHead`` is the same ``[vocab_padded, hidden]`` matrix used the
    other way round (hidden -> logits); it never runs ``forward``, the
    ``LogitsProcessor`` reads its weight;
  * ``tie_weights`` makes the head share the embedding's parameter when
    config.json says ``tie_word_embeddings``, so the checkpoint holds it once.
Sessions: 04.

With a ``quant_config`` the table may be quantized (GGUF: the rows stay in
their block format and only the looked-up rows are dequantized); a tied LM
head is then the embedding module itself, since its method does both jobs.

Simpler than vLLM: tensor parallel size 1, so each rank's shard is the whole
vocabulary and no masking / all-reduce is needed; no LoRA-added vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from engine.model_executor.layers.linear import (
    _maybe_load_gguf,
    cpu_unquantized_gemm,
    dispatch_cpu_unquantized_gemm,
    set_weight_attrs,
)

if TYPE_CHECKING:
    from engine.model_executor.layers.quantization import QuantizationConfig

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """Round ``vocab_size`` up to a multiple of ``pad_to``."""
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


class UnquantizedEmbeddingMethod:
    """Plain embedding table; ``apply`` is its use as an output projection."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        # The linear methods' signature: the table is [vocab rows, embedding_dim].
        weight = Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # Only the output projection is a matmul worth prepacking on CPU (the
        # LM head is the largest single GEMM of a small model's decode step);
        # an input embedding is a table lookup.
        if isinstance(layer, ParallelLMHead) and layer.weight.device.type == "cpu":
            dispatch_cpu_unquantized_gemm(layer)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # [N, hidden] -> [N, vocab_padded]
        if layer.weight.is_cpu:
            return cpu_unquantized_gemm(layer, x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_, layer.weight)  # [T] -> [T, hidden]


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        org_num_embeddings: int | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = 0, 1  # one worker
        self.num_embeddings = num_embeddings
        self.org_vocab_size = org_num_embeddings or num_embeddings  # rows the checkpoint has
        self.padding_size = padding_size
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_config = quant_config
        method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self.quant_method = method or UnquantizedEmbeddingMethod()
        self.quant_method.create_weights(
            self,
            embedding_dim,
            [self.num_embeddings_per_partition],
            embedding_dim,
            self.num_embeddings_padded,
            self.params_dtype,
            weight_loader=self.weight_loader,
        )

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor) -> None:
        if _maybe_load_gguf(param, loaded_weight):
            return
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:  # e.g. a bias-like tensor shared by every rank
            if param.data.shape != loaded_weight.shape:
                raise ValueError(
                    f"{self.prefix}: expected shape {tuple(param.data.shape)}, "
                    f"checkpoint tensor has {tuple(loaded_weight.shape)}"
                )
            param.data.copy_(loaded_weight)
            return
        expected = [self.org_vocab_size, *param.data.shape[1:]]
        if list(loaded_weight.shape) != expected:
            raise ValueError(
                f"{self.prefix or 'embedding'}: expected a checkpoint tensor of shape "
                f"{tuple(expected)} "
                f"(vocab_size x hidden_size), got {tuple(loaded_weight.shape)}"
            )
        # Real rows first, padding rows zeroed.
        param.data[: self.org_vocab_size].copy_(loaded_weight)
        param.data[self.org_vocab_size :].fill_(0)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        # input_: [T] token ids -> [T, embedding_dim]. With tp_size > 1, ids
        # outside this rank's vocab range would be masked and the partial
        # embeddings all-reduced.
        return self.quant_method.embedding(self, input_.long())

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings_per_partition}, "
            f"embedding_dim={self.embedding_dim}, "
            f"org_vocab_size={self.org_vocab_size}, "
            f"num_embeddings_padded={self.num_embeddings_padded}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection ``[vocab_padded, hidden]``; used by ``LogitsProcessor``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        org_num_embeddings: int | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            params_dtype,
            org_num_embeddings,
            padding_size,
            prefix,
            quant_config=quant_config,
        )
        if bias:
            self.bias = Parameter(
                torch.empty(self.num_embeddings_per_partition, dtype=self.params_dtype),
                requires_grad=False,
            )
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def tie_weights(
        self, embed_tokens: VocabParallelEmbedding
    ) -> ParallelLMHead | VocabParallelEmbedding:
        """Share ``embed_tokens.weight`` (one tensor, listed once in named_parameters).
        A GGUF table has no ``weight``: the head becomes the embedding module,
        whose method also computes logits (``apply``), as in vLLM."""
        if self.quant_config is not None and self.quant_config.get_name() == "gguf":
            return embed_tokens
        self.weight = embed_tokens.weight
        return self

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead has no forward: LogitsProcessor uses its weight")

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

Under tensor parallelism (session 07) rank r holds rows ``[r * V/tp, (r+1) *
V/tp)`` of the padded table: the embedding looks up only the ids in its range
(the others give zero rows) and an all-reduce adds the ranks' rows together;
the LM head computes its slice of the logits, which ``LogitsProcessor``
all-gathers.

Simpler than vLLM: no LoRA-added vocabulary (so no second, added-vocabulary
range per rank); a vocabulary whose padded size does not split evenly is
padded further, to a multiple of ``padding_size * tp_size``, where vLLM
refuses it; a GGUF table is never split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from engine.distributed.communication_op import tensor_model_parallel_all_reduce
from engine.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
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
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.org_vocab_size = org_num_embeddings or num_embeddings  # rows the checkpoint has
        self.padding_size = padding_size
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size)
        if self.num_embeddings_padded % self.tp_size:
            self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        # This rank's rows of the padded table: [vocab_start_index, vocab_end_index).
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
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
        # This rank's real rows first, padding rows (past the checkpoint's) zeroed.
        start = min(self.vocab_start_index, self.org_vocab_size)
        end = min(self.vocab_end_index, self.org_vocab_size)
        param.data[: end - start].copy_(loaded_weight.narrow(0, start, end - start))
        param.data[end - start :].fill_(0)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        # input_: [T] token ids -> [T, embedding_dim].
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_.long())
        # Ids outside this rank's rows look up row 0 and are zeroed; the
        # all-reduce then adds the one rank that holds each id.
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_.long() - self.vocab_start_index).masked_fill(outside, 0)
        output = self.quant_method.embedding(self, local_ids)
        output = output.masked_fill(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(output)

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

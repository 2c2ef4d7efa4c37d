"""Hidden states -> logits over the vocabulary.

vLLM twin: ``vllm/model_executor/layers/logits_processor.py``
(``LogitsProcessor``).
Read it for the last step of ``compute_logits``: multiply the selected hidden
states (one row per sequence that samples this step, not every token) by the
LM head, drop the vocabulary padding rows, then apply the optional soft cap
(``soft_cap * tanh(logits / soft_cap)``, Gemma 2) and ``scale``
(``logit_scale`` in some configs).
Sessions: 04, 05 (sampling starts from its output).

Under tensor parallelism each rank's LM head computes its slice of the
vocabulary and ``_gather_logits`` all-gathers the slices, so every rank holds
all the logits and samples the same tokens (vLLM all-gathers too on most
platforms; every rank runs the sampler and only the output rank's result
goes back to the engine).

Simpler than vLLM: always an all-gather (vLLM may gather to rank 0 only).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.communication_op import tensor_model_parallel_all_gather
from engine.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding


class LogitsProcessor(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        org_vocab_size: int | None = None,
        scale: float = 1.0,
        logits_as_input: bool = False,
        soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if soft_cap is not None and soft_cap <= 0:
            raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")
        self.vocab_size = vocab_size
        self.org_vocab_size = org_vocab_size or vocab_size
        self.scale = scale
        self.logits_as_input = logits_as_input
        self.soft_cap = soft_cap

    def forward(
        self,
        lm_head: VocabParallelEmbedding,
        hidden_states: torch.Tensor,  # [N, hidden]
        embedding_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [N, vocab_size]
        if self.logits_as_input:
            logits = hidden_states
        else:
            logits = self._get_logits(hidden_states, lm_head, embedding_bias)
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    def _get_logits(
        self,
        hidden_states: torch.Tensor,
        lm_head: VocabParallelEmbedding,
        embedding_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        logits = lm_head.quant_method.apply(lm_head, hidden_states, bias=embedding_bias)
        logits = self._gather_logits(logits)
        # [N, vocab_padded] -> [N, org_vocab_size]: padding rows are not tokens.
        return logits[..., : self.org_vocab_size]

    def _gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, vocab_padded / tp] on each rank -> [N, vocab_padded] on every rank."""
        return tensor_model_parallel_all_gather(logits)

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.vocab_size}, org_vocab_size={self.org_vocab_size}, "
            f"scale={self.scale}, logits_as_input={self.logits_as_input}, soft_cap={self.soft_cap}"
        )

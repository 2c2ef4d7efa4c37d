"""What the Sampler returns: the sampled ids and, if asked for, logprobs.

vLLM twin: ``SamplerOutput`` and ``LogprobsTensors`` live in
``vllm/v1/outputs.py`` next to ``ModelRunnerOutput``.
Read it for: the shapes the sampler hands to the model runner -- one sampled
id per request row (``[N, 1]``), and per row the sampled token's logprob
followed by the top-k logprobs (``[N, k + 1]``) plus the sampled token's rank.
Sessions: 04 (worker: turning these into ``ModelRunnerOutput``), 05.

Why a separate file: Glassbox keeps ``engine/v1/outputs.py`` torch-free so the
scheduler side never imports torch; these two hold tensors, so they live here
with the sampler. ``LogprobsTensors.tolists()`` converts to the torch-free
``engine.v1.outputs.LogprobsLists``.

Simpler than vLLM: one sampled token per request per step (no speculative
decoding), so there is no ``cu_num_generated_tokens`` bookkeeping, and
``tolists()`` returns Python lists rather than numpy arrays because that is
what ``LogprobsLists`` holds in Glassbox. Token ids are int64 (vLLM narrows
them to int32 to save memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.v1.outputs import LogprobsLists


class LogprobsTensors(NamedTuple):
    """Logprobs for one sampled token per row.

    Column 0 is the sampled token; columns 1..k are the k most likely tokens
    in descending order (the sampled token may appear there again).
    """

    # [N, k + 1] int64: sampled id, then the top-k ids.
    logprob_token_ids: torch.Tensor
    # [N, k + 1] float32: the matching log-probabilities.
    logprobs: torch.Tensor
    # [N] int64: rank of the sampled token in the whole vocabulary; 1 = most
    # likely. Tokens tied with it count as ahead of it.
    selected_token_ranks: torch.Tensor

    def tolists(self) -> LogprobsLists:
        """Copy to the CPU as plain Python lists (for the scheduler side)."""
        return LogprobsLists(
            logprob_token_ids=self.logprob_token_ids.cpu().tolist(),
            logprobs=self.logprobs.cpu().tolist(),
            sampled_token_ranks=self.selected_token_ranks.cpu().tolist(),
        )


@dataclass
class SamplerOutput:
    # [N, 1] int32: the token sampled for each request row.
    sampled_token_ids: torch.Tensor
    # None unless at least one request in the batch asked for logprobs.
    logprobs_tensors: LogprobsTensors | None

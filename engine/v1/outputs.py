"""What the worker hands back to the scheduler after one step.

vLLM twin: ``vllm/v1/outputs.py`` (``ModelRunnerOutput``, ``LogprobsLists``).
Read it for: the worker's answer is per *request*, indexed by
``req_id_to_index``; ``sampled_token_ids[i]`` is empty for a request whose
prefill chunk did not reach the end of its prompt (nothing to sample yet).
Sessions: 01, 04.

Torch-free on purpose: the scheduler side only sees Python lists. The
tensor-shaped twins (``SamplerOutput``, ``LogprobsTensors``) live with the
sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class LogprobsLists(NamedTuple):
    """Logprobs for a batch of sampled tokens, one row per token.

    Row r: ``logprob_token_ids[r]`` is [sampled id, top-1 id, ..., top-k id],
    ``logprobs[r]`` the matching log-probabilities, ``sampled_token_ranks[r]``
    the sampled token's rank in the full vocabulary (1 = most likely).
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]

    def slice_rows(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(
            self.logprob_token_ids[start:end],
            self.logprobs[start:end],
            self.sampled_token_ranks[start:end],
        )


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # [num_reqs][num_generated]; [] when the request sampled nothing this step.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Rows follow req_ids order, one row per sampled token.
    logprobs: LogprobsLists | None = None
    prompt_logprobs_dict: dict[str, LogprobsLists | None] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={})

"""What the sampler and the worker hand back after one step.

vLLM twin: ``vllm/v1/outputs.py`` (``SamplerOutput``, ``LogprobsTensors``,
``LogprobsLists``, ``ModelRunnerOutput``, ``AsyncModelRunnerOutput``,
``DraftTokenIds``).
Read it for:

- the Sampler's answer (``SamplerOutput``): one sampled id per request row
  (``[N, 1]``) and, if any row asked, ``LogprobsTensors`` -- per row the
  sampled token's logprob followed by the top-k logprobs (``[N, k + 1]``)
  plus the sampled token's rank;
- the worker's answer to the scheduler (``ModelRunnerOutput``): per
  *request*, indexed by ``req_id_to_index``; ``sampled_token_ids[i]`` is empty
  for a request whose prefill chunk did not reach the end of its prompt
  (nothing to sample yet). ``LogprobsTensors.tolists()`` makes the
  ``LogprobsLists`` it carries; ``prompt_logprobs_dict`` holds, for a request
  that asked for ``prompt_logprobs`` and finished its prefill this step, one
  row per prompt position after the first (``LogprobsTensors.empty_cpu``
  collects them chunk by chunk on the worker).
Sessions: 01, 04, 05.

Importable without torch: the scheduler imports this module and must stay
torch-free, so torch appears here only in annotations (the tensor-holding
types never need torch to be defined).

Simpler than vLLM: no ``cu_num_generated_tokens`` bookkeeping (with
speculative decoding a request may get several tokens; their logprob rows
follow each other in request order); ``LogprobsLists`` holds Python lists
where vLLM holds numpy arrays, and prompt logprobs travel as
``LogprobsLists`` too (vLLM sends the tensors).

Differs from vLLM on purpose: ``LogprobsTensors.logprob_token_ids`` stay
int64 (vLLM narrows them to int32 to halve the copy) so they can index a
tensor directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


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


class LogprobsTensors(NamedTuple):
    """Logprobs for one sampled token per row, on the sampler's device.

    Column 0 is the sampled token; columns 1..k are the k most likely tokens
    in descending order (the sampled token may appear there again). Every row
    has the batch's largest k; the engine cuts each request's row to what it
    asked for (``LogprobsProcessor``).
    """

    # [N, k + 1] int64: sampled id, then the top-k ids.
    logprob_token_ids: torch.Tensor
    # [N, k + 1] float32: the matching log-probabilities.
    logprobs: torch.Tensor
    # [N] int64: rank of the sampled token in the whole vocabulary; 1 = most
    # likely. Tokens tied with it count as ahead of it.
    selected_token_ranks: torch.Tensor

    @staticmethod
    def empty_cpu(num_positions: int, num_tokens_per_position: int) -> LogprobsTensors:
        """Host tensors to fill in slices: ``[num_positions, num_tokens_per_position]``
        ids and logprobs, ``[num_positions]`` ranks (a prompt's logprobs, chunk by chunk)."""
        import torch  # here, not at the top: the scheduler imports this module

        shape = (num_positions, num_tokens_per_position)
        return LogprobsTensors(
            logprob_token_ids=torch.empty(shape, dtype=torch.int64),
            logprobs=torch.empty(shape, dtype=torch.float32),
            selected_token_ranks=torch.empty(num_positions, dtype=torch.int64),
        )

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


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # [num_reqs][num_generated]; [] when the request sampled nothing this step.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Rows follow req_ids order, one row per sampled token.
    logprobs: LogprobsLists | None = None
    # Requests whose prefill ended this step and that asked for prompt_logprobs:
    # rows for prompt positions 1..P-1 (position 0 has no logprob), each row
    # [actual prompt token, top-1 .. top-k], its rank in the vocabulary.
    prompt_logprobs_dict: dict[str, LogprobsLists | None] = field(default_factory=dict)


@dataclass
class DraftTokenIds:
    """The drafts a proposer made after a step (speculative decoding), per
    request, for the scheduler to verify in the next one."""

    req_ids: list[str]
    # [num_reqs][<= num_speculative_tokens]
    draft_token_ids: list[list[int]]


class AsyncModelRunnerOutput(ABC):
    """A step's output whose sampled ids are still being copied to the host
    (async scheduling). The worker returns it at once; ``get_output()``
    blocks until the copy is done and returns the ``ModelRunnerOutput``."""

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput: ...


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={})

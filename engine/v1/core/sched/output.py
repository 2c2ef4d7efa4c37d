"""The scheduler's decision for one step, handed to the worker.

vLLM twin: ``vllm/v1/core/sched/output.py`` (``SchedulerOutput``,
``NewRequestData``, ``CachedRequestData``, ``GrammarOutput``).
Read it for the diff-based protocol between scheduler and worker: a request's
full data (prompt, sampling params, block ids) is sent once, in
``NewRequestData``, the step it is first scheduled; after that only what
changed travels in ``CachedRequestData`` -- new block ids and the cursor. The
worker keeps the rest in its persistent input batch.
Sessions: 02 (scheduler), 04 (worker).

``GrammarOutput`` travels separately, with ``sample_tokens``: the bitmask
rows of the step's constrained requests (session 06).

Simpler than vLLM: no encoder inputs, invalid spec-token counts or
KV-connector metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from engine.lora.request import LoRARequest
    from engine.sampling_params import SamplingParams
    from engine.v1.request import Request


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # One list per KV cache group: the whole block table so far.
    block_ids: tuple[list[int], ...]
    # Tokens already in cache (prefix hit) before this step's tokens.
    num_computed_tokens: int
    lora_request: LoRARequest | None = None

    @classmethod
    def from_request(cls, request: Request, block_ids: tuple[list[int], ...]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            lora_request=request.lora_request,
        )

    def __repr__(self) -> str:
        return (
            f"NewRequestData(req_id={self.req_id!r}, num_prompt_tokens="
            f"{len(self.prompt_token_ids)}, block_ids={self.block_ids}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )


@dataclass
class CachedRequestData:
    """Column-wise deltas for requests the worker already knows (or is
    re-learning after a preemption: those are in ``resumed_req_ids``)."""

    req_ids: list[str] = field(default_factory=list)
    # Requests coming back from preemption: their block table restarts from
    # new_block_ids instead of being appended to.
    resumed_req_ids: set[str] = field(default_factory=set)
    # Token ids the worker has not seen: full token lists for requests that
    # were not scheduled in the previous step (the worker may have dropped them).
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per request, per group: block ids appended this step (None = none).
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls()


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to run this step (prefill chunk length, or 1 for decode).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Per KV cache group: leading blocks shared by every running request.
    num_common_prefix_blocks: list[int]
    # Requests that finished since the last step: the worker drops their state.
    finished_req_ids: set[str]
    # Requests preempted in this step: the worker drops their state too.
    preempted_req_ids: set[str] = field(default_factory=set)
    # req_id -> the draft tokens verified this step, scheduled after the
    # request's known tokens (absent: no drafts). Speculative decoding only.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Some scheduled request samples under a grammar this step.
    has_structured_output_requests: bool = False
    # Async scheduling: a constrained request's previous token is still in
    # flight, so its bitmask (and the step's sampling) must wait for it.
    pending_structured_output_tokens: bool = False
    # Step counter, for traces and the TUI (not in vLLM's struct).
    step: int = 0

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            num_common_prefix_blocks=[],
            finished_req_ids=set(),
        )


@dataclass
class GrammarOutput:
    # The constrained requests that sample this step, in bitmask order.
    structured_output_request_ids: list[str]
    # int32 [rows, ceil(vocab / 32)]: one row per request, 1 + d with d drafts.
    grammar_bitmask: np.ndarray

"""Stop checks and list helpers for the scheduler.

vLLM twin: ``vllm/v1/core/sched/utils.py`` (``check_stop``,
``check_sequence_repetition``, ``remove_all``).
Read it for the order of stop checks after each sampled token: nothing stops
before ``min_tokens`` outputs; then EOS (unless ``ignore_eos``), then
``stop_token_ids``, then length (``max_tokens`` or ``max_model_len``), then a
repeated pattern at the end of the output (``repetition_detection``).
Stop *strings* are not here: they need detokenized text, so the front end's
output processor checks them and aborts the request.
Sessions: 02.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.v1.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.sampling_params import RepetitionDetectionParams


def remove_all(lst: list, items_to_remove: set) -> list:
    """A copy of ``lst`` without ``items_to_remove`` (order kept)."""
    if not items_to_remove:
        return lst
    return [item for item in lst if item not in items_to_remove]


def _ends_in_repeats(token_ids: Sequence[int], pattern_len: int, count: int) -> bool:
    """The last ``pattern_len`` tokens equal each of the ``count - 1`` blocks
    of the same length before them."""
    tail = token_ids[len(token_ids) - pattern_len :]
    return all(
        token_ids[len(token_ids) - pattern_len * (k + 1) : len(token_ids) - pattern_len * k] == tail
        for k in range(1, count)
    )


def check_sequence_repetition(token_ids: Sequence[int], params: RepetitionDetectionParams) -> bool:
    """Whether ``token_ids`` ends in a pattern of ``min_pattern_size`` ..
    ``max_pattern_size`` tokens repeated ``min_count`` times back to back."""
    if params.max_pattern_size <= 0 or params.min_count < 2:
        return False
    for pattern_len in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        if pattern_len * params.min_count > len(token_ids):
            return False  # longer patterns need even more tokens
        if _ends_in_repeats(token_ids, pattern_len, params.min_count):
            return True
    return False


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a finished status on ``request`` if its last token ends it."""
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    last_token_id = request.output_token_ids[-1]
    # eos_token_id is None when ignore_eos is set (SamplingParams handles it).
    if params.eos_token_id is not None and last_token_id == params.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in (params.stop_token_ids or ()):
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    repetition = params.repetition_detection
    if repetition is not None and check_sequence_repetition(request.output_token_ids, repetition):
        request.status = RequestStatus.FINISHED_REPETITION
        request.stop_reason = "repetition_detected"
        return True
    return False

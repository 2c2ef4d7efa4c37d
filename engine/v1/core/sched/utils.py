"""Stop checks and list helpers for the scheduler.

vLLM twin: ``vllm/v1/core/sched/utils.py`` (``check_stop``, ``remove_all``).
Read it for the order of stop checks after each sampled token: nothing stops
before ``min_tokens`` outputs; then EOS (unless ``ignore_eos``), then
``stop_token_ids``, then length (``max_tokens`` or ``max_model_len``).
Stop *strings* are not here: they need detokenized text, so the front end's
output processor checks them and aborts the request.
Sessions: 02.
"""

from __future__ import annotations

from engine.v1.request import Request, RequestStatus


def remove_all(lst: list, items_to_remove: set) -> list:
    """A copy of ``lst`` without ``items_to_remove`` (order kept)."""
    if not items_to_remove:
        return lst
    return [item for item in lst if item not in items_to_remove]


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
    return False

"""SamplingMetadata: one step's sampling knobs for the whole batch, as tensors.

vLLM twin: ``vllm/v1/sample/metadata.py`` (``SamplingMetadata``).
Read it for: how per-request settings become per-row tensors the Sampler can
apply to all rows at once, and the flags that let it skip work
(``all_greedy``, ``all_random``, ``no_penalties``; ``temperature``, ``top_k``,
``top_p`` left as None when no row needs them).
Sessions: 04 (the runner builds it), 05 (the sampler reads it).

Two ways to build one:
- The runner's: the persistent ``InputBatch`` (``engine/v1/worker/
  gpu_input_batch.py``, ``_make_sampling_metadata``) keeps per-row values in
  CPU arrays as requests join and leave, and rebuilds the metadata only when
  the batch changed, copying into persistent device tensors without waiting
  for the GPU. A steady decode batch reuses last step's object.
- ``build_sampling_metadata`` below (Glassbox's own): from scratch, from a
  list of ``SamplingParams``, with fresh logits processors that are told
  every row was just added. The readable reference, and what the sampler
  tests use; each ``torch.tensor(..., device=cuda)`` in it is a blocking
  host-to-device copy, which is why the runner does not call it.
``validate_request_token_ids`` is the per-request check both share.

min-p, logit bias and min-tokens are not fields: they are logits processors
(``logitsprocs``), long-lived objects that keep their own per-row state
(``MinPLogitsProcessor.min_p``, ``LogitBiasLogitsProcessor.biases``,
``MinTokensLogitsProcessor.min_toks``).

Simpler than vLLM: no ``logprob_token_ids`` (the scoring API) and no
thinking-token budget (``thinking_budget_state_holder``).

Glassbox addition: ``temperature_cpu``, the host copy of ``temperature``,
read only by the sampler trace.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import GlassboxConfig, ModelConfig, SchedulerConfig
from engine.sampling_params import SamplingParams, SamplingType
from engine.v1.sample.logits_processor import BatchUpdate, LogitsProcessors, build_logitsprocs
from engine.v1.sample.ops.penalties import make_padded_token_tensor


@dataclass
class SamplingMetadata:
    # [N] float32, 0.0 on greedy rows; None when every row is greedy.
    temperature: torch.Tensor | None
    all_greedy: bool  # every row is greedy: argmax and return early
    all_random: bool  # no row is greedy: skip the argmax

    # [N] float32 in (0, 1], or None when every row has top_p == 1.
    top_p: torch.Tensor | None
    # [N] int32 in [1, V] (V = off), or None when no row uses top-k.
    top_k: torch.Tensor | None

    # row -> that request's own RNG (seeded requests only).
    generators: dict[int, torch.Generator]

    # Largest logprobs count any row asked for; None when no row asked.
    # 0 means "only the sampled token's logprob". -1 (whole vocab) is stored as V.
    max_num_logprobs: int | None

    no_penalties: bool  # every row has repetition 1, frequency 0, presence 0
    # [N, max_prompt_len] int64 padded with V; None when no_penalties.
    prompt_token_ids: torch.Tensor | None
    # [N] float32 each. Read only when not no_penalties (the persistent batch
    # does not refresh them otherwise).
    frequency_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    repetition_penalties: torch.Tensor

    # Generated ids so far, one list per row (the requests' own lists, not copies).
    output_token_ids: list[list[int]]

    # [N, V] bool, True = this token is NOT allowed for this row. None when no
    # row has allowed_token_ids.
    allowed_token_ids_mask: torch.Tensor | None

    # row -> the row's bad words as token id sequences.
    bad_words_token_ids: dict[int, list[list[int]]]

    # The engine's logits processors (min-tokens, logit bias, min-p, custom).
    logitsprocs: LogitsProcessors

    # Draft tokens proposed for each row this step ([] per row without
    # speculative decoding); penalties and bad words see them when the
    # sampler predicts the bonus token.
    spec_token_ids: list[list[int]] | None = None

    # The host values ``temperature`` was copied from ([N] float32 numpy), where
    # the builder has them. Read only by tracing: ``sampler.sampled``'s greedy
    # flags come from here without a device read.
    temperature_cpu: np.ndarray | None = None


def _check_token_ids(field: str, row: int, token_ids: Iterable[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{field} of request row {row} must be token ids in [0, {vocab_size - 1}] "
            f"(vocab size {vocab_size}), got {bad}."
        )


def validate_request_token_ids(
    row: int, sp: SamplingParams, output_token_ids: Sequence[int], vocab_size: int
) -> None:
    """Raise ValueError if a token id the request's params name is outside [0, V).

    Checks what the sampler would index the logits with: allowed_token_ids,
    bad words, logit_bias keys and the stop ids min_tokens masks while it is
    active. (Prompt and output ids are checked only when some row of the
    batch has penalties, since only then do they index a [N, V] tensor.)
    """
    if sp.allowed_token_ids:
        _check_token_ids("allowed_token_ids", row, sp.allowed_token_ids, vocab_size)
    for ids in sp.bad_words_token_ids or ():
        _check_token_ids("bad_words_token_ids", row, ids, vocab_size)
    if sp.logit_bias:
        _check_token_ids("logit_bias", row, sp.logit_bias.keys(), vocab_size)
    if sp.min_tokens and len(output_token_ids) < sp.min_tokens:
        _check_token_ids("all_stop_token_ids", row, sp.all_stop_token_ids, vocab_size)


def has_penalties(sp: SamplingParams) -> bool:
    """Any of repetition (!= 1), frequency or presence (!= 0) penalties set."""
    return not (
        sp.repetition_penalty == 1.0 and sp.frequency_penalty == 0.0 and sp.presence_penalty == 0.0
    )


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: dict[int, torch.Generator],
    vocab_size: int,
    device: torch.device | str,
) -> SamplingMetadata:
    """Turn the batch's per-request settings into a SamplingMetadata.

    Row i is request i of the batch: ``params[i]``, its prompt ids
    ``prompt_token_ids[i]`` and its generated ids so far ``output_token_ids[i]``.
    ``generators[i]`` is request i's own ``torch.Generator``; every request
    with a seed (``SamplingType.RANDOM_SEED``) must have one, and the runner
    must keep it across steps so the stream of random numbers continues
    (on CUDA it must be a CUDA generator on the logits' device).
    ``vocab_size`` is the width of the logits the sampler will receive.
    """
    num_reqs = len(params)
    if len(prompt_token_ids) != num_reqs or len(output_token_ids) != num_reqs:
        raise ValueError(
            "params, prompt_token_ids and output_token_ids must have one entry per "
            f"request; got {num_reqs}, {len(prompt_token_ids)} and {len(output_token_ids)}."
        )
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}.")
    bad_rows = [row for row in generators if not 0 <= row < num_reqs]
    if bad_rows:
        raise ValueError(
            f"generators keys must be request rows in [0, {num_reqs - 1}], got {bad_rows}."
        )

    sampling_types = [sp.sampling_type for sp in params]
    for row, sampling_type in enumerate(sampling_types):
        if sampling_type == SamplingType.RANDOM_SEED and row not in generators:
            raise ValueError(
                f"request row {row} has seed={params[row].seed} but no entry in generators; "
                "seeded requests must sample with their own torch.Generator."
            )
    all_greedy = all(t == SamplingType.GREEDY for t in sampling_types)
    all_random = num_reqs > 0 and not any(t == SamplingType.GREEDY for t in sampling_types)

    def per_row(values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    temperature_values = [
        0.0 if t == SamplingType.GREEDY else sp.temperature for sp, t in zip(params, sampling_types)
    ]
    temperature = None if all_greedy else per_row(temperature_values)

    top_p = None
    if any(sp.top_p < 1.0 for sp in params):
        top_p = per_row([sp.top_p for sp in params])
    # top_k 0 means off; k >= V keeps everything too. Both are stored as V.
    top_k_values = [sp.top_k if 0 < sp.top_k < vocab_size else vocab_size for sp in params]
    top_k = None
    if any(k < vocab_size for k in top_k_values):
        top_k = torch.tensor(top_k_values, dtype=torch.int32, device=device)

    # Logprobs: -1 asks for the whole vocabulary; more than V is the same thing.
    num_logprobs = [
        vocab_size if sp.logprobs == -1 else min(sp.logprobs, vocab_size)
        for sp in params
        if sp.logprobs is not None
    ]
    max_num_logprobs = max(num_logprobs) if num_logprobs else None

    for row, sp in enumerate(params):
        validate_request_token_ids(row, sp, output_token_ids[row], vocab_size)

    no_penalties = not any(has_penalties(sp) for sp in params)
    prompt_tensor = None
    if not no_penalties:
        for row in range(num_reqs):
            _check_token_ids("prompt_token_ids", row, prompt_token_ids[row], vocab_size)
            _check_token_ids("output_token_ids", row, output_token_ids[row], vocab_size)
        prompt_tensor = make_padded_token_tensor(prompt_token_ids, vocab_size, device)

    allowed_token_ids_mask = None
    if any(sp.allowed_token_ids for sp in params):
        # Start from "nothing masked" so rows without a whitelist are untouched.
        mask = torch.zeros((num_reqs, vocab_size), dtype=torch.bool)
        for row, sp in enumerate(params):
            if sp.allowed_token_ids:
                mask[row] = True
                mask[row, sp.allowed_token_ids] = False
        allowed_token_ids_mask = mask.to(device)

    bad_words_token_ids: dict[int, list[list[int]]] = {
        row: sp.bad_words_token_ids for row, sp in enumerate(params) if sp.bad_words_token_ids
    }

    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=top_p,
        top_k=top_k,
        generators=generators,
        max_num_logprobs=max_num_logprobs,
        no_penalties=no_penalties,
        prompt_token_ids=prompt_tensor,
        frequency_penalties=per_row([sp.frequency_penalty for sp in params]),
        presence_penalties=per_row([sp.presence_penalty for sp in params]),
        repetition_penalties=per_row([sp.repetition_penalty for sp in params]),
        output_token_ids=output_token_ids,
        allowed_token_ids_mask=allowed_token_ids_mask,
        bad_words_token_ids=bad_words_token_ids,
        logitsprocs=_fresh_logitsprocs(params, prompt_token_ids, output_token_ids, device),
        spec_token_ids=[[] for _ in range(num_reqs)],
    )


def _fresh_logitsprocs(
    params: Sequence[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    device: torch.device | str,
) -> LogitsProcessors:
    """The built-in processors, sized for this batch and told that every row
    was just added (what the persistent batch's first step tells them)."""
    # Processors size their per-row buffers from the engine config.
    config = GlassboxConfig(
        model_config=ModelConfig(model="build_sampling_metadata", hf_config={"vocab_size": 1}),
        scheduler_config=SchedulerConfig(max_num_seqs=max(len(params), 1)),
    )
    logitsprocs = build_logitsprocs(config, torch.device(device), is_pin_memory=False)
    added = [
        (row, sp, prompt_token_ids[row], output_token_ids[row]) for row, sp in enumerate(params)
    ]
    update = BatchUpdate(batch_size=len(params), removed=[], added=added, moved=[])
    for proc in logitsprocs.all:
        proc.update_state(update)
    return logitsprocs

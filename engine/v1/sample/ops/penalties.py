"""Repetition, frequency and presence penalties on a batch of logits.

vLLM twin: ``vllm/v1/sample/ops/penalties.py`` (``apply_all_penalties``),
which pads the output ids into a tensor and calls ``apply_penalties`` in
``vllm/model_executor/layers/utils.py`` (plus the repetition-penalty op in
``vllm/_custom_ops.py``).
Read it for: which tokens each penalty looks at and how it changes a logit.

- repetition_penalty r (multiplicative, from the CTRL paper): for every token
  seen in the prompt **or** the output so far, a positive logit is divided by
  r and a negative one multiplied by r. r > 1 makes repeats less likely.
- frequency_penalty f (additive, OpenAI): logit -= f * (times the token was
  generated). Output tokens only; the prompt does not count.
- presence_penalty p (additive, OpenAI): logit -= p if the token was generated
  at least once. Output tokens only.

Sessions: 05.

Simpler than vLLM: everything is in this one file (vLLM splits it over three)
and the repetition penalty is always the plain-torch version (vLLM has a CUDA
kernel for it).
"""

from __future__ import annotations

import torch


def make_padded_token_tensor(
    token_ids: list[list[int]], pad: int, device: torch.device | str
) -> torch.Tensor:
    """Ragged lists of token ids -> int64 tensor [N, max_len] padded with ``pad``.

    The pad is ``vocab_size``, an id no real token has; ``get_token_bin_counts_and_mask``
    gives it its own throw-away column.
    """
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = torch.full((len(token_ids), max_len), pad, dtype=torch.int64)
    for row, ids in enumerate(token_ids):
        if ids:
            padded[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    return padded.to(device)


def get_token_bin_counts_and_mask(
    tokens: torch.Tensor, vocab_size: int, num_seqs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row histogram of token ids.

    tokens: int64 [num_seqs, L], padded with ``vocab_size``.
    Returns (counts int64 [num_seqs, vocab_size], seen bool [num_seqs, vocab_size]).
    """
    # One extra column catches the padding id, then gets dropped.
    counts = torch.zeros((num_seqs, vocab_size + 1), dtype=torch.int64, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens))
    counts = counts[:, :vocab_size]
    return counts, counts > 0


def apply_penalties(
    logits: torch.Tensor,
    prompt_tokens_tensor: torch.Tensor,
    output_tokens_tensor: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Apply all three penalties to ``logits`` [N, V] in place and return it.

    prompt/output token tensors: int64 [N, L] padded with V. Penalty tensors:
    float32 [N]. A row with r = 1, f = 0, p = 0 is left unchanged.
    """
    num_seqs, vocab_size = logits.shape
    _, prompt_mask = get_token_bin_counts_and_mask(prompt_tokens_tensor, vocab_size, num_seqs)
    output_counts, output_mask = get_token_bin_counts_and_mask(
        output_tokens_tensor, vocab_size, num_seqs
    )

    # Repetition: scale every token seen anywhere (prompt or output) towards 0
    # when r > 1 -- divide if the logit is positive, multiply if not.
    seen = prompt_mask | output_mask
    r = repetition_penalties.unsqueeze(1).to(logits.dtype)  # [N, 1]
    per_token_r = torch.where(seen, r, torch.ones_like(r))  # [N, V]
    logits *= torch.where(logits > 0, 1.0 / per_token_r, per_token_r)

    # Frequency and presence: OpenAI's definition, generated tokens only.
    logits -= frequency_penalties.unsqueeze(1).to(logits.dtype) * output_counts
    logits -= presence_penalties.unsqueeze(1).to(logits.dtype) * output_mask
    return logits


def apply_all_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """The Sampler's entry point: pads ``output_token_ids`` and applies the penalties.

    ``prompt_token_ids`` is already padded (SamplingMetadata builds it once per
    step); the output ids arrive as Python lists because they grow every step.
    """
    _, vocab_size = logits.shape
    output_tokens = make_padded_token_tensor(output_token_ids, vocab_size, logits.device)
    return apply_penalties(
        logits,
        prompt_token_ids,
        output_tokens,
        presence_penalties,
        frequency_penalties,
        repetition_penalties,
    )

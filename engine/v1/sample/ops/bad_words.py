"""Ban "bad words": token sequences a request must never generate.

vLLM twin: ``vllm/v1/sample/ops/bad_words.py`` (``apply_bad_words``).
Read it for: how a multi-token ban works one step at a time. A bad word is a
list of token ids ``[t1, ..., tn]``. At each step the sampler can only stop
its *last* token: if the request's most recent ``n - 1`` generated tokens are
``t1 .. t(n-1)``, the logit of ``tn`` is set to -inf. A single-token bad word
(n = 1) is therefore banned at every step. Only generated tokens are matched,
never the prompt. ``SamplingParams.update_from_tokenizer`` turns the words
into token ids (``params.bad_words_token_ids``).
Sessions: 05.

Simpler than vLLM: no ``apply_bad_words_with_drafts``; the rejection sampler
applies this to each draft's target row with the drafts before it counted as
generated.
"""

from __future__ import annotations

import torch


def _apply_bad_words_single_batch(
    logits: torch.Tensor,
    bad_words_token_ids: list[list[int]],
    past_tokens_ids: list[int],
) -> None:
    """One row: logits [V], the row's bad words, the row's generated ids."""
    for bad_word_ids in bad_words_token_ids:
        prefix = bad_word_ids[:-1]
        if len(prefix) > len(past_tokens_ids):
            continue  # not enough output yet for the prefix to have appeared
        recent = past_tokens_ids[len(past_tokens_ids) - len(prefix) :]
        if recent == prefix:
            logits[bad_word_ids[-1]] = float("-inf")


def apply_bad_words(
    logits: torch.Tensor,
    bad_words_token_ids: dict[int, list[list[int]]],
    past_tokens_ids: list[list[int]],
) -> None:
    """Mask in place. logits [N, V]; ``bad_words_token_ids`` maps row -> bad words."""
    for row, bad_words in bad_words_token_ids.items():
        _apply_bad_words_single_batch(logits[row], bad_words, past_tokens_ids[row])

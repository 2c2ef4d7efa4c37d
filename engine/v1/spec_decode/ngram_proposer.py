"""NgramProposer: draft tokens by prompt lookup in the request's own history.

vLLM twin: ``vllm/v1/spec_decode/ngram_proposer.py`` (``NgramProposer``,
``_find_longest_matched_ngram_and_propose_tokens``).
Read it for the matching rule. Take the request's tokens so far (prompt and
output, no drafts) and look for an earlier place where its last n tokens
occur, trying the longest n first, with n in [``prompt_lookup_min``,
``prompt_lookup_max``]; the tokens that followed that occurrence (up to k =
``num_speculative_tokens``) are the drafts. Among several occurrences of the
longest n-gram the *earliest* one wins. An occurrence may overlap the suffix
itself, so a run like ``a a a a`` drafts more ``a``s. No drafts for a request
that sampled nothing this step (a prefill chunk that did not reach the end of
its prompt) or that is already at ``max_model_len``, and never drafts that
would carry it past ``max_model_len``.
Sessions: 06 (speculative decoding).

The runner calls ``propose`` after sampling, as vLLM's
``propose_draft_token_ids`` does: the step's sampled ids per request row, and
the persistent batch's ``num_tokens_no_spec`` and ``token_ids_cpu``.

Simpler than vLLM: vLLM runs a numba-compiled KMP scan (the token history
reversed, one pass, several threads for big batches) into preallocated
buffers, compiled once at start-up. Glassbox filters candidate positions with
numpy instead: keep the positions whose previous token equals the last token,
then those whose token two back equals the second-last, and so on up to
``prompt_lookup_max``; the survivors of the last round that left any are the
occurrences of the longest n-gram, in order. Same drafts, no JIT.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from engine.config import GlassboxConfig


class NgramProposer:
    def __init__(self, glassbox_config: GlassboxConfig):
        speculative_config = glassbox_config.speculative_config
        assert speculative_config is not None and speculative_config.method == "ngram"
        assert speculative_config.prompt_lookup_min is not None
        assert speculative_config.prompt_lookup_max is not None
        self.min_n = speculative_config.prompt_lookup_min
        self.max_n = speculative_config.prompt_lookup_max
        self.k = speculative_config.num_speculative_tokens
        self.max_model_len = glassbox_config.model_config.max_model_len

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,  # unused; vLLM's runner passes it to every proposer
    ) -> list[list[int]]:
        """Drafts for each request row ([] for none).

        sampled_token_ids: [num_reqs][0 or more] this step's sampled ids per
            row ([] when the row's prefill chunk sampled nothing).
        num_tokens_no_spec: [>= num_reqs] the row's token count, drafts excluded
            (the step's sampled tokens already written).
        token_ids_cpu: [>= num_reqs, max_model_len] the rows' tokens; only the
            first num_tokens_no_spec[row] of each row are read.
        """
        valid_ngram_requests = [
            row
            for row, sampled in enumerate(sampled_token_ids)
            if sampled and num_tokens_no_spec[row] < self.max_model_len
        ]
        return self.batch_propose(
            len(sampled_token_ids), valid_ngram_requests, num_tokens_no_spec, token_ids_cpu
        )

    def batch_propose(
        self,
        num_requests: int,
        valid_ngram_requests: list[int],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
    ) -> list[list[int]]:
        """Drafts for rows 0..num_requests-1; only the rows in
        ``valid_ngram_requests`` are searched, the others get []."""
        draft_token_ids: list[list[int]] = [[] for _ in range(num_requests)]
        for row in valid_ngram_requests:
            num_tokens = int(num_tokens_no_spec[row])
            drafts = _find_longest_matched_ngram_and_propose_tokens(
                origin_tokens=token_ids_cpu[row, :num_tokens],
                min_ngram=self.min_n,
                max_ngram=self.max_n,
                max_model_len=self.max_model_len,
                k=self.k,
            )
            draft_token_ids[row] = drafts.tolist()
        return draft_token_ids

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load (the runner calls this on every proposer)."""


def _find_longest_matched_ngram_and_propose_tokens(
    origin_tokens: np.ndarray,
    min_ngram: int,
    max_ngram: int,
    max_model_len: int,
    k: int,
) -> np.ndarray:
    """Up to k tokens that followed the earliest occurrence of the longest
    suffix of ``origin_tokens`` ([T]) with length in [min_ngram, max_ngram];
    empty if there is none. Never more than ``max_model_len - T`` tokens."""
    total = origin_tokens.shape[0]
    k = min(k, max_model_len - total)
    if total < min_ngram or k <= 0:
        return origin_tokens[:0]

    # starts[j]: a position where drafts could begin, i.e. one just after an
    # occurrence. Candidates are 1..T-1 (at least one token must follow, so
    # the suffix itself never counts); round n keeps those whose n-th token
    # back equals the n-th token from the end.
    starts = np.arange(1, total)
    longest = 0
    for n in range(1, max_ngram + 1):
        candidates = starts[starts >= n]
        matches = origin_tokens[candidates - n] == origin_tokens[total - n]
        if not matches.any():
            break
        starts = candidates[matches]
        longest = n
    if longest < min_ngram:
        return origin_tokens[:0]
    # starts is ascending: the first is the earliest occurrence of the longest n-gram.
    start = int(starts[0])
    return origin_tokens[start : start + k]

"""Log-probability containers handed back to the user.

vLLM twin: ``vllm/logprobs.py``.
Read it for: the shape of the logprobs a ``CompletionOutput`` carries -- one
``{token_id: Logprob}`` dict per generated position -- and how a position is
filled: the sampled token first (with its true rank), then the top-k tokens
with ranks 1..k.
Sessions: 05 (sampling: where logprobs come from), 01 (what the user sees).

Simpler than vLLM: only the ``list[dict[int, Logprob]]`` layout. vLLM also has
``FlatLogprobs``, a column-oriented container that exists purely to cut Python
GC cost at high throughput; it holds the same information, so Glassbox leaves
it out and rejects ``flat_logprobs=True`` with a clear error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log-probability at one position.

    ``rank`` is 1 for the most likely token in the vocabulary; ``decoded_token``
    is the token's text when detokenization is on, else None.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# token_id -> Logprob for a single position.
LogprobsOnePosition = dict[int, Logprob]

# One entry per prompt token. The first prompt token has nothing before it to
# be predicted from, so its entry is None.
PromptLogprobs = list[LogprobsOnePosition | None]

# One entry per generated token.
SampleLogprobs = list[LogprobsOnePosition]


def _reject_flat(flat_logprobs: bool) -> None:
    if flat_logprobs:
        raise ValueError(
            "flat_logprobs=True is not supported: Glassbox stores logprobs only "
            "as list[dict[int, Logprob]] (vLLM's FlatLogprobs is a GC "
            "optimisation of the same data)."
        )


def create_prompt_logprobs(flat_logprobs: bool = False) -> PromptLogprobs:
    """An empty prompt-logprobs list, already holding the None for token 0."""
    _reject_flat(flat_logprobs)
    return [None]


def create_sample_logprobs(flat_logprobs: bool = False) -> SampleLogprobs:
    """An empty list to collect per-generated-token logprobs into."""
    _reject_flat(flat_logprobs)
    return []


def append_logprobs_for_next_position(
    request_logprobs: PromptLogprobs | SampleLogprobs,
    token_ids: list[int],
    logprobs: list[float],
    decoded_tokens: Iterable[str | None],
    rank: int,
    num_logprobs: int,
) -> None:
    """Append the dict for one more position.

    ``token_ids`` / ``logprobs`` are laid out as the sampler returns them:
    index 0 is the sampled (or actual prompt) token, whose vocabulary rank is
    ``rank``; indices 1..num_logprobs are the top-k tokens, ranks 1..k.
    ``num_logprobs == -1`` means "all of them" (full vocabulary).
    Only the first ``num_logprobs + 1`` entries are read: the sampler gathers
    as many top-k columns as the *batch* needs, so a row may be wider than
    this request asked for.
    If the sampled token is also in the top-k, its dict key appears twice and
    the top-k entry (same logprob, same rank) simply overwrites it, so the
    position then holds ``num_logprobs`` entries instead of ``num_logprobs + 1``.
    """
    if len(token_ids) != len(logprobs):
        raise ValueError(
            f"token_ids and logprobs must have the same length, got "
            f"{len(token_ids)} and {len(logprobs)}"
        )
    if num_logprobs == -1:
        num_logprobs = len(logprobs)
    ranks = [rank, *range(1, num_logprobs + 1)]
    position: LogprobsOnePosition = {}
    for token_id, logprob, token_rank, text in zip(token_ids, logprobs, ranks, decoded_tokens):
        position[token_id] = Logprob(logprob=logprob, rank=token_rank, decoded_token=text)
    request_logprobs.append(position)

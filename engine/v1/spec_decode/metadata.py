"""SpecDecodeMetadata: where each request's draft tokens and logits rows sit in a step.

vLLM twin: ``vllm/v1/spec_decode/metadata.py`` (``SpecDecodeMetadata``).
Read it for the layout the rejection sampler works on. In a verification
step request i is fed its last sampled token followed by its ``n_i`` drafts,
and the model returns ``n_i + 1`` logits rows for it, one after the other:
rows for "the token after draft position 0 .. n_i - 1" (the *target* rows,
which judge drafts 0 .. n_i - 1) and a last one (the *bonus* row, the token
after the final draft). All requests' rows are stacked in request order,
``sum(n_i) + batch_size`` rows in all.

Example, drafts ``[[a, b], [], [c]]``:

    logits rows        0   1   2  |  3  |  4   5
    role               t   t   b  |  b  |  t   b
    draft_token_ids    [a, b, c]
    num_draft_tokens   [2, 0, 1]
    cu_num_draft_tokens    [2, 2, 3]
    cu_num_sampled_tokens  [3, 4, 6]
    target_logits_indices  [0, 1, 4]
    bonus_logits_indices   [2, 3, 5]
    logits_indices         the hidden-state rows (token positions of the
                           whole batch) the model's head is applied to

The runner builds it (``_calc_spec_decode_metadata``); ``make_dummy`` makes
one with the right shapes and zero indices for warm-up and profiling runs.
Sessions: 06 (speculative decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SpecDecodeMetadata:
    # [num_draft_tokens_total] int32: every request's drafts, concatenated in request order.
    draft_token_ids: torch.Tensor
    # [batch_size] host ints: how many drafts each request has (0 allowed).
    num_draft_tokens: list[int]
    # [batch_size] int32: running sum of num_draft_tokens (request i's drafts end here).
    cu_num_draft_tokens: torch.Tensor
    # [batch_size] int32: running sum of num_draft_tokens + 1 (request i's logits rows end here).
    cu_num_sampled_tokens: torch.Tensor
    # [num_draft_tokens_total] int32: the logits row that judges each draft.
    target_logits_indices: torch.Tensor
    # [batch_size] int32: each request's bonus row (the token after its last draft).
    bonus_logits_indices: torch.Tensor
    # [num_draft_tokens_total + batch_size] int32: the hidden-state rows the
    # model's head turns into logits, in the order of the logits rows.
    logits_indices: torch.Tensor
    # Most drafts any request has this step (the output width is this + 1).
    max_spec_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_spec_len = max(self.num_draft_tokens, default=0)

    @classmethod
    def make_dummy(
        cls, draft_token_ids: list[list[int]], device: torch.device
    ) -> SpecDecodeMetadata:
        """Shapes of a real step with these drafts; every logits index is 0."""
        batch_size = len(draft_token_ids)
        num_draft_tokens = [len(ids) for ids in draft_token_ids]
        flat = [token for ids in draft_token_ids for token in ids]
        num_tokens = len(flat)
        cu_drafts = np.cumsum(num_draft_tokens, dtype=np.int32)
        cu_sampled = cu_drafts + np.arange(1, batch_size + 1, dtype=np.int32)

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        return cls(
            draft_token_ids=torch.tensor(flat, dtype=torch.int32, device=device),
            num_draft_tokens=num_draft_tokens,
            cu_num_draft_tokens=torch.from_numpy(cu_drafts).to(device),
            cu_num_sampled_tokens=torch.from_numpy(cu_sampled).to(device),
            target_logits_indices=zeros(num_tokens),
            bonus_logits_indices=zeros(batch_size),
            logits_indices=zeros(num_tokens + batch_size),
        )

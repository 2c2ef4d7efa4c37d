"""The rejection sampler's kernels: Triton on CUDA, a torch twin of each.

vLLM twin: the kernels at the end of ``vllm/v1/sample/rejection_sampler.py``
(``rejection_greedy_sample_kernel``, ``rejection_random_sample_kernel``,
``expand_kernel``, ``sample_recovered_tokens_kernel``); Glassbox keeps them in
a file of their own so that ``rejection_sampler.py`` reads as the algorithm.
Each ``*_torch`` function takes the same arguments as its kernel and writes
the same result (tested bit for bit under ``TRITON_INTERPRET=1``); the CPU
runs the torch ones. ``rejection_sampler.py`` picks one of the pair per call.
Sessions: 06 (speculative decoding).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


# ----------------------------------------------------------------------------
# The torch reference: one function per kernel, same arguments, same results
# ----------------------------------------------------------------------------
class _DraftSlots(NamedTuple):
    """Each request's drafts laid out as a [batch_size, max_spec_len] grid."""

    num_drafts: torch.Tensor  # [batch_size] int64
    flat_index: torch.Tensor  # [batch_size, max_spec_len] int64, index into the drafts (0 = hole)
    valid: torch.Tensor  # [batch_size, max_spec_len] bool: the slot holds a draft


def _draft_slots(cu_num_draft_tokens: torch.Tensor, max_spec_len: int) -> _DraftSlots:
    cu = cu_num_draft_tokens.to(torch.int64)
    num_drafts = torch.diff(cu, prepend=cu.new_zeros(1))
    starts = cu - num_drafts
    positions = torch.arange(max_spec_len, device=cu.device)
    valid = positions < num_drafts.unsqueeze(1)
    flat_index = (starts.unsqueeze(1) + positions).masked_fill(~valid, 0)
    return _DraftSlots(num_drafts, flat_index, valid)


def _write_accepted_prefix(
    output_token_ids: torch.Tensor,  # [batch_size, max_spec_len + 1]
    rows: torch.Tensor,  # [batch_size] bool: the rows this pass owns
    slots: _DraftSlots,
    accepted: torch.Tensor,  # [batch_size, max_spec_len] bool
    accepted_tokens: torch.Tensor,  # [batch_size, max_spec_len]: what an accepted slot emits
    rejected_tokens: torch.Tensor,  # [batch_size, max_spec_len]: what the first rejection emits
    bonus_token_ids: torch.Tensor,  # [batch_size, 1]
) -> None:
    """Write, for ``rows``, the tokens up to the first rejection (or the bonus)."""
    max_spec_len = accepted.shape[1]
    positions = torch.arange(max_spec_len, device=accepted.device)
    # Length of the run of accepted drafts at the start of each row.
    num_accepted = (accepted & slots.valid).to(torch.int32).cumprod(dim=1).sum(dim=1)
    tokens = torch.where(
        positions < num_accepted.unsqueeze(1), accepted_tokens, rejected_tokens
    ).to(output_token_ids.dtype)
    write = rows.unsqueeze(1) & slots.valid & (positions <= num_accepted.unsqueeze(1))
    output_token_ids[:, :max_spec_len] = torch.where(
        write, tokens, output_token_ids[:, :max_spec_len]
    )
    # Every draft accepted: the bonus token goes right after them.
    all_accepted = rows & (num_accepted == slots.num_drafts)
    bonus_column = slots.num_drafts.unsqueeze(1)
    current = output_token_ids.gather(1, bonus_column)
    bonus = bonus_token_ids.view(-1, 1).to(output_token_ids.dtype)
    output_token_ids.scatter_(
        1, bonus_column, torch.where(all_accepted.unsqueeze(1), bonus, current)
    )


def rejection_greedy_sample_torch(
    output_token_ids: torch.Tensor,  # [batch_size, max_spec_len + 1]
    cu_num_draft_tokens: torch.Tensor,  # [batch_size]
    draft_token_ids: torch.Tensor,  # [num_tokens]
    target_argmax: torch.Tensor,  # [num_tokens]
    bonus_token_ids: torch.Tensor,  # [batch_size, 1]
    is_greedy: torch.Tensor | None,  # [batch_size] bool, or None = all rows
    max_spec_len: int,
) -> None:
    """Greedy rows, in place: drafts equal to the target argmax, then the argmax."""
    slots = _draft_slots(cu_num_draft_tokens, max_spec_len)
    drafts = draft_token_ids[slots.flat_index].to(torch.int64)
    argmax = target_argmax[slots.flat_index].to(torch.int64)
    rows = slots.valid.new_ones(slots.num_drafts.shape) if is_greedy is None else is_greedy
    _write_accepted_prefix(
        output_token_ids, rows, slots, drafts == argmax, argmax, argmax, bonus_token_ids
    )


def rejection_random_sample_torch(
    output_token_ids: torch.Tensor,  # [batch_size, max_spec_len + 1]
    cu_num_draft_tokens: torch.Tensor,  # [batch_size]
    draft_token_ids: torch.Tensor,  # [num_tokens]
    draft_probs: torch.Tensor | None,  # [num_tokens, V] or None
    target_probs: torch.Tensor,  # [num_tokens, V]
    bonus_token_ids: torch.Tensor,  # [batch_size, 1]
    recovered_token_ids: torch.Tensor,  # [num_tokens]
    uniform_probs: torch.Tensor,  # [num_tokens] float64
    is_greedy: torch.Tensor,  # [batch_size] bool
    max_spec_len: int,
) -> None:
    """Random rows, in place: accept draft d iff p(d) >= u * q(d) (and q(d) > 0)."""
    slots = _draft_slots(cu_num_draft_tokens, max_spec_len)
    drafts = draft_token_ids[slots.flat_index].to(torch.int64)
    target_prob = target_probs[slots.flat_index, drafts].to(torch.float64)
    if draft_probs is None:
        draft_prob = torch.ones_like(target_prob)
    else:
        draft_prob = draft_probs[slots.flat_index, drafts].to(torch.float64)
    uniform = uniform_probs[slots.flat_index]
    accepted = (draft_prob > 0) & (target_prob >= uniform * draft_prob)
    recovered = recovered_token_ids[slots.flat_index].to(torch.int64)
    _write_accepted_prefix(
        output_token_ids, ~is_greedy, slots, accepted, drafts, recovered, bonus_token_ids
    )


def sample_recovered_tokens_torch(
    cu_num_draft_tokens: torch.Tensor,  # [batch_size]
    draft_token_ids: torch.Tensor,  # [num_tokens]
    draft_probs: torch.Tensor | None,  # [num_tokens, V] or None
    target_probs: torch.Tensor,  # [num_tokens, V]
    inv_q: torch.Tensor,  # [batch_size, V]: 1 / Exp(1) draws
) -> torch.Tensor:
    """argmax over the vocabulary of residual * inv_q, per draft position."""
    num_tokens = draft_token_ids.shape[0]
    num_drafts = torch.diff(
        cu_num_draft_tokens.to(torch.int64), prepend=inv_q.new_zeros(1, dtype=torch.int64)
    )
    request_of_token = torch.arange(inv_q.shape[0], device=inv_q.device).repeat_interleave(
        num_drafts, output_size=num_tokens
    )
    if draft_probs is None:
        # A point mass on the draft: the residual is p without the draft token.
        residual = target_probs.scatter(1, draft_token_ids.to(torch.int64).unsqueeze(1), 0.0)
    else:
        residual = (target_probs - draft_probs).clamp_min(0.0)
    scores = residual * inv_q[request_of_token]
    return scores.argmax(dim=-1).to(draft_token_ids.dtype)


def expand_torch(
    x: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size]
    num_tokens: int,
    replace_from: int,
    replace_to: int,
) -> torch.Tensor:
    """``expand_kernel`` in torch: [batch_size] -> [num_tokens]."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=x.new_zeros(1, dtype=torch.int64))
    expanded = x.repeat_interleave(counts, output_size=num_tokens)
    return expanded.masked_fill(expanded == replace_from, replace_to)


# ----------------------------------------------------------------------------
# Triton kernels (one program per request, or per (request, draft position))
# ----------------------------------------------------------------------------
@triton.jit(do_not_specialize=["max_spec_len"])
def rejection_greedy_sample_kernel(
    output_token_ids_ptr,  # [batch_size, max_spec_len + 1] int32
    cu_num_draft_tokens_ptr,  # [batch_size] int32
    draft_token_ids_ptr,  # [num_tokens] int32
    target_argmax_ptr,  # [num_tokens] int64
    bonus_token_ids_ptr,  # [batch_size] int32
    is_greedy_ptr,  # [batch_size] bool, or None when every row is greedy
    max_spec_len,
):
    req_idx = tl.program_id(0)
    is_greedy = True if is_greedy_ptr is None else tl.load(is_greedy_ptr + req_idx)
    if not is_greedy:
        return  # the random kernel owns this row

    start_idx = 0 if req_idx == 0 else tl.load(cu_num_draft_tokens_ptr + req_idx - 1)
    end_idx = tl.load(cu_num_draft_tokens_ptr + req_idx)
    num_draft_tokens = end_idx - start_idx
    row_ptr = output_token_ids_ptr + req_idx * (max_spec_len + 1)

    rejected = False
    for pos in range(num_draft_tokens):
        if not rejected:
            draft_token_id = tl.load(draft_token_ids_ptr + start_idx + pos)
            target_argmax_id = tl.load(target_argmax_ptr + start_idx + pos).to(tl.int32)
            # Accepted or not, the target's argmax is what greedy decoding emits.
            tl.store(row_ptr + pos, target_argmax_id)
            rejected = draft_token_id != target_argmax_id

    if not rejected:
        tl.store(row_ptr + num_draft_tokens, tl.load(bonus_token_ids_ptr + req_idx))


@triton.jit(do_not_specialize=["max_spec_len"])
def rejection_random_sample_kernel(
    output_token_ids_ptr,  # [batch_size, max_spec_len + 1] int32
    cu_num_draft_tokens_ptr,  # [batch_size] int32
    draft_token_ids_ptr,  # [num_tokens] int32
    draft_probs_ptr,  # [num_tokens, vocab_size] float32, or None
    target_probs_ptr,  # [num_tokens, vocab_size] float32
    bonus_token_ids_ptr,  # [batch_size] int32
    recovered_token_ids_ptr,  # [num_tokens] int32
    uniform_probs_ptr,  # [num_tokens] float64
    is_greedy_ptr,  # [batch_size] bool
    max_spec_len,
    vocab_size,
    NO_DRAFT_PROBS: tl.constexpr,
):
    req_idx = tl.program_id(0)
    if tl.load(is_greedy_ptr + req_idx):
        return  # the greedy kernel owns this row

    start_idx = 0 if req_idx == 0 else tl.load(cu_num_draft_tokens_ptr + req_idx - 1)
    end_idx = tl.load(cu_num_draft_tokens_ptr + req_idx)
    num_draft_tokens = end_idx - start_idx
    row_ptr = output_token_ids_ptr + req_idx * (max_spec_len + 1)

    rejected = False
    for pos in range(num_draft_tokens):
        if not rejected:
            token_idx = start_idx + pos
            draft_token_id = tl.load(draft_token_ids_ptr + token_idx)
            uniform_prob = tl.load(uniform_probs_ptr + token_idx)  # float64
            prob_offset = token_idx.to(tl.int64) * vocab_size + draft_token_id
            if NO_DRAFT_PROBS:
                draft_prob = 1.0
            else:
                draft_prob = tl.load(draft_probs_ptr + prob_offset).to(tl.float64)
            target_prob = tl.load(target_probs_ptr + prob_offset).to(tl.float64)
            # p >= u * q, in float64 (q = 0 never accepts).
            accepted = draft_prob > 0 and target_prob >= uniform_prob * draft_prob
            if accepted:
                token_id = draft_token_id
            else:
                rejected = True
                token_id = tl.load(recovered_token_ids_ptr + token_idx)
            tl.store(row_ptr + pos, token_id)

    if not rejected:
        tl.store(row_ptr + num_draft_tokens, tl.load(bonus_token_ids_ptr + req_idx))


@triton.jit(do_not_specialize=["replace_from", "replace_to"])
def expand_kernel(
    output_ptr,  # [num_tokens]
    input_ptr,  # [batch_size]
    cu_num_tokens_ptr,  # [batch_size] int32
    replace_from,
    replace_to,
    MAX_NUM_TOKENS: tl.constexpr,  # tile: at least any request's token count
):
    req_idx = tl.program_id(0)
    start_idx = 0 if req_idx == 0 else tl.load(cu_num_tokens_ptr + req_idx - 1)
    end_idx = tl.load(cu_num_tokens_ptr + req_idx)
    num_tokens = end_idx - start_idx

    value = tl.load(input_ptr + req_idx)
    value = tl.where(value == replace_from, replace_to, value)
    offsets = tl.arange(0, MAX_NUM_TOKENS)
    tl.store(output_ptr + start_idx + offsets, value, mask=offsets < num_tokens)


@triton.jit
def sample_recovered_tokens_kernel(
    output_token_ids_ptr,  # [num_tokens] int32
    cu_num_draft_tokens_ptr,  # [batch_size] int32
    draft_token_ids_ptr,  # [num_tokens] int32
    draft_probs_ptr,  # [num_tokens, vocab_size] float32, or None
    target_probs_ptr,  # [num_tokens, vocab_size] float32
    inv_q_ptr,  # [batch_size, vocab_size] float32
    vocab_size,
    BLOCK_SIZE: tl.constexpr,
    NO_DRAFT_PROBS: tl.constexpr,
):
    req_idx = tl.program_id(0)
    start_idx = 0 if req_idx == 0 else tl.load(cu_num_draft_tokens_ptr + req_idx - 1)
    end_idx = tl.load(cu_num_draft_tokens_ptr + req_idx)
    pos = tl.program_id(1)
    if pos >= end_idx - start_idx:
        return  # this request has fewer drafts

    token_idx = start_idx + pos
    probs_row = token_idx.to(tl.int64) * vocab_size
    inv_q_row = req_idx.to(tl.int64) * vocab_size
    if NO_DRAFT_PROBS:
        draft_token_id = tl.load(draft_token_ids_ptr + token_idx)

    # Running first maximum of residual * inv_q over the vocabulary tiles.
    best_score = float("-inf")
    best_id = 0
    for v in range(0, vocab_size, BLOCK_SIZE):
        offsets = v + tl.arange(0, BLOCK_SIZE)
        in_vocab = offsets < vocab_size
        if NO_DRAFT_PROBS:
            # A point mass on the draft: p with the draft token removed.
            residual = tl.load(
                target_probs_ptr + probs_row + offsets,
                mask=in_vocab & (offsets != draft_token_id),
                other=0.0,
            )
        else:
            target_prob = tl.load(target_probs_ptr + probs_row + offsets, mask=in_vocab, other=0.0)
            draft_prob = tl.load(draft_probs_ptr + probs_row + offsets, mask=in_vocab, other=0.0)
            residual = tl.maximum(target_prob - draft_prob, 0.0)
        inv_q = tl.load(inv_q_ptr + inv_q_row + offsets, mask=in_vocab, other=0.0)
        # Ties go to the lowest index, as torch.argmax: leftmost in the tile,
        # and a later tile must be strictly larger.
        tile_score, tile_id = tl.max(residual * inv_q, axis=0, return_indices=True)
        if tile_score > best_score:
            best_score = tile_score
            best_id = v + tile_id

    tl.store(output_token_ids_ptr + token_idx, best_id)

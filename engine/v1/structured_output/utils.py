"""Helpers shared by the front end, the manager and the model runner.

vLLM twin: ``vllm/v1/structured_output/utils.py`` (``apply_grammar_bitmask``,
``choice_as_grammar``).
Read it for ``apply_grammar_bitmask``: the scheduler sends one bitmask row per
constrained *position* (one per request, or 1 + d with d drafts), in the order
of ``GrammarOutput.structured_output_request_ids``; the runner's logits rows
are in its own batch order, with free requests in between. The rows are laid
out to match the logits, copied to the device without a sync, and xgrammar's
``apply_token_bitmask_inplace`` sets every disallowed logit to -inf (a
Triton/CUDA kernel on a GPU, a C++ loop on the CPU). In vLLM this happens in
the model runner just before sampling, not in a logits processor.
Sessions: 06.

Simpler than vLLM: no Lark conversion or outlines vocabulary helpers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from engine.v1.core.sched.output import GrammarOutput


def choice_as_grammar(choice: list[str]) -> str:
    """``["yes", "no"]`` -> ``root ::= "yes" | "no"`` (EBNF string literals)."""

    def literal(s: str) -> str:
        s = s.replace("\\", "\\\\").replace('"', '\\"')
        return '"' + s.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t") + '"'

    return "root ::= " + " | ".join(literal(c) for c in choice)


def grammar_bitmask_rows(
    grammar_output: GrammarOutput,
    req_ids: list[str],
    num_draft_tokens: dict[str, int],
) -> tuple[np.ndarray, list[int]]:
    """The scheduler's bitmask rows rearranged to the runner's logits rows
    (Glassbox's own: the first half of vLLM's ``apply_grammar_bitmask``,
    apart so it can be tested without a model).

    ``req_ids`` is the runner's row order; request ``i`` owns 1 +
    ``num_draft_tokens[req_id]`` consecutive logits rows. Returns the
    rearranged bitmask (free rows all ones: nothing masked) and the logits
    rows that are constrained."""
    bitmask = grammar_output.grammar_bitmask
    first_row: dict[str, int] = {}
    row = 0
    for req_id in req_ids:
        first_row[req_id] = row
        row += 1 + num_draft_tokens.get(req_id, 0)
    sorted_bitmask = np.full((row, bitmask.shape[1]), -1, dtype=bitmask.dtype)
    out_indices: list[int] = []
    src = 0
    for req_id in grammar_output.structured_output_request_ids:
        n = 1 + num_draft_tokens.get(req_id, 0)
        if (dst := first_row.get(req_id)) is not None:
            sorted_bitmask[dst : dst + n] = bitmask[src : src + n]
            out_indices.extend(range(dst, dst + n))
        src += n
    return sorted_bitmask, out_indices


def apply_grammar_bitmask(
    grammar_output: GrammarOutput,
    req_ids: list[str],
    num_draft_tokens: dict[str, int],
    logits: torch.Tensor,
) -> None:
    """Mask ``logits`` in place: disallowed tokens of constrained rows -> -inf."""
    import torch
    import xgrammar as xgr

    sorted_bitmask, out_indices = grammar_bitmask_rows(grammar_output, req_ids, num_draft_tokens)
    assert sorted_bitmask.shape[0] == logits.shape[0], (sorted_bitmask.shape, logits.shape)
    bitmask = torch.from_numpy(sorted_bitmask)
    indices = None if len(out_indices) == logits.shape[0] else out_indices
    if not logits.is_cpu:
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        if indices is not None:
            # A device tensor of indices: xgrammar would otherwise copy the
            # list itself, synchronously.
            index_tensor = torch.tensor(indices, dtype=torch.int32).pin_memory()
            indices = index_tensor.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)
        return
    if logits.dtype != torch.float32:
        # xgrammar's CPU kernel takes float32 only.
        masked = logits.float()
        xgr.apply_token_bitmask_inplace(masked, bitmask, indices=indices)
        logits.copy_(masked)
        return
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)

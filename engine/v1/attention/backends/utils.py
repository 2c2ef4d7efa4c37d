"""Helpers shared by the attention backends: putting decodes before prefills.

vLLM twin: ``vllm/v1/attention/backends/utils.py``
(``reorder_batch_to_split_decodes_and_prefills``).
Read it for why the persistent batch is reordered at all: a backend that
runs decodes and prefills through different kernels wants them as two
contiguous runs of rows, so that each kernel gets one slice of the query
rows and of the block table instead of a scattered index list. A builder
that wants this sets ``reorder_batch_threshold`` (the longest query that
still counts as a decode); before the step's inputs are laid out the runner
calls the function below, which reorders the rows with
``InputBatch.swap_states`` -- each swap also recorded for the logits
processors.

The rows end up in four runs, in this order:
  0. decodes -- at most ``threshold`` tokens scheduled, prompt fully computed;
  1. short extends -- at most ``threshold`` tokens of a prompt already begun;
  2. long extends -- more than ``threshold`` tokens, some already computed;
  3. prefills -- nothing computed yet (the first chunk of a prompt, or a
     request recomputed after preemption).
Only rows outside their run move: the misplaced rows, taken run by run,
fill the misplaced slots in row order, and every swap sends one request
straight to its final slot (a cycle of k misplaced rows costs k - 1 swaps),
so a batch that is almost in order costs almost nothing. The order inside a
run is not preserved.
Sessions: 05 (attention backends).

Simpler than vLLM: only the reorder function lives here; vLLM's module also
holds ``split_decodes_and_prefills`` (where a reordered batch's decodes end)
and many helpers for backends Glassbox does not have. Glassbox's builders
find their decode rows by query length, in any order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine.v1.core.sched.output import SchedulerOutput
    from engine.v1.worker.gpu_input_batch import InputBatch

# The four runs, in batch order.
DECODE, SHORT_EXTEND, LONG_EXTEND, PREFILL = 0, 1, 2, 3


def batch_regions(
    num_scheduled_tokens: np.ndarray,
    num_computed_tokens: np.ndarray,
    num_prompt_tokens: np.ndarray,
    decode_threshold: int,
) -> np.ndarray:
    """The run (``DECODE`` .. ``PREFILL``) each row belongs to, [num_reqs] int.

    Glassbox's own helper: vLLM computes the four masks inline."""
    started = num_computed_tokens > 0
    short = num_scheduled_tokens <= decode_threshold
    in_prompt = num_computed_tokens < num_prompt_tokens
    return np.select(
        [~started, ~short, in_prompt],
        [PREFILL, LONG_EXTEND, SHORT_EXTEND],
        default=DECODE,
    )


def reorder_batch_to_split_decodes_and_prefills(
    input_batch: InputBatch,
    scheduler_output: SchedulerOutput,
    decode_threshold: int = 1,
) -> bool:
    """Swap rows of ``input_batch`` so decodes come first, then short
    extends, long extends and prefills (see the module docstring). Returns
    whether any row moved."""
    req_ids = input_batch.req_ids
    num_reqs = len(req_ids)
    scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids])
    region = batch_regions(
        scheduled,
        input_batch.num_computed_tokens_cpu[:num_reqs],
        input_batch.num_prompt_tokens[:num_reqs],
        decode_threshold,
    )
    # Sorted, the regions say which run each slot must hold.
    misplaced = np.flatnonzero(region != np.sort(region))
    if misplaced.size == 0:
        return False
    # The misplaced rows, taken run by run (in row order within a run), fill
    # the misplaced slots in row order: row movers[k] goes to slot misplaced[k].
    movers = misplaced[np.argsort(region[misplaced], kind="stable")]
    destination = dict(zip(movers.tolist(), misplaced.tolist()))
    settled: set[int] = set()
    for start in destination:
        if start in settled:
            continue
        # Follow the cycle through `start`: send the request sitting there to
        # its slot; the one that was in that slot now sits in `start`.
        origin = start  # where the request now in `start` came from
        while (slot := destination[origin]) != start:
            input_batch.swap_states(start, slot)
            settled.add(slot)
            origin = slot
        settled.add(start)
    return True

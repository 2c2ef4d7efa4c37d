"""CommonAttentionMetadata.seq_lens_cpu: given, or copied from the device once.

A drafter's lookahead pass under async scheduling knows its context lengths
on the device only; a backend that plans on the host (FlashInfer) reads
``seq_lens_cpu`` and gets the copy, the others never ask.
"""

from __future__ import annotations

import torch

from engine.v1.attention.backend import CommonAttentionMetadata


def _common(seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor | None) -> CommonAttentionMetadata:
    n = len(seq_lens)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.zeros(n, 4, dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.long),
        _seq_lens_cpu=seq_lens_cpu,
    )


def test_seq_lens_cpu_is_the_given_tensor():
    given = torch.tensor([3, 5], dtype=torch.int32)
    common = _common(torch.tensor([9, 9], dtype=torch.int32), given)
    assert common.seq_lens_cpu is given


def test_seq_lens_cpu_is_copied_from_the_device_values_once():
    seq_lens = torch.tensor([4, 7, 1], dtype=torch.int32)
    common = _common(seq_lens, None)
    first = common.seq_lens_cpu
    assert first.tolist() == [4, 7, 1] and first.device.type == "cpu"
    assert common.seq_lens_cpu is first  # kept, not copied again

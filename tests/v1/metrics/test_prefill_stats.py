"""``PrefillStats`` (engine/v1/metrics/stats.py): how it splits a prompt, and
that it crosses the process hop on an ``EngineCoreOutput``."""

from __future__ import annotations

import pytest

from engine.v1.engine import EngineCoreOutput, EngineCoreOutputs
from engine.v1.metrics.stats import PrefillStats
from engine.v1.serial_utils import MsgpackDecoder, MsgpackEncoder


def test_set_splits_the_prompt_into_computed_and_cached():
    stats = PrefillStats()
    stats.set(num_prompt_tokens=50, num_local_cached_tokens=32, num_external_cached_tokens=0)
    assert stats == PrefillStats(
        num_prompt_tokens=50,
        num_computed_tokens=18,
        num_cached_tokens=32,
        num_local_cached_tokens=32,
        num_external_cached_tokens=0,
    )


def test_set_counts_external_tokens_as_cached():
    stats = PrefillStats()
    stats.set(num_prompt_tokens=30, num_local_cached_tokens=8, num_external_cached_tokens=12)
    assert (stats.num_cached_tokens, stats.num_computed_tokens) == (20, 10)


def test_set_overwrites_an_earlier_set():
    stats = PrefillStats()
    stats.set(num_prompt_tokens=30, num_local_cached_tokens=16, num_external_cached_tokens=0)
    stats.set(num_prompt_tokens=30, num_local_cached_tokens=0, num_external_cached_tokens=0)
    assert (stats.num_cached_tokens, stats.num_computed_tokens) == (0, 30)


def test_more_cached_than_prompt_tokens_is_an_error():
    with pytest.raises(ValueError, match=r"num_cached_tokens \(9\).*num_prompt_tokens \(8\)"):
        PrefillStats().set(
            num_prompt_tokens=8, num_local_cached_tokens=9, num_external_cached_tokens=0
        )


def test_prefill_stats_survive_the_msgpack_hop():
    stats = PrefillStats()
    stats.set(num_prompt_tokens=21, num_local_cached_tokens=16, num_external_cached_tokens=0)
    batch = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(request_id="first", new_token_ids=[5], prefill_stats=stats),
            EngineCoreOutput(request_id="later", new_token_ids=[6]),
        ]
    )
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(batch))
    first, later = decoded.outputs
    assert isinstance(first.prefill_stats, PrefillStats)
    assert first.prefill_stats == stats
    assert later.prefill_stats is None

"""``SchedulerStats`` (engine/v1/metrics/stats.py) across the process hop and
into the front end's ``StatLogger`` (engine/v1/metrics/loggers.py)."""

from __future__ import annotations

from engine.v1.engine import EngineCoreOutputs
from engine.v1.metrics.loggers import StatLogger
from engine.v1.metrics.stats import PrefixCacheStats, SchedulerStats
from engine.v1.serial_utils import MsgpackDecoder, MsgpackEncoder


def make_stats() -> SchedulerStats:
    prefix = PrefixCacheStats(reset=True, requests=2, queries=40, hits=16)
    prefix.record(num_tokens=8, num_hits=4, preempted=True)
    return SchedulerStats(
        num_running_reqs=3,
        num_waiting_reqs=2,
        num_skipped_waiting_reqs=1,
        step_counter=17,
        kv_cache_usage=0.25,
        prefix_cache_stats=prefix,
        num_preemptions=1,
    )


def test_scheduler_stats_survive_the_msgpack_hop():
    stats = make_stats()
    frames = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    assert isinstance(decoded.scheduler_stats, SchedulerStats)
    assert isinstance(decoded.scheduler_stats.prefix_cache_stats, PrefixCacheStats)
    assert decoded.scheduler_stats == stats


def test_no_stats_decode_as_none():
    frames = MsgpackEncoder().encode(EngineCoreOutputs())
    assert MsgpackDecoder(EngineCoreOutputs).decode(frames).scheduler_stats is None


def test_default_stats_have_vllms_fields():
    stats = SchedulerStats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_skipped_waiting_reqs) == (
        0,
        0,
        0,
    )
    assert stats.step_counter == 0 and stats.kv_cache_usage == 0.0
    assert stats.prefix_cache_stats == PrefixCacheStats()
    # Each instance gets its own counters.
    assert SchedulerStats().prefix_cache_stats is not stats.prefix_cache_stats


def test_stat_logger_adds_up_prefix_cache_stats_and_both_waiting_queues():
    logger = StatLogger("m")
    logger.record_scheduler_stats(make_stats())
    logger.record_scheduler_stats(make_stats())
    values = {m.name: m.value for m in logger.get_metrics()}
    # Preempted requests' re-lookups are not counted, as in vLLM.
    assert values["glassbox:prefix_cache_queries"] == 80
    assert values["glassbox:prefix_cache_hits"] == 32
    assert values["glassbox:num_preemptions"] == 2
    # The gauges show the last step; waiting counts both queues.
    assert values["glassbox:num_requests_running"] == 3.0
    assert values["glassbox:num_requests_waiting"] == 3.0
    assert values["glassbox:kv_cache_usage_perc"] == 0.25

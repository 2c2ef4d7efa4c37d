"""benchmarks/async_scheduling.py: its summary and where its results go."""

from __future__ import annotations

import pytest

from benchmarks import results_store
from benchmarks.async_scheduling import main, summarize


def test_summary_takes_medians_and_compares_async_with_sync():
    runs = {
        "sync": {
            "throughput": [{"tokens_per_s": 100.0}, {"tokens_per_s": 120.0}, {"error": "x"}],
            "itl": [{"median_itl_ms": 4.0}, {"median_itl_ms": 6.0}],
            "latency": [{"1": {"median_ms": 5.0}}, {"1": {"median_ms": 7.0}}],
        },
        "async": {
            "throughput": [{"tokens_per_s": 150.0}, {"tokens_per_s": 130.0}],
            "itl": [{"median_itl_ms": 3.0}, {"median_itl_ms": 2.0}],
            "latency": [{"1": {"median_ms": 3.0}}, {"1": {"median_ms": 3.0}}],
        },
    }
    summary = summarize(runs)
    assert summary["sync"] == {
        "throughput_tokens_per_s": 110.0,  # the failed round is left out
        "client_itl_batch1_median_ms": 5.0,
        "decode_step_batch1_median_ms": 6.0,
    }
    assert summary["async_over_sync"] == pytest.approx(
        {
            "throughput_tokens_per_s": 140.0 / 110.0,
            "client_itl_batch1_median_ms": 2.5 / 5.0,
            "decode_step_batch1_median_ms": 3.0 / 6.0,
        }
    )


def test_series_name_per_machine():
    assert results_store.current_name({"benchmark": "async_scheduling"}) == "async_scheduling_cpu"
    gpu = {"benchmark": "async_scheduling", "device": "cuda", "gpu": "NVIDIA H200"}
    assert results_store.current_name(gpu) == "async_scheduling_h200"


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--rounds", "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--parts", "itl,nope"])
    assert "unknown ['nope']" in capsys.readouterr().err

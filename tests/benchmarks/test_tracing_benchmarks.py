"""The tracing benchmarks run end to end on the tiny model (one round each).

They run on the GPU machine inside one call of ``scripts/gpu_run.sh``, where a
script that breaks costs device time nobody gets back; here they run on the
CPU in seconds. The figures themselves are not checked (one round of a
2-layer model is noise), only that every mode ran, produced the same tokens
(the script exits otherwise), that the results say what they claim, and that
``--record`` stores them the way ``benchmarks/results`` expects.
"""

from __future__ import annotations

import json

from benchmarks import results_store, tracing_overhead, tracing_profile
from engine.tracing import NULL_TRACER, Tracer
from engine.tracing.core_trace import KVCacheTrace, SchedulerTrace
from engine.tracing.worker_trace import RunnerTrace, SamplerTrace


def test_tracing_overhead_runs_every_mode_and_records_its_results(tmp_path):
    results = tmp_path / "results"
    hooks_before = {name: vars(SchedulerTrace)[name] for name in ("scheduled", "queued")}
    record_before = Tracer.record
    rc = tracing_overhead.main(
        "--model tiny --rounds 1 --num-prompts 4 --max-num-seqs 4 --max-tokens 4 --split".split()
        + ["--record", str(results), "--note", "smoke"]
    )
    assert rc == 0
    result = json.loads((results / "tracing_overhead_cpu_tiny.json").read_text())
    assert set(result["slowdown_vs_off_percent"]) == {
        "lifecycle",
        "full",
        "lifecycle-hooks",
        "full-hooks",
    }
    assert set(result["within_target"]) == {"off", "lifecycle", "full"}
    assert result["trace_bytes_per_run"]["full"] > result["trace_bytes_per_run"]["lifecycle"] > 0
    # 4 tokens, and with async scheduling (the default) a fifth, empty step:
    # scheduled while the fourth, which samples the last tokens, is in flight.
    assert result["workload"]["engine_steps_per_run"] == 5
    # The bound on off: counted hook calls (the scheduler and the engine core
    # call theirs once per step) times a measured no-op call, over a step.
    per_hook = result["hook_calls_per_step"]
    assert per_hook["SchedulerTrace.scheduled"] == 1.0
    assert per_hook["EngineCoreTrace.step_launched"] == 1.0
    assert per_hook["EngineCoreTrace.output_ready"] == 1.0
    bound = result["off_upper_bound"]
    # (each figure is rounded on its own)
    assert abs(bound["hook_calls_per_step"] - sum(per_hook.values())) <= 0.05 + 0.005 * len(
        per_hook
    )
    assert bound["noop_hook_call_ns"] > 0 and bound["step_ms"] > 0
    expected = (
        100 * bound["hook_calls_per_step"] * bound["noop_hook_call_ns"] / (bound["step_ms"] * 1e6)
    )
    assert abs(bound["percent"] - expected) <= 0.01 * expected
    assert result["tracer_us_per_event"]["full"] > 0
    # The counters and the split's no-op tracer are gone once the run is over.
    assert {name: vars(SchedulerTrace)[name] for name in hooks_before} == hooks_before
    assert Tracer.record is record_before
    # --record: the current file and one history line holding the same result.
    (line,) = results_store.read_history(results)
    assert line["result"] == result
    assert line["current_file"] == line["source_file"] == "tracing_overhead_cpu_tiny.json"
    assert (line["benchmark"], line["machine"], line["note"]) == (
        "tracing_overhead",
        "cpu",
        "smoke",
    )


def test_hook_counter_counts_the_engines_calls_only(tmp_path):
    tracer = Tracer(str(tmp_path / "t.jsonl"), "lifecycle")
    with tracing_overhead.HookCounter() as hooks:
        trace = RunnerTrace(tracer)
        trace.step_started(1)
        trace.sampling(["a", "b"], [1])  # calls SamplerTrace.begin itself: not counted
        SchedulerTrace.NULL.queued(None)  # a NULL twin: not a counted class
        KVCacheTrace.NULL.cache_reset()
    tracer.close()
    assert hooks.counts == {"RunnerTrace.step_started": 1, "RunnerTrace.sampling": 1}
    assert not hasattr(SamplerTrace.begin, "__wrapped__")
    assert SchedulerTrace.create(NULL_TRACER) is SchedulerTrace.NULL


def test_tracing_profile_lists_the_functions_tracing_adds(tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = tracing_profile.main(
        "--model tiny --rounds 1 --profiled-runs 1 --num-prompts 4 --max-tokens 4 --top 50".split()
        + ["--out", str(out)]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert set(result["unprofiled_step_us"]) == {"off", "lifecycle"}
    functions = [row["function"] for row in result["top_functions_by_added_own_time"]]
    # Work that only tracing does shows up among the added time.
    assert any("engine/tracing/worker_trace.py" in f and f.endswith(" batch") for f in functions), (
        functions
    )
    assert any("engine/tracing/tracer.py" in f for f in functions), functions
    assert "unprofiled step time" in capsys.readouterr().out
    assert out.with_suffix(".txt").read_text().startswith("unprofiled step time")
    assert results_store.current_name(result) == "tracing_profile_cpu_tiny"

"""The tracing benchmarks run end to end on the tiny model (one round each).

They run on the GPU machine inside one call of ``scripts/gpu_run.sh``, where a
script that breaks costs device time nobody gets back; here they run on the
CPU in seconds. The figures themselves are not checked (one round of a
2-layer model is noise), only that every mode ran, produced the same tokens
(the script exits otherwise) and that the results say what they claim.
"""

from __future__ import annotations

import json

from benchmarks import tracing_overhead, tracing_profile


def test_tracing_overhead_runs_every_mode_and_writes_its_results(tmp_path):
    out = tmp_path / "overhead.json"
    rc = tracing_overhead.main(
        ["--model", "tiny", "--rounds", "1", "--num-prompts", "4", "--max-num-seqs", "4",
         "--max-tokens", "4", "--split", "--out", str(out)]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    modes = {"noop", "off", "lifecycle", "full", "lifecycle-hooks", "full-hooks"}
    assert set(result["slowdown_vs_noop_percent"]) == modes
    assert result["slowdown_vs_noop_percent"]["noop"] == 0.0
    assert set(result["within_target"]) == {"off", "lifecycle", "full"}
    assert result["trace_bytes_per_run"]["full"] > result["trace_bytes_per_run"]["lifecycle"] > 0
    assert result["workload"]["engine_steps_per_run"] == 4


def test_tracing_profile_lists_the_functions_tracing_adds(tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = tracing_profile.main(
        ["--model", "tiny", "--rounds", "1", "--profiled-runs", "1", "--num-prompts", "4",
         "--max-tokens", "4", "--top", "50", "--out", str(out)]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert set(result["unprofiled_step_us"]) == {"off", "lifecycle"}
    functions = [row["function"] for row in result["top_functions_by_added_own_time"]]
    # Work that only tracing does shows up among the added time.
    assert any("_trace_batch" in f for f in functions), functions
    assert any("tracing/__init__.py" in f for f in functions), functions
    assert "unprofiled step time" in capsys.readouterr().out

"""benchmarks/tensor_parallel_cpu.py, cut down to seconds: gloo's collectives
between 2 processes, the tiny llama at TP=1 and TP=2 (mp executor), the
collectives per decode step read back from the workers' trace, and each
rank's memory against TP=1."""

from __future__ import annotations

import json

from benchmarks import results_store, tensor_parallel_cpu


def test_tensor_parallel_benchmark_runs_on_cpu(tmp_path):
    argv = ["--allreduce-worlds", "2", "--allreduce-iters", "20", "--tiny-tp", "1,2"]
    argv += ["--default-tp", "", "--repeats", "1", "--num-prompts", "4", "--output-len", "4"]
    assert tensor_parallel_cpu.main([*argv, "--out", f"{tmp_path}/"]) == 0
    (path,) = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    assert path.name == "tensor_parallel_cpu.json" == results_store.current_name(result) + ".json"

    collectives = result["collectives"]
    assert {(c["op"], c["world"]) for c in collectives} == {("all_reduce", 2), ("all_gather", 2)}
    assert len(collectives) == len(tensor_parallel_cpu.ALLREDUCE_SHAPES) + 2
    for c in collectives:
        assert 0 < c["min_us"] <= c["median_us"] <= c["p90_us"]

    rows = {r["tp"]: r for r in result["engine"]}
    assert sorted(rows) == [1, 2]
    for tp, row in rows.items():
        assert all(run["output_tokens"] == 4 * 4 for run in row["runs"])
        assert row["output_tokens_per_second"] > 0 and row["decode_step_mean_ms"] > 0
        assert [r["rank"] for r in row["ranks"]] == list(range(tp))
        assert [r["rank"] for r in row["traced"]["per_rank"]] == list(range(tp))
        assert row["traced"]["decode_steps"] >= 2
    # Two layers: an all-reduce after o_proj and after down_proj each, one for
    # the embedding; one all-gather of the logits. None with one rank.
    for rank in rows[2]["traced"]["per_rank"]:
        assert rank["all_reduce_per_step"] == 5 and rank["all_gather_per_step"] == 1
        assert rank["collective_ms_per_step"] > 0
    assert rows[1]["traced"]["per_rank"][0]["all_reduce_per_step"] == 0

    # Memory: measured before and after loading in every worker (fork).
    for rank in rows[2]["ranks"]:
        assert 0.5 <= rank["fraction_of_tp1"]["param_bytes"] < 0.6  # norms are replicated
        assert rank["before_load"]["VmRSS"] > 0
        assert rank["after_runs"]["VmHWM"] >= rank["after_runs"]["VmRSS"]
        assert set(rank["growth_bytes"]) == set(tensor_parallel_cpu.GROWTHS)

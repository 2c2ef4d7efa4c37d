"""benchmarks/spec_verify_cost.py on the CPU: every mode measured, and every
timed verification step really verified k drafts per request."""

from __future__ import annotations

import json

from benchmarks import results_store, spec_verify_cost


def test_spec_verify_cost_runs_on_cpu(tmp_path):
    argv = ["--device", "cpu", "--batch-sizes", "1,2", "--ks", "1,2"]
    assert (
        spec_verify_cost.main([*argv, "--steps", "3", "--warmup", "1", "--out", f"{tmp_path}/"])
        == 0
    )
    (path,) = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    assert path.name == "spec_verify_cost_cpu.json" == results_store.current_name(result) + ".json"
    rows = {(r["mode"], r["batch"]): r for r in result["results"]}
    modes = ["decode_graphs", "decode_eager", "verify_k1", "verify_k2"]
    assert sorted(rows) == sorted((m, b) for m in modes for b in (1, 2))
    for r in rows.values():
        assert r["drafts_verified_per_request"] == [r["k"]]
        assert r["median_ms"] > 0 and r["p90_ms"] >= r["median_ms"]
    for b in (1, 2):
        assert rows[("decode_graphs", b)]["ratio_to_decode_graphs"] == 1.0

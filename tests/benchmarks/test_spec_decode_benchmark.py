"""benchmarks/spec_decode.py: the counters and their maths, the output comparison, the
summary, the series name, the generated table, and one small run of ``main`` on the
tiny checkpoint with dummy weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import results_store, results_table
from benchmarks.spec_decode import (
    Acceptance,
    SpecCounters,
    first_difference,
    main,
    mismatches,
    parse_mode,
    summarize,
)
from engine.v1.metrics.reader import Counter, Gauge
from tests.helpers.tiny_model import make_tiny_model_dir


def spec_metrics(drafts: int, tokens: int, accepted: int, per_pos: list[int]) -> list[Any]:
    labels = {"model_name": "m"}
    return [
        Gauge("glassbox:num_requests_running", dict(labels), 3.0),
        Counter("glassbox:generation_tokens", dict(labels), 999),
        Counter("glassbox:spec_decode_num_drafts", dict(labels), drafts),
        Counter("glassbox:spec_decode_num_draft_tokens", dict(labels), tokens),
        Counter("glassbox:spec_decode_num_accepted_tokens", dict(labels), accepted),
        # Out of order on purpose: the position label decides the place.
        *(
            Counter(
                "glassbox:spec_decode_num_accepted_tokens_per_pos",
                {**labels, "position": str(pos)},
                per_pos[pos],
            )
            for pos in reversed(range(len(per_pos)))
        ),
    ]


def test_counters_are_read_from_the_metrics_and_differenced():
    before = SpecCounters.from_metrics(spec_metrics(4, 12, 7, [4, 2, 1]))
    after = SpecCounters.from_metrics(spec_metrics(14, 40, 22, [12, 7, 3]))
    assert before == SpecCounters(4, 12, 7, (4, 2, 1))
    assert after - before == SpecCounters(10, 28, 15, (8, 5, 2))
    # No speculation: no spec counters at all, so zeros and an empty per-position tuple.
    off = SpecCounters.from_metrics(spec_metrics(0, 0, 0, [])[:2])
    assert off == SpecCounters() and off - off == SpecCounters()
    assert SpecCounters.from_json(after.to_json()) == after


def test_counters_add_across_rounds():
    a = SpecCounters(2, 6, 3, (2, 1, 0))
    assert a + SpecCounters(1, 3, 3, (1, 1, 1)) == SpecCounters(3, 9, 6, (3, 2, 1))
    assert SpecCounters() + a == a  # an empty per-position tuple pads with zeros


def test_acceptance_is_vllms_three_formulas():
    # 10 drafts of up to 3 tokens (28 proposed), 15 accepted: 8 at position 0, 5 at 1, 2 at 2.
    acc = Acceptance.of(SpecCounters(10, 28, 15, (8, 5, 2)))
    assert acc is not None
    assert acc.mean_acceptance_length == pytest.approx(1 + 15 / 10)
    assert acc.acceptance_rate == pytest.approx(15 / 28)
    assert acc.per_position == pytest.approx((0.8, 0.5, 0.2))
    assert Acceptance.of(SpecCounters()) is None


def test_first_difference_and_mismatches():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # one stopped early
    assert first_difference([], []) is None
    found = mismatches(
        [[1, 2], [3, 4], [5]], [[1, 2], [3, 5], [5, 6]], round_index=1, mode="m", part="batch"
    )
    assert [(m["prompt"], m["first_difference_at"], m["tokens"]) for m in found] == [
        (1, 1, 2),
        (2, 1, 2),
    ]
    assert found[0]["round"] == 1 and found[0]["mode"] == "m" and found[0]["part"] == "batch"
    with pytest.raises(ValueError):  # a lost output is an error, not a silent match
        mismatches([[1]], [], round_index=0, mode="m", part="batch")


def test_modes_parse():
    off = parse_mode("off", 2, 4)
    assert off.speculative_config is None and off.async_scheduling is False
    assert parse_mode("off_async", 2, 4).async_scheduling is True
    k3 = parse_mode("ngram_k3", 2, 4)
    assert k3.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    assert k3.async_scheduling is False  # n-gram runs the serial loop
    window = parse_mode("ngram_k5_n1-3", 2, 4).speculative_config
    assert window is not None
    assert (window["num_speculative_tokens"], window["prompt_lookup_min"]) == (5, 1)
    assert window["prompt_lookup_max"] == 3
    with pytest.raises(ValueError, match="unknown mode"):
        parse_mode("eagle_k3", 2, 4)


def run(tps: float, seconds: float = 1.0, spec: SpecCounters | None = None) -> dict[str, Any]:
    r: dict[str, Any] = {"output_tokens": 100, "seconds": seconds, "tokens_per_s": tps}
    if spec is not None:
        r["spec"] = spec.to_json()
    return r


def test_summary_pairs_rounds_and_sums_counters():
    spec = SpecCounters(10, 30, 15, (7, 5, 3))
    runs = {
        "off": {"batch": [run(100.0, 2.0), run(50.0, 4.0), run(80.0, 3.0)]},
        "ngram_k3": {
            "batch": [run(150.0, 1.0, spec), run(100.0, 2.0, spec), {"error": "boom"}],
        },
    }
    summary = summarize(runs)
    off, k3 = summary["off"]["batch"], summary["ngram_k3"]["batch"]
    assert off["tokens_per_s"] == 80.0 and off["seconds"] == 3.0 and "speedup" not in off
    assert "mean_acceptance_length" not in off
    # Paired by round: 1.5 and 2.0 -> 1.75. The ratio of medians would be 125 / 80.
    assert k3["speedup"] == pytest.approx(1.75)
    assert k3["rounds"] == 2 and k3["tokens_per_s"] == 125.0
    assert k3["spec"] == (spec + spec).to_json()
    assert k3["mean_acceptance_length"] == pytest.approx(2.5)
    assert k3["acceptance_rate"] == pytest.approx(0.5)
    assert k3["acceptance_per_position"] == pytest.approx([0.7, 0.5, 0.3])


def test_series_names():
    assert results_store.current_name({"benchmark": "spec_decode"}) == "spec_decode_cpu"
    gpu = {"benchmark": "spec_decode", "device": "cuda", "gpu": "NVIDIA H200"}
    assert results_store.current_name(gpu) == "spec_decode_h200"
    other = {"benchmark": "spec_decode", "model_arg": "/tmp/x/tiny-llama/"}
    assert results_store.current_name(other) == "spec_decode_cpu_tiny_llama"


def made_up_result(mismatched: int = 0) -> dict[str, Any]:
    spec = SpecCounters(10, 30, 15, (7, 5, 3))
    runs = {
        "off": {"batch": [run(100.0)], "batch1": [run(20.0)]},
        "ngram_k3": {"batch": [run(110.0, spec=spec)], "batch1": [run(30.0, spec=spec)]},
    }
    return {
        "benchmark": "spec_decode",
        "device": "cpu",
        "date": "2026-12-04T10:00:00+00:00",
        "commit": "abc1234",
        "torch": "2.9.0",
        "machine": {"cpu_model": "Some CPU", "logical_cpus": 2},
        "model": "SmolLM2-135M-Instruct (default model), float32",
        "workload": {"num_prompts": 16, "batch1_prompts": 16, "max_tokens": 128},
        "modes": {
            "off": {"speculative_config": None, "async_scheduling": False},
            "ngram_k3": {
                "speculative_config": {
                    "method": "ngram",
                    "num_speculative_tokens": 3,
                    "prompt_lookup_min": 2,
                    "prompt_lookup_max": 4,
                },
                "async_scheduling": False,
            },
        },
        "rounds": 1,
        "summary": summarize(runs),
        "mismatches": [{"prompt": i} for i in range(mismatched)],
        "outputs_compared": 32,
    }


def results_of(r: dict[str, Any]) -> results_table.Results:
    line = {"current_file": "spec_decode_cpu.json", "date": r["date"], "commit": r["commit"]}
    return results_table.Results({"spec_decode_cpu.json": r}, [line], ["spec_decode_cpu.json"])


def test_table_renders_speed_acceptance_and_identity():
    text = results_table.spec_decode_table(results_of(made_up_result()))
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| mode | batch 16: tok/s | × off | batch 1 (16 prompts): tok/s")
    assert rows[2] == "| off, serial loop | 100.0 |  | 20.0 |  |  |  |  |"
    assert rows[3] == (
        "| n-gram, k = 3, lookup 2–4 | 110.0 | 1.10 | 30.0 | 1.50 | 2.50 | 50% "
        "| 0.70 / 0.50 / 0.30 |"
    )
    assert "`spec_decode_cpu.json` (2026-12-04, abc1234;" in text
    assert "greedy outputs token-identical to `off`'s (32 outputs compared)" in text
    says = results_table.spec_decode_says(made_up_result())
    assert (
        says
        == "against off: ngram_k3 1.50x (batch 1), acceptance length 2.50; greedy outputs identical"
    )
    assert results_table.spec_status(made_up_result()) == "k = 3: 1.50x, acceptance length 2.50"


def test_table_says_when_outputs_differ():
    r = made_up_result(mismatched=2)
    assert "**2 of 32 greedy outputs differ from `off`'s**" in results_table.spec_decode_table(
        results_of(r)
    )
    assert results_table.spec_decode_says(r).endswith("greedy outputs 2 differ")
    assert results_table.spec_status(r).endswith("; 2 greedy outputs differ")


def test_the_table_has_a_block_in_its_doc():
    blocks = {b.name: b.doc for b in results_table.BLOCKS}
    assert blocks["spec-decode"] == "docs/spec_decode.md"
    assert "docs/spec_decode.md" in results_table.DOCS  # its file must be named there


def test_bad_arguments_are_refused(capsys):
    for argv, message in (
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--modes", "off,eagle_k3"], "unknown mode 'eagle_k3'"),
        (["--modes", "ngram_k3"], "must start with off"),
        (["--parts", "batch,nope"], "unknown ['nope']"),
        (["--num-prompts", "99"], "--num-prompts must be in 1..16"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    path = make_tiny_model_dir(tmp_path / "tiny")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 32  # the helper's config is for the counting executor
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_main_runs_end_to_end_on_the_tiny_model(tiny_dir: Path, tmp_path: Path):
    """Two prompts (all <unk> in the tiny vocabulary), 8 tokens, dummy weights: every
    figure is written, the outputs are compared, and --record stores the series."""
    store = tmp_path / "results"
    argv = ["--model", str(tiny_dir), "--load-format", "dummy", "--num-prompts", "2"]
    argv += ["--max-tokens", "8", "--rounds", "1", "--modes", "off,ngram_k2_n1-2"]
    argv += ["--out", str(tmp_path / "out") + "/", "--record", str(store), "--note", "smoke"]
    assert main(argv) == 0
    path = tmp_path / "out" / "spec_decode_cpu_tiny.json"
    r = json.loads(path.read_text())
    assert r["benchmark"] == "spec_decode" and r["commit"] and r["torch"] and r["date"]
    assert r["machine"]["logical_cpus"] and r["workload"]["batch1_prompts"] == 2
    for part in ("batch", "batch1"):
        tokens = set()
        for mode in ("off", "ngram_k2_n1-2"):
            (figures,) = r["runs"][mode][part]
            assert "error" not in figures, figures.get("error")
            tokens.add(figures["output_tokens"])
        assert len(tokens) == 1 and 0 < tokens.pop() <= 16, part  # 2 prompts, 8 tokens each
    assert r["outputs_compared"] == 4  # 2 prompts x 2 parts
    assert r["identical_outputs"] is (not r["mismatches"])
    spec = r["summary"]["ngram_k2_n1-2"]["batch"]["spec"]
    assert len(spec["num_accepted_tokens_per_pos"]) == 2
    assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0
    stored = json.loads((store / "spec_decode_cpu_tiny.json").read_text())
    assert stored == r
    (line,) = results_store.read_history(store)
    assert line["note"] == "smoke" and line["current_file"] == "spec_decode_cpu_tiny.json"

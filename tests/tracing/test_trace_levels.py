"""Trace levels and the rule that tracing never changes what the engine does.

* ``off`` writes nothing; ``lifecycle`` has no sampler stages or runner
  inputs; ``full`` adds them (engine/v1/sample/sampler.py,
  engine/v1/worker/gpu_model_runner.py).
* Outputs -- token ids, text, logprobs -- are identical with tracing off,
  lifecycle and full, for greedy, seeded-random and penalised requests.
* The sampler's stage snapshots: one per stage that ran, in order, the
  top-k / top-p stage keeps at most k candidates, the chosen token's logprob
  is the raw log-softmax.
* The hook convention: every ``emit`` in the engine is guarded by a level
  check on the same line, or sits in a ``_trace*`` / ``_emit*`` helper that
  only guarded lines call.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.tracing import NULL_TRACER, Tracer, load_trace
from engine.v1.sample.metadata import build_sampling_metadata
from engine.v1.sample.sampler import Sampler
from tests.helpers.engine_fixtures import ids
from tests.tracing.scenario import make_engine, run_scenario

ENGINE_DIR = Path(__file__).resolve().parents[2] / "engine"


def _mixed_run(engine):
    """Greedy, seeded random with top-k/top-p/min-p, penalties and logprobs."""
    prompts = ["w0 w1 w2 w3 w4 w5", "w0 w1 w2 w3 w9", "w20 w21 w22"]
    all_params = [
        SamplingParams(temperature=0.0, max_tokens=7, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=4, top_p=0.8, min_p=0.05, seed=11, max_tokens=7,
                       ignore_eos=True),
        SamplingParams(temperature=1.2, seed=5, repetition_penalty=1.3, frequency_penalty=0.4,
                       presence_penalty=0.2, max_tokens=7, logprobs=2, ignore_eos=True),
    ]
    for i, (prompt, sp) in enumerate(zip(prompts, all_params)):
        engine.add_request(str(i), {"prompt_token_ids": ids(prompt)}, sp)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                lps = [sorted((t, round(lp.logprob, 6)) for t, lp in pos.items()) for pos in c.logprobs or []]
                outputs[out.request_id] = (c.token_ids, c.text, c.finish_reason, lps)
    engine.shutdown()
    return outputs


@pytest.mark.parametrize("real_model", [True, False], ids=["tiny-llama", "counting"])
def test_tracing_never_changes_outputs(tiny_model_dir, tmp_path, real_model):
    results = {}
    for level in ("off", "lifecycle", "full"):
        path = None if level == "off" else str(tmp_path / f"{level}.jsonl")
        engine = make_engine(tiny_model_dir, path, level, real_model=real_model)
        results[level] = (_mixed_run(engine), )
        engine = make_engine(tiny_model_dir, path, level, real_model=real_model)
        results[level] += (run_scenario(engine, real_model=real_model),)
        engine.shutdown()
    off_mixed, off_scenario = results["off"]
    assert len(off_mixed) == 3
    for level in ("lifecycle", "full"):
        mixed, scenario = results[level]
        assert mixed == off_mixed, level
        assert {r: (o.outputs[0].token_ids, o.outputs[0].text) for r, o in scenario.items()} == {
            r: (o.outputs[0].token_ids, o.outputs[0].text) for r, o in off_scenario.items()
        }


def test_off_writes_nothing(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = make_engine(tiny_model_dir, None, "off", real_model=True)
    assert engine.tracer.lifecycle is False
    assert engine.engine_core.engine_core.scheduler.tracer.lifecycle is False
    _mixed_run(engine)
    assert list(tmp_path.iterdir()) == []
    tracer = Tracer(str(tmp_path / "never.jsonl"), "off")
    tracer.emit("kv.init", num_blocks=1)
    tracer.flush()
    tracer.close()
    assert not (tmp_path / "never.jsonl").exists()
    assert NULL_TRACER.lifecycle is False and NULL_TRACER.full is False


def test_full_adds_sampler_stages_and_runner_inputs(tiny_model_dir, tmp_path):
    kinds = {}
    stages = {}
    for level in ("lifecycle", "full"):
        path = str(tmp_path / f"{level}.jsonl")
        _mixed_run(make_engine(tiny_model_dir, path, level, real_model=True))
        events = load_trace(path)
        kinds[level] = {e["kind"] for e in events}
        stages[level] = {
            e["request_id"]: [s["stage"] for s in e.get("stages", [])]
            for e in events
            if e["kind"] == "sampler.sampled"
        }
    assert kinds["full"] - kinds["lifecycle"] == {"runner.inputs"}
    assert all(s == [] for s in stages["lifecycle"].values())
    # Mixed batch: every row sees the random stages; the greedy row is flagged.
    assert stages["full"]["1"] == ["raw", "processed", "temperature", "min_p", "top_k_top_p"]
    sampled = [e for e in load_trace(str(tmp_path / "full.jsonl")) if e["kind"] == "sampler.sampled"]
    assert {e["request_id"]: e["greedy"] for e in sampled} == {"0": True, "1": False, "2": False}
    for e in sampled:
        by_stage = {s["stage"]: s for s in e["stages"]}
        for s in e["stages"]:
            assert len(s["token_ids"]) == len(s["probs"]) == Sampler.NUM_TRACE_CANDIDATES
            assert s["probs"] == sorted(s["probs"], reverse=True)
            assert all(0.0 <= p <= 1.0 + 1e-6 for p in s["probs"])
        if e["request_id"] == "1":
            top = by_stage["top_k_top_p"]
            kept = [p for p in top["probs"] if p > 0]
            # top_k=4 < 5 candidates: the whole kept set is visible and renormalised.
            assert 1 <= len(kept) <= 4 and math.isclose(sum(kept), 1.0, rel_tol=1e-4)
            assert e["token_id"] in [t for t, p in zip(top["token_ids"], top["probs"]) if p > 0]
        if e["greedy"]:
            assert e["token_id"] == by_stage["processed"]["token_ids"][0]
    events = load_trace(str(tmp_path / "full.jsonl"))
    first = next(e for e in events if e["kind"] == "runner.inputs")
    first_step = next(e for e in events if e["kind"] == "sched.step")
    # Request "1" hits request "0"'s first block, so it computes 1 block less.
    assert first_step["num_scheduled_tokens"] == {"0": 6, "1": 1, "2": 3}
    assert first["input_ids"]["shape"] == [10]
    assert first["input_ids"]["values"] == ids("w0 w1 w2 w3 w4 w5 w9 w20 w21 w22")
    assert first["positions"]["values"] == [0, 1, 2, 3, 4, 5, 4, 0, 1, 2]


def test_sampler_stage_trace_unit(tmp_path):
    path = str(tmp_path / "s.jsonl")
    tracer = Tracer(path, "full")
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=3, seed=1),
        SamplingParams(temperature=1.0, top_p=0.5, seed=2),
    ]
    gens = {i: torch.Generator().manual_seed(p.seed) for i, p in enumerate(params) if p.seed is not None}
    meta = build_sampling_metadata(params, [[1]] * 3, [[], [], []], gens, 32, "cpu")
    sampler = Sampler(tracer=tracer)
    out = sampler(logits.clone(), meta, trace_req_ids=["g", None, "p"])
    assert load_trace(path) == []  # nothing until the caller has the tokens on the host
    sampler.emit_pending_trace()
    tracer.close()
    events = load_trace(path)
    assert [e["request_id"] for e in events] == ["g", "p"]  # row 1 is not traced
    raw_logprobs = logits.log_softmax(-1)
    for e in events:
        row = e["row"]
        assert e["token_id"] == out.sampled_token_ids[row, 0].item()
        assert math.isclose(e["logprob"], raw_logprobs[row, e["token_id"]].item(), rel_tol=1e-5)
        assert [s["stage"] for s in e["stages"]] == ["raw", "processed", "temperature", "top_k_top_p"]
        raw = e["stages"][0]
        expect = logits[row].softmax(-1).topk(Sampler.NUM_TRACE_CANDIDATES)
        assert raw["token_ids"] == expect.indices.tolist()
        filtered = e["stages"][-1]
        kept = [t for t, p in zip(filtered["token_ids"], filtered["probs"]) if p > 0]
        assert e["token_id"] in kept
        if e["request_id"] == "p":  # top_p=0.5 at temperature 1: the kept mass renormalised
            assert kept[0] == raw["token_ids"][0] and filtered["probs"][0] >= raw["probs"][0]
    # Row 1 (top_k=3) traced on its own: at most 3 candidates survive the filter.
    gens = {i: torch.Generator().manual_seed(p.seed) for i, p in enumerate(params) if p.seed is not None}
    meta = build_sampling_metadata(params, [[1]] * 3, [[], [], []], gens, 32, "cpu")
    tracer = Tracer(path, "full")
    sampler = Sampler(tracer=tracer)
    sampler(logits.clone(), meta, trace_req_ids=[None, "k", None])
    sampler.emit_pending_trace()
    tracer.close()
    (k_event,) = load_trace(path)
    top = k_event["stages"][-1]
    assert top["stage"] == "top_k_top_p"
    assert sum(p > 0 for p in top["probs"]) == 3
    assert top["token_ids"][:3] == logits[1].topk(3).indices.tolist()
    # Same result with the tracer off and without labels.
    gens = {i: torch.Generator().manual_seed(p.seed) for i, p in enumerate(params) if p.seed is not None}
    meta = build_sampling_metadata(params, [[1]] * 3, [[], [], []], gens, 32, "cpu")
    again = Sampler()(logits.clone(), meta)
    assert torch.equal(again.sampled_token_ids, out.sampled_token_ids)


def test_processed_stage_reuses_raw_only_when_nothing_edits_the_logits(tmp_path):
    """Without masks, bad words, min-tokens, logit bias or penalties the
    ``processed`` stage is the ``raw`` one (its snapshot is reused); with a
    penalty it is the softmax top-k of the penalised logits."""
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(3)) * 3
    for penalty in (1.0, 1.8):
        path = str(tmp_path / f"p{penalty}.jsonl")
        tracer = Tracer(path, "full")
        params = [SamplingParams(temperature=0.0, repetition_penalty=penalty)] * 2
        history = [[int(logits[0].argmax()), int(logits[1].argmax())]] * 2
        meta = build_sampling_metadata(params, history, [[], []], {}, 32, "cpu")
        assert Sampler.edits_logits(meta) is (penalty != 1.0)
        sampler = Sampler(tracer=tracer)
        sampler(logits.clone(), meta, trace_req_ids=["a", "b"])
        sampler.emit_pending_trace()
        tracer.close()
        for event in load_trace(path):
            raw, processed = event["stages"]
            assert (raw["stage"], processed["stage"]) == ("raw", "processed")
            if penalty == 1.0:
                assert processed["token_ids"] == raw["token_ids"] and processed["probs"] == raw["probs"]
            else:
                # The most likely raw token was in the prompt: the penalty demotes it.
                assert processed["token_ids"][0] != raw["token_ids"][0]
                assert event["token_id"] == processed["token_ids"][0]


_GUARD = re.compile(r"^\s*if [^:]*\.(lifecycle|full)\b[^:]*:\s*\S")


def test_every_engine_emit_is_a_guarded_one_liner_or_in_a_trace_helper():
    offenders = []
    for path in sorted(ENGINE_DIR.rglob("*.py")):
        if "tracing" in path.parts:
            continue
        source = path.read_text()
        tree = ast.parse(source)
        helpers = {
            (node.lineno, node.end_lineno)
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name.startswith(("_trace", "_emit", "emit_pending"))
        }
        for no, line in enumerate(source.splitlines(), 1):
            if ".emit(" not in line and ".emit_rows(" not in line and "set_step(" not in line:
                continue
            if _GUARD.match(line) or any(a <= no <= b for a, b in helpers):
                continue
            offenders.append(f"{path.relative_to(ENGINE_DIR)}:{no}: {line.strip()}")
    assert offenders == []


def test_sampler_pending_trace_is_emitted_before_the_next_call(tmp_path):
    # A caller that never calls emit_pending_trace loses nothing: the next call
    # writes the previous call's events first, in order.
    path = str(tmp_path / "s.jsonl")
    tracer = Tracer(path, "lifecycle")
    sampler = Sampler(tracer=tracer)
    params = [SamplingParams(temperature=0.0)]
    for step_logits in (torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[4.0, 0.0, 1.0]])):
        meta = build_sampling_metadata(params, [[1]], [[]], {}, 3, "cpu")
        sampler(step_logits, meta, trace_req_ids=["a"])
    sampler.emit_pending_trace()
    sampler.emit_pending_trace()  # nothing pending: a no-op
    tracer.close()
    assert [e["token_id"] for e in load_trace(path) if e["kind"] == "sampler.sampled"] == [1, 0]


@pytest.mark.parametrize("temperatures", [(0.0, 0.8, 0.0), (0.0, 0.0, 0.0), (0.9, 0.8, 1.0)],
                         ids=["mixed", "all_greedy", "all_random"])
@pytest.mark.parametrize("traced", [("a", "b", "c"), (None, "b", "c")], ids=["all_rows", "some_rows"])
@pytest.mark.parametrize("host_temperatures", [False, True], ids=["device_flags", "host_flags"])
def test_sampler_lifecycle_events_with_and_without_host_tokens(tmp_path, temperatures, traced, host_temperatures):
    """``sampler.sampled`` at lifecycle: the same events whether the caller
    hands over its host copy of the tokens (the model runner does) or the
    sampler copies them itself; greedy flags right for mixed, all-greedy and
    all-random batches (the last two come from the host, not the device)."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)) * 2
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate(temperatures)]
    events = {}
    for how in ("host", "device"):
        path = str(tmp_path / f"{how}.jsonl")
        tracer = Tracer(path, "lifecycle")
        gens = {i: torch.Generator().manual_seed(i) for i, p in enumerate(params) if p.temperature > 0}
        meta = build_sampling_metadata(params, [[1]] * 3, [[], [], []], gens, 40, "cpu")
        if host_temperatures:  # as the persistent batch builds it: greedy flags from the host
            meta = dataclasses.replace(meta, temperature_cpu=meta.temperature.numpy().copy())
        sampler = Sampler(tracer=tracer)
        out = sampler(logits.clone(), meta, trace_req_ids=list(traced))
        tokens = out.sampled_token_ids.squeeze(-1).tolist()
        sampler.emit_pending_trace(tokens if how == "host" else None)
        tracer.close()
        events[how] = [{k: v for k, v in e.items() if k not in ("ts", "seq", "pid")}
                       for e in load_trace(path)]
        raw_logprobs = logits.log_softmax(-1)
        assert [e["request_id"] for e in events[how]] == [r for r in traced if r is not None]
        for e in events[how]:
            row = e["row"]
            assert e["token_id"] == tokens[row]
            assert e["greedy"] is (temperatures[row] == 0.0)
            assert math.isclose(e["logprob"], raw_logprobs[row, e["token_id"]].item(), rel_tol=1e-5)
            assert "stages" not in e and "rank" not in e  # full only
    assert events["host"] == events["device"]

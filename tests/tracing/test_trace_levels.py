"""Trace levels, the rule that tracing never changes what the engine does,
and the convention by which the engine calls its trace objects.

* ``off`` writes nothing; ``lifecycle`` has no sampler stages or runner
  inputs; ``full`` adds them (engine/tracing/worker_trace.py).
* Outputs -- token ids, text, logprobs -- are identical with tracing off,
  lifecycle and full, for greedy, seeded-random and penalised requests.
* The sampler's stage snapshots: one per stage that ran, in order, the
  top-k / top-p stage keeps at most k candidates, the chosen token's logprob
  is the raw log-softmax; the ``processed`` stage equals the ``raw`` one
  exactly when nothing edited the logits.
* The hook convention: event building lives in engine/tracing/; the engine
  calls its trace objects in one-line statements of at most 100 characters,
  and tracing stays a small share of the files learners read beside vLLM.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from engine import tracing
from engine.sampling_params import SamplingParams
from engine.tracing import NULL_TRACER, KVInit, SamplerSampled, Tracer, load_trace
from engine.tracing.core_trace import SchedulerTrace
from engine.tracing.worker_trace import SamplerTrace
from engine.v1.sample.metadata import build_sampling_metadata
from engine.v1.sample.sampler import Sampler
from tests.helpers.engine_fixtures import ids
from tests.tracing.scenario import internal_ids, make_engine, run_scenario

ENGINE_DIR = Path(__file__).resolve().parents[2] / "engine"
NUM_CANDIDATES = SamplerTrace.NUM_CANDIDATES


def _mixed_run(engine):
    """Greedy, seeded random with top-k/top-p/min-p, penalties and logprobs."""
    prompts = ["w0 w1 w2 w3 w4 w5", "w0 w1 w2 w3 w9", "w20 w21 w22"]
    all_params = [
        SamplingParams(temperature=0.0, max_tokens=7, logprobs=3, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_k=4, top_p=0.8, min_p=0.05, seed=11, max_tokens=7, ignore_eos=True
        ),
        SamplingParams(
            temperature=1.2,
            seed=5,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=0.2,
            max_tokens=7,
            logprobs=2,
            ignore_eos=True,
        ),
    ]
    for i, (prompt, sp) in enumerate(zip(prompts, all_params)):
        engine.add_request(str(i), {"prompt_token_ids": ids(prompt)}, sp)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                lps = [
                    sorted((t, round(lp.logprob, 6)) for t, lp in pos.items())
                    for pos in c.logprobs or []
                ]
                outputs[out.request_id] = (c.token_ids, c.text, c.finish_reason, lps)
    engine.shutdown()
    return outputs


@pytest.mark.parametrize("real_model", [True, False], ids=["tiny-llama", "counting"])
def test_tracing_never_changes_outputs(tiny_model_dir, tmp_path, real_model):
    results = {}
    for level in ("off", "lifecycle", "full"):
        path = None if level == "off" else str(tmp_path / f"{level}.jsonl")
        engine = make_engine(tiny_model_dir, path, level, real_model=real_model)
        results[level] = (_mixed_run(engine),)
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
    assert engine.engine_core.engine_core.scheduler.trace is SchedulerTrace.NULL
    _mixed_run(engine)
    assert list(tmp_path.iterdir()) == []
    tracer = Tracer(str(tmp_path / "never.jsonl"), "off")
    tracer.record(KVInit(num_blocks=1, block_size=1, null_block_id=0))
    tracer.record_rows(SamplerSampled, {"request_id": ["a"], "row": [0]})
    tracer.flush()
    tracer.close()
    assert not (tmp_path / "never.jsonl").exists()
    assert NULL_TRACER.lifecycle is False and NULL_TRACER.full is False
    # What a subsystem holds when tracing is off: the do-nothing twin.
    assert SchedulerTrace.create(tracer) is SchedulerTrace.NULL
    assert SamplerTrace.create(tracer) is SamplerTrace.NULL


def test_full_adds_sampler_stages_and_runner_inputs(tiny_model_dir, tmp_path):
    kinds = {}
    stages = {}
    for level in ("lifecycle", "full"):
        path = str(tmp_path / f"{level}.jsonl")
        _mixed_run(make_engine(tiny_model_dir, path, level, real_model=True))
        events = load_trace(path)
        kinds[level] = {e.kind for e in events}
        stages[level] = {
            e.request_id: [s.stage for s in e.stages or []]
            for e in events
            if e.kind == "sampler.sampled"
        }
    assert kinds["full"] - kinds["lifecycle"] == {"runner.inputs"}
    assert all(s == [] for s in stages["lifecycle"].values())
    events = load_trace(str(tmp_path / "full.jsonl"))
    internal = internal_ids(events)  # "0", "1", "2" -> the engine's ids
    # Mixed batch: every row sees the random stages; the greedy row is flagged.
    assert stages["full"][internal["1"]] == [
        "raw",
        "processed",
        "temperature",
        "min_p",
        "top_k_top_p",
    ]
    sampled = [e for e in events if e.kind == "sampler.sampled"]
    assert {e.request_id: e.greedy for e in sampled} == {
        internal["0"]: True,
        internal["1"]: False,
        internal["2"]: False,
    }
    for e in sampled:
        by_stage = {s.stage: s for s in e.stages}
        for s in e.stages:
            assert len(s.token_ids) == len(s.probs) == NUM_CANDIDATES
            assert s.probs == sorted(s.probs, reverse=True)
            assert all(0.0 <= p <= 1.0 + 1e-6 for p in s.probs)
        if e.request_id == internal["1"]:
            top = by_stage["top_k_top_p"]
            kept = [p for p in top.probs if p > 0]
            # top_k=4 < 5 candidates: the whole kept set is visible and renormalised.
            assert 1 <= len(kept) <= 4 and math.isclose(sum(kept), 1.0, rel_tol=1e-4)
            assert e.token_id in [t for t, p in zip(top.token_ids, top.probs) if p > 0]
        if e.greedy:
            assert e.token_id == by_stage["processed"].token_ids[0]
    first = next(e for e in events if e.kind == "runner.inputs")
    first_step = next(e for e in events if e.kind == "sched.step")
    # Request "1" hits request "0"'s first block, so it computes 1 block less.
    assert first_step.num_scheduled_tokens == {internal["0"]: 6, internal["1"]: 1, internal["2"]: 3}
    assert first.input_ids.shape == [10]
    assert first.input_ids.values == ids("w0 w1 w2 w3 w4 w5 w9 w20 w21 w22")
    assert first.positions.values == [0, 1, 2, 3, 4, 5, 4, 0, 1, 2]


def _seeded_generators(params: list[SamplingParams]) -> dict[int, torch.Generator]:
    return {
        i: torch.Generator().manual_seed(p.seed) for i, p in enumerate(params) if p.seed is not None
    }


def _traced_sampler(path: str, level: str) -> tuple[Tracer, SamplerTrace, Sampler]:
    tracer = Tracer(path, level)
    trace = SamplerTrace(tracer)
    return tracer, trace, Sampler(trace=trace)


def test_sampler_stage_trace_unit(tmp_path):
    path = str(tmp_path / "s.jsonl")
    tracer, trace, sampler = _traced_sampler(path, "full")
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=3, seed=1),
        SamplingParams(temperature=1.0, top_p=0.5, seed=2),
    ]
    meta = build_sampling_metadata(
        params, [[1]] * 3, [[], [], []], _seeded_generators(params), 32, "cpu"
    )
    trace.begin(["g", None, "p"])
    out = sampler(logits.clone(), meta)
    tracer.flush()
    assert load_trace(path) == []  # nothing until the caller has the tokens on the host
    trace.emit()
    tracer.close()
    events = load_trace(path)
    assert [e.request_id for e in events] == ["g", "p"]  # row 1 is not traced
    raw_logprobs = logits.log_softmax(-1)
    for e in events:
        row = e.row
        assert e.token_id == out.sampled_token_ids[row, 0].item()
        assert math.isclose(e.logprob, raw_logprobs[row, e.token_id].item(), rel_tol=1e-5)
        assert [s.stage for s in e.stages] == ["raw", "processed", "temperature", "top_k_top_p"]
        raw = e.stages[0]
        expect = logits[row].softmax(-1).topk(NUM_CANDIDATES)
        assert raw.token_ids == expect.indices.tolist()
        filtered = e.stages[-1]
        kept = [t for t, p in zip(filtered.token_ids, filtered.probs) if p > 0]
        assert e.token_id in kept
        if e.request_id == "p":  # top_p=0.5 at temperature 1: the kept mass renormalised
            assert kept[0] == raw.token_ids[0] and filtered.probs[0] >= raw.probs[0]
    # Row 1 (top_k=3) traced on its own: at most 3 candidates survive the filter.
    meta = build_sampling_metadata(
        params, [[1]] * 3, [[], [], []], _seeded_generators(params), 32, "cpu"
    )
    tracer, trace, sampler = _traced_sampler(path, "full")
    trace.begin([None, "k", None])
    sampler(logits.clone(), meta)
    trace.emit()
    tracer.close()
    (k_event,) = load_trace(path)
    top = k_event.stages[-1]
    assert top.stage == "top_k_top_p"
    assert sum(p > 0 for p in top.probs) == 3
    assert top.token_ids[:3] == logits[1].topk(3).indices.tolist()
    # Same result with the tracer off and without labels.
    meta = build_sampling_metadata(
        params, [[1]] * 3, [[], [], []], _seeded_generators(params), 32, "cpu"
    )
    again = Sampler()(logits.clone(), meta)
    assert torch.equal(again.sampled_token_ids, out.sampled_token_ids)


class _IdTokenizer:
    """``"t7 t3"`` -> ``[7, 3]``: enough for ``SamplingParams.update_from_tokenizer``."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(word[1:]) for word in text.split()]


VOCAB = 32
# Row 0 of these logits: the token every edit below pushes out of first place.
_EDIT_LOGITS = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
_TOP = int(_EDIT_LOGITS[0].argmax())
_SECOND = int(_EDIT_LOGITS[0].topk(2).indices[1])

# Settings of row 0 that edit its logits before sampling (``processed``), each
# pushing the raw argmax ``_TOP`` down: row 0's prompt and output hold ``_TOP``,
# and its logit leads the next by about 0.5, less than any penalty below takes.
EDITS: dict[str, dict] = {
    "allowed_token_ids": dict(allowed_token_ids=[_SECOND]),
    "bad_words": dict(bad_words=[f"t{_TOP}"]),
    "min_tokens": dict(min_tokens=2, stop_token_ids=[_TOP]),
    "logit_bias": dict(logit_bias={_TOP: -100.0}),
    "repetition_penalty": dict(repetition_penalty=1.8),
    "frequency_penalty": dict(frequency_penalty=2.0),
    "presence_penalty": dict(presence_penalty=2.0),
}
# Settings that act only after the ``processed`` stage (temperature, min-p,
# top-k / top-p) or are neutral: ``processed`` must be the ``raw`` stage.
NO_EDITS: dict[str, dict] = {
    "greedy": {},
    "neutral_penalties": dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0),
    "empty_logit_bias": dict(logit_bias={}),
    "min_tokens_reached": dict(min_tokens=1, stop_token_ids=[_TOP]),
    "random_stages": dict(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05, seed=7),
}


def _sample_two_rows(path: str, row0: dict, outputs0: list[int]):
    """Sample the two rows of ``_EDIT_LOGITS`` at ``full``: row 0 with
    ``row0``'s settings (greedy unless they set a temperature) and generated
    tokens ``outputs0``, row 1 greedy with no settings; returns the two
    ``sampler.sampled`` events."""
    tracer, trace, sampler = _traced_sampler(path, "full")
    tokenizer = _IdTokenizer(VOCAB)
    params = []
    for settings in (row0, {}):
        sp = SamplingParams(**{"temperature": 0.0, **settings})
        sp.update_from_tokenizer(tokenizer)
        params.append(sp)
    prompts = [[_TOP, 1], [2, 3]]
    meta = build_sampling_metadata(
        params, prompts, [outputs0, []], _seeded_generators(params), VOCAB, "cpu"
    )
    trace.begin(["edited", "plain"])
    sampler(_EDIT_LOGITS.clone(), meta)
    trace.emit()
    tracer.close()
    return load_trace(path)


def _same_candidates(a, b) -> bool:
    return a.token_ids == b.token_ids and a.probs == b.probs


@pytest.mark.parametrize("name", sorted(NO_EDITS))
def test_processed_stage_is_the_raw_one_when_nothing_edits_the_logits(tmp_path, name):
    """No mask, bad word, min-tokens, logit bias or penalty applies: the
    ``processed`` candidates are exactly the ``raw`` ones, on every row."""
    events = _sample_two_rows(str(tmp_path / "t.jsonl"), NO_EDITS[name], outputs0=[5])
    assert [e.request_id for e in events] == ["edited", "plain"]
    for event in events:
        raw, processed = event.stages[:2]
        assert (raw.stage, processed.stage) == ("raw", "processed")
        assert _same_candidates(processed, raw), (name, event.request_id)
        if event.greedy:
            assert event.token_id == raw.token_ids[0] == int(_EDIT_LOGITS[event.row].argmax())


@pytest.mark.parametrize("name", sorted(EDITS))
def test_processed_stage_differs_from_raw_when_a_processor_edits_the_logits(tmp_path, name):
    """Each edit that runs before sampling (allowed-token mask, bad words,
    min-tokens, logit bias, each penalty) shows in ``processed``: the raw
    argmax is pushed down and the greedy row takes ``processed``'s first
    candidate. The row nothing edits keeps ``processed`` equal to ``raw``."""
    edited, plain = _sample_two_rows(str(tmp_path / "t.jsonl"), EDITS[name], outputs0=[_TOP])
    raw, processed = edited.stages[:2]
    assert raw.token_ids[0] == _TOP
    assert not _same_candidates(processed, raw), name
    assert processed.token_ids[0] != _TOP, name
    assert edited.token_id == processed.token_ids[0] != _TOP
    raw, processed = plain.stages[:2]
    # The batch's edits run on every row; row 1's values are untouched by them
    # (softmax of the same float32 logits, recomputed).
    assert processed.token_ids == raw.token_ids
    assert processed.probs == pytest.approx(raw.probs, rel=1e-6)


def test_processed_stage_follows_a_penalty_on_the_prompt(tmp_path):
    """With a repetition penalty the ``processed`` stage is the softmax top-k
    of the penalised logits; without one (1.0) it is the ``raw`` stage."""
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(3)) * 3
    for penalty in (1.0, 1.8):
        path = str(tmp_path / f"p{penalty}.jsonl")
        tracer, trace, sampler = _traced_sampler(path, "full")
        params = [SamplingParams(temperature=0.0, repetition_penalty=penalty)] * 2
        history = [[int(logits[0].argmax()), int(logits[1].argmax())]] * 2
        meta = build_sampling_metadata(params, history, [[], []], {}, 32, "cpu")
        trace.begin(["a", "b"])
        sampler(logits.clone(), meta)
        trace.emit()
        tracer.close()
        for event in load_trace(path):
            raw, processed = event.stages
            assert (raw.stage, processed.stage) == ("raw", "processed")
            if penalty == 1.0:
                assert _same_candidates(processed, raw)
            else:
                # The most likely raw token was in the prompt: the penalty demotes it.
                assert processed.token_ids[0] != raw.token_ids[0]
                assert event.token_id == processed.token_ids[0]


def test_sampler_pending_values_are_kept_per_step_until_emitted(tmp_path):
    # With async scheduling step 2 samples before step 1's tokens are read:
    # each call's values wait under its step, so nothing is lost or mixed up,
    # and emit writes the step it is given (a second emit of it is a no-op).
    path = str(tmp_path / "s.jsonl")
    tracer, trace, sampler = _traced_sampler(path, "lifecycle")
    params = [SamplingParams(temperature=0.0)]
    for step, step_logits in (
        (1, torch.tensor([[0.0, 5.0, 1.0]])),
        (2, torch.tensor([[4.0, 0.0, 1.0]])),
    ):
        tracer.set_step(step)
        meta = build_sampling_metadata(params, [[1]], [[]], {}, 3, "cpu")
        trace.begin(["a"])
        sampler(step_logits, meta)
    tracer.set_step(1)  # the runner stamps what it emits with the step (RunnerTrace.sampled)
    trace.emit(1)
    tracer.set_step(2)
    trace.emit(2)
    trace.emit(2)  # nothing pending for step 2 any more: a no-op
    trace.emit(7)  # a step that never sampled: a no-op
    tracer.close()
    sampled = [(e.step, e.token_id) for e in load_trace(path) if e.kind == "sampler.sampled"]
    assert sampled == [(1, 1), (2, 0)]


@pytest.mark.parametrize(
    "temperatures",
    [(0.0, 0.8, 0.0), (0.0, 0.0, 0.0), (0.9, 0.8, 1.0)],
    ids=["mixed", "all_greedy", "all_random"],
)
@pytest.mark.parametrize(
    "traced", [("a", "b", "c"), (None, "b", "c")], ids=["all_rows", "some_rows"]
)
@pytest.mark.parametrize("host_temperatures", [False, True], ids=["device_flags", "host_flags"])
def test_sampler_lifecycle_events_with_and_without_host_tokens(
    tmp_path, temperatures, traced, host_temperatures
):
    """``sampler.sampled`` at lifecycle: the same events whether the caller
    hands over its host copy of the tokens (the model runner does) or the
    trace copies them itself; greedy flags right for mixed, all-greedy and
    all-random batches (the last two come from the host, not the device)."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)) * 2
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate(temperatures)]
    events = {}
    for how in ("host", "device"):
        path = str(tmp_path / f"{how}.jsonl")
        tracer, trace, sampler = _traced_sampler(path, "lifecycle")
        gens = {
            i: torch.Generator().manual_seed(i) for i, p in enumerate(params) if p.temperature > 0
        }
        meta = build_sampling_metadata(params, [[1]] * 3, [[], [], []], gens, 40, "cpu")
        if host_temperatures:  # as the persistent batch builds it: greedy flags from the host
            host = np.array([p.temperature for p in params], dtype=np.float32)
            meta = dataclasses.replace(meta, temperature_cpu=host)
        tracer.set_step(3)
        trace.begin(list(traced))
        out = sampler(logits.clone(), meta)
        tokens = out.sampled_token_ids.squeeze(-1).tolist()
        trace.emit(3, tokens if how == "host" else None)
        tracer.close()
        loaded = load_trace(path)
        events[how] = [
            {k: v for k, v in msgspec.to_builtins(e).items() if k not in ("ts", "seq", "pid")}
            for e in loaded
        ]
        raw_logprobs = logits.log_softmax(-1)
        assert [e.request_id for e in loaded] == [r for r in traced if r is not None]
        for e in loaded:
            row = e.row
            assert e.step == 3
            assert e.token_id == tokens[row]
            assert e.greedy is (temperatures[row] == 0.0)
            assert math.isclose(e.logprob, raw_logprobs[row, e.token_id].item(), rel_tol=1e-5)
            assert e.stages is None and e.rank is None  # full only
    assert events["host"] == events["device"]


# ---------------------------------------------------------------------------
# The hook convention
# ---------------------------------------------------------------------------
def _engine_modules_outside_tracing() -> list[Path]:
    return [p for p in sorted(ENGINE_DIR.rglob("*.py")) if "tracing" not in p.parts]


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _receiver_text(call: ast.Call) -> str:
    return ast.unparse(call.func.value) if isinstance(call.func, ast.Attribute) else ""


# Every class of the trace format (events and the structs inside them).
EVENT_CLASS_NAMES = {cls.__name__ for cls in tracing.EVENT_TYPES} | {
    "SamplerStage",
    "SamplingParamsSummary",
    "TensorSummary",
    "TraceEvent",
}


def test_no_engine_code_outside_tracing_builds_events_or_records_them():
    """Event building lives in engine/tracing/: elsewhere in engine/ nothing
    constructs an event class, and nothing calls ``Tracer.record`` or
    ``Tracer.record_rows`` (reading events back, e.g. ``isinstance``, is fine)."""
    assert {"SchedStep", "SamplerSampled", "TraceCli", "TensorSummary"} <= EVENT_CLASS_NAMES
    offenders = []
    for path in _engine_modules_outside_tracing():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = _called_name(node)
            builds = name in EVENT_CLASS_NAMES
            records = name == "record_rows" or (
                name == "record" and re.search(r"tracer", _receiver_text(node), re.I)
            )
            if builds or records:
                where = path.relative_to(ENGINE_DIR.parent)
                offenders.append(f"{where}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not offenders, "\n".join(offenders)


def _is_trace_object(node: ast.expr) -> bool:
    """``self.trace``, a local ``trace``, or an attribute of either
    (``self.trace.sampler``)."""
    if isinstance(node, ast.Name):
        return node.id == "trace"
    if isinstance(node, ast.Attribute):
        if node.attr == "trace" and isinstance(node.value, ast.Name) and node.value.id == "self":
            return True
        return _is_trace_object(node.value)
    return False


_COMPOUND = (ast.If, ast.While, ast.For, ast.With, ast.AsyncFor, ast.AsyncWith)


def test_every_trace_call_in_the_engine_is_a_one_line_statement():
    """Each call of a subsystem's trace object (``self.trace.x(...)`` or a
    local ``trace.x(...)``) outside engine/tracing/ is a statement of one line
    of at most 100 characters (or sits, on one line, in the header of an
    ``if`` / ``with``)."""
    offenders = []
    calls = 0
    for path in _engine_modules_outside_tracing():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and _is_trace_object(node.func.value)
            ):
                continue
            calls += 1
            stmt = node
            while not isinstance(stmt, ast.stmt):
                stmt = parents[stmt]
            if isinstance(stmt, _COMPOUND):
                first, last = node.lineno, node.end_lineno
                one_line = first == last == stmt.lineno
            else:
                first, last = stmt.lineno, stmt.end_lineno
                one_line = first == last
            where = f"{path.relative_to(ENGINE_DIR.parent)}:{first}"
            if not one_line:
                offenders.append(f"{where}: spans lines {first}-{last}")
            elif len(lines[first - 1]) > 100:
                offenders.append(f"{where}: {len(lines[first - 1])} characters")
    assert calls >= 30  # the scan sees the hooks (scheduler, KV cache, runner, sampler, ...)
    assert not offenders, "\n".join(offenders)


# The files learners read beside their vLLM twins: tracing stays a small share.
TRACE_SHARE_FILES = [
    "v1/sample/sampler.py",
    "v1/worker/gpu_model_runner.py",
    "v1/core/sched/scheduler.py",
    "v1/engine/core.py",
    "v1/core/block_pool.py",
]


@pytest.mark.parametrize("relpath", TRACE_SHARE_FILES)
def test_tracing_is_at_most_a_tenth_of_the_central_files(relpath):
    lines = (ENGINE_DIR / relpath).read_text().splitlines()
    tracing_lines = [line for line in lines if re.search(r"trace|tracer", line, re.I)]
    assert tracing_lines  # the file is instrumented: the count is meaningful
    assert len(tracing_lines) <= 0.10 * len(lines), (len(tracing_lines), len(lines))

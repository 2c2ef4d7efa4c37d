"""The trace of a structured-output run, and the replay of it.

Twin of nothing in vLLM; it checks the ``so.*`` events
(``StructuredOutputTrace`` in ``engine/tracing/core_trace.py``,
``RunnerTrace.grammar_mask_started`` / ``grammar_masked`` in
``worker_trace.py``) against the tokens the run produced, against xgrammar
itself (the token the mask left on top is one the grammar allows), and the
replay model (``skipped_waiting``, ``StepView.structured_output``) against
the live scheduler after every step. The run, on the default model at
``full`` with async scheduling (the default): a JSON-schema request (seeded
random sampling), an unconstrained one, and after a few steps a second
request with the same schema (the compile is a cache hit). Older traces
(format 1.6 and before: no ``so.*`` events) still replay.

``record_structured_output_run`` records the run once per test process; the
TUI's tests (``tests/tui/test_sampler_grammar.py``) read it too.
"""

from __future__ import annotations

import json
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.engine.arg_utils import EngineArgs
from engine.entrypoints.cli import trace as trace_cli
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.tracing import (
    WAITING_FOR_GRAMMAR,
    GrammarAdvanced,
    GrammarBitmask,
    GrammarCompiled,
    GrammarCompileStarted,
    GrammarMasked,
    GrammarReady,
    ReplayError,
    SamplerSampled,
    SchedAdmitted,
    SchedFinished,
    SchedQueued,
    SchedStep,
    SchedUpdate,
    TraceEvent,
    Tracer,
    TraceReplay,
    build_perfetto,
    load_trace,
)
from engine.tracing.core_trace import StructuredOutputTrace
from engine.tracing.worker_trace import RunnerTrace
from engine.v1.engine.llm_engine import LLMEngine
from tests.helpers.hf_checkpoints import default_model_path
from tests.tracing.scenario import assert_replay_matches_engine, internal_ids, scheduler_of

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
# Sent id -> (prompt, sampling params); AGAIN is added after the third step.
PERSON, PLAIN, AGAIN = "person", "plain", "again"
PROMPTS = {
    PERSON: "Give me a person as JSON.",
    PLAIN: "Hello",
    AGAIN: "Another person, as JSON:",
}


def _params(sent_id: str) -> SamplingParams:
    constrained = StructuredOutputsParams(json=SCHEMA)
    if sent_id == PERSON:
        return SamplingParams(
            temperature=1.0, seed=1, max_tokens=40, structured_outputs=constrained
        )
    if sent_id == AGAIN:
        return SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constrained)
    return SamplingParams(temperature=0.0, max_tokens=10)


@dataclass
class StructuredOutputRun:
    """The recorded run: the trace, the internal id of each sent id, each
    request's output text, the decoded text of every token id the trace
    mentions (the engine records ids only) and the live checks made."""

    path: str
    model: str
    ids: dict[str, str]
    outputs: dict[str, str]
    token_texts: dict[str, str] = field(default_factory=dict)
    live_checks: list[str] = field(default_factory=list)


# The recording, kept where both imports of this module find it: pytest
# imports it as ``test_structured_output_trace`` (the tests have no
# ``__init__.py``), the TUI's tests as ``tests.tracing.test_structured_output_trace``.
_SHARED = sys.modules.setdefault(
    "_glassbox_tests_structured_output_run", types.ModuleType("structured_output_run")
)


def record_structured_output_run(folder: Path) -> StructuredOutputRun:
    """Record the run into ``folder`` (once per test process: later calls
    return the first recording)."""
    run = getattr(_SHARED, "run", None)
    if run is None:
        run = _SHARED.run = _record(folder)
    return run


def _record(folder: Path) -> StructuredOutputRun:
    path = str(folder / "structured.jsonl")
    model = default_model_path()
    # A small pool: the live comparison looks at every block after every step.
    args = EngineArgs(
        model=model,
        max_model_len=256,
        num_gpu_blocks_override=64,
        trace_path=path,
        trace_level="full",
    )
    engine = LLMEngine.from_engine_args(args, enable_multiprocessing=False)
    scheduler = scheduler_of(engine)
    # The first compile waits until the first step has run, so the request
    # waits for its grammar for at least one step on any machine (a compile
    # takes ~30 ms, about as long as adding a request and scheduling).
    manager = engine.engine_core.engine_core.structured_output_manager
    gate = threading.Event()
    create_grammar = manager._create_grammar

    def gated_create_grammar(request: Any) -> Any:
        gate.wait(timeout=60)
        return create_grammar(request)

    manager._create_grammar = gated_create_grammar
    checks: list[str] = []
    outputs: dict[str, str] = {}

    def compare(label: str) -> None:
        """The replay of the trace so far equals the live scheduler, the
        second waiting queue and the grammar statuses included."""
        engine.tracer.flush()
        state = TraceReplay(path, snapshot_interval=4).final_state
        assert_replay_matches_engine(state, scheduler, label)
        live = [r.request_id for r in scheduler.skipped_waiting]
        assert state.skipped_waiting == live, f"skipped_waiting ({label})"
        checks.append(label)

    try:
        for sent_id in (PERSON, PLAIN):
            engine.add_request(sent_id, PROMPTS[sent_id], _params(sent_id))
            compare(f"add {sent_id}")
        n = 0
        while engine.has_unfinished_requests() and n < 80:
            n += 1
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].text
            compare(f"step {n}")
            gate.set()
            if n == 3:
                engine.add_request(AGAIN, PROMPTS[AGAIN], _params(AGAIN))
                compare(f"add {AGAIN}")
        engine.step()  # tells the worker which requests finished
        tokenizer = engine.get_tokenizer()
    finally:
        engine.shutdown()
    events = load_trace(path)
    return StructuredOutputRun(
        path=path,
        model=model,
        ids=internal_ids(events),
        outputs=outputs,
        token_texts=trace_cli._token_texts(str(path), tokenizer),  # as glassbox trace
        live_checks=checks,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> StructuredOutputRun:
    return record_structured_output_run(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def events(run) -> list[TraceEvent]:
    return load_trace(run.path)


@pytest.fixture(scope="module")
def replay(events) -> TraceReplay:
    return TraceReplay(events)


def _of(events: list[TraceEvent], cls: type, rid: str | None = None) -> list[Any]:
    return [e for e in events if type(e) is cls and (rid is None or e.request_id == rid)]


def _tokens_by_step(events: list[TraceEvent], rid: str) -> dict[int, list[int]]:
    return {
        e.step: e.new_token_ids[rid]
        for e in events
        if type(e) is SchedUpdate and e.new_token_ids.get(rid)
    }


def test_the_outputs_follow_the_schema(run):
    for sent_id in (PERSON, AGAIN):
        person = json.loads(run.outputs[sent_id])
        assert set(person) == {"name", "age"}, run.outputs[sent_id]
        assert isinstance(person["name"], str) and len(person["name"]) <= 10
        assert isinstance(person["age"], int)
    assert run.outputs[PLAIN]  # unconstrained


def test_a_constrained_request_waits_for_its_grammar_then_is_admitted(run, events):
    rid = run.ids[PERSON]
    kinds = [
        e.kind
        for e in events
        if getattr(e, "request_id", None) == rid
        and type(e) in (GrammarCompileStarted, GrammarCompiled, GrammarReady, SchedQueued)
    ]
    # The core starts the compile, then queues the request; the compile
    # thread finishes it; a later schedule() finds it ready.
    assert kinds[0] == "so.compile_started", kinds
    assert kinds.index("sched.queued") < kinds.index("so.ready")
    assert kinds.index("so.compiled") < kinds.index("so.ready")
    (started,) = _of(events, GrammarCompileStarted, rid)
    (compiled,) = _of(events, GrammarCompiled, rid)
    (ready,) = _of(events, GrammarReady, rid)
    (admitted,) = _of(events, SchedAdmitted, rid)
    assert started.grammar_kind == compiled.grammar_kind == "JSON"
    assert compiled.compile_s > 0 and not compiled.cache_hit and not compiled.error
    assert ready.step == admitted.step and ready.seq < admitted.seq
    # While it waited, the scheduler held it in skipped_waiting, not in waiting.
    steps = [e for e in events if type(e) is SchedStep and e.step < ready.step]
    assert steps and all(e.num_skipped_waiting == 1 for e in steps)
    # The same schema again: xgrammar's cache holds it.
    (again,) = _of(events, GrammarCompiled, run.ids[AGAIN])
    assert again.cache_hit and again.compile_s < compiled.compile_s


def test_each_step_masks_samples_and_advances_the_grammar(run, events):
    """Per step that samples for a constrained request: one ``so.bitmask``
    row with fewer tokens allowed than the vocabulary, a ``so.masked`` (full)
    that agrees with it, a ``sampler.sampled`` and a ``so.advanced`` with the
    token the request got."""
    for sent_id in (PERSON, AGAIN):
        rid = run.ids[sent_id]
        tokens = _tokens_by_step(events, rid)
        assert sum(len(t) for t in tokens.values()) >= 8
        bitmasks = {e.step: e for e in _of(events, GrammarBitmask) if rid in e.request_ids}
        masked = {e.step: e for e in _of(events, GrammarMasked, rid)}
        # With async scheduling the step after the last was scheduled before
        # the request finished: it samples for it, unmasked, and the token is
        # dropped (the grammar was freed).
        (finished,) = _of(events, SchedFinished, rid)
        sampled = {e.step: e for e in _of(events, SamplerSampled, rid) if e.step <= finished.step}
        advanced = {e.step: e for e in _of(events, GrammarAdvanced, rid)}
        assert set(bitmasks) == set(masked) == set(sampled) == set(advanced) == set(tokens)
        processed = 0
        for step, new in sorted(tokens.items()):
            b = bitmasks[step]
            i = b.request_ids.index(rid)
            assert b.num_rows[i] == 1  # no drafts
            assert b.vocab_size == 49152  # SmolLM2's
            assert 0 < b.num_allowed[i] < b.vocab_size, (step, b)
            m = masked[step]
            assert m.num_allowed == b.num_allowed[i]
            assert m.top_token_id_after not in m.masked_top_token_ids
            assert (m.top_token_id_before in m.masked_top_token_ids) == (
                m.top_token_id_before != m.top_token_id_after
            )
            s = sampled[step]
            assert s.token_id == new[0]
            if sent_id == AGAIN:  # greedy: the top allowed token
                assert s.token_id == m.top_token_id_after
            a = advanced[step]
            processed += len(new)
            assert a.token_ids == new and a.num_processed_tokens == processed
        # The grammar completes with the request's last token (EOS).
        last = advanced[max(advanced)]
        assert last.terminated
        assert not any(a.terminated for s, a in advanced.items() if s != max(advanced))
    # Without drafts the matcher is never rolled back.
    assert not [e for e in events if e.kind == "so.rollback"]


def test_the_mask_keeps_what_the_grammar_allows(run, events):
    """Replay each constrained request's tokens through xgrammar itself: at
    every step the token the mask left on top, and the token sampled, are
    allowed; every candidate the mask removed is not."""
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(run.model), vocab_size=49152
    )
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    for sent_id in (PERSON, AGAIN):
        rid = run.ids[sent_id]
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        masked = {e.step: e for e in _of(events, GrammarMasked, rid)}
        for step, new in sorted(_tokens_by_step(events, rid).items()):
            matcher.fill_next_token_bitmask(bitmask)
            allowed = _allowed(bitmask[0], info.vocab_size)
            m = masked[step]
            assert m.num_allowed == len(allowed)
            assert m.top_token_id_after in allowed and new[0] in allowed
            assert not set(m.masked_top_token_ids) & allowed
            assert matcher.accept_token(new[0])


def test_the_chosen_tokens_rank_before_and_after_the_mask(run, events):
    """``sampler.sampled`` at full: ``rank`` is after the mask (it runs before
    the sampler), ``rank_before_mask`` in the model's own logits; the mask
    only removes tokens, so the rank can only improve, and the model's own
    top token has rank 1 before it."""
    for sent_id in (PERSON, AGAIN):
        rid = run.ids[sent_id]
        masked = {e.step: e for e in _of(events, GrammarMasked, rid)}
        # Not the step after the last (async: computed, then dropped unmasked,
        # as the request had finished when its bitmask was due).
        samples = [e for e in _of(events, SamplerSampled, rid) if e.step in masked]
        assert len(samples) == len(masked)
        for e in samples:
            assert e.rank is not None and e.rank_before_mask is not None
            assert 1 <= e.rank <= e.rank_before_mask
            if e.token_id == masked[e.step].top_token_id_before:
                assert e.rank_before_mask == 1
        assert any(e.rank < e.rank_before_mask for e in samples), "the mask never mattered"
    assert all(e.rank_before_mask is None for e in _of(events, SamplerSampled, run.ids[PLAIN]))


def _allowed(row: torch.Tensor, vocab_size: int) -> set[int]:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return set(np.flatnonzero(bits).tolist())


def test_an_unconstrained_request_has_no_grammar_events(run, events):
    rid = run.ids[PLAIN]
    assert not [e for e in events if e.kind.startswith("so.") and rid in _ids_of(e)]
    # Its sampler events are all there (the deferred sampling of its
    # constrained neighbours does not lose them).
    tokens = _tokens_by_step(events, rid)
    (finished,) = _of(events, SchedFinished, rid)
    sampled = {e.step for e in _of(events, SamplerSampled, rid) if e.step <= finished.step}
    assert sampled == set(tokens)


def _ids_of(e: TraceEvent) -> list[str]:
    rid = getattr(e, "request_id", None)
    return [rid] if rid is not None else list(getattr(e, "request_ids", ()))


def test_the_replay_matched_the_live_scheduler_after_every_step(run):
    assert run.live_checks[:2] == [f"add {PERSON}", f"add {PLAIN}"]
    assert sum(label.startswith("step") for label in run.live_checks) >= 15


def test_the_replay_shows_each_constrained_request_per_step(run, events, replay):
    assert replay.structured_outputs and replay.async_scheduling
    person, plain = run.ids[PERSON], run.ids[PLAIN]
    (ready,) = _of(events, GrammarReady, person)
    (compiled,) = _of(events, GrammarCompiled, person)
    (finished,) = _of(events, SchedFinished, person)
    bitmasks = {e.step: e for e in _of(events, GrammarBitmask) if person in e.request_ids}
    masked = {e.step: e for e in _of(events, GrammarMasked, person)}
    tokens = _tokens_by_step(events, person)
    seen_waiting = 0
    for step in replay.steps:
        view = replay.view(step)
        so = view.structured_output
        row = so.requests.get(person) if so is not None else None
        if step > finished.step:
            assert row is None
            continue
        assert row is not None, step
        assert plain not in so.requests
        assert row.grammar_kind == "JSON"
        req = view.state.requests[person]
        waiting = step < ready.step
        assert row.waiting_for_grammar is waiting
        assert (req.status == WAITING_FOR_GRAMMAR) is waiting
        assert (person in view.state.skipped_waiting) is waiting
        assert person not in view.state.waiting
        if waiting:
            seen_waiting += 1
            assert so.waiting_for_grammar == [person]
        # The compile is known from the step it finished in.
        compiled_by_now = compiled.step is None or compiled.step <= step
        assert (row.compile_s == compiled.compile_s) is compiled_by_now
        assert row.ready_step == (ready.step if step >= ready.step else None)
        b = bitmasks.get(step)
        assert row.masked is (b is not None) is (person in so.masked)
        if b is not None:
            assert row.num_allowed == b.num_allowed[b.request_ids.index(person)]
            assert row.vocab_size == 49152 and 0 < row.allowed_fraction < 1
            m = masked[step]
            assert row.mask is not None
            assert row.mask.masked_top_token_ids == m.masked_top_token_ids
            assert row.mask.top_token_id_after == m.top_token_id_after
            assert row.mask.changed_top == (m.top_token_id_before != m.top_token_id_after)
            assert row.accepted_token_ids == tokens[step] == view.new_token_ids[person]
        else:
            assert row.num_allowed is None and row.mask is None
        assert row.terminated is (step == finished.step)
    assert seen_waiting >= 1  # steps 0 .. (ready - 1)


def test_an_admission_without_so_ready_is_refused(events):
    """The replay checks the grammar wait: a constrained request admitted
    with no ``so.ready`` contradicts the model."""
    broken = [e for e in events if type(e) is not GrammarReady]
    with pytest.raises(ReplayError, match="waiting for its grammar"):
        TraceReplay(broken)


def test_older_traces_still_replay(small_trace_path):
    """A trace of format 1.6 or before (no ``so.*`` events, no
    ``num_skipped_waiting``): the replay has no structured outputs."""
    events = load_trace(small_trace_path)
    assert not [e for e in events if e.kind.startswith("so.")]
    replay = TraceReplay(events)
    assert not replay.structured_outputs
    for step in replay.steps:
        view = replay.view(step)
        assert view.structured_output is None
        assert view.state.skipped_waiting == []


@pytest.fixture(scope="module")
def small_trace_path() -> str:
    return str(Path(__file__).parent.parent / "tui" / "data" / "small_trace.jsonl")


def test_perfetto_draws_the_compile_and_the_wait(run, events):
    doc = build_perfetto(events)
    out = doc["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in out if e["name"] == "thread_name"}
    compiles = [e for e in out if e["ph"] == "X" and e["name"] == "compile JSON"]
    by_request = {e["args"]["request_id"]: e for e in compiles}
    assert set(by_request) == {run.ids[PERSON], run.ids[AGAIN]}
    (compiled,) = _of(events, GrammarCompiled, run.ids[PERSON])
    slice_ = by_request[run.ids[PERSON]]
    assert names[(slice_["pid"], slice_["tid"])] == "grammar compile"
    assert slice_["dur"] == pytest.approx(compiled.compile_s * 1e6, rel=1e-6)
    assert by_request[run.ids[AGAIN]]["args"]["cache_hit"] is True
    phases = [
        e["name"]
        for e in out
        if e.get("cat") == "request.core" and e["ph"] == "b" and e["id"] == _core_id(out, PERSON)
    ]
    assert phases[:3] == [f"core {run.ids[PERSON]}", "waiting for grammar", "waiting"]
    assert any(e["name"] == "so.masked" and e["ph"] == "i" for e in out)
    requests = [e for e in out if e["ph"] == "C" and e["name"] == "requests"]
    assert max(e["args"]["skipped waiting"] for e in requests) == 1


def _core_id(out: list[dict], sent_id: str) -> int:
    return next(
        e["id"]
        for e in out
        if e.get("cat") == "request.core"
        and e["ph"] == "b"
        and e["name"].startswith(f"core {sent_id}-")
    )


# -- the hooks on their own (no model) ----------------------------------------
def test_the_bitmask_hook_counts_allowed_tokens_and_names_the_scheduled_step(tmp_path):
    tracer = Tracer(str(tmp_path / "t.jsonl"), "lifecycle")
    trace = StructuredOutputTrace.create(tracer)
    # With async scheduling a deferred step's rows are filled after the
    # previous step's update, which set the tracer back to that step.
    tracer.scheduled_step = 7
    tracer.set_step(6)
    vocab = 40  # two int32 words per row; the last 24 bits are padding
    bitmask = torch.zeros((5, 2), dtype=torch.int32)
    bitmask[0, 0] = 0b1011  # "a": 3 allowed
    bitmask[1] = -1  # "a"'s draft row: not counted
    bitmask[2] = -1  # "b": everything allowed (the padding bits are set too)
    bitmask[3] = torch.tensor([0x0F, 0x01], dtype=torch.int32)  # "c": 5 allowed
    bitmask[4] = -1  # a stale row past the step's
    trace.bitmask_filled(["a", "b", "c"], [2, 1, 1], bitmask, vocab)
    tracer.close()
    (e,) = [e for e in load_trace(str(tmp_path / "t.jsonl")) if type(e) is GrammarBitmask]
    assert e.step == 7
    assert e.request_ids == ["a", "b", "c"] and e.num_rows == [2, 1, 1]
    assert e.num_allowed == [3, vocab, 5] and e.vocab_size == vocab


@pytest.mark.parametrize("level", ["lifecycle", "full"])
def test_the_mask_hooks_write_so_masked_at_full_only(tmp_path, level):
    path = str(tmp_path / "t.jsonl")
    tracer = Tracer(path, level)
    trace = RunnerTrace.create(tracer)
    trace.step_started(3)
    logits = torch.tensor(
        [
            [0.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.5],  # "a", one draft: two rows
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0],  # "b": unconstrained
            [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],  # "c"
        ]
    )

    class Output:
        structured_output_request_ids = ["a", "c"]

    trace.grammar_mask_started(logits, ["a", "b", "c"], Output(), {"a": 1})
    logits[0, [1, 2, 4]] = float("-inf")  # the mask: "a" may not say 1, 2 or 4
    logits[3, :] = float("-inf")
    logits[3, 6] = 7.0
    trace.grammar_masked(logits)
    tracer.close()
    masked = [e for e in load_trace(path) if type(e) is GrammarMasked]
    if level == "lifecycle":
        assert masked == []
        return
    a, c = masked
    assert (a.request_id, a.step, a.num_allowed) == ("a", 3, 4)
    assert a.top_token_id_before == 1 and a.top_token_id_after == 3
    assert a.masked_top_token_ids == [1, 2, 4]  # of the raw top 5: 1, 2, 3, 4, 5
    assert (c.request_id, c.num_allowed, c.masked_top_token_ids) == ("c", 1, [5, 4, 3, 2])
    assert c.top_token_id_before == c.top_token_id_after == 6


def test_sampling_events_carry_the_step_of_the_forward(tmp_path):
    """Async scheduling with a grammar: step n+1's sampling runs after step
    n's update set the (shared) tracer back to n; the runner's sampling
    events still carry n + 1."""
    tracer = Tracer(str(tmp_path / "t.jsonl"), "lifecycle")
    trace = RunnerTrace.create(tracer)
    trace.step_started(5)  # execute_model of step 5
    tracer.set_step(4)  # step 4's update_from_output
    trace.sampling(["a"], [])
    assert tracer.step == 5
    tracer.close()


def test_the_trace_object_does_nothing_when_tracing_is_off():
    trace = StructuredOutputTrace.create(Tracer())
    assert trace is StructuredOutputTrace.NULL and not trace.enabled
    trace.bitmask_filled(["a"], [1], None, 10)  # not even looked at

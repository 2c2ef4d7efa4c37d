"""The trace of an n-gram speculative-decoding run, and the replay of it.

Twin of nothing in vLLM; it checks ``spec.proposed`` (``RunnerTrace.
drafts_proposed``), ``spec.verified`` (``SchedulerTrace.drafts_verified``),
``sched.step``'s ``scheduled_spec_decode_tokens`` and the replay model's
rollback of ``num_computed_tokens`` (``replay_state.py``) against each other,
against the tokens the steps appended, against a run without drafts and
against the live scheduler after every step. The run (``spec_scenario.py``)
has drafts rejected, partly and fully accepted, a budget that cuts drafts
short, a chunked prompt, a preemption and requests that end inside a step's
accepted drafts.
"""

from __future__ import annotations

import msgspec
import pytest

from engine.tracing import (
    ReplayError,
    SchedPreempted,
    SchedStep,
    SchedUpdate,
    SpecProposed,
    SpecVerified,
    TraceReplay,
    build_perfetto,
    load_trace,
)
from tests.tracing.scenario import assert_replay_matches_engine, internal_ids, scheduler_of
from tests.tracing.spec_scenario import (
    make_spec_engine,
    record_spec_scenario,
    run_spec_scenario,
)

SPEC_KINDS = {SpecProposed.kind, SpecVerified.kind}


@pytest.fixture(scope="module")
def spec_run(tiny_model_dir, tmp_path_factory):
    """(events, outputs by sent id) of the scenario with n-gram drafts."""
    path = str(tmp_path_factory.mktemp("spec") / "spec.jsonl")
    outputs = record_spec_scenario(tiny_model_dir, path)
    return load_trace(path), outputs


@pytest.fixture(scope="module")
def plain_run(tiny_model_dir, tmp_path_factory):
    """The same requests without speculation."""
    path = str(tmp_path_factory.mktemp("plain") / "plain.jsonl")
    outputs = record_spec_scenario(tiny_model_dir, path, speculative=False)
    return load_trace(path), outputs


def _one_per_step(events, cls) -> dict[int, object]:
    out = {}
    for e in events:
        if type(e) is cls:
            assert e.step not in out, f"two {cls.kind} at step {e.step}"
            out[e.step] = e
    return out


def _proposed(events) -> dict[int, dict[str, list[int]]]:
    """step -> {request: the drafts proposed after it}."""
    out: dict[int, dict[str, list[int]]] = {}
    for e in events:
        if type(e) is SpecProposed:
            assert e.request_id not in out.get(e.step, {})
            out.setdefault(e.step, {})[e.request_id] = e.draft_token_ids
    return out


def test_each_verdict_adds_up_and_matches_the_steps_tokens(spec_run):
    """Per ``spec.verified``: accepted + rejected = drafts; the tokens are the
    accepted drafts and one of the target's, which (greedy) differs from the
    first rejected draft; the drafts are the ones its ``sched.step``
    scheduled after one known token; ``sched.update`` appended those tokens
    (a prefix of them when the request ended inside them)."""
    events, _ = spec_run
    verified = [e for e in events if type(e) is SpecVerified]
    steps = _one_per_step(events, SchedStep)
    updates = _one_per_step(events, SchedUpdate)
    fates = set()
    cut = 0
    for e in verified:
        rid, drafts, acc = e.request_id, e.draft_token_ids, e.num_accepted
        assert e.num_accepted + e.num_rejected == len(drafts), e
        assert 0 <= acc <= len(drafts) and drafts, e
        assert e.token_ids[:acc] == drafts[:acc] and len(e.token_ids) == acc + 1, e
        if e.num_rejected:
            assert e.token_ids[-1] != drafts[acc], e  # greedy: equal would be accepted
        sched = steps[e.step]
        assert sched.scheduled_spec_decode_tokens[rid] == drafts, e
        assert sched.num_scheduled_tokens[rid] == 1 + len(drafts), e
        update = updates[e.step]
        new = update.new_token_ids[rid]
        if rid in update.finished:  # max_tokens: the step made more than it keeps
            assert 1 <= len(new) <= len(e.token_ids) and new == e.token_ids[: len(new)], e
            cut += len(new) < len(e.token_ids)
        else:
            assert new == e.token_ids, e
        fates.add("none" if acc == 0 else "all" if e.num_rejected == 0 else "some")
    # Every scheduled draft list got its verdict, in the step that verified it.
    assert {(e.step, e.request_id) for e in verified} == {
        (s, rid) for s, sched in steps.items() for rid in sched.scheduled_spec_decode_tokens
    }
    # The run went through every path: none, some and all drafts accepted,
    # a request cut inside a step's tokens, a preemption.
    assert fates == {"none", "some", "all"}
    assert cut >= 1
    assert any(type(e) is SchedPreempted for e in events)


def test_greedy_outputs_equal_a_run_without_drafts_whose_trace_has_no_spec(spec_run, plain_run):
    """Speculation changes how many steps the tokens take, not the tokens. The
    run without it writes no spec event, its steps schedule no drafts, and its
    views have no ``spec``."""
    spec_events, spec_outputs = spec_run
    plain_events, plain_outputs = plain_run
    assert spec_outputs == plain_outputs and len(spec_outputs) == 4
    assert not SPEC_KINDS & {e.kind for e in plain_events}
    assert not any(e.scheduled_spec_decode_tokens for e in plain_events if type(e) is SchedStep)
    plain = TraceReplay(plain_events)
    assert not plain.speculative and plain.spec_method is None
    assert all(plain.view(s).spec is None for s in plain.steps)

    spec = TraceReplay(spec_events)
    assert spec.speculative and spec.spec_method == "ngram"
    assert spec.last_step < plain.last_step  # fewer steps for the same tokens
    # Each request's draft counters sum its verdicts.
    verified = [e for e in spec_events if type(e) is SpecVerified]
    for rid, req in spec.final_state.requests.items():
        mine = [e for e in verified if e.request_id == rid]
        assert req.num_draft_tokens == sum(len(e.draft_token_ids) for e in mine), rid
        assert req.num_accepted_tokens == sum(e.num_accepted for e in mine), rid
    assert sum(r.num_accepted_tokens for r in spec.final_state.requests.values()) > 0


def test_replay_follows_the_rollback_of_the_live_engine_after_every_step(tiny_model_dir, tmp_path):
    """After every step, the state rebuilt from the trace written so far
    equals the live scheduler and block pool (cursors rolled back over the
    rejected drafts included); each verdict's cursor is the replay's, and
    before the rollback it was the runner's context length; the drafts the
    scheduler holds for the next step are the runner's ``spec.proposed``."""
    trace = str(tmp_path / "live.jsonl")
    engine = make_spec_engine(tiny_model_dir, trace, "lifecycle")
    scheduler = scheduler_of(engine)
    rolled_back: list[tuple[int, str]] = []
    checked: list[int] = []

    def compare(n: int) -> None:
        engine.tracer.flush()
        replay = TraceReplay(trace, snapshot_interval=4)
        assert replay.last_step == scheduler.step_counter
        step = replay.last_step
        state = replay.state_at(step)
        assert_replay_matches_engine(state, scheduler, f"step {step}")
        view = replay.view(step)
        spec = view.spec
        for rid, row in spec.verified.items() if spec is not None else ():
            assert state.requests[rid].num_computed_tokens == row.num_computed_tokens, rid
            if rid in scheduler.requests:
                assert scheduler.requests[rid].num_computed_tokens == row.num_computed_tokens
            slot = next(s for s in view.batch if s.request_id == rid)
            assert slot.query_len == 1 + len(row.draft_token_ids), (step, rid)
            assert slot.seq_len == row.num_computed_tokens_scheduled, (step, rid)
            if row.num_rejected:
                rolled_back.append((step, rid))
        proposed = spec.proposed if spec is not None else {}
        scheduled = view.sched_step.num_scheduled_tokens if view.sched_step else {}
        for rid, req in scheduler.requests.items():
            if req.is_finished() or req.is_prefill_chunk:
                continue
            if rid in proposed or rid in scheduled:
                assert req.spec_token_ids == proposed.get(rid, []), (step, rid)
        checked.append(n)

    try:
        run_spec_scenario(engine, after_each_step=compare)
    finally:
        engine.shutdown()
    assert len(checked) >= 10
    assert len(rolled_back) >= 2


def test_proposed_drafts_are_what_the_next_step_verifies(spec_run):
    """The drafts a step schedules are the ``spec.proposed`` of the last step
    that ran the request (the step before, unless the budget skipped it),
    cut short only where the budget ran out or the model's window ends."""
    events, _ = spec_run
    replay = TraceReplay(events)
    max_model_len = replay.config.max_model_len
    proposed = _proposed(events)
    steps = _one_per_step(events, SchedStep)
    last_ran: dict[str, int] = {}
    truncated = compared = 0
    for s in sorted(steps):
        sched = steps[s]
        for rid, drafts in sched.scheduled_spec_decode_tokens.items():
            origin = proposed.get(last_ran[rid], {}).get(rid)
            assert origin is not None and origin[: len(drafts)] == drafts, (s, rid)
        for rid, origin in proposed.get(s - 1, {}).items():
            n = sched.num_scheduled_tokens.get(rid)
            if n is None:  # finished, or not scheduled: the drafts go or wait
                continue
            compared += 1
            drafts = sched.scheduled_spec_decode_tokens.get(rid, [])
            assert n == 1 + len(drafts), (s, rid)
            if len(drafts) < len(origin):
                truncated += 1
                cursor = replay.state_at(s - 1).requests[rid].num_computed_tokens + n
                assert sched.token_budget_left == 0 or cursor == max_model_len - 1, (s, rid)
        for rid in sched.num_scheduled_tokens:
            last_ran[rid] = s
    assert compared >= 10 and truncated >= 1


def test_a_verdict_the_replay_cannot_follow_is_refused(spec_run):
    """A ``spec.verified`` whose cursor is not where the rollback leaves the
    replay's (a wrong count of rejected drafts, or a wrong cursor) stops the
    replay rather than show a wrong state."""
    events, _ = spec_run
    TraceReplay(events)  # as written, it replays
    i, e = next((i, e) for i, e in enumerate(events) if type(e) is SpecVerified and e.num_rejected)
    for bad in (
        msgspec.structs.replace(e, num_computed_tokens=e.num_computed_tokens + 1),
        msgspec.structs.replace(e, num_rejected=0, num_accepted=len(e.draft_token_ids)),
    ):
        with pytest.raises(ReplayError, match=rf"{e.request_id} rejected \d+ drafts"):
            TraceReplay([*events[:i], bad, *events[i + 1 :]])


def test_step_views_keep_each_drafts_fate_and_the_next_drafts(spec_run):
    events, _ = spec_run
    replay = TraceReplay(events)
    updates = _one_per_step(events, SchedUpdate)
    proposed = _proposed(events)
    verified = [e for e in events if type(e) is SpecVerified]
    for e in verified:
        row = replay.view(e.step).spec.verified[e.request_id]
        assert (row.draft_token_ids, row.num_accepted, row.token_ids) == (
            e.draft_token_ids,
            e.num_accepted,
            e.token_ids,
        )
        assert row.accepted_token_ids + row.rejected_token_ids == e.draft_token_ids
        assert len(row.rejected_token_ids) == row.num_rejected == e.num_rejected
        own = e.token_ids[-1]
        assert (row.bonus_token_id, row.recovered_token_id) == (
            (own, None) if e.num_rejected == 0 else (None, own)
        )
        assert row.num_computed_tokens == e.num_computed_tokens
        assert row.num_computed_tokens_scheduled == e.num_computed_tokens + e.num_rejected
        assert row.new_token_ids == updates[e.step].new_token_ids[e.request_id]
    for step in replay.steps:
        spec = replay.view(step).spec
        mine = [e for e in verified if e.step == step]
        if spec is None:
            assert not mine and step not in proposed
            continue
        assert list(spec.verified) == [e.request_id for e in mine]
        assert spec.proposed == proposed.get(step, {})
        assert spec.method == ("ngram" if step in proposed else None)
        assert spec.num_draft_tokens == sum(len(e.draft_token_ids) for e in mine)
        assert spec.num_accepted_tokens == sum(e.num_accepted for e in mine)
    # The proposals name requests by their internal ids.
    internal = set(internal_ids(events).values())
    assert {rid for p in proposed.values() for rid in p} <= internal


def test_perfetto_marks_each_verdict_on_its_request_and_each_proposal_on_the_runner(spec_run):
    events, _ = spec_run
    out = build_perfetto(events)["traceEvents"]
    verdicts = [ev for ev in out if ev["name"] == "drafts verified"]
    verified = [e for e in events if type(e) is SpecVerified]
    assert len(verdicts) == len(verified)
    for ev, e in zip(verdicts, verified):
        assert ev["ph"] == "n" and ev["cat"] == "request.core"
        assert ev["args"]["draft_token_ids"] == e.draft_token_ids
        assert ev["args"]["num_accepted"] == e.num_accepted
    proposals = [ev for ev in out if ev["name"] == "spec.proposed"]
    assert len(proposals) == sum(len(p) for p in _proposed(events).values()) > 0
    runner_tid = next(ev["tid"] for ev in out if ev["name"] == "forward")
    assert {ev["tid"] for ev in proposals} == {runner_tid}

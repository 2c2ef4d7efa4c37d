"""Every required event kind shows up in the scripted run, with fields that
agree with each other and with the engine's outputs.

Covers the hooks in engine/v1/core (scheduler, KV cache manager, block pool),
engine/v1/worker (runner), engine/v1/sample (sampler) and the front end's
OutputProcessor. See docs/trace_format.md for the fields.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

import pytest

from engine.tracing import TraceReplay, load_trace
from tests.tracing.scenario import BLOCK_SIZE, internal_ids, record_scenario

REQUIRED_KINDS = {
    "engine.config",
    "kv.init",
    "request.added",
    "sched.queued",
    "sched.admitted",
    "sched.step",
    "sched.update",
    "sched.preempted",
    "sched.finished",
    "kv.cache_hit",
    "kv.touched",
    "kv.allocated",
    "kv.allocation_failed",
    "kv.cached",
    "kv.evicted",
    "kv.freed",
    "request.output",
    "request.finished",
}
RUNNER_KINDS = {"runner.init", "runner.batch", "runner.forward", "sampler.sampled"}


@pytest.fixture(scope="module")
def counting_run(tiny_model_dir, tmp_path_factory):
    trace = str(tmp_path_factory.mktemp("events") / "run.jsonl")
    outputs = record_scenario(tiny_model_dir, trace, "lifecycle")
    return load_trace(trace), outputs


@pytest.fixture(scope="module")
def real_run(full_real_scenario):
    trace, outputs = full_real_scenario
    return load_trace(trace), outputs


def by_kind(events):
    out = defaultdict(list)
    for e in events:
        out[e.kind].append(e)
    return out


def test_every_event_has_the_common_fields(counting_run, real_run):
    for events, _ in (counting_run, real_run):
        pids = {e.pid for e in events}
        # In-process: front end and core share one tracer, this process's.
        assert pids == {os.getpid()}
        seqs = [e.seq for e in events]
        assert sorted(seqs) == list(range(1, len(events) + 1))
        added = {e.request_id for e in events if e.kind == "request.added"}
        first_step = None
        for e in events:
            assert e.ts > 1_500_000_000 * 10**9, e  # wall-clock ns
            if e.kind == "sched.step":
                first_step = first_step or e.step
            if first_step is not None:
                assert isinstance(e.step, int), e  # every event after the first step
            if e.kind.startswith(("request.", "sched.", "kv.", "sampler.")) and e.kind not in (
                "sched.step",
                "sched.update",
                "kv.init",
                "kv.cached",
                "kv.evicted",
                "kv.cache_reset",
            ):
                assert e.request_id in added, e  # names a request the front end added


def test_events_name_each_request_by_its_internal_id(counting_run):
    """As in vLLM, the engine knows a request by an internal id (the id it was
    sent under, "-" and 8 hex digits); only request.added keeps the sent id."""
    events, outputs = counting_run
    ids = internal_ids(events)
    assert set(ids) == {"a", "b", "long", "stop", "doomed", "c", "d"}
    assert set(outputs) == {"a", "b", "long", "stop", "c", "d"}  # not the aborted one
    assert all(out.request_id == sent for sent, out in outputs.items())
    named = {e.request_id for e in events if getattr(e, "request_id", None) is not None}
    assert named == set(ids.values())
    for e in events:
        if e.kind == "sched.step":
            assert set(e.num_scheduled_tokens) <= named
        elif e.kind == "sched.update":
            assert set(e.new_token_ids) | set(e.finished) <= named


def test_required_kinds_are_present(counting_run, real_run):
    assert REQUIRED_KINDS <= {e.kind for e in counting_run[0]}
    assert REQUIRED_KINDS | RUNNER_KINDS <= {e.kind for e in real_run[0]}
    # The fake model has no runner: no runner or sampler events.
    assert not RUNNER_KINDS & {e.kind for e in counting_run[0]}


def test_scheduler_events_are_consistent(counting_run):
    events, _ = counting_run
    ids = internal_ids(events)
    k = by_kind(events)
    (config,) = k["engine.config"]
    (init,) = k["kv.init"]
    assert (init.num_blocks, init.block_size, init.null_block_id) == (16, BLOCK_SIZE, 0)
    assert config.num_gpu_blocks == 16 and config.max_num_batched_tokens == 16
    steps = [e.step for e in k["sched.step"]]
    assert steps == list(range(1, len(steps) + 1))
    per_step = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e.step is not None:
            per_step[e.step][e.kind].append(e)
    chunked = set()
    for e in k["sched.step"]:
        n = e.num_scheduled_tokens
        assert sum(n.values()) == e.total_num_scheduled_tokens <= e.token_budget == 16
        assert e.token_budget_left == e.token_budget - e.total_num_scheduled_tokens
        assert e.num_running <= 4
        assert 0.0 <= e.kv_cache_usage <= 1.0
        step_events = per_step[e.step]
        admitted = step_events["sched.admitted"]
        assert sorted(e.new_req_ids + e.resumed_req_ids) == sorted(a.request_id for a in admitted)
        assert e.resumed_req_ids == [a.request_id for a in admitted if a.resumed]
        assert sorted(e.preempted_req_ids) == sorted(
            p.request_id for p in step_events["sched.preempted"]
        )
        assert set(e.running_req_ids) | {a.request_id for a in admitted} == set(n)
        for a in admitted:
            assert n[a.request_id] == a.num_new_tokens
        for rid, tokens in n.items():
            update = step_events["sched.update"][0]
            if rid not in update.new_token_ids and tokens > 1:
                chunked.add(rid)
    assert ids["long"] in chunked  # a 30-token prompt cannot fit a 16-token budget
    # Preemption: the victim goes back to waiting and is resumed later.
    victims = {p.request_id for p in k["sched.preempted"]}
    assert victims
    resumed = {rid for e in k["sched.step"] for rid in e.resumed_req_ids}
    assert victims <= resumed
    for p in k["sched.preempted"]:
        assert p.for_request_id in {e.request_id for e in k["sched.queued"]}
        assert p.num_preemptions >= 1
    # Every queued request finishes exactly once, in the core too.
    queued = [e.request_id for e in k["sched.queued"]]
    finished = [e.request_id for e in k["sched.finished"]]
    assert sorted(queued) == sorted(finished) == sorted(set(queued))
    status = {e.request_id: e.status for e in k["sched.finished"]}
    assert status[ids["doomed"]] == "FINISHED_ABORTED"
    # The stop string is found by the front end, which then aborts the core's request.
    assert status[ids["stop"]] == "FINISHED_ABORTED"
    assert status[ids["a"]] == "FINISHED_LENGTH_CAPPED"


def test_kv_events_are_consistent(counting_run):
    events, _ = counting_run
    k = by_kind(events)
    held: dict[str, list[int]] = defaultdict(list)
    cached: dict[int, str] = {}
    hits = 0
    for e in events:
        kind = e.kind
        if kind == "kv.cache_hit":
            assert e.num_cached_tokens == len(e.block_ids) * BLOCK_SIZE
            assert e.num_cached_tokens < e.num_tokens  # the last token is always recomputed
            hits += e.num_cached_tokens > 0
        elif kind == "kv.touched":
            assert not held[e.request_id]  # hits only start a block table
            assert all(cached.get(b) for b in e.block_ids)  # only cached blocks are hit
            assert all(r >= 1 for r in e.ref_cnts)
            held[e.request_id].extend(e.block_ids)
        elif kind == "kv.allocated":
            assert 0 not in e.block_ids and e.block_ids
            held[e.request_id].extend(e.block_ids)
            assert e.num_blocks == len(held[e.request_id])
        elif kind == "kv.cached":
            assert re.fullmatch(r"[0-9a-f]{64}", e.block_hash), e  # hex sha256
            assert e.block_id in held[e.request_id]
            assert held[e.request_id].index(e.block_id) == e.block_index
            assert e.block_id not in cached
            cached[e.block_id] = e.block_hash
        elif kind == "kv.evicted":
            assert cached.pop(e.block_id) == e.block_hash
        elif kind == "kv.freed":
            # Tail first: the exact reverse of the block table.
            assert e.block_ids == held.pop(e.request_id)[::-1]
            assert set(e.to_free_queue) <= set(e.block_ids)
        elif kind == "kv.allocation_failed":
            assert e.num_blocks_needed > e.num_free_blocks
    assert hits >= 2  # "b" behind "a", and "c"/"d" on the freed prefix
    assert not held  # everything was given back
    assert k["kv.evicted"]


def test_front_end_events_match_the_outputs(counting_run):
    events, outputs = counting_run
    ids = internal_ids(events)
    k = by_kind(events)
    added = {e.request_id: e for e in k["request.added"]}
    assert set(added) == set(ids.values()) and len(added) == 7
    assert added[ids["stop"]].sampling_params.stop == ["w45"]
    assert added[ids["a"]].num_prompt_tokens == 10
    for e in k["request.added"]:
        queued = next(q for q in k["sched.queued"] if q.request_id == e.request_id)
        assert e.seq < queued.seq  # the front end adds before the core queues
    tokens, text = defaultdict(list), defaultdict(str)
    for e in k["request.output"]:
        tokens[e.request_id] += e.new_token_ids
        text[e.request_id] += e.text_delta
        assert e.num_output_tokens == len(tokens[e.request_id])
    finished = {e.request_id: e for e in k["request.finished"]}
    assert set(finished) == set(added)
    for sent, out in outputs.items():
        rid = ids[sent]
        completion = out.outputs[0]
        assert tokens[rid] == completion.token_ids
        assert text[rid] == completion.text
        assert finished[rid].finish_reason == completion.finish_reason
        assert finished[rid].num_output_tokens == len(completion.token_ids)
    assert finished[ids["doomed"]].finish_reason == "abort"
    assert finished[ids["stop"]].finish_reason == "stop"
    assert finished[ids["stop"]].stop_reason == "w45"
    assert finished[ids["stop"]].stop_string_in_front_end is True
    assert text[ids["stop"]].split() == ["w42", "w43", "w44"]  # the stop string is cut
    assert finished[ids["a"]].finish_reason == "length"


def test_runner_and_sampler_events(real_run):
    events, outputs = real_run
    k = by_kind(events)
    (init,) = k["runner.init"]
    assert init.attn_backend == "CPU_ATTN" and init.device == "cpu"
    assert init.num_blocks == 16 and init.block_size == BLOCK_SIZE
    sched = {e.step: e for e in k["sched.step"]}
    updates = {e.step: e for e in k["sched.update"]}
    forwards = {e.step: e for e in k["runner.forward"]}
    inputs = {e.step: e for e in k["runner.inputs"]}
    for f in forwards.values():  # launched before it was written, and took some time
        assert 0 < f.start_ts <= f.ts and f.duration_ns > 0
    sampled = defaultdict(list)
    for e in k["sampler.sampled"]:
        sampled[e.step].append(e)
    assert len(k["runner.batch"]) == len(k["runner.inputs"]) == len(forwards)
    for batch in k["runner.batch"]:
        step = batch.step
        n = sched[step].num_scheduled_tokens
        assert batch.cudagraph_mode == "NONE" and batch.attn_backend == "CPU_ATTN"
        assert batch.num_reqs == len(n) == len(batch.req_ids)
        assert batch.num_tokens == batch.num_tokens_padded == sum(n.values())
        assert sorted(batch.req_ids) == sorted(n)
        for rid, q, c, s, slots in zip(
            batch.req_ids,
            batch.query_lens,
            batch.num_computed_tokens,
            batch.seq_lens,
            batch.slot_mapping,
        ):
            assert q == n[rid] and c + q == s
            assert sum(run[2] for run in slots) == q
            assert all(
                0 <= off < BLOCK_SIZE and 0 < cnt <= BLOCK_SIZE - off for _, off, cnt in slots
            )
        # The runs name exactly the slots the step wrote (runner.inputs holds them).
        expanded = [
            b * BLOCK_SIZE + o + i
            for runs in batch.slot_mapping
            for b, o, c in runs
            for i in range(c)
        ]
        written = inputs[step].slot_mapping
        if written.values is not None:
            assert expanded == written.values
        else:
            assert expanded[: len(written.head)] == written.head
            assert expanded[-len(written.tail) :] == written.tail
        assert forwards[step].duration_ns > 0
        assert forwards[step].num_tokens == batch.num_tokens
        # One sample per request whose prompt is complete, and it is what the core appended.
        kept = [r for r in batch.req_ids if r not in batch.discard_req_ids]
        assert [e.request_id for e in sampled[step]] == kept
        for e in sampled[step]:
            got = updates[step].new_token_ids.get(e.request_id)
            if got is not None:  # None: aborted while the step ran
                assert got == [e.token_id]
            assert e.logprob <= 0.0
            assert [s.stage for s in e.stages][:2] == ["raw", "processed"]
            assert e.rank >= 1
    ids = internal_ids(events)
    final_tokens = {ids[sent]: out.outputs[0].token_ids for sent, out in outputs.items()}
    for rid, tokens in final_tokens.items():
        assert [e.token_id for e in k["sampler.sampled"] if e.request_id == rid][
            -len(tokens) :
        ] == tokens


def test_core_front_end_and_replay_agree_on_prefix_hits(counting_run):
    """``sched.finished`` (noted by the core's trace at admission),
    ``request.finished`` and the ``RequestOutput`` (both from the first
    output's ``PrefillStats``) and the replay (from ``sched.admitted``) give
    each request the same prefix hit."""
    events, outputs = counting_run
    ids = internal_ids(events)
    k = by_kind(events)
    core = {e.request_id: e.num_cached_tokens for e in k["sched.finished"]}
    front = {e.request_id: e.num_cached_tokens for e in k["request.finished"]}
    replayed = TraceReplay(events).final_state.requests
    for sent, out in outputs.items():
        rid = ids[sent]
        if front[rid] is None:  # an abort from the front end records no counts
            continue
        assert front[rid] == core[rid] == out.num_cached_tokens, sent
        assert replayed[rid].num_cached_tokens == out.num_cached_tokens, sent
    assert any(out.num_cached_tokens > 0 for out in outputs.values())

"""Tracing on CUDA: the same trace rules as on CPU (tests/tracing/), checked
where the sampler's values reach the host through a queued copy
(``HostListsCopy``) and decode steps replay CUDA graphs.

* Outputs are identical with tracing off, ``lifecycle`` and ``full``.
* Each ``sampler.sampled`` event names the token the request really got, in
  order, with the logprob the request's own ``logprobs`` reported.
* ``runner.batch`` says ``FULL`` for replayed decode steps.
* The replay model's KV state equals the live BlockPool after every step of
  the scripted run (prefix hits, chunked prefill, preemption, abort, stop
  string) on CUDA.

Marked ``gpu``: skipped without CUDA (CI), run by ``make test-gpu``.
"""

from __future__ import annotations

import math

import pytest

from engine.sampling_params import SamplingParams
from engine.tracing import load_trace
from tests.helpers.engine_fixtures import ids
from tests.helpers.gpu import decode_graphs
from tests.helpers.tiny_model import make_tiny_model_dir
from tests.tracing.scenario import (
    internal_ids,
    make_engine,
    replay_scenario_against_live_engine,
)

pytestmark = pytest.mark.gpu

CUDA = decode_graphs(device="cuda", dtype="float32")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("gpu_tracing") / "tiny")


def _run(engine):
    """Greedy with logprobs, seeded top-k/top-p, penalised: outputs by request."""
    all_params = {
        "g": SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True),
        "k": SamplingParams(
            temperature=0.9, top_k=4, top_p=0.8, seed=11, max_tokens=8, logprobs=1, ignore_eos=True
        ),
        "p": SamplingParams(
            temperature=1.1, seed=5, repetition_penalty=1.3, max_tokens=8, ignore_eos=True
        ),
    }
    prompts = {"g": "w0 w1 w2 w3 w4 w5", "k": "w0 w1 w2 w3 w9", "p": "w20 w21 w22"}
    for rid, sp in all_params.items():
        engine.add_request(rid, {"prompt_token_ids": ids(prompts[rid])}, sp)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                outputs[out.request_id] = (c.token_ids, c.logprobs)
    engine.shutdown()
    return outputs


def test_cuda_trace_names_the_tokens_the_requests_got(tiny_model_dir, tmp_path):
    results = {}
    for level in ("off", "lifecycle", "full"):
        path = None if level == "off" else str(tmp_path / f"{level}.jsonl")
        results[level] = _run(make_engine(tiny_model_dir, path, level, real_model=True, **CUDA))
    tokens = {level: {r: o[0] for r, o in out.items()} for level, out in results.items()}
    assert tokens["lifecycle"] == tokens["off"] == tokens["full"]
    for level in ("lifecycle", "full"):
        events = load_trace(str(tmp_path / f"{level}.jsonl"))
        sampled = [e for e in events if e.kind == "sampler.sampled"]
        internal = internal_ids(events)  # outputs carry "g", "k", "p"; events the engine's ids
        assert set(internal) == set(results[level]) == {"g", "k", "p"}
        for rid, (token_ids, logprobs) in results[level].items():
            mine = [e for e in sampled if e.request_id == internal[rid]]
            assert [e.token_id for e in mine] == token_ids, (level, rid)
            assert [e.greedy for e in mine] == [rid == "g"] * len(token_ids)
            for e, position in zip(mine, logprobs or []):
                assert math.isclose(e.logprob, position[e.token_id].logprob, abs_tol=1e-4)
            if level == "full":
                for e in mine:
                    assert e.stages[0].stage == "raw"
                    assert e.rank >= 1
            else:
                assert all(e.stages is None and e.rank is None for e in mine)
        batches = [e for e in events if e.kind == "runner.batch"]
        forwards = [e for e in events if e.kind == "runner.forward"]
        assert len(forwards) == len(batches) > 0
        assert all(e.duration_ns > 0 for e in forwards)
        decode = [b for b in batches if b.num_tokens == b.num_reqs]
        assert decode and all(b.cudagraph_mode == "FULL" for b in decode)
        assert all(b.num_tokens_padded >= b.num_tokens for b in batches)
    full_kinds = {e.kind for e in load_trace(str(tmp_path / "full.jsonl"))}
    assert "runner.inputs" in full_kinds


def test_cuda_replay_equals_live_block_pool_after_every_step(tiny_model_dir, tmp_path):
    trace = str(tmp_path / "run.jsonl")
    checked = replay_scenario_against_live_engine(tiny_model_dir, trace, real_model=True, **CUDA)
    assert sum(label.startswith("step") for label in checked) >= 10
    kinds = {e.kind for e in load_trace(trace)}
    assert {"sched.preempted", "kv.evicted", "kv.cached", "runner.batch"} <= kinds

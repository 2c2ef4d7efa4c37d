"""LLMEngine end to end, in one process (twin of vllm/v1/engine/llm_engine.py):
request ids (the user's and the internal one), a failed add that must leave
nothing behind, logprobs of a mixed batch with the real sampler, and
``stream_interval`` from the engine arguments.

The model is ``CountingExecutor`` (next token = last token + 1) unless a test
needs the real sampler; then it is a random tiny Llama on the CPU.
"""

from __future__ import annotations

import re

import pytest
import torch

from engine.engine.arg_utils import EngineArgs
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.v1.engine.llm_engine import LLMEngine
from tests.helpers.counting_executor import CountingExecutor
from tests.helpers.engine_fixtures import ids
from tests.helpers.tiny_model import make_tiny_model_dir

DELTA = RequestOutputKind.DELTA
FINAL_ONLY = RequestOutputKind.FINAL_ONLY
# A random Llama with the tiny checkpoint's shapes (its config has no MLP width).
REAL_MODEL = dict(
    load_format="dummy", device="cpu", dtype="float32", hf_overrides={"intermediate_size": 32}
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llm_engine") / "tiny")


def make_engine(model_dir, real_model=False, **kwargs) -> LLMEngine:
    kwargs.setdefault("block_size", 4)
    if real_model:
        kwargs.update(REAL_MODEL)
    else:
        kwargs.setdefault("distributed_executor_backend", CountingExecutor)
    args = EngineArgs(model=str(model_dir), **kwargs)
    return LLMEngine.from_engine_args(args, enable_multiprocessing=False)


@pytest.fixture
def engine(model_dir):
    engine = make_engine(model_dir)
    yield engine
    engine.shutdown()


def greedy(**kwargs) -> SamplingParams:
    # n > 1 needs a temperature; the counting model ignores it anyway.
    kwargs.setdefault("temperature", 0.0 if kwargs.get("n", 1) == 1 else 0.8)
    return SamplingParams(ignore_eos=True, **kwargs)


def run(engine: LLMEngine) -> list:
    """Step until idle; the finished outputs in the order they finished."""
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    return finished


def scheduler(engine: LLMEngine):
    return engine.engine_core.engine_core.scheduler


def assert_nothing_left(engine: LLMEngine) -> None:
    op = engine.output_processor
    assert (op.request_states, op.parent_requests, dict(op.external_req_ids)) == ({}, {}, {})
    assert scheduler(engine).requests == {}
    assert engine.stat_logger is None or engine.stat_logger._requests == {}


# ---------------------------------------------------------------------------
# Ids
# ---------------------------------------------------------------------------
def test_add_request_returns_the_internal_id(engine):
    internal = engine.add_request("mine", {"prompt_token_ids": ids("w5")}, greedy(max_tokens=2))
    assert re.fullmatch(r"mine-[0-9a-f]{8}", internal)
    assert list(scheduler(engine).requests) == [internal]
    (o,) = run(engine)
    assert o.request_id == "mine"
    assert_nothing_left(engine)


def test_client_id_that_looks_like_a_child_id_does_not_collide(engine):
    """A client's "0_col" in flight used to take the id of the first child of
    "col" with n=2, so "col" failed -- and stayed refused for ever."""
    engine.add_request("0_col", {"prompt_token_ids": ids("w1")}, greedy(max_tokens=3))
    sp = greedy(max_tokens=2, n=2, output_kind=FINAL_ONLY)
    engine.add_request("col", {"prompt_token_ids": ids("w20")}, sp)
    outputs = {o.request_id: o for o in run(engine)}
    assert [c.token_ids for c in outputs["col"].outputs] == [ids("w21 w22")] * 2
    assert outputs["0_col"].outputs[0].token_ids == ids("w2 w3 w4")
    engine.add_request("col", {"prompt_token_ids": ids("w30")}, sp)
    (again,) = run(engine)
    assert again.request_id == "col" and len(again.outputs) == 2
    assert_nothing_left(engine)


def test_the_same_id_twice_in_flight(engine):
    first = engine.add_request("same", {"prompt_token_ids": ids("w1")}, greedy(max_tokens=2))
    second = engine.add_request("same", {"prompt_token_ids": ids("w40")}, greedy(max_tokens=2))
    assert first != second
    outputs = run(engine)
    assert sorted(o.outputs[0].token_ids for o in outputs) == [ids("w2 w3"), ids("w41 w42")]
    assert {o.request_id for o in outputs} == {"same"}


def test_abort_by_the_users_id_or_the_internal_one(engine):
    sp = greedy(max_tokens=50)
    kept = engine.add_request("job", {"prompt_token_ids": ids("w1")}, sp)
    engine.add_request("job", {"prompt_token_ids": ids("w2")}, sp)
    engine.add_request("n3", {"prompt_token_ids": ids("w3")}, greedy(max_tokens=50, n=3))
    engine.step()
    engine.abort_request(["n3"])  # the user's id: all three samples
    assert sorted(scheduler(engine).requests) == sorted(engine.output_processor.request_states)
    assert len(scheduler(engine).requests) == 2
    engine.abort_request([kept], internal=True)  # only that one
    assert engine.output_processor.external_req_ids == {
        "job": [r for r in scheduler(engine).requests]
    }
    engine.abort_request(["job"])
    assert_nothing_left(engine)


def test_a_failed_add_leaves_nothing_behind(engine, monkeypatch):
    """The second child of an n=3 request cannot be sent: the first one, already
    in the core, is aborted and every front-end record is removed."""
    real_add = engine.engine_core.add_request
    calls = []

    def add_fails_the_second_time(request):
        calls.append(request.request_id)
        if len(calls) == 2:
            raise OverflowError("int too big to convert")
        real_add(request)

    monkeypatch.setattr(engine.engine_core, "add_request", add_fails_the_second_time)
    with pytest.raises(OverflowError):
        engine.add_request("big", {"prompt_token_ids": ids("w5")}, greedy(max_tokens=2, n=3))
    assert len(calls) == 2
    assert_nothing_left(engine)
    monkeypatch.setattr(engine.engine_core, "add_request", real_add)
    sp = greedy(max_tokens=2, n=3, output_kind=FINAL_ONLY)
    engine.add_request("big", {"prompt_token_ids": ids("w5")}, sp)
    (o,) = run(engine)
    assert o.request_id == "big" and len(o.outputs) == 3


# ---------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------
def test_mixed_logprobs_batch_with_the_real_sampler(model_dir):
    """logprobs=1 batched with logprobs=5: the sampler gathers 5 for both; the
    front end must still give the first request only its own 1 (+ the sampled
    token when it is not the top one)."""
    engine = make_engine(model_dir, real_model=True)
    try:
        engine.add_request(
            "one", {"prompt_token_ids": ids("w1 w2")}, greedy(max_tokens=4, logprobs=1)
        )
        engine.add_request(
            "five", {"prompt_token_ids": ids("w3 w4")}, greedy(max_tokens=4, logprobs=5)
        )
        outputs = {o.request_id: o.outputs[0] for o in run(engine)}
    finally:
        engine.shutdown()
    for request_id, wanted in (("one", 1), ("five", 5)):
        completion = outputs[request_id]
        assert len(completion.logprobs) == 4
        for token_id, position in zip(completion.token_ids, completion.logprobs):
            # The top-k, plus the sampled token when it is not among them
            # (random weights leave near-ties, so greedy may pick a rank > 1).
            top_k = [lp.rank for t, lp in position.items() if t != token_id or lp.rank <= wanted]
            assert sorted(top_k) == list(range(1, wanted + 1))
            assert token_id in position and len(position) <= wanted + 1


def test_custom_logits_processor_and_logprobs_mode_come_from_the_engine_arguments(model_dir):
    """``logits_processors`` (built once in the worker, with the built-ins)
    and ``logprobs_mode`` travel from EngineArgs to the worker's sampler."""
    prompt = {"prompt_token_ids": ids("w1 w2")}
    plain = make_engine(model_dir, real_model=True)
    try:
        plain.add_request("a", prompt, greedy(max_tokens=1, logprobs=0))
        (first,) = run(plain)
    finally:
        plain.shutdown()
    (top,) = first.outputs[0].token_ids
    top_logprob = first.outputs[0].logprobs[0][top].logprob

    engine = make_engine(
        model_dir,
        real_model=True,
        logits_processors=["tests.v1.sample.utils:BanTokenLogitsProcessor"],
        logprobs_mode="raw_logits",
    )
    try:
        with pytest.raises(ValueError, match="ban_token must be an int"):
            engine.add_request("bad", prompt, greedy(extra_args={"ban_token": "x"}))
        engine.add_request("c", prompt, greedy(max_tokens=1, logprobs=0))
        engine.add_request("b", prompt, greedy(max_tokens=1, extra_args={"ban_token": top}))
        outputs = {o.request_id: o.outputs[0] for o in run(engine)}
        assert_nothing_left(engine)
    finally:
        engine.shutdown()
    assert outputs["c"].token_ids == [top]
    assert outputs["b"].token_ids != [top]
    # raw_logits: the value is the model's logit, not its log-softmax; the two
    # differ by logsumexp over the vocabulary, far above float32 noise.
    assert top_logprob <= 0
    assert outputs["c"].logprobs[0][top].logprob != pytest.approx(top_logprob, abs=1e-3)


def test_logprobs_mode_is_checked(model_dir):
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineArgs(model=str(model_dir), logprobs_mode="probs").create_engine_config()


def test_max_logprobs_bounds_what_a_request_may_ask(model_dir):
    """vLLM's max_logprobs (default 20): logprobs=-1 counts as the vocabulary."""
    engine = make_engine(model_dir)
    try:
        vocab = engine.model_config.vocab_size
        engine.add_request("ok", {"prompt_token_ids": ids("w1")}, greedy(logprobs=20))
        for n, shown in [(21, 21), (-1, vocab)]:
            with pytest.raises(ValueError) as error:
                engine.add_request(f"r{n}", {"prompt_token_ids": ids("w1")}, greedy(logprobs=n))
            assert str(error.value).startswith(
                f"Requested sample logprobs of {shown}, which is greater than max allowed: 20"
            )
        assert [r.split("-")[0] for r in engine.output_processor.request_states] == ["ok"]
    finally:
        engine.shutdown()
    unlimited = make_engine(model_dir, max_logprobs=-1)
    try:
        unlimited.add_request("all", {"prompt_token_ids": ids("w1")}, greedy(logprobs=-1))
    finally:
        unlimited.shutdown()
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0, or -1"):
        EngineArgs(model=str(model_dir), max_logprobs=-2).create_engine_config()


def test_prompt_logprobs_are_bounded_and_need_the_cache_skipped(model_dir):
    engine = make_engine(model_dir)
    try:
        vocab = engine.model_config.vocab_size
        prompt = {"prompt_token_ids": ids("w1 w2")}
        for n, shown in [(21, 21), (-1, vocab)]:
            with pytest.raises(ValueError) as error:
                engine.add_request(f"r{n}", prompt, greedy(prompt_logprobs=n))
            assert str(error.value).startswith(
                f"Requested prompt logprobs of {shown}, which is greater than max allowed: 20"
            )
        with pytest.raises(ValueError, match="prompt_logprobs needs skip_reading_prefix_cache"):
            engine.add_request(
                "cached", prompt, greedy(prompt_logprobs=1, skip_reading_prefix_cache=False)
            )
        assert engine.output_processor.request_states == {}
    finally:
        engine.shutdown()


def test_prompt_logprobs_arrive_once_with_the_first_token(model_dir, tmp_path):
    """DELTA: the whole prompt's logprobs in the first output, none after;
    the full vocabulary with -1 (rows that sum to one); one
    ``runner.prompt_logprobs`` event per step with prompt tokens, 4-token
    chunks here (the prompt of 10 runs in 3 steps)."""
    from engine.tracing import TraceReplay

    trace = tmp_path / "trace.jsonl"
    engine = make_engine(
        model_dir,
        real_model=True,
        max_logprobs=-1,
        max_num_batched_tokens=4,
        max_num_seqs=1,
        trace_path=str(trace),
        trace_level="lifecycle",
    )
    prompt = ids("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10")
    try:
        vocab = engine.model_config.vocab_size
        engine.add_request(
            "d",
            {"prompt_token_ids": prompt},
            greedy(max_tokens=3, prompt_logprobs=-1, output_kind=DELTA),
        )
        deltas = []
        while engine.has_unfinished_requests():
            deltas += engine.step()
        assert_nothing_left(engine)
    finally:
        engine.shutdown()
    first, *rest = deltas
    assert [len(o.outputs[0].token_ids) for o in deltas] == [1, 1, 1]
    assert all(o.prompt_logprobs in (None, []) for o in rest)
    positions = first.prompt_logprobs
    assert len(positions) == len(prompt) and positions[0] is None
    for pos, position in enumerate(positions[1:], 1):
        assert len(position) == vocab and prompt[pos] in position
        total = torch.logsumexp(torch.tensor([lp.logprob for lp in position.values()]), 0)
        assert total.item() == pytest.approx(0.0, abs=1e-5)  # fp32 over a small vocabulary
        assert sorted(lp.rank for lp in position.values()) == list(range(1, vocab + 1))
    events = [e for e in TraceReplay(str(trace)).events if e.kind == "runner.prompt_logprobs"]
    assert [(e.first_position, e.num_positions, e.done) for e in events] == [
        (0, 4, False),
        (4, 4, False),
        (8, 1, True),
    ]
    assert {e.num_logprobs for e in events} == {vocab}


def test_prompt_logprobs_of_an_aborted_prefill_leave_nothing(model_dir):
    """Aborted between two chunks of its prompt: the runner forgets the rows
    it was filling; a later request with the same prompt gets all of them."""
    engine = make_engine(model_dir, real_model=True, max_num_batched_tokens=4)
    prompt = {"prompt_token_ids": ids("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10")}
    runner = engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    try:
        engine.add_request("a", prompt, greedy(max_tokens=2, prompt_logprobs=1))
        engine.step()
        engine.step()  # at most 8 of the 10 prompt tokens have run
        assert len(runner.num_prompt_logprobs) == 1
        engine.abort_request(["a"])
        while engine.has_unfinished_requests():
            engine.step()
        engine.step()  # the step that tells the worker about the abort
        assert runner.num_prompt_logprobs == {}
        assert all(r.in_progress_prompt_logprobs_cpu is None for r in runner.requests.values())
        engine.add_request("b", prompt, greedy(max_tokens=2, prompt_logprobs=1))
        (done,) = run(engine)
        assert len(done.prompt_logprobs) == 10 and all(done.prompt_logprobs[1:])
        assert_nothing_left(engine)
    finally:
        engine.shutdown()


def test_auto_fitted_max_model_len_reaches_the_worker(model_dir):
    """max_model_len=-1 with 10 blocks of 4 tokens (one is the null block): 36."""
    engine = make_engine(model_dir, real_model=True, max_model_len=-1, num_gpu_blocks_override=10)
    try:
        worker = engine.engine_core.engine_core.model_executor.driver_worker
        assert engine.model_config.max_model_len == 36
        assert worker.model_runner.max_model_len == 36
        assert worker.glassbox_config.scheduler_config.max_model_len == 36
    finally:
        engine.shutdown()


def test_stream_interval_comes_from_the_engine_arguments(model_dir):
    engine = make_engine(model_dir, stream_interval=4)
    try:
        assert engine.output_processor.stream_interval == 4
        engine.add_request(
            "s", {"prompt_token_ids": ids("w5")}, greedy(max_tokens=9, output_kind=DELTA)
        )
        sent = []
        while engine.has_unfinished_requests():
            sent += [list(o.outputs[0].token_ids) for o in engine.step()]
    finally:
        engine.shutdown()
    assert sent == [ids("w6"), ids("w7 w8 w9 w10"), ids("w11 w12 w13 w14")]


def test_stream_interval_is_checked(model_dir):
    args = EngineArgs(model=str(model_dir), stream_interval=0)
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1, got 0"):
        args.create_engine_config()


def test_request_id_must_be_a_non_empty_string(engine):
    with pytest.raises(TypeError, match="request_id must be a string, got <class 'int'>"):
        engine.add_request(7, {"prompt_token_ids": ids("w1")}, greedy())
    with pytest.raises(ValueError, match="request_id must be a non-empty string"):
        engine.add_request("", {"prompt_token_ids": ids("w1")}, greedy())
    assert_nothing_left(engine)


# ---------------------------------------------------------------------------
# reset_prefix_cache through every client
# ---------------------------------------------------------------------------
def test_reset_prefix_cache_with_running_requests(engine):
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 8, 9]}, greedy(max_tokens=6))
    engine.step()  # r is running and holds blocks
    assert engine.reset_prefix_cache() is False
    # Preempts r (its blocks are freed), then resets; r is recomputed.
    assert engine.reset_prefix_cache(reset_running_requests=True) is True
    assert scheduler(engine).requests[engine.output_processor.external_req_ids["r"][0]]
    (out,) = run(engine)
    assert out.outputs[0].token_ids == [10, 11, 12, 13, 14, 15]


def test_reset_prefix_cache_arguments_cross_the_process_hop(model_dir):
    # The core steps on its own in its process, so nothing stays running
    # here; this checks that both arguments reach EngineCore's utility call.
    args = EngineArgs(
        model=str(model_dir), block_size=4, distributed_executor_backend=CountingExecutor
    )
    engine = LLMEngine.from_engine_args(args, enable_multiprocessing=True)
    try:
        assert engine.reset_prefix_cache(True, False) is True
        assert engine.reset_prefix_cache(reset_running_requests=False) is True
    finally:
        engine.shutdown()

"""AsyncLLM over ZMQ (twin of vllm/v1/engine/async_llm.py).

EngineCore runs in its own process (``AsyncMPClient``); the model is
``SlowCountingExecutor`` (next token = last token + 1, a few ms per step) over
the tiny word vocabulary, so every output is known exactly and long requests
stay in flight long enough to cancel, abort or kill the engine under them.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest
import pytest_asyncio

from engine.engine.arg_utils import EngineArgs
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.v1.engine.async_llm import AsyncLLM
from engine.v1.engine.exceptions import (
    EngineDeadError,
    EngineGenerateError,
    EngineShuttingDownError,
)
from tests.entrypoints.openai.utils import SlowCountingExecutor, pid_exited
from tests.helpers.engine_fixtures import ids
from tests.helpers.leaks import ipc_socket_files, stale_ipc_files
from tests.helpers.tiny_model import make_tiny_model_dir

DELTA = RequestOutputKind.DELTA
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("async_llm") / "tiny")


def make_engine(model_dir, **kwargs) -> AsyncLLM:
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("num_gpu_blocks_override", 512)
    args = EngineArgs(
        model=str(model_dir), distributed_executor_backend=SlowCountingExecutor, **kwargs
    )
    return AsyncLLM.from_engine_args(args)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir):
    previous = os.environ.get("GLASSBOX_TEST_STEP_DELAY_S")
    os.environ["GLASSBOX_TEST_STEP_DELAY_S"] = "0.005"  # read by the child at each step
    engine = make_engine(model_dir)
    try:
        yield engine
    finally:
        engine.shutdown()
        if previous is None:
            os.environ.pop("GLASSBOX_TEST_STEP_DELAY_S", None)
        else:
            os.environ["GLASSBOX_TEST_STEP_DELAY_S"] = previous


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


async def collect(engine: AsyncLLM, prompt, params: SamplingParams, request_id: str):
    return [out async for out in engine.generate(prompt, params, request_id)]


def metric(engine: AsyncLLM, name: str) -> float:
    return {m.name: m.value for m in engine.get_metrics()}[name]


async def wait_idle(engine: AsyncLLM, timeout_s: float = 5.0) -> None:
    """Until the core reports nothing running and every KV block free."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            metric(engine, "glassbox:num_requests_running") == 0
            and metric(engine, "glassbox:num_requests_waiting") == 0
            and metric(engine, "glassbox:kv_cache_usage_perc") == 0.0
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError({m.name: m.value for m in engine.get_metrics()})


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_streamed_deltas_add_up_to_the_final_output(engine):
    params = dict(max_tokens=6)
    deltas = await collect(engine, "w5", greedy(output_kind=DELTA, **params), "delta")
    final = await collect(engine, "w5", greedy(output_kind=FINAL_ONLY, **params), "final")
    cumulative = await collect(engine, "w5", greedy(**params), "cumulative")
    assert len(final) == 1 and final[0].finished
    assert [o.finished for o in deltas][-1] is True and not any(o.finished for o in deltas[:-1])
    assert (
        "".join(o.outputs[0].text for o in deltas)
        == final[0].outputs[0].text
        == " w6 w7 w8 w9 w10 w11"
    )
    assert [t for o in deltas for t in o.outputs[0].token_ids] == ids("w6 w7 w8 w9 w10 w11")
    assert cumulative[-1].outputs[0].text == final[0].outputs[0].text
    assert final[0].outputs[0].finish_reason == "length"
    await wait_idle(engine)


async def test_concurrent_requests_each_get_their_own_stream(engine):
    async def one(i: int):
        outs = await collect(engine, f"w{i}", greedy(max_tokens=4, output_kind=DELTA), f"c{i}")
        return "".join(o.outputs[0].text for o in outs)

    texts = await asyncio.gather(*(one(i) for i in range(24)))
    assert texts == [" " + " ".join(f"w{i + k}" for k in range(1, 5)) for i in range(24)]
    await wait_idle(engine)


async def test_n_samples_are_grouped_under_the_parent_id(engine):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=3, output_kind=FINAL_ONLY)
    (out,) = await collect(engine, "w20", params, "parent")
    assert out.request_id == "parent" and out.finished
    assert [(c.index, c.text) for c in out.outputs] == [(i, " w21 w22 w23") for i in range(3)]
    streamed = await collect(
        engine, "w20", SamplingParams(n=2, temperature=1.0, max_tokens=3, output_kind=DELTA), "p2"
    )
    texts: dict[int, str] = {}
    for o in streamed:
        for c in o.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: " w21 w22 w23", 1: " w21 w22 w23"}
    assert streamed[-1].finished
    await wait_idle(engine)


async def test_stop_string_ends_the_request_in_the_core_too(engine):
    (out,) = await collect(
        engine, "w5", greedy(max_tokens=50, stop=["w8"], output_kind=FINAL_ONLY), "stop"
    )
    assert (out.outputs[0].text, out.outputs[0].finish_reason, out.outputs[0].stop_reason) == (
        " w6 w7 ",
        "stop",
        "w8",
    )
    await wait_idle(engine)


async def test_cancelled_consumer_aborts_the_request_and_frees_its_blocks(engine):
    received = asyncio.Event()

    async def consume():
        async for _ in engine.generate(
            "w1", greedy(max_tokens=240, ignore_eos=True, output_kind=DELTA), "cancel-me"
        ):
            received.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(received.wait(), 5)
    assert metric(engine, "glassbox:num_requests_running") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "cancel-me" not in engine.output_processor.external_req_ids
    assert engine.output_processor.request_states == {}
    await wait_idle(engine)


async def test_external_abort_ends_the_stream_with_finish_reason_abort(engine):
    aborted_before = engine.stat_logger.request_success.get("abort", 0)
    outputs = []

    async def consume():
        async for out in engine.generate(
            "w1", greedy(max_tokens=240, ignore_eos=True, output_kind=DELTA), "abort-me"
        ):
            outputs.append(out)

    task = asyncio.create_task(consume())
    while not outputs:
        await asyncio.sleep(0.01)
    await engine.abort("abort-me")
    await asyncio.wait_for(task, 5)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    streamed = [t for o in outputs for t in o.outputs[0].token_ids]
    assert 0 < len(streamed) < 240
    assert streamed == list(range(ids("w2")[0], ids("w2")[0] + len(streamed)))
    await wait_idle(engine)
    # Counted like any other ending (hardening issue: aborts stayed at 0).
    assert engine.stat_logger.request_success.get("abort") == aborted_before + 1
    text = engine.render_prometheus()
    line = re.search(r'request_success_total\{[^}]*reason="abort"[^}]*\} (\S+)', text)
    assert line is not None and float(line.group(1)) == aborted_before + 1


async def test_bad_requests_fail_alone(engine):
    with pytest.raises(ValueError, match="vocab"):
        await collect(engine, {"prompt_token_ids": [4, 999]}, greedy(), "bad")
    with pytest.raises(ValueError, match="max_model_len"):
        await collect(engine, {"prompt_token_ids": [4] * 256}, greedy(), "long")
    with pytest.raises(ValueError, match="request_id must be a non-empty string"):
        await collect(engine, "w1", greedy(), "")
    assert engine.output_processor.request_states == {}
    assert not engine.errored
    await engine.check_health()


async def test_the_same_id_twice_in_flight(engine):
    """As in vLLM, a user id may be reused while a request under it still
    runs: the core knows each by its own internal id."""
    final = greedy(max_tokens=2, output_kind=FINAL_ONLY)
    first, second = await asyncio.gather(
        collect(engine, "w1", final, "dup"), collect(engine, "w30", final, "dup")
    )
    assert [(o.request_id, o.outputs[0].text) for o in first + second] == [
        ("dup", " w2 w3"),
        ("dup", " w31 w32"),
    ]
    await wait_idle(engine)


async def test_abort_by_the_users_id_ends_every_request_under_it(engine):
    outputs: dict[int, list] = {0: [], 1: []}

    async def consume(k: int, prompt: str):
        async for out in engine.generate(
            prompt, greedy(max_tokens=240, ignore_eos=True, output_kind=DELTA), "twice"
        ):
            outputs[k].append(out)

    tasks = [asyncio.create_task(consume(k, p)) for k, p in enumerate(["w1", "w40"])]
    while not (outputs[0] and outputs[1]):
        await asyncio.sleep(0.01)
    await engine.abort("twice")
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    for outs in outputs.values():
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert engine.output_processor.external_req_ids == {}
    await wait_idle(engine)


async def test_client_id_that_looks_like_a_child_id_does_not_collide(engine):
    """ "0_col" in flight used to take the id of the first child of "col"
    (n=2), which then failed -- and "col" stayed refused for ever."""
    blocker = asyncio.create_task(
        collect(engine, "w1", greedy(max_tokens=30, ignore_eos=True), "0_col")
    )
    await asyncio.sleep(0.02)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=2, output_kind=FINAL_ONLY)
    for _ in range(2):  # and again, once the first "col" is done
        (out,) = await collect(engine, "w20", params, "col")
        assert out.request_id == "col" and [c.text for c in out.outputs] == [" w21 w22"] * 2
    assert (await blocker)[-1].request_id == "0_col"
    await wait_idle(engine)


async def test_a_failed_add_leaves_nothing_behind(engine, monkeypatch):
    """The second child of an n=3 request cannot be sent (say msgpack refuses
    an integer): the child already in the core is aborted and every record in
    the front end -- output state, id mapping, stat entry -- is removed."""
    real_add = engine.engine_core.add_request_async
    calls = []

    async def add_fails_the_second_time(request):
        calls.append(request.request_id)
        if len(calls) == 2:
            raise OverflowError("int too big to convert")
        await real_add(request)

    monkeypatch.setattr(engine.engine_core, "add_request_async", add_fails_the_second_time)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=200, output_kind=FINAL_ONLY)
    with pytest.raises(EngineGenerateError):
        await collect(engine, "w5", params, "big")
    monkeypatch.setattr(engine.engine_core, "add_request_async", real_add)
    op = engine.output_processor
    assert (op.request_states, op.parent_requests, dict(op.external_req_ids)) == ({}, {}, {})
    assert engine.stat_logger._requests == {}
    await wait_idle(engine)
    params.max_tokens = 2
    (out,) = await collect(engine, "w5", params, "big")
    assert len(out.outputs) == 3


async def test_latency_histograms_and_prometheus_text(engine):
    before = {h.name: h.count for h in engine.get_histograms()}
    await asyncio.gather(
        *(collect(engine, f"w{i}", greedy(max_tokens=5), f"h{i}") for i in range(3))
    )
    after = {h.name: h for h in engine.get_histograms()}
    assert (
        after["glassbox:time_to_first_token_seconds"].count
        - before["glassbox:time_to_first_token_seconds"]
        == 3
    )
    assert (
        after["glassbox:e2e_request_latency_seconds"].count
        - before["glassbox:e2e_request_latency_seconds"]
        == 3
    )
    # 5 tokens per request: the first is TTFT, then 4 inter-token gaps.
    assert (
        after["glassbox:inter_token_latency_seconds"].count
        - before["glassbox:inter_token_latency_seconds"]
        == 12
    )
    itl = after["glassbox:inter_token_latency_seconds"]
    assert itl.buckets["+Inf"] == itl.count and itl.sum > 0
    text = engine.render_prometheus()
    for line in (
        "# TYPE glassbox:time_to_first_token_seconds histogram",
        "# TYPE glassbox:inter_token_latency_seconds histogram",
        "# TYPE glassbox:generation_tokens_total counter",
        "# TYPE glassbox:num_requests_running gauge",
    ):
        assert line in text
    assert 'glassbox:time_to_first_token_seconds_bucket{le="+Inf",model_name=' in text


async def test_reset_prefix_cache_is_a_utility_call(engine):
    await collect(engine, "w1 w2 w3 w4 w5 w6 w7 w8 w9", greedy(max_tokens=1), "cache-a")
    (hit,) = await collect(
        engine,
        "w1 w2 w3 w4 w5 w6 w7 w8 w10",
        greedy(max_tokens=1, output_kind=FINAL_ONLY),
        "cache-b",
    )
    assert hit.num_cached_tokens == 8
    assert await engine.reset_prefix_cache() is True
    (miss,) = await collect(
        engine,
        "w1 w2 w3 w4 w5 w6 w7 w8 w11",
        greedy(max_tokens=1, output_kind=FINAL_ONLY),
        "cache-c",
    )
    assert miss.num_cached_tokens == 0


@pytest.mark.asyncio(loop_scope="function")
async def test_killed_engine_fails_pending_and_new_requests(model_dir, monkeypatch):
    monkeypatch.setenv("GLASSBOX_TEST_STEP_DELAY_S", "0.02")
    engine = make_engine(model_dir)
    try:
        pid = engine.engine_core.engine_core_pids[0]
        started = asyncio.Event()

        async def consume(request_id: str):
            async for _ in engine.generate(
                "w1", greedy(max_tokens=240, ignore_eos=True, output_kind=DELTA), request_id
            ):
                started.set()

        pending = [asyncio.create_task(consume(f"k{i}")) for i in range(3)]
        await asyncio.wait_for(started.wait(), 5)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 5)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert time.monotonic() - killed_at < 5
        assert engine.errored
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await collect(engine, "w2", greedy(), "after-death")
        # The gauges tell the truth after the death: nothing runs any more.
        assert metric(engine, "glassbox:num_requests_running") == 0
        assert metric(engine, "glassbox:num_requests_waiting") == 0
        assert metric(engine, "glassbox:engine_dead") == 1
        text = engine.render_prometheus()
        assert re.search(r'request_success_total\{finished_reason="error",[^}]*\} 3\.0', text)
    finally:
        engine.shutdown()
    assert pid_exited(pid)


async def _shut_down_with(engine: AsyncLLM, max_tokens: list[int]) -> tuple[list, float]:
    """Start one DELTA stream per entry, shut down off the loop once all
    streamed a token; returns each stream's (finish_reason, tokens received)
    and the shutdown's duration."""
    started = [asyncio.Event() for _ in max_tokens]

    async def consume(i: int, n: int):
        params = greedy(max_tokens=n, ignore_eos=True, output_kind=DELTA)
        received = 0
        async for out in engine.generate("w1", params, f"s{i}"):
            started[i].set()
            received += len(out.outputs[0].token_ids)
        return out.outputs[0].finish_reason, received

    tasks = [asyncio.create_task(consume(i, n)) for i, n in enumerate(max_tokens)]
    for event in started:
        await asyncio.wait_for(event.wait(), 10)
    begun = time.monotonic()
    await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return results, time.monotonic() - begun


@pytest.mark.asyncio(loop_scope="function")
async def test_shutdown_aborts_what_is_in_flight_and_refuses_new_requests(model_dir, monkeypatch):
    monkeypatch.setenv("GLASSBOX_TEST_STEP_DELAY_S", "0.02")
    engine = make_engine(model_dir)  # shutdown_timeout=0, as vLLM: abort at once
    pid = engine.engine_core.engine_core_pids[0]
    results, took = await _shut_down_with(engine, [240, 240])
    assert [reason for reason, _ in results] == ["abort", "abort"]
    assert took < 5
    assert pid_exited(pid)
    with pytest.raises(EngineShuttingDownError, match="shutting down"):
        await collect(engine, "w2", greedy(), "too-late")
    assert 'finished_reason="abort"' in engine.render_prometheus()


@pytest.mark.asyncio(loop_scope="function")
async def test_shutdown_drains_for_shutdown_timeout_then_aborts(model_dir, monkeypatch):
    monkeypatch.setenv("GLASSBOX_TEST_STEP_DELAY_S", "0.02")
    engine = make_engine(model_dir, shutdown_timeout=1)
    # 12 tokens finish well within the drain; 240 (4.8 s of steps) do not.
    results, took = await _shut_down_with(engine, [12, 240])
    assert results[0] == ("length", 12)
    assert results[1][0] == "abort" and results[1][1] < 240
    assert 0.9 < took < 6


@pytest.mark.asyncio(loop_scope="function")
async def test_shutdown_stops_the_engine_process(model_dir):
    sockets_before = ipc_socket_files()
    engine = make_engine(model_dir)
    (out,) = await collect(engine, "w3", greedy(max_tokens=2, output_kind=FINAL_ONLY), "once")
    assert out.outputs[0].text == " w4 w5"
    pid = engine.engine_core.engine_core_pids[0]
    engine.shutdown()
    deadline = time.monotonic() + 10
    while not pid_exited(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert pid_exited(pid)
    assert not stale_ipc_files(sockets_before)

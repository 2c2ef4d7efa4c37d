"""``AsyncLLM.pause_generation`` / ``resume_generation`` / ``is_paused``
(vLLM's names) and the scheduler's pause states, on ``SlowCountingExecutor``
(next token = last + 1, 20 ms a step) with EngineCore in its own process.

* ``keep``: a request in flight freezes (no token while paused) and finishes
  after the resume with all its tokens; ``is_paused`` says so.
* ``abort``: the request in flight ends with finish_reason "abort"; one sent
  while paused waits and runs after the resume.
* ``wait``: the pause returns only once the request in flight has finished
  (finish_reason "length"); one sent meanwhile waits for the resume.
* A bad mode names the choices. The trace records ``sched.pause``.
* The scheduler alone: PAUSED_NEW schedules the running request but admits
  none; PAUSED_ALL schedules nothing; neither counts what it holds back.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from engine.engine.arg_utils import EngineArgs
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.tracing import Tracer, load_trace
from engine.tracing.core_trace import SchedulerTrace
from engine.v1.core.sched.interface import PauseState
from engine.v1.engine.async_llm import AsyncLLM
from tests.entrypoints.openai.utils import SlowCountingExecutor
from tests.helpers.core import make_request, make_scheduler
from tests.helpers.engine_fixtures import ids
from tests.helpers.tiny_model import make_tiny_model_dir

pytestmark = pytest.mark.asyncio(loop_scope="module")
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pause")
    args = EngineArgs(
        model=str(make_tiny_model_dir(root / "tiny")),
        distributed_executor_backend=SlowCountingExecutor,
        block_size=4,
        num_gpu_blocks_override=128,
    )
    engine = AsyncLLM.from_engine_args(args)
    try:
        yield engine
    finally:
        engine.shutdown()


async def _stream(engine: AsyncLLM, request_id: str, params: SamplingParams, seen: list):
    """Run a request, appending each token count it reaches to ``seen``."""
    params = params.clone()
    params.output_kind = RequestOutputKind.CUMULATIVE
    final = None
    async for out in engine.generate({"prompt_token_ids": ids("w1")}, params, request_id):
        seen.append(len(out.outputs[0].token_ids))
        final = out
    return final.outputs[0]


async def _until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_keep_freezes_a_request_and_resume_finishes_it(engine):
    seen: list[int] = []
    task = asyncio.create_task(_stream(engine, "frozen", LONG, seen))
    await _until(lambda: len(seen) >= 3)
    await engine.pause_generation(mode="keep")
    assert await engine.is_paused()
    await asyncio.sleep(0.05)
    frozen_at = len(seen)
    await asyncio.sleep(0.3)  # 15 steps' time: nothing moves
    assert len(seen) == frozen_at and not task.done()
    await engine.resume_generation()
    assert not await engine.is_paused()
    out = await asyncio.wait_for(task, 10)
    assert len(out.token_ids) == LONG.max_tokens and out.finish_reason == "length"


async def test_abort_ends_the_running_request_and_queues_new_ones(engine):
    seen: list[int] = []
    running = asyncio.create_task(_stream(engine, "aborted", LONG, seen))
    await _until(lambda: len(seen) >= 2)
    await engine.pause_generation(mode="abort")
    out = await asyncio.wait_for(running, 10)
    assert out.finish_reason == "abort" and len(out.token_ids) < LONG.max_tokens
    later: list[int] = []
    queued = asyncio.create_task(_stream(engine, "queued", SHORT, later))
    await asyncio.sleep(0.3)
    assert later == []  # accepted, not scheduled
    await engine.resume_generation()
    out = await asyncio.wait_for(queued, 10)
    assert len(out.token_ids) == SHORT.max_tokens


async def test_wait_returns_once_the_running_request_finished(engine):
    seen: list[int] = []
    running = asyncio.create_task(_stream(engine, "drained", SHORT.clone(), seen))
    await _until(lambda: len(seen) >= 1)
    await engine.pause_generation(mode="wait")
    assert running.done()  # the pause completed only after it
    out = running.result()
    assert out.finish_reason == "length" and len(out.token_ids) == SHORT.max_tokens
    later: list[int] = []
    queued = asyncio.create_task(_stream(engine, "after_wait", SHORT, later))
    await asyncio.sleep(0.2)
    assert later == []
    await engine.resume_generation()
    assert len((await asyncio.wait_for(queued, 10)).token_ids) == SHORT.max_tokens


async def test_a_bad_mode_names_the_choices(engine):
    with pytest.raises(ValueError, match="pause mode must be 'abort', 'wait' or 'keep', got 'x'"):
        await engine.pause_generation(mode="x")
    assert not await engine.is_paused()


def test_the_scheduler_holds_back_what_a_pause_says(tmp_path) -> None:
    # Two prompt tokens a step per request: the first stays mid-prefill.
    scheduler = make_scheduler(
        num_blocks=32, block_size=4, max_model_len=64, long_prefill_token_threshold=2
    )
    tracer = Tracer(str(tmp_path / "trace.jsonl"), "lifecycle")
    scheduler.trace = SchedulerTrace.create(tracer)
    scheduler.add_request(make_request("running", list(range(1, 11)), max_tokens=5, block_size=4))
    assert scheduler.schedule().num_scheduled_tokens == {"running": 2}
    scheduler.add_request(make_request("waiting", [4, 5, 6], max_tokens=5, block_size=4))
    scheduler.set_pause_state(PauseState.PAUSED_NEW)
    assert scheduler.get_num_unfinished_requests() == 1  # the waiting one is held back
    assert scheduler.schedule().num_scheduled_tokens == {"running": 2}
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    assert scheduler.get_num_unfinished_requests() == 0
    assert scheduler.schedule().num_scheduled_tokens == {}
    scheduler.set_pause_state(PauseState.UNPAUSED)
    assert scheduler.get_num_unfinished_requests() == 2
    assert scheduler.schedule().num_scheduled_tokens == {"running": 2, "waiting": 2}
    tracer.close()
    states = [e.state for e in load_trace(str(tmp_path / "trace.jsonl")) if e.kind == "sched.pause"]
    assert states == ["PAUSED_NEW", "PAUSED_ALL", "UNPAUSED"]

"""``EngineCore.step_with_batch_queue`` (twin of vLLM's, in vllm/v1/engine/core.py)
with a recording executor, and how ``async_scheduling`` is resolved.

The executor is ``CountingExecutor`` (next token = last token + 1) split into
vLLM's two phases: ``execute_model`` runs the forward and returns None,
``sample_tokens(non_block=True)`` returns a future that is not done until
someone waits for it (as a device-to-host copy still under way). It logs
every call, and the scheduler's ``schedule`` / ``update_from_output`` are
wrapped to log into the same list, so a test reads the loop's order:

    schedule 1, execute 1, sample 1            (first call: returns None)
    schedule 2, execute 2, sample 2, wait 1, update 1
    schedule 3, execute 3, sample 3, wait 2, update 2 ...

Step N+1 is launched before step N's output is read; never more than two
steps are in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from engine.benchmarks.throughput import engine_args_from_cli as bench_engine_args
from engine.engine.arg_utils import EngineArgs
from engine.entrypoints.cli.main import build_parser
from engine.entrypoints.openai.cli_args import engine_args_from_cli as serve_engine_args
from engine.sampling_params import SamplingParams
from engine.v1.core.sched.async_scheduler import AsyncScheduler
from engine.v1.core.sched.output import SchedulerOutput
from engine.v1.core.sched.scheduler import Scheduler
from engine.v1.engine import FinishReason
from engine.v1.engine.core import EngineCore
from engine.v1.executor.abstract import done_future
from engine.v1.outputs import ModelRunnerOutput
from tests.helpers.counting_executor import CountingExecutor
from tests.helpers.engine_fixtures import ids, make_config, make_engine_core_request, make_llm
from tests.helpers.tiny_model import make_tiny_model_dir

Event = tuple[str, int]  # (call, scheduler step)


class StepFuture(Future):
    """The sampled output of one step. Not done when returned: it completes
    when ``result()`` is called, or -- with the executor's ``gate`` set up --
    on another thread once the gate opens (then ``result()`` really blocks)."""

    def __init__(self, executor: RecordingExecutor, step: int, output: ModelRunnerOutput) -> None:
        super().__init__()
        self.executor, self.step, self.output = executor, step, output
        if executor.gate is not None:
            gate = executor.gate
            threading.Thread(target=lambda: (gate.wait(), self._finish()), daemon=True).start()

    def _finish(self) -> None:
        if self.done():
            return
        if self.step == self.executor.fail_sample_at:
            self.set_exception(RuntimeError(f"sampling failed at step {self.step}"))
        else:
            self.set_result(self.output)

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self.executor.log.append(("wait", self.step))
        if self.executor.gate is None:
            self._finish()
        # Bounded: a loop that waits for the wrong step fails instead of hanging.
        return super().result(timeout=10 if timeout is None else timeout)


class RecordingExecutor(CountingExecutor):
    """CountingExecutor in two phases, logging each call, able to overlap
    steps (as ``UniProcExecutor``: two in flight when async scheduling is on)."""

    fail_forward_at: int | None = None
    fail_sample_at: int | None = None

    def _init_executor(self) -> None:
        super()._init_executor()
        self.log: list[Event] = []
        self.pending: tuple[int, ModelRunnerOutput] | None = None
        self.gate: threading.Event | None = None

    @property
    def max_concurrent_batches(self) -> int:
        return 2 if self.glassbox_config.scheduler_config.async_scheduling else 1

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        step = scheduler_output.step
        self.log.append(("execute", step))

        def forward() -> ModelRunnerOutput | None:
            if step == self.fail_forward_at:
                raise RuntimeError(f"forward failed at step {step}")
            output = CountingExecutor.execute_model(self, scheduler_output)
            if scheduler_output.total_num_scheduled_tokens == 0:
                return output  # nothing to sample: the (empty) output now, as the runner
            assert self.pending is None, "sample_tokens was not called for the last step"
            self.pending = (step, output)
            return None

        return done_future(forward) if non_block else forward()

    def sample_tokens(self, grammar_output: None = None, non_block: bool = False) -> Any:
        assert self.pending is not None
        (step, output), self.pending = self.pending, None
        self.log.append(("sample", step))
        return StepFuture(self, step, output) if non_block else output


class FailingForward(RecordingExecutor):
    fail_forward_at = 2


class FailingSample(RecordingExecutor):
    fail_sample_at = 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("batch_queue") / "tiny")


def make_core(model_dir, executor: type = RecordingExecutor, **kwargs: Any) -> EngineCore:
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("async_scheduling", True)
    core = EngineCore(
        make_config(model_dir, distributed_executor_backend=executor, **kwargs), executor
    )
    log = core.model_executor.log
    scheduler = core.scheduler
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def logged_schedule() -> SchedulerOutput:
        out = schedule()
        log.append(("schedule", out.step))
        return out

    def logged_update(scheduler_output: SchedulerOutput, model_output: Any) -> Any:
        log.append(("update", scheduler_output.step))
        return update(scheduler_output, model_output)

    scheduler.schedule = logged_schedule  # type: ignore[method-assign]
    scheduler.update_from_output = logged_update  # type: ignore[method-assign]
    return core


def req(request_id: str, words: str, max_tokens: int = 3):
    return make_engine_core_request(
        request_id, ids(words), SamplingParams(temperature=0.0, max_tokens=max_tokens)
    )


def call(core: EngineCore) -> tuple[Any, bool, list[Event]]:
    """One step_with_batch_queue; returns its result and the calls it made."""
    log = core.model_executor.log
    start = len(log)
    outputs, model_executed = core.step_with_batch_queue()
    return outputs, model_executed, log[start:]


def tokens(outputs: Any) -> dict[str, tuple[list[int], FinishReason | None]]:
    return {o.request_id: (o.new_token_ids, o.finish_reason) for o in outputs[0].outputs}


def drain(core: EngineCore) -> dict[str, list[int]]:
    """Call until the scheduler and the queue are empty; the tokens each
    request got meanwhile."""
    got: dict[str, list[int]] = {}
    for _ in range(100):
        if not core.scheduler.has_requests() and not core.batch_queue:
            return got
        outputs, _, _ = call(core)
        for o in outputs[0].outputs if outputs else []:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("the loop did not finish")


# ---------------------------------------------------------------------------
# The loop chosen at start-up
# ---------------------------------------------------------------------------
def test_async_executor_gets_the_batch_queue(model_dir):
    core = make_core(model_dir)
    assert core.batch_queue_size == 2
    assert core.batch_queue is not None and core.batch_queue.maxlen == 2
    assert core.step_fn == core.step_with_batch_queue
    assert type(core.scheduler) is AsyncScheduler

    serial = make_core(model_dir, async_scheduling=False)
    assert serial.batch_queue is None
    assert serial.step_fn == serial.step
    assert type(serial.scheduler) is Scheduler


# ---------------------------------------------------------------------------
# step_with_batch_queue
# ---------------------------------------------------------------------------
def test_first_call_launches_and_returns_none(model_dir):
    core = make_core(model_dir)
    core.add_request(req("a", "w5 w6"))
    outputs, model_executed, events = call(core)
    assert (outputs, model_executed) == (None, True)
    assert events == [("schedule", 1), ("execute", 1), ("sample", 1)]
    assert len(core.batch_queue) == 1
    # Nothing consumed: the token is still a placeholder.
    request = core.scheduler.requests["a"]
    assert request.num_output_placeholders == 1
    assert request.output_token_ids == []


def test_order_of_calls(model_dir):
    """schedule / execute / sample step N+1 before waiting for and updating
    from step N; the outputs are the serial loop's."""
    core = make_core(model_dir)
    core.add_request(req("a", "w5 w6", max_tokens=4))
    core.add_request(req("b", "w20", max_tokens=4))

    assert call(core)[2] == [("schedule", 1), ("execute", 1), ("sample", 1)]
    outputs, model_executed, events = call(core)
    assert model_executed is True
    assert events == [
        ("schedule", 2),
        ("execute", 2),
        ("sample", 2),
        ("wait", 1),
        ("update", 1),
    ]
    assert tokens(outputs) == {"a": (ids("w7"), None), "b": (ids("w21"), None)}
    outputs, _, events = call(core)
    assert events == [
        ("schedule", 3),
        ("execute", 3),
        ("sample", 3),
        ("wait", 2),
        ("update", 2),
    ]
    assert tokens(outputs) == {"a": (ids("w8"), None), "b": (ids("w22"), None)}

    rest = drain(core)
    assert rest == {"a": ids("w9 w10"), "b": ids("w23 w24")}
    log = core.model_executor.log
    updated = [s for c, s in log if c == "update"]
    assert updated == sorted(updated)  # oldest first
    for n in updated:
        # Overlap: step n+1 was launched before step n's output was used ...
        if ("sample", n + 1) in log:
            assert log.index(("sample", n + 1)) < log.index(("update", n))
        # ... and never a third step: n+2 waits for step n's update.
        if ("schedule", n + 2) in log:
            assert log.index(("update", n)) < log.index(("schedule", n + 2))
    # Every step with tokens was sampled exactly once and waited for once.
    sampled = [s for c, s in log if c == "sample"]
    assert sampled == sorted(set(sampled)) == [s for c, s in log if c == "wait"]


def test_a_done_step_is_read_at_once(model_dir):
    """If the oldest step is already done the call does not return empty
    handed: it reads it (vLLM's check of ``batch_queue[-1][0].done()``)."""
    core = make_core(model_dir)
    core.add_request(req("a", "w5 w6"))
    core.model_executor.sample_tokens = _sample_done(core.model_executor)  # type: ignore[method-assign]
    outputs, model_executed, events = call(core)
    assert model_executed is True
    assert events == [("schedule", 1), ("execute", 1), ("sample", 1), ("update", 1)]
    assert tokens(outputs) == {"a": (ids("w7"), None)}


def _sample_done(executor: RecordingExecutor) -> Any:
    sample = executor.sample_tokens

    def sample_done(grammar_output: None = None, non_block: bool = False) -> Any:
        output = sample(grammar_output, non_block=False)
        return done_future(lambda: output) if non_block else output

    return sample_done


def test_blocks_on_the_oldest_step_when_nothing_can_be_scheduled(model_dir):
    """max_tokens=2: the second step samples the last token, so once it is in
    flight there is nothing to schedule; the call then waits for it (here
    until another thread completes the copy), and only runs an empty step."""
    core = make_core(model_dir)
    executor = core.model_executor
    core.add_request(req("a", "w5 w6", max_tokens=2))
    # Each step's output completes on another thread once its gate opens.
    gate1 = executor.gate = threading.Event()
    assert call(core)[:2] == (None, True)
    assert not core.batch_queue[0][0].done()
    gate2 = executor.gate = threading.Event()
    gate1.set()
    outputs, _, events = call(core)
    assert events == [("schedule", 2), ("execute", 2), ("sample", 2), ("wait", 1), ("update", 1)]
    assert tokens(outputs) == {"a": (ids("w7"), None)}

    # Step 2 is in flight with a's last token: the third call has nothing to
    # launch, so it waits for step 2 -- until the gate opens, 0.2 s from now.
    (in_flight,) = core.batch_queue
    assert not in_flight[0].done()
    opener = threading.Timer(0.2, gate2.set)
    opener.start()
    start = time.monotonic()
    outputs, model_executed, events = call(core)
    waited = time.monotonic() - start
    assert gate2.is_set() and waited >= 0.15
    assert model_executed is False
    assert events == [("schedule", 3), ("execute", 3), ("wait", 2), ("update", 2)]
    assert executor.steps[-1].total_num_scheduled_tokens == 0  # step 3: empty
    assert tokens(outputs) == {"a": (ids("w8"), FinishReason.LENGTH)}

    assert drain(core) == {}
    assert core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == (
        core.glassbox_config.cache_config.num_gpu_blocks - 1
    )


def test_nothing_to_do(model_dir):
    core = make_core(model_dir)
    assert core.step_with_batch_queue() == (None, False)
    assert core.model_executor.log == []
    core.add_request(req("a", "w5", max_tokens=2))
    assert drain(core) == {"a": ids("w6 w7")}
    assert core.step_with_batch_queue() == (None, False)
    assert not core.scheduler.has_requests() and not core.batch_queue


def test_a_failed_forward_surfaces(model_dir, caplog):
    core = make_core(model_dir, executor=FailingForward)
    core.add_request(req("a", "w5 w6", max_tokens=5))
    assert call(core)[:2] == (None, True)
    with (
        caplog.at_level(logging.ERROR),
        pytest.raises(RuntimeError, match="forward failed at step 2"),
    ):
        core.step_with_batch_queue()
    assert "model execution failed at step 2" in caplog.text


def test_a_failed_sample_surfaces_when_read(model_dir, caplog):
    core = make_core(model_dir, executor=FailingSample)
    core.add_request(req("a", "w5 w6", max_tokens=5))
    assert call(core)[:2] == (None, True)  # launched; the failure is not known yet
    with (
        caplog.at_level(logging.ERROR),
        pytest.raises(RuntimeError, match="sampling failed at step 1"),
    ):
        core.step_with_batch_queue()
    assert "model execution failed at step 1" in caplog.text


# ---------------------------------------------------------------------------
# Resolving async_scheduling (GlassboxConfig, as vLLM's VllmConfig)
# ---------------------------------------------------------------------------
def test_default_is_async_on_the_uni_executor(model_dir):
    config = EngineArgs(model=str(model_dir)).create_engine_config()
    assert config.scheduler_config.async_scheduling is True
    assert config.scheduler_config.get_scheduler_cls() is AsyncScheduler
    off = EngineArgs(model=str(model_dir), async_scheduling=False).create_engine_config()
    assert off.scheduler_config.async_scheduling is False
    assert off.scheduler_config.get_scheduler_cls() is Scheduler


def test_llm_default_runs_the_batch_queue(model_dir):
    llm = make_llm(
        model_dir,
        executor="uni",
        load_format="dummy",
        device="cpu",
        dtype="float32",
        hf_overrides={"intermediate_size": 32},
    )
    try:
        core = llm.llm_engine.engine_core.engine_core
        assert llm.llm_engine.glassbox_config.scheduler_config.async_scheduling is True
        assert core.step_fn == core.step_with_batch_queue and core.batch_queue_size == 2
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        engine.add_request("r", {"prompt_token_ids": ids("w1 w2 w3")}, params)
        finished = []
        for _ in range(20):  # a bounded LLM.generate: a broken loop fails, not hangs
            finished += [o for o in engine.step() if o.finished]
            if not engine.has_unfinished_requests():
                break
        (out,) = finished
        assert len(out.outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_executor_without_async_support_resolves_off(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.config.glassbox"):
        config = make_config(model_dir)  # CountingExecutor: no supports_async_scheduling
    assert config.scheduler_config.async_scheduling is False
    assert "CountingExecutor" in caplog.text and "does not support" in caplog.text
    core = EngineCore(config, CountingExecutor)
    assert core.batch_queue is None and core.step_fn == core.step


def test_async_scheduling_forced_on_an_executor_without_support(model_dir):
    with pytest.raises(ValueError, match="async_scheduling"):
        make_config(model_dir, async_scheduling=True)


@pytest.mark.parametrize(
    ("argv", "to_engine_args"),
    [(["serve"], serve_engine_args), (["bench", "latency"], bench_engine_args)],
)
def test_cli_flags(argv, to_engine_args, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([*argv, "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--async-scheduling, --no-async-scheduling" in help_text
    for flag, value in (
        ([], None),
        (["--async-scheduling"], True),
        (["--no-async-scheduling"], False),
    ):
        args = parser.parse_args([*argv, *flag])
        assert args.async_scheduling is value
        assert to_engine_args(args).async_scheduling is value

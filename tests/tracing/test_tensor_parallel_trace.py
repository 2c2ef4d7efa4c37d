"""The trace of a tensor-parallel run (TP=2, ``mp`` executor, the tiny 2-layer
Llama on the CPU), recorded twice: EngineCore in the test's process with
async scheduling, and in a process of its own with the serial loop.

* every event a worker process writes carries its ``tp_rank``; each step's
  ``execute_model`` is received and done once per rank, with 2 all-reduces
  per layer plus the embedding's and one all-gather of the logits; only
  rank 0 answers and records the runner's events;
* the replay's ``StepView.ranks`` gives one ``RankStep`` per rank, agreeing
  with the events, and rank 0's forward fills the step's phases;
* the Perfetto export has a ``worker TP<rank>`` process per rank with a slice
  per call, flows from the engine to each rank and back;
* the TUI's runner panel shows a line per rank (and nothing new with one rank).
"""

from __future__ import annotations

import glob
import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from engine import LLM, SamplingParams
from engine.tracing import (
    RankStep,
    RunnerBatch,
    RunnerForward,
    SamplerSampled,
    SchedStep,
    TraceReplay,
    WorkerRpcDone,
    WorkerRpcReceived,
    build_perfetto,
    load_trace,
    rpc_calls,
)
from engine.v1.engine.utils import ENABLE_MULTIPROCESSING_ENV
from tests.helpers.hf_checkpoints import TINY_CONFIG, save_tiny_checkpoint
from tests.tracing.test_trace_perfetto import validate_trace_events
from tests.tui.pilot_helpers import assert_panels_match_replay, wait_ready
from tui.app import TraceApp
from tui.session import open_session
from tui.widgets.common import StepContext
from tui.widgets.runner import RunnerPanel, render_runner

TP = 2
NUM_LAYERS = TINY_CONFIG["num_hidden_layers"]
# Per forward: after o_proj and down_proj in each layer, and the embedding.
ALL_REDUCES = 2 * NUM_LAYERS + 1
SMALL_TRACE = Path(__file__).parents[1] / "tui" / "data" / "small_trace.jsonl"
RANK_LINE = re.compile(
    r"^TP(\d) recv [+-]\d+\.\d\d ms  exec \d+\.\d ms  (\d+) all-reduce / (\d+) all-gather "
    r"\d+\.\d ms(  \(answered\))?$",
    re.MULTILINE,
)
# A narrow panel's table of the same numbers: TP0✓ +0.49 23.9 5/1 18.1
RANK_ROW = re.compile(r"^TP(\d)(✓| ) +[+-]\d+\.\d\d +\d+\.\d +(\d+)/(\d+) +\d+\.\d$", re.MULTILINE)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, str]:
    """{"in_process": path, "multiprocess": path}: two requests of 4 tokens
    each, one with a 20-token prompt prefilled in two chunks."""
    folder = tmp_path_factory.mktemp("tp-trace")
    model = folder / "llama"
    save_tiny_checkpoint("llama", model, seed=0)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [7] * 20}]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = {}
    for name, multiprocess, async_scheduling in (
        ("in_process", "0", True),
        ("multiprocess", "1", False),
    ):
        path = str(folder / f"{name}.jsonl")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(ENABLE_MULTIPROCESSING_ENV, multiprocess)
            llm = LLM(
                str(model),
                tensor_parallel_size=TP,
                distributed_executor_backend="mp",
                skip_tokenizer_init=True,
                max_model_len=64,
                max_num_batched_tokens=16,  # the long prompt in two chunks
                num_gpu_blocks_override=32,
                async_scheduling=async_scheduling,
                trace_path=path,
                trace_level="lifecycle",
            )
            try:
                llm.generate(prompts, params, use_tqdm=False)
            finally:
                llm.shutdown()
        # The front end merged every process's part at shutdown, in-process too.
        assert not glob.glob(glob.escape(path) + ".*.part")
        out[name] = path
    return out


@pytest.fixture(scope="module", params=["in_process", "multiprocess"])
def trace(request, traces) -> str:
    return traces[request.param]


def _executed_steps(events) -> list[int]:
    """Steps whose forward ran (tokens scheduled)."""
    return [e.step for e in events if type(e) is SchedStep and e.total_num_scheduled_tokens]


def test_every_worker_event_carries_its_rank(trace):
    events = load_trace(trace)
    engine_pid = next(e.pid for e in events if e.kind == "kv.init")
    worker_pids: dict[int, set[int]] = {}
    for e in events:
        if e.kind.startswith(("worker.", "runner.", "sampler.")):
            assert e.tp_rank in (0, 1), e
            worker_pids.setdefault(e.tp_rank, set()).add(e.pid)
        if e.pid == engine_pid:
            assert e.tp_rank is None, e
    # One process per rank, neither the engine's.
    assert sorted(worker_pids) == [0, 1]
    assert all(len(pids) == 1 for pids in worker_pids.values())
    assert engine_pid not in worker_pids[0] | worker_pids[1]
    assert worker_pids[0] != worker_pids[1]


def test_each_step_is_received_and_done_once_per_rank(trace):
    events = load_trace(trace)
    executed = _executed_steps(events)
    scheduled = [e.step for e in events if type(e) is SchedStep]
    assert len(executed) >= 5
    for kind in (WorkerRpcReceived, WorkerRpcDone):
        calls = sorted(
            (e.step, e.tp_rank) for e in events if type(e) is kind and e.method == "execute_model"
        )
        assert calls == sorted((s, r) for s in scheduled for r in range(TP)), kind
    for e in events:
        if type(e) is not WorkerRpcDone or e.method != "execute_model":
            continue
        assert e.replied is (e.tp_rank == 0), e
        assert e.seconds > 0 and 0 <= e.collective_seconds <= e.seconds
        if e.step in executed:
            assert (e.all_reduce_count, e.all_gather_count) == (ALL_REDUCES, 1), e
            assert e.collective_bytes > 0
        else:  # an empty step (it only told the workers what finished)
            assert (e.all_reduce_count, e.all_gather_count) == (0, 0), e
    # sample_tokens follows each executed step's execute_model on every rank.
    calls = rpc_calls(events)
    for rank in range(TP):
        mine = [c for c in calls if c.tp_rank == rank and c.step is not None]
        sampled = [c.step for c in mine if c.method == "sample_tokens"]
        assert sampled == executed, rank
        for before, call in zip(mine, mine[1:]):
            if call.method == "sample_tokens":
                assert (before.method, before.step) == ("execute_model", call.step)
        assert all(c.done is not None for c in calls)


def test_only_rank_0_records_the_runner(trace):
    events = load_trace(trace)
    executed = _executed_steps(events)
    for kind in (RunnerBatch, RunnerForward, SamplerSampled):
        mine = [e for e in events if type(e) is kind]
        assert mine and {e.tp_rank for e in mine} == {0}, kind
    assert sorted(e.step for e in events if type(e) is RunnerBatch) == executed
    assert sum(e.kind == "runner.init" for e in events) == 1


def test_replay_gives_each_ranks_share_of_a_step(trace):
    events = load_trace(trace)
    replay = TraceReplay(events)
    assert replay.tp_ranks == [0, 1]
    executed = set(_executed_steps(events))
    received = {
        (e.step, e.tp_rank): e
        for e in events
        if type(e) is WorkerRpcReceived and e.method == "execute_model"
    }
    done = {
        (e.step, e.tp_rank): e
        for e in events
        if type(e) is WorkerRpcDone and e.method == "execute_model"
    }
    assert replay.ranks_at(0) == []
    for step in replay.steps[1:]:
        view = replay.view(step)
        ranks = view.ranks
        assert ranks == replay.ranks_at(step)
        assert [type(r) for r in ranks] == [RankStep] * TP
        assert [r.tp_rank for r in ranks] == [0, 1]
        assert [r.replied for r in ranks] == [True, False]
        assert ranks[0].pid != ranks[1].pid != replay.engine_pid
        launched = view.phases.launched_ts
        for r in ranks:
            rec, end = received[(step, r.tp_rank)], done[(step, r.tp_rank)]
            assert r.pid == rec.pid and r.received_ts == rec.ts
            assert r.received_after_launch_ms == pytest.approx((rec.ts - launched) / 1e6)
            assert r.execute_seconds == end.seconds
            if step in executed:
                assert (r.all_reduce_count, r.all_gather_count) == (ALL_REDUCES, 1)
                assert r.sample_seconds is not None and r.sample_seconds > 0
                # The forward's collectives are inside its execute_model.
                assert 0 < r.collective_seconds <= r.execute_seconds + r.sample_seconds
                assert r.collective_bytes == end.collective_bytes
            else:
                assert r.sample_seconds is None and r.all_reduce_count == 0
        if step in executed:
            # Rank 0's runner.forward gives the step's forward phase.
            forward = next(e for e in view.events if type(e) is RunnerForward)
            assert view.phases.forward_ns == forward.duration_ns
            assert view.batch_source == "runner" and view.sampler


def test_a_single_rank_trace_has_no_ranks():
    replay = TraceReplay(str(SMALL_TRACE))
    assert replay.tp_ranks == []
    assert all(replay.view(step).ranks == [] for step in (0, 4, 31))


def test_perfetto_has_a_process_per_rank_with_a_slice_per_call(trace):
    events = load_trace(trace)
    doc = build_perfetto(events)
    validate_trace_events(doc)
    trace_events = doc["traceEvents"]
    names = {
        ev["pid"]: ev["args"]["name"]
        for ev in trace_events
        if ev["ph"] == "M" and ev["name"] == "process_name"
    }
    pids = {}
    for e in events:
        if e.tp_rank is not None:
            pids[e.tp_rank] = e.pid
    assert sorted(pids) == [0, 1]
    for rank, pid in pids.items():
        assert names[pid] == f"worker TP{rank} (pid {pid})"
    engine_pid = next(e.pid for e in events if e.kind == "kv.init")
    assert not names[engine_pid].startswith("worker")
    rpc_slices = [ev for ev in trace_events if ev["ph"] == "X" and ev["args"].get("method")]
    calls = [e for e in events if type(e) is WorkerRpcReceived]
    assert len(rpc_slices) == len(calls)
    executed = _executed_steps(events)
    for rank, pid in pids.items():
        mine = {ev["name"]: ev for ev in rpc_slices if ev["pid"] == pid}
        for step in executed:
            forward = mine[f"execute_model step {step}"]
            assert forward["args"]["all_reduce_count"] == ALL_REDUCES
            assert forward["args"]["all_gather_count"] == 1
            assert forward["args"]["replied"] is (rank == 0)
            assert forward["dur"] > 0
            assert f"sample_tokens step {step}" in mine
        threads = {
            ev["args"]["name"]
            for ev in trace_events
            if ev["ph"] == "M" and ev["name"] == "thread_name" and ev["pid"] == pid
        }
        assert "rpcs" in threads and ("model runner" in threads) is (rank == 0)
    # Flows: the SchedulerOutput from the engine to every rank, each step;
    # the ModelRunnerOutput back from rank 0 once per step it answered.
    flows = [ev for ev in trace_events if ev["ph"] in "sf" and ev.get("cat") == "rpc"]
    starts = [ev for ev in flows if ev["ph"] == "s"]
    finishes = {ev["id"]: ev for ev in flows if ev["ph"] == "f"}
    scheduled = sum(type(e) is SchedStep for e in events)
    out = [s for s in starts if s["name"] == "SchedulerOutput"]
    assert len(out) == TP * scheduled
    assert all(s["pid"] == engine_pid for s in out)
    assert sorted(finishes[s["id"]]["pid"] for s in out) == sorted([*pids.values()] * scheduled)
    back = [s for s in starts if s["name"] == "ModelRunnerOutput"]
    assert len(back) == sum(e.kind == "engine.output_ready" for e in events)
    assert all(s["pid"] == pids[0] and finishes[s["id"]]["pid"] == engine_pid for s in back)


def _plain(renderable, width: int = 120) -> str:
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_runner_panel_shows_a_line_per_rank(trace):
    session = open_session(trace)
    executed = _executed_steps(session.events)
    for step in executed:
        view = session.view(step)
        text = _plain(render_runner(StepContext(session, step, view, None), 116))
        lines = RANK_LINE.findall(text)
        assert [(int(r), int(ar), int(ag), bool(a)) for r, ar, ag, a in lines] == [
            (0, ALL_REDUCES, 1, True),
            (1, ALL_REDUCES, 1, False),
        ], text
        assert "Tensor parallel · 2 ranks" in text
        assert "ModelRunnerOutput from TP0" in text
        # The engine loop draws rank 0's forward.
        assert "Engine loop" in text and "█" in text.split("Engine loop")[1].split("█forward")[0]
        # Too narrow for the lines (the default layout's panel): a table.
        text = _plain(render_runner(StepContext(session, step, view, None), 27), 27)
        assert not RANK_LINE.search(text)
        rows = RANK_ROW.findall(text)
        assert [(int(r), a == "✓", int(ar), int(ag)) for r, a, ar, ag in rows] == [
            (0, True, ALL_REDUCES, 1),
            (1, False, ALL_REDUCES, 1),
        ], text
    small = open_session(str(SMALL_TRACE))
    for step in (4, 31):
        text = _plain(render_runner(StepContext(small, step, small.view(step), None), 116))
        assert "Tensor parallel" not in text and not RANK_LINE.search(text)
        assert not RANK_ROW.search(
            _plain(render_runner(StepContext(small, step, small.view(step), None), 27), 27)
        )


@pytest.mark.asyncio
async def test_the_app_replays_a_tensor_parallel_trace(traces):
    path = traces["multiprocess"]
    replay = TraceReplay(path)
    app = TraceApp(path)
    async with app.run_test(size=(140, 50)) as pilot:
        await wait_ready(app, pilot)
        assert app.error is None
        await pilot.press("home")
        for _ in range(replay.last_step + 1):
            assert_panels_match_replay(app, replay, app.session)
            runner = app.query_one(RunnerPanel).plain_text()
            ranks = replay.ranks_at(app.step)
            assert len(RANK_ROW.findall(runner)) == len(ranks), runner  # a narrow panel
            await pilot.press("right")
        assert app.step == replay.last_step

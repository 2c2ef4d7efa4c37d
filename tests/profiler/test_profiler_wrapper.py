"""Profiling windows: ``ProfilerConfig`` checks, the worker profiler's step
counting, and ``LLM.start_profile`` / ``stop_profile`` writing a torch trace
per rank whose steps carry vLLM's prompt/generation labels."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config.profiler import ProfilerConfig
from engine.profiler.wrapper import TorchProfilerWrapper, WorkerProfiler
from engine.tracing import load_trace
from engine.tracing.perfetto import build_perfetto
from engine.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.v1.utils import IterationDetails, compute_iteration_details
from tests.helpers.hf_checkpoints import save_tiny_checkpoint

ENGINE = {
    "skip_tokenizer_init": True,
    "max_model_len": 64,
    "num_gpu_blocks_override": 32,
    "dtype": "float32",
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# torch cannot always read Python-stack event names back for the op table
# (profiler_out_<rank>.txt), which these tests check.
NO_STACKS = {"torch_profiler_with_stack": False}


# ---------------------------------------------------------------------------
# ProfilerConfig
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"profiler": "nsys"}, r"profiler must be 'torch', 'cuda' or None, got 'nsys'"),
        ({"profiler": "torch"}, r"torch_profiler_dir is required with profiler='torch'"),
        ({"torch_profiler_dir": "/tmp/x"}, r"torch_profiler_dir is only used with profiler="),
        ({"profiler": "cuda", "delay_iterations": -1}, r"delay_iterations must be an int >= 0"),
        ({"profiler": "cuda", "max_iterations": 1.5}, r"max_iterations must be an int >= 0"),
        ({"profiler": "cuda", "active_iterations": 0}, r"active_iterations must be an int >= 1"),
        (
            {"profiler": "torch", "torch_profiler_dir": "gs://bucket/traces"},
            r"must be a local folder, got 'gs://bucket/traces'",
        ),
        ({"profiler": "torch", "torch_dir": "/tmp"}, r"unknown field\(s\) \['torch_dir'\]"),
        ([], r"profiler_config must be a JSON object \(a dict\), got list"),
    ],
)
def test_bad_profiler_config_names_the_field(values, message) -> None:
    with pytest.raises(ValueError, match=message):
        ProfilerConfig.from_dict(values)


def test_profiler_dir_is_made_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = ProfilerConfig(profiler="torch", torch_profiler_dir="traces")
    assert config.torch_profiler_dir == str(tmp_path / "traces")
    assert ProfilerConfig().profiler is None  # off unless asked


# ---------------------------------------------------------------------------
# The window's step counting
# ---------------------------------------------------------------------------
class RecordingProfiler(WorkerProfiler):
    """Records which engine steps ran while the profiler was on."""

    def __init__(self, config: ProfilerConfig) -> None:
        super().__init__(config)
        self.calls: list[str] = []

    def _start(self) -> None:
        self.calls.append("start")

    def _stop(self) -> None:
        self.calls.append("stop")


def _run_steps(profiler: RecordingProfiler, first: int, last: int) -> list[int]:
    recorded = []
    for step in range(first, last + 1):
        profiler.step()
        if profiler.is_running:
            recorded.append(step)
    return recorded


@pytest.mark.parametrize(
    ("delay", "max_iters", "want"),
    [
        (0, 0, [1, 2, 3, 4, 5, 6]),
        (2, 0, [3, 4, 5, 6]),  # two steps pass unrecorded
        (0, 3, [1, 2, 3]),  # stops by itself after three
        (1, 2, [2, 3]),
    ],
)
def test_delay_and_max_iterations_count_engine_steps(delay, max_iters, want) -> None:
    config = ProfilerConfig(profiler="cuda", delay_iterations=delay, max_iterations=max_iters)
    profiler = RecordingProfiler(config)
    assert _run_steps(profiler, 1, 2) == []  # before start_profile: nothing
    profiler.start()
    profiler.start()  # a second start while on is ignored
    assert _run_steps(profiler, 1, 6) == want
    profiler.stop()
    profiler.stop()  # a second stop is ignored
    assert profiler.calls == ["start", "stop"]
    # A second window counts from its own start.
    profiler.start()
    assert _run_steps(profiler, 1, 6) == want
    profiler.shutdown()
    assert profiler.calls == ["start", "stop"] * 2 and not profiler.is_running


def _labelled_window(profiler: TorchProfilerWrapper, traces: list, name: str) -> set[str]:
    """Six labelled steps in one window; the labels its trace kept."""
    import torch

    profiler.start()
    for step in range(1, 7):
        profiler.step()
        with profiler.annotate_context_manager(f"{name}_{step}"):
            torch.ones(4).add_(1)
    profiler.stop()
    return {e.key for e in traces[-1].key_averages() if e.key.startswith(f"{name}_")}


def test_a_schedule_keeps_only_its_active_steps(tmp_path) -> None:
    config = ProfilerConfig(
        profiler="torch",
        torch_profiler_dir=str(tmp_path),
        wait_iterations=1,
        warmup_iterations=1,
        active_iterations=2,
        torch_profiler_with_stack=False,
    )
    traces: list = []
    profiler = TorchProfilerWrapper(config, "w", 1, ["CPU"], on_trace_ready=traces.append)
    # Wait 1 step, warm up 1, then record 2.
    assert _labelled_window(profiler, traces, "step") == {"step_3", "step_4"}
    assert len(traces) == 1
    assert (tmp_path / "profiler_out_1.txt").read_text().strip()
    # A second window runs the schedule again.
    assert _labelled_window(profiler, traces, "again") == {"again_3", "again_4"}
    assert len(traces) == 2


def test_an_unreadable_event_name_costs_only_the_op_table(tmp_path, monkeypatch, caplog) -> None:
    config = ProfilerConfig(profiler="torch", torch_profiler_dir=str(tmp_path))
    traces = []
    profiler = TorchProfilerWrapper(config, "w", 0, ["CPU"], on_trace_ready=traces.append)

    def unreadable(_profiler):
        raise UnicodeDecodeError("utf-8", b"\xfe", 0, 1, "invalid start byte")

    monkeypatch.setattr(profiler, "_op_table", unreadable)
    profiler.start()
    profiler.step()
    profiler.stop()
    assert len(traces) == 1 and not profiler.is_running  # the trace was still handed on
    assert not (tmp_path / "profiler_out_0.txt").exists()
    assert "No op table: torch could not read an event's name" in caplog.text


# ---------------------------------------------------------------------------
# A step's label
# ---------------------------------------------------------------------------
def test_iteration_details_split_prompt_and_generation_work() -> None:
    new = NewRequestData("a", [1] * 10, SamplingParams(), ([0],), 0)
    cached = CachedRequestData(
        req_ids=["b", "c", "d"],
        new_block_ids=[None] * 3,
        num_computed_tokens=[8, 20, 30],
        num_output_tokens=[0, 3, 1],  # b is still in its prompt (a later chunk)
    )
    output = SchedulerOutput(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"a": 10, "b": 8, "c": 1, "d": 3},
        total_num_scheduled_tokens=22,
        num_common_prefix_blocks=[0],
        finished_req_ids=set(),
    )
    assert compute_iteration_details(output) == IterationDetails(2, 18, 2, 4)


# ---------------------------------------------------------------------------
# Through the engine
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("profiler") / "llama"
    save_tiny_checkpoint("llama", path, seed=3)
    return str(path)


def _step_labels(trace: Path) -> list[str]:
    events = json.load(gzip.open(trace))["traceEvents"]
    return [e["name"] for e in events if e.get("name", "").startswith("execute_context_")]


def test_llm_profile_windows_write_one_trace_each(checkpoint, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "max_iterations": 3}
    config |= NO_STACKS
    trace = tmp_path / "glassbox" / "run.jsonl"
    llm = LLM(checkpoint, profiler_config=config, trace_path=str(trace), **ENGINE)
    try:
        prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
        llm.generate([prompt], GREEDY, use_tqdm=False)  # before any window: not recorded
        llm.start_profile("first")
        llm.generate([prompt], GREEDY, use_tqdm=False)
        llm.stop_profile()
        (first,) = tmp_path.glob("first_tp0_rank0.*.pt.trace.json.gz")
        # max_iterations=3: the prefill step and two decode steps.
        assert _step_labels(first) == [
            "execute_context_1(5)_generation_0(0)",
            "execute_context_0(0)_generation_1(1)",
            "execute_context_0(0)_generation_1(1)",
        ]
        assert (tmp_path / "profiler_out_0.txt").exists()
        # A second window keeps the first window's name, in a file of its own.
        llm.start_profile("ignored")
        llm.generate([prompt], GREEDY, use_tqdm=False)
        llm.stop_profile()
        assert len(list(tmp_path.glob("first_tp0_rank0.*.pt.trace.json.gz"))) == 2
        assert not list(tmp_path.glob("ignored*"))
        llm.start_profile()  # left open: shutdown writes it
    finally:
        llm.shutdown()
    assert len(list(tmp_path.glob("first_tp0_rank0.*.pt.trace.json.gz"))) == 3
    # The Glassbox trace marks the windows among its steps (engine.profile).
    events = load_trace(str(trace))
    marks = [(e.is_start, e.profile_prefix) for e in events if e.kind == "engine.profile"]
    assert marks == [(True, "first"), (False, None), (True, "ignored"), (False, None), (True, None)]
    start = next(e for e in events if e.kind == "engine.profile")
    first_profiled = next(e for e in events if e.kind == "sched.step" and e.ts > start.ts)
    assert list(first_profiled.num_scheduled_tokens.values()) == [5]  # the profiled prefill
    assert first_profiled.new_req_ids
    instants = [e for e in build_perfetto(events)["traceEvents"] if e["name"] == "engine.profile"]
    assert [e["args"]["is_start"] for e in instants] == [True, False, True, False, True]


def test_profiling_without_a_profiler_config_is_refused(checkpoint, monkeypatch) -> None:
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(checkpoint, **ENGINE)
    try:
        with pytest.raises(RuntimeError, match="profiling is off: start the engine with profiler"):
            llm.start_profile()
        # The engine keeps serving.
        assert (
            len(
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)[0]
                .outputs[0]
                .token_ids
            )
            == 6
        )
    finally:
        llm.shutdown()


def test_the_cuda_profiler_needs_a_cuda_device(checkpoint, monkeypatch) -> None:
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match=r"profiler='cuda' needs a CUDA device; use 'torch'"):
        LLM(checkpoint, profiler_config={"profiler": "cuda"}, device="cpu", **ENGINE)


def test_every_tensor_parallel_rank_writes_its_trace(checkpoint, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path)} | NO_STACKS
    llm = LLM(checkpoint, tensor_parallel_size=2, profiler_config=config, **ENGINE)
    try:
        llm.start_profile()
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], GREEDY, use_tqdm=False)
        llm.stop_profile()
    finally:
        llm.shutdown()
    labels = {}
    for rank in (0, 1):
        (trace,) = tmp_path.glob(f"tp{rank}_rank{rank}.*.pt.trace.json.gz")
        labels[rank] = _step_labels(trace)
        assert (tmp_path / f"profiler_out_{rank}.txt").exists()
    assert labels[0] == labels[1]  # every rank runs every step
    prefill, *rest = labels[0]
    assert prefill == "execute_context_1(4)_generation_0(0)"
    decodes = [label for label in rest if label == "execute_context_0(0)_generation_1(1)"]
    assert len(decodes) == GREEDY.max_tokens - 1
    # The rest: steps with nothing scheduled (the worker still drops the
    # finished request's state), which async scheduling may run.
    assert set(rest) - set(decodes) <= {"execute_context_0(0)_generation_0(0)"}
    assert sorted(os.listdir(tmp_path)) == sorted(
        [p.name for p in tmp_path.glob("*.gz")] + ["profiler_out_0.txt", "profiler_out_1.txt"]
    )

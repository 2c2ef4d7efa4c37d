"""EngineCore in its own process (twin of vllm/v1/engine/core.py
``EngineCoreProc`` and core_client.py ``SyncMPClient``).

Shown here: ``LLM`` runs EngineCore in a child process by default and gives
exactly the outputs of the in-process engine (the real-model comparison is
in tests/entrypoints/openai/test_real_model.py); the ZMQ protocol (add / abort /
utility frames, the ready message); engine death (SIGKILL, or an exception
inside the core) fails pending and new requests fast with ``EngineDeadError``;
no EngineCore process outlives its front end -- after shutdown, after garbage
collection, or after the front end is SIGKILLed -- and leaves no ipc socket
file behind in any of these cases; and a multi-process trace merges both
processes' hop events.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from engine.entrypoints.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tracing import load_trace
from engine.tracing.events import TraceEvent
from engine.v1.engine.core_client import EngineCoreClient, InprocClient, SyncMPClient
from engine.v1.engine.exceptions import EngineDeadError
from tests.entrypoints.openai.utils import (
    ExplodingExecutor,
    FailingInitExecutor,
    SlowCountingExecutor,
    pid_exited,
    wait_until,
)
from tests.helpers.counting_executor import CountingExecutor
from tests.helpers.engine_fixtures import ids, make_config, make_engine_core_request
from tests.helpers.leaks import ipc_socket_files, stale_ipc_files
from tests.helpers.tiny_model import make_tiny_model_dir

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("core_proc") / "tiny")


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def make_llm(
    model_dir, multiprocess: bool, monkeypatch, executor=CountingExecutor, **kwargs
) -> LLM:
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1" if multiprocess else "0")
    kwargs.setdefault("block_size", 4)
    return LLM(str(model_dir), distributed_executor_backend=executor, **kwargs)


def summary(outputs) -> list:
    return [
        (
            o.request_id,
            o.prompt,
            o.prompt_token_ids,
            o.num_cached_tokens,
            o.finished,
            [
                (
                    c.index,
                    c.text,
                    list(c.token_ids),
                    c.cumulative_logprob,
                    c.logprobs,
                    c.finish_reason,
                    c.stop_reason,
                )
                for c in o.outputs
            ],
        )
        for o in outputs
    ]


def core_pid(llm: LLM) -> int:
    client = llm.llm_engine.engine_core
    assert isinstance(client, SyncMPClient)
    (pid,) = client.engine_core_pids
    return pid


# ---------------------------------------------------------------------------
# Multi-process is the default, and it changes nothing in the outputs
# ---------------------------------------------------------------------------
def test_llm_uses_the_multiprocess_client_by_default(model_dir, monkeypatch):
    monkeypatch.delenv("GLASSBOX_ENABLE_MULTIPROCESSING", raising=False)
    llm = LLM(str(model_dir), distributed_executor_backend=CountingExecutor, block_size=4)
    try:
        assert isinstance(llm.llm_engine.engine_core, SyncMPClient)
        pid = core_pid(llm)
        assert pid != os.getpid() and not pid_exited(pid)
        # The block count decided in the child reached the front end's config.
        assert llm.llm_engine.glassbox_config.cache_config.num_gpu_blocks == 256
    finally:
        llm.shutdown()
    assert wait_until(lambda: pid_exited(pid), 5)


def test_switch_to_in_process(model_dir, monkeypatch):
    llm = make_llm(model_dir, multiprocess=False, monkeypatch=monkeypatch)
    assert isinstance(llm.llm_engine.engine_core, InprocClient)
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "maybe")
    with pytest.raises(ValueError, match="GLASSBOX_ENABLE_MULTIPROCESSING"):
        LLM(str(model_dir), distributed_executor_backend=CountingExecutor)


BATCH = [
    "w1 w2 w3 w4 w5 w6 w7 w8 w9",
    "w1 w2 w3 w4 w5 w6 w7 w8 w20",  # shares two blocks with the first
    {"prompt_token_ids": ids("w40 w41")},
    "w55",  # wraps around the vocabulary into EOS
    "w10",
]
PARAMS = [
    greedy(max_tokens=6, logprobs=2),
    greedy(max_tokens=4),
    SamplingParams(n=3, temperature=0.8, max_tokens=3, seed=7),
    greedy(max_tokens=20),
    greedy(max_tokens=10, stop=["w14"]),
]


def test_multiprocess_and_in_process_give_identical_outputs(model_dir, monkeypatch):
    results = {}
    for multiprocess in (False, True):
        llm = make_llm(model_dir, multiprocess, monkeypatch)
        try:
            first = llm.generate(BATCH, PARAMS, use_tqdm=False)
            # Prefix-cache hits and later request ids behave the same too.
            second = llm.generate(BATCH[:2], PARAMS[:2], use_tqdm=False)
            chat = llm.chat(
                [{"role": "user", "content": "w3 w4"}], greedy(max_tokens=3), use_tqdm=False
            )
            results[multiprocess] = summary(first) + summary(second) + summary(chat)
        finally:
            llm.shutdown()
    assert results[True] == results[False]
    texts = [entry[5][0][1] for entry in results[True][:5]]
    assert texts == [
        " w10 w11 w12 w13 w14 w15",
        " w21 w22 w23 w24",
        " w42 w43 w44",
        " w56 w57 w58 w59 system user assistant",
        " w11 w12 w13 ",
    ]
    assert results[True][6][3] == 8  # the repeated prompt hit two cached blocks


# ---------------------------------------------------------------------------
# The client protocol
# ---------------------------------------------------------------------------
def test_sync_mp_client_add_abort_and_utility(model_dir):
    sockets_before = ipc_socket_files()
    client = EngineCoreClient.make_client(
        make_config(model_dir, block_size=4, distributed_executor_backend=SlowCountingExecutor),
        SlowCountingExecutor,
        True,
        multiprocess_mode=True,
    )
    try:
        assert isinstance(client, SyncMPClient)
        client.add_request(make_engine_core_request("a", ids("w5"), greedy(max_tokens=2)))
        client.add_request(
            make_engine_core_request("b", ids("w9"), greedy(max_tokens=500, ignore_eos=True))
        )
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        finished = set()
        while "a" not in finished:
            for out in client.get_output().outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    finished.add(out.request_id)
        assert tokens["a"] == ids("w6 w7")
        client.abort_requests(["b"])
        # After the abort the core steps once more and reports nothing running.
        while True:
            batch = client.get_output()
            assert all(o.request_id == "b" for o in batch.outputs)
            if batch.scheduler_stats is not None and batch.scheduler_stats.num_running_reqs == 0:
                break
        assert batch.scheduler_stats.kv_cache_usage == 0.0
        # A utility call runs a method of EngineCore in the other process.
        assert client.call_utility("get_num_unfinished_requests") == 0
        assert client.reset_prefix_cache() is True
        with pytest.raises(RuntimeError, match="no utility method"):
            client.call_utility("_private")
        own = {a.removeprefix("ipc://") for a in client.resources.ipc_addresses}
        assert own and own <= ipc_socket_files()
        # The start-up handshake's socket file went with the handshake: other tests'
        # engines (parallel workers) may add files, but none without a listener.
        assert not stale_ipc_files(sockets_before)
    finally:
        client.shutdown()
    # libzmq leaves a bound ipc socket's file behind; the client removes its own.
    assert not stale_ipc_files(sockets_before)
    assert not ipc_socket_files() & own


def test_start_up_error_keeps_its_type(model_dir, monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match=r"checkpoint_shard must be in \[0, 3\]"):
        LLM(str(model_dir), distributed_executor_backend=FailingInitExecutor)


# ---------------------------------------------------------------------------
# Engine death
# ---------------------------------------------------------------------------
def test_killed_engine_fails_pending_and_new_requests_fast(model_dir, monkeypatch):
    sockets_before = ipc_socket_files()
    llm = make_llm(model_dir, True, monkeypatch, executor=SlowCountingExecutor)
    pid = core_pid(llm)
    errors: list[BaseException] = []
    started = time.monotonic()
    done_at: list[float] = []

    def run() -> None:
        try:
            llm.generate("w1", greedy(max_tokens=200, ignore_eos=True), use_tqdm=False)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        done_at.append(time.monotonic())

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.3)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    worker.join(timeout=10)
    assert not worker.is_alive(), "generate() hung after the engine was killed"
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
    assert done_at[0] - killed_at < 5.0
    assert killed_at - started < 5.0
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        llm.generate("w2", greedy(max_tokens=2), use_tqdm=False)
    assert time.monotonic() - t0 < 1.0
    llm.shutdown()
    assert not stale_ipc_files(sockets_before)


def test_exception_in_the_core_is_reported_as_engine_death(model_dir, monkeypatch):
    monkeypatch.setenv("GLASSBOX_TEST_EXPLODE_AT_STEP", "3")
    llm = make_llm(model_dir, True, monkeypatch, executor=ExplodingExecutor)
    pid = core_pid(llm)
    with pytest.raises(EngineDeadError, match="EngineCore is dead"):
        llm.generate("w1", greedy(max_tokens=10), use_tqdm=False)
    assert wait_until(lambda: pid_exited(pid), 10)
    llm.shutdown()


# ---------------------------------------------------------------------------
# No orphans
# ---------------------------------------------------------------------------
def test_garbage_collected_llm_stops_its_engine(model_dir, monkeypatch):
    llm = make_llm(model_dir, True, monkeypatch)
    pid = core_pid(llm)
    del llm
    gc.collect()
    assert wait_until(lambda: pid_exited(pid), 10)


PARENT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from engine.entrypoints.llm import LLM
    from tests.helpers.counting_executor import CountingExecutor

    if __name__ == "__main__":
        # No tokenizer: this parent only has to start the engine, quickly.
        llm = LLM(
            sys.argv[1], distributed_executor_backend=CountingExecutor, skip_tokenizer_init=True
        )
        client = llm.llm_engine.engine_core
        print(client.engine_core_pids[0], *client.resources.ipc_addresses, flush=True)
        time.sleep(600)
    """
)


def test_engine_exits_when_its_parent_is_killed(model_dir, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), GLASSBOX_ENABLE_MULTIPROCESSING="1")
    parent = subprocess.Popen(
        [sys.executable, str(script), str(model_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )
    try:
        child_pid, *addresses = parent.stdout.readline().split()
        child_pid = int(child_pid)
        socket_files = [a.removeprefix("ipc://") for a in addresses]
        assert not pid_exited(child_pid)
        parent.kill()  # SIGKILL: no cleanup code runs in the parent
        parent.wait(timeout=10)
        assert wait_until(lambda: pid_exited(child_pid), 15), "EngineCore outlived its parent"
        # EngineCore removed the socket files its killed parent had bound.
        assert socket_files and not [f for f in socket_files if os.path.exists(f)]
    finally:
        parent.kill()


# ---------------------------------------------------------------------------
# Tracing across the hop
# ---------------------------------------------------------------------------
def test_multiprocess_trace_merges_both_processes(model_dir, tmp_path, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    llm = make_llm(model_dir, True, monkeypatch, trace_path=str(trace), trace_level="lifecycle")
    child = core_pid(llm)
    llm.generate(["w1", "w2"], greedy(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    events = load_trace(str(trace))
    assert not list(tmp_path.glob("trace.jsonl.*.part"))
    by_kind: dict[str, list[TraceEvent]] = {}
    for event in events:
        by_kind.setdefault(event.kind, []).append(event)
    for kind in ("request.sent", "request.received", "output.sent", "output.received"):
        assert kind in by_kind, kind
    assert {e.pid for e in by_kind["request.sent"]} == {os.getpid()}
    assert {e.pid for e in by_kind["request.received"]} == {child}
    assert {e.pid for e in by_kind["output.sent"]} == {child}
    assert {e.pid for e in by_kind["output.received"]} == {os.getpid()}
    # The hop carries internal ids; request.added maps them to the ids LLM sent ("0", "1").
    internal = {e.external_req_id: e.request_id for e in by_kind["request.added"]}
    assert set(internal) == {"0", "1"}
    assert all(re.fullmatch(rf"{sent}-[0-9a-f]{{8}}", rid) for sent, rid in internal.items())
    ids = set(internal.values())
    sent = {e.request_id: e.ts for e in by_kind["request.sent"] if e.type == "add"}
    received = {e.request_id: e.ts for e in by_kind["request.received"] if e.type == "add"}
    assert set(sent) == set(received) == ids
    assert all(sent[r] <= received[r] for r in sent)
    assert set().union(*(e.request_ids for e in by_kind["output.received"])) == ids
    assert set().union(*(e.request_ids for e in by_kind["output.sent"])) == ids


def test_executor_class_must_be_importable_by_path_with_spawn(model_dir, monkeypatch):
    class LocalExecutor(CountingExecutor):
        pass

    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    # spawn pickles the executor class by name; fork (the default) copies it.
    monkeypatch.setenv("GLASSBOX_WORKER_MULTIPROC_METHOD", "spawn")
    with pytest.raises(TypeError, match="top-level class"):
        LLM(str(model_dir), distributed_executor_backend=LocalExecutor)


def test_forked_engine_core_takes_a_local_executor_class(model_dir, monkeypatch):
    class LocalExecutor(CountingExecutor):
        pass

    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.delenv("GLASSBOX_WORKER_MULTIPROC_METHOD", raising=False)
    llm = LLM(str(model_dir), distributed_executor_backend=LocalExecutor, skip_tokenizer_init=True)
    try:
        assert llm.llm_engine.engine_core.engine_core_pids
    finally:
        llm.llm_engine.engine_core.shutdown()

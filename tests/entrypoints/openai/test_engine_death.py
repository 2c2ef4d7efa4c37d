"""Killing the EngineCore process under a running server.

In-flight streams get an error event, in-flight non-streaming requests a 503,
both within 5 seconds; afterwards every request is a 503 at once and
``/health`` reports 503. Nothing hangs, and the HTTP server itself stays up.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.utils import SLOW_EXECUTOR, RemoteOpenAIServer, pid_exited, wait_until
from tests.helpers.leaks import ipc_socket_files, stale_ipc_files
from tests.helpers.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("death") / "tiny")


def test_killed_engine_core_fails_requests_fast_and_health_turns_503(model_dir, monkeypatch):
    monkeypatch.setenv("GLASSBOX_TEST_STEP_DELAY_S", "0.02")
    flags = ["--distributed-executor-backend", SLOW_EXECUTOR, "--block-size", "4"]
    with RemoteOpenAIServer(model_dir, flags) as server:
        client = server.get_client()
        model = str(model_dir)
        long = dict(
            model=model, prompt="w1", max_tokens=240, temperature=0, extra_body={"ignore_eos": True}
        )
        assert httpx.get(server.url_for("health")).status_code == 200

        def stream_until_error():
            received = 0
            try:
                for _chunk in client.completions.create(stream=True, **long):
                    received += 1
            except openai.APIError as e:
                return ("error", received, time.monotonic(), e)
            return ("finished", received, time.monotonic(), None)

        def non_streaming():
            try:
                client.completions.create(**long)
            except openai.APIStatusError as e:
                return ("error", e.status_code, time.monotonic(), e)
            return ("finished", 200, time.monotonic(), None)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream_until_error) for _ in range(2)]
            plain = [pool.submit(non_streaming) for _ in range(2)]
            assert wait_until(lambda: server.metrics()["glassbox:num_requests_running"] == 4, 10)
            pid = server.engine_core_pid
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            stream_results = [f.result(timeout=10) for f in streams]
            plain_results = [f.result(timeout=10) for f in plain]

        for outcome, received, done_at, error in stream_results:
            assert outcome == "error" and received > 0
            assert done_at - killed_at < 5
            assert "EngineCore is dead" in str(error)
        for outcome, status, done_at, error in plain_results:
            assert (outcome, status) == ("error", 503)
            assert done_at - killed_at < 5
            assert error.body["type"] == "ServiceUnavailableError"

        health = httpx.get(server.url_for("health"))
        assert health.status_code == 503
        assert health.json()["error"]["code"] == 503
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as excinfo:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "w1"}]
            )
        assert excinfo.value.status_code == 503
        assert time.monotonic() - started < 2
        # A new stream gets the same 503, not a 200 whose first event is the error.
        for path, body in (
            ("v1/completions", {"prompt": "w1"}),
            ("v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]}),
        ):
            response = httpx.post(
                server.url_for(path), json={"model": model, "stream": True, **body}
            )
            assert response.status_code == 503, response.text
            assert response.json()["error"]["type"] == "ServiceUnavailableError"
        # The metrics say the engine is gone and nothing runs.
        metrics = server.metrics()
        assert metrics["glassbox:engine_dead"] == 1
        assert metrics["glassbox:num_requests_running"] == 0
        # The HTTP side keeps answering.
        assert httpx.get(server.url_for("v1/models")).status_code == 200
        assert pid_exited(pid)


def test_killed_tensor_parallel_worker_turns_the_server_unhealthy():
    """The default model at -tp 3 (its 9 heads): SIGKILL one worker process;
    the engine fails within 5 s (the executor's monitor), requests get 503,
    /health 503, no process and no socket file is left."""
    import psutil

    from tests.helpers.hf_checkpoints import default_model_path

    model = default_model_path()
    sockets_before = ipc_socket_files()
    with RemoteOpenAIServer(model, ["-tp", "3", "--max-model-len", "256"]) as server:
        client = server.get_client()
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices
        engine_core = psutil.Process(server.engine_core_pid)
        workers = [p for p in engine_core.children() if "resource_tracker" not in p.cmdline()[-1]]
        assert len(workers) == 3
        workers[1].kill()
        killed_at = time.monotonic()
        assert wait_until(lambda: httpx.get(server.url_for("health")).status_code == 503, 5)
        assert time.monotonic() - killed_at < 5
        with pytest.raises(openai.APIStatusError) as excinfo:
            client.completions.create(model=model, prompt="Hi", max_tokens=2)
        assert excinfo.value.status_code == 503
    gone, alive = psutil.wait_procs([engine_core, *workers], timeout=15)
    assert not alive
    # The server's SIGTERM may reach EngineCore while its executor is stopping
    # the workers; that stop still finishes and removes every queue's file.
    assert not stale_ipc_files(sockets_before)

"""Stopping ``glassbox serve`` (twin of vllm/entrypoints/launcher.py's serve_http).

On SIGTERM the server stops taking connections, lets the streams in flight
run for ``--shutdown-timeout`` seconds, ends the rest with finish_reason
"abort", stops EngineCore itself (not through EngineCore's parent-death
watcher, and without SIGKILL) and exits with code 0.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.entrypoints.openai.test_serve_cli import REPO_ROOT, engine_core_children, free_port
from tests.entrypoints.openai.utils import SLOW_EXECUTOR, pid_exited, wait_until
from tests.helpers.tiny_model import make_tiny_model_dir


def start_server(model, port: int, *flags: str, step_delay_s: float) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), GLASSBOX_TEST_STEP_DELAY_S=str(step_delay_s))
    argv = [sys.executable, "-m", "engine.entrypoints.cli.main", "serve", str(model)]
    argv += ["--port", str(port), "--distributed-executor-backend", SLOW_EXECUTOR]
    argv += ["--served-model-name", "tiny", "--block-size", "4", *flags]
    return subprocess.Popen(
        argv, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def stream(port: int, max_tokens: int) -> tuple[str | None, int, float]:
    """One streamed completion: (last finish_reason, words of text, monotonic end time).
    Each token of the tiny model is one word (" w5")."""
    body = {
        "model": "tiny",
        "prompt": "w1",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    finish_reason, text = None, ""
    with httpx.stream(
        "POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish_reason = choice["finish_reason"] or finish_reason
    return finish_reason, len(text.split()), time.monotonic()


def running(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("glassbox:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(text)


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_drains_then_aborts_and_exits_cleanly(tmp_path, sig):
    model = make_tiny_model_dir(tmp_path / "tiny")
    port = free_port()
    # 0.05 s per step: 20 tokens take ~1 s, 240 tokens ~12 s.
    server = start_server(model, port, "--shutdown-timeout", "2", step_delay_s=0.05)
    try:
        assert wait_until(lambda: healthy(port), 60, 0.2), "glassbox serve did not come up"
        (core,) = engine_core_children(server.pid)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream, port, n) for n in (20, 240, 240)]
            assert wait_until(lambda: running(port) == 3, 20, 0.05)
            server.send_signal(sig)
            signalled = time.monotonic()
            short, *long = (f.result(timeout=30) for f in streams)
        assert short[0] == "length" and short[1] == 20
        for reason, tokens, ended in long:
            assert reason == "abort"
            assert tokens < 240
            # Drained for ~2 s, then aborted; slack for a busy CI machine.
            assert 1.5 < ended - signalled < 15
        with pytest.raises(httpx.HTTPError):  # the listening socket is closed
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        assert server.wait(timeout=30) == 0
        assert wait_until(lambda: pid_exited(core), 10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    stderr = server.stderr.read().decode()
    assert "Traceback" not in stderr, stderr
    assert "killing it" not in stderr, stderr
    assert "front-end process is gone" not in stderr, stderr
    assert "draining for up to 2 s" in stderr, stderr


def test_no_keep_alive_on_engine_death_stops_the_server(tmp_path):
    # vLLM's default (without VLLM_KEEP_ALIVE_ON_ENGINE_DEATH): the server goes with its engine.
    model = make_tiny_model_dir(tmp_path / "tiny")
    port = free_port()
    server = start_server(model, port, "--no-keep-alive-on-engine-death", step_delay_s=0.0)
    try:
        assert wait_until(lambda: healthy(port), 60, 0.2), "glassbox serve did not come up"
        (core,) = engine_core_children(server.pid)
        os.kill(core, signal.SIGKILL)
        server.wait(timeout=20)  # the watchdog looks every 5 s
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    stderr = server.stderr.read().decode()
    assert "EngineCore is dead; stopping the API server." in stderr, stderr

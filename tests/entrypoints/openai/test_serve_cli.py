"""``glassbox serve`` as a real command (twin of vllm/entrypoints/cli/serve.py).

The server runs as its own process group leader; EngineCore is its child.
Shown: the command serves the OpenAI API on 127.0.0.1, and Ctrl-C (SIGINT)
shuts down the server *and* the EngineCore process -- no orphan left behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.openai.utils import COUNTING_EXECUTOR, pid_exited, wait_until
from tests.helpers.tiny_model import make_tiny_model_dir

REPO_ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_core_children(pid: int) -> list[int]:
    """Children of ``pid`` that multiprocessing started: EngineCore (forked,
    or spawned), not a resource tracker."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) != pid:
            continue
        with open(f"/proc/{entry}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                children.append(int(entry))
    return children


def test_glassbox_serve_command(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.entrypoints.cli.main",
            "serve",
            str(model),
            "--port",
            str(port),
            "--distributed-executor-backend",
            COUNTING_EXECUTOR,
            "--served-model-name",
            "tiny",
            "--block-size",
            "4",
            "--uvicorn-log-level",
            "warning",
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:

        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(healthy, 60, 0.2), "glassbox serve did not come up"
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0
        )
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.completions.create(model="tiny", prompt="w5", max_tokens=3, temperature=0)
        assert out.choices[0].text == " w6 w7 w8"
        (core,) = engine_core_children(server.pid)
        assert not pid_exited(core)

        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0
        assert wait_until(lambda: pid_exited(core), 10), "EngineCore outlived glassbox serve"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    stderr = server.stderr.read().decode()
    assert "Traceback" not in stderr, stderr


def test_serve_rejects_a_busy_port(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "engine.entrypoints.cli.main",
                "serve",
                str(model),
                "--port",
                str(port),
                "--distributed-executor-backend",
                COUNTING_EXECUTOR,
            ],
            cwd=REPO_ROOT,
            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
            capture_output=True,
            timeout=60,
        )
    assert result.returncode != 0
    assert b"Address already in use" in result.stderr
    assert b"Traceback" not in result.stderr
    # Failed before any engine was started.
    assert b"EngineCore" not in result.stderr


@pytest.mark.parametrize("argv,message", [(["--port", "70000"], "--port must be in")])
def test_serve_validates_its_arguments(tmp_path, argv, message):
    model = make_tiny_model_dir(tmp_path / "tiny")
    result = subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli.main", "serve", str(model), *argv],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message.encode() in result.stderr
    assert b"Traceback" not in result.stderr

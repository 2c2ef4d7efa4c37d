"""Helpers for the API-server tests: a real uvicorn server on 127.0.0.1 at a
free port, run on a background thread (httpx's ASGITransport buffers whole
responses, so streaming must go over a real socket), and a slowed-down
counting executor for tests that need requests to stay in flight.

Executors given to an engine must be importable top-level classes: the
EngineCore process imports them by path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from engine.entrypoints.openai.api_server import (
    build_app,
    build_async_engine_client,
    build_server,
    create_server_socket,
    init_app_state,
)
from engine.entrypoints.openai.cli_args import make_arg_parser
from tests.helpers.counting_executor import CountingExecutor, non_blocking

COUNTING_EXECUTOR = "tests.helpers.counting_executor.CountingExecutor"
SLOW_EXECUTOR = "tests.entrypoints.openai.utils.SlowCountingExecutor"


class SlowCountingExecutor(CountingExecutor):
    """CountingExecutor that takes ``GLASSBOX_TEST_STEP_DELAY_S`` (default
    20 ms) per step, so a long request is still running when a test acts."""

    @non_blocking
    def execute_model(self, scheduler_output):
        time.sleep(float(os.environ.get("GLASSBOX_TEST_STEP_DELAY_S", "0.02")))
        return super().execute_model(scheduler_output)


class RemoteOpenAIServer:
    """``glassbox serve`` in this process, on its own thread and event loop
    (vLLM's tests have a class of this name that runs a subprocess)."""

    def __init__(
        self, model: str | Path, cli_args: list[str], startup_timeout_s: float = 120
    ) -> None:
        parser = make_arg_parser(argparse.ArgumentParser())
        self.args = parser.parse_args(
            [str(model), *cli_args, "--host", "127.0.0.1", "--uvicorn-log-level", "warning"]
        )
        self.sock = create_server_socket("127.0.0.1", 0)  # a free port, held from now on
        self.port = self.sock.getsockname()[1]
        self.url_root = f"http://127.0.0.1:{self.port}"
        self.engine_client: Any = None
        self.server: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()
        if not self._started.wait(startup_timeout_s):
            raise TimeoutError("the API server did not start in time")
        if self._error is not None:
            raise RuntimeError("the API server failed to start") from self._error

    async def _serve(self) -> None:
        try:
            async with build_async_engine_client(self.args) as engine_client:
                self.engine_client = engine_client
                app = build_app(self.args)
                await init_app_state(engine_client, app.state, self.args)
                self.server = build_server(app, self.args)
                self.loop = asyncio.get_running_loop()
                task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
                while not self.server.started and not task.done():
                    await asyncio.sleep(0.01)
                self._started.set()
                await task
        except BaseException as e:  # noqa: BLE001 -- reported to the test thread
            self._error = e
            self._started.set()

    def url_for(self, *parts: str) -> str:
        return "/".join([self.url_root, *parts])

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", "EMPTY")
        return openai.OpenAI(base_url=self.url_for("v1"), max_retries=0, timeout=60, **kwargs)

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", "EMPTY")
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), max_retries=0, timeout=60, **kwargs)

    @property
    def engine_core_pid(self) -> int:
        return self.engine_client.engine_core.engine_core_pids[0]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples without labels other than model_name, by name."""
        text = httpx.get(self.url_for("metrics"), timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            if "le=" in name_labels or "finished_reason=" in name_labels:
                continue
            values[name] = float(value)
        return values

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self._thread.join(timeout=60)
        self.sock.close()

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def pid_exited(pid: int) -> bool:
    """True once ``pid`` is gone or a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


class ExplodingExecutor(CountingExecutor):
    """Raises inside the engine step once ``GLASSBOX_TEST_EXPLODE_AT_STEP``
    steps have run: EngineCore dies of an exception and says so
    (ENGINE_CORE_DEAD) before exiting."""

    @non_blocking
    def execute_model(self, scheduler_output):
        if len(self.steps) >= int(os.environ.get("GLASSBOX_TEST_EXPLODE_AT_STEP", "3")):
            raise RuntimeError("the worker exploded")
        return super().execute_model(scheduler_output)


class FailingInitExecutor(CountingExecutor):
    """Start-up fails with a ValueError inside the EngineCore process."""

    def _init_executor(self) -> None:
        raise ValueError("checkpoint_shard must be in [0, 3], got 7 (a start-up error)")


def make_tiny_llama_with_tokenizer(path: Path, seed: int = 0) -> Path:
    """A real (random) Llama checkpoint that speaks the tiny word vocabulary:
    the tokenizer of ``tests.helpers.tiny_model`` plus transformers weights
    of the right vocabulary size, run by the real executor."""
    import torch
    import transformers

    from tests.helpers.hf_checkpoints import TINY_CONFIG
    from tests.helpers.tiny_model import make_tiny_model_dir

    make_tiny_model_dir(path)
    tiny_config = json.loads((path / "config.json").read_text())
    config_dict = {
        **TINY_CONFIG,
        "vocab_size": tiny_config["vocab_size"],
        "max_position_embeddings": tiny_config["max_position_embeddings"],
    }
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config_dict)).to(torch.float32)
    model.save_pretrained(str(path))
    return path

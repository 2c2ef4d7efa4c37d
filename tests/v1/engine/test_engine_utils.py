"""Stopping the EngineCore process (engine/v1/engine/utils.py ``shutdown``).

EngineCore handles SIGTERM between two steps, so a process busy in one long
step must be waited for, not SIGKILLed (which would lose its trace part); a
process that stays stuck past the step bound is killed, with a warning.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import time

from engine.v1.engine.utils import shutdown


def _slow_to_stop(seconds: float) -> None:
    # SIGTERM only takes effect after `seconds`, like a step that cannot be interrupted.
    signal.signal(signal.SIGTERM, lambda *_: time.sleep(seconds) or exit(0))
    time.sleep(60)


def start(seconds: float) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(target=_slow_to_stop, args=(seconds,))
    proc.start()
    time.sleep(1.0)  # let it install its handler
    return proc


def test_a_core_finishing_a_long_step_is_waited_for(monkeypatch, caplog):
    monkeypatch.setattr("engine.v1.engine.utils.SHUTDOWN_NOTICE_AFTER_S", 0.5)
    proc = start(2.0)
    with caplog.at_level(logging.INFO):
        shutdown([proc])
    assert proc.exitcode == 0  # exited by itself, not SIGKILLed
    assert "finish its current step" in caplog.text
    assert "killing it" not in caplog.text


def test_a_stuck_core_is_killed_after_the_step_bound(monkeypatch, caplog):
    monkeypatch.setenv("GLASSBOX_ENGINE_ITERATION_TIMEOUT_S", "1")
    proc = start(30.0)
    began = time.monotonic()
    with caplog.at_level(logging.INFO):
        shutdown([proc])
    assert time.monotonic() - began < 10
    assert proc.exitcode == -signal.SIGKILL
    assert "did not exit" in caplog.text and "killing it" in caplog.text

"""Fixtures of the tracing tests: the tiny checkpoint, engines that trace, and
a scripted run that exercises every scheduler and KV-cache path."""

from __future__ import annotations

import pytest

from tests.helpers.tiny_model import make_tiny_model_dir
from tests.tracing.scenario import record_scenario


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tracing") / "tiny")


@pytest.fixture(scope="session")
def full_real_scenario(tiny_model_dir, tmp_path_factory):
    """The scripted run on the real tiny model at trace_level 'full', recorded
    once for every test module that reads it: (trace path, outputs). The
    engine's default loop: async scheduling."""
    trace = str(tmp_path_factory.mktemp("scenario-full-real") / "run.jsonl")
    return trace, record_scenario(tiny_model_dir, trace, "full", real_model=True)


@pytest.fixture(scope="session")
def full_real_scenario_sync(tiny_model_dir, tmp_path_factory):
    """The same run with ``async_scheduling=False``: one step at a time."""
    trace = str(tmp_path_factory.mktemp("scenario-full-real-sync") / "run.jsonl")
    outputs = record_scenario(
        tiny_model_dir, trace, "full", real_model=True, async_scheduling=False
    )
    return trace, outputs

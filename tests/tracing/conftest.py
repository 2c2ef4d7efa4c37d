"""Fixtures of the tracing tests: the tiny checkpoint, engines that trace, and
a scripted run that exercises every scheduler and KV-cache path."""

from __future__ import annotations

import pytest

from tests.helpers.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tracing") / "tiny")

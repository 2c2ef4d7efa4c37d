"""Suite-wide pytest set-up for Glassbox.

- Registers Hypothesis profiles: "ci" (no per-example deadline, derandomized so a
  CI failure reproduces exactly) is loaded when the CI environment variable is set;
  otherwise Hypothesis's own "default" profile.
- Skips tests marked ``@pytest.mark.gpu`` when there is no CUDA device (or no torch).
  torch is imported only if at least one such test was collected, so CPU-only
  runs of the pure-Python core never pay for importing it.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


def _cuda_unavailable_reason() -> str | None:
    """Return why GPU tests cannot run here, or None when a CUDA device is usable."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    # device_count() asks NVML; is_available() asks the CUDA runtime, which
    # marks this process unsafe to fork (torch's "poison fork"), and an engine
    # forked from it then fails with "Cannot re-initialize CUDA in forked
    # subprocess" although torch.cuda.is_initialized() is False.
    if torch.cuda.device_count() == 0:
        return "no CUDA device (torch.cuda.device_count() is 0)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _cuda_unavailable_reason()
    if reason is None:
        return
    skip_gpu = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in gpu_items:
        item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def in_process_engine():
    """EngineCore in the test's process (GLASSBOX_ENABLE_MULTIPROCESSING=0) for a
    whole module: its tests look inside the runner, or count compiles in this
    process. Use with ``pytestmark = pytest.mark.usefixtures("in_process_engine")``."""
    from engine.v1.engine.utils import ENABLE_MULTIPROCESSING_ENV

    previous = os.environ.get(ENABLE_MULTIPROCESSING_ENV)
    os.environ[ENABLE_MULTIPROCESSING_ENV] = "0"
    yield
    if previous is None:
        del os.environ[ENABLE_MULTIPROCESSING_ENV]
    else:
        os.environ[ENABLE_MULTIPROCESSING_ENV] = previous

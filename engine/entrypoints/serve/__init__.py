"""Server endpoints that are not part of the OpenAI API (vLLM twin: ``vllm/entrypoints/serve/``).

``server_dev_mode`` is the switch of the development routes (``cache/``,
``rlhf/``): ``GLASSBOX_SERVER_DEV_MODE=1``, vLLM's ``VLLM_SERVER_DEV_MODE``.
"""

from __future__ import annotations

import os

SERVER_DEV_MODE_ENV = "GLASSBOX_SERVER_DEV_MODE"


def server_dev_mode() -> bool:
    """Whether the development routes are on (/reset_prefix_cache, /pause, ...)."""
    return os.environ.get(SERVER_DEV_MODE_ENV, "").lower() in ("1", "true")

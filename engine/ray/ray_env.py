"""Which of the driver's environment variables the Ray workers get.

vLLM twin: ``vllm/ray/ray_env.py`` (``get_env_vars_to_copy``). Read it for
why this exists: a Ray actor is started by its node's raylet, not by the
engine, so it has the environment the raylet had when the cluster started --
on another machine, or in a cluster started before the user exported
``NCCL_NVLS_ENABLE=0``, not the engine's. The executor copies the variables
named here into every worker before it builds the worker (see
``RayDistributedExecutor._init_executor``). Sessions: 07 (executor).

What is copied: every variable of the driver whose name starts with one of
``DEFAULT_ENV_VAR_PREFIXES`` (Glassbox's own, NCCL's, UCX's, Hugging Face's)
or of ``GLASSBOX_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` (comma-separated), and
the single names of ``DEFAULT_EXTRA_ENV_VARS`` and
``GLASSBOX_RAY_EXTRA_ENV_VARS_TO_COPY``; never the worker-specific ones
the executor sets itself. Simpler than vLLM: no list of registered variables
(Glassbox has no ``envs.py``: the prefix covers them) and no file of names
never to copy (``ray_non_carry_over_env_vars.json``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

DEFAULT_ENV_VAR_PREFIXES = ("GLASSBOX_", "NCCL_", "UCX_", "HF_", "HUGGING_FACE_")
DEFAULT_EXTRA_ENV_VARS = ("PYTHONHASHSEED",)
EXTRA_PREFIXES_VAR = "GLASSBOX_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
EXTRA_VARS_VAR = "GLASSBOX_RAY_EXTRA_ENV_VARS_TO_COPY"


def _parse_csv(value: str) -> set[str]:
    return {name.strip() for name in value.split(",") if name.strip()}


def get_env_vars_to_copy(
    exclude_vars: Iterable[str] = (),
    additional_vars: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The driver's variables a Ray worker should get, name -> value (only those
    set here). ``environ``: the environment to read (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    prefixes = set(DEFAULT_ENV_VAR_PREFIXES) | _parse_csv(env.get(EXTRA_PREFIXES_VAR, ""))
    names = {name for name in env if name.startswith(tuple(prefixes))}
    names |= set(DEFAULT_EXTRA_ENV_VARS) | _parse_csv(env.get(EXTRA_VARS_VAR, ""))
    names |= set(additional_vars)
    names -= set(exclude_vars)
    return {name: env[name] for name in sorted(names) if name in env}

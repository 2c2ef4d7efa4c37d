"""How Glassbox starts its processes: ``fork`` by default, ``spawn`` when it must.

vLLM twin: ``vllm/utils/system_utils.py`` (``get_mp_context``,
``_maybe_force_spawn``) and ``VLLM_WORKER_MULTIPROC_METHOD`` in
``vllm/envs.py``. Read it for why a learner's script without an
``if __name__ == "__main__":`` guard works: the EngineCore process is
*forked*, so it starts as a copy of the parent and never re-imports the
script. ``spawn`` starts a fresh interpreter that imports the main module
again -- and a script that builds an engine at import time would build one
more in the child, which fails.

Forking a process that has initialised CUDA gives the child a CUDA context it
cannot use, so then (as vLLM) the method is switched to ``spawn``, with a
warning saying why. ``GLASSBOX_WORKER_MULTIPROC_METHOD=spawn`` asks for spawn
always.

OpenMP is the other thing a fork breaks: a process whose torch ops ran on two
or more threads keeps a pool of GNU OpenMP worker threads, and a forked child
inherits the pool's bookkeeping without its threads, so the child's first
parallel region waits for them forever (a notebook that did some torch work,
then ``LLM()`` on a machine where EngineCore runs several threads).
``_release_openmp_threads`` runs before every fork and lets the forking
thread's pool go; parent and child each make new threads when they next need
them. Inductor's compile thread pool is the third: a child inherits it, cached,
without its threads, and its first compile waits forever; torch's own fork
hook resets only Inductor's process pool, so ``_forget_inductor_threads`` drops
the thread pool in the child. vLLM's CPU platform avoids the question by
always spawning.
Sessions: 01 (engine loop across two processes), 07 (executor).

Simpler than vLLM: the reasons checked are CUDA only (vLLM also forces spawn
inside a Ray actor, with NUMA binding, an initialised XPU, or under WSL, and
on the CPU platform always).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import sys
from multiprocessing.context import BaseContext

logger = logging.getLogger(__name__)

# Twin of VLLM_WORKER_MULTIPROC_METHOD: "fork" (default) or "spawn".
MULTIPROC_METHOD_ENV = "GLASSBOX_WORKER_MULTIPROC_METHOD"
MULTIPROC_METHODS = ("fork", "spawn")


# omp_pause_resource_all(omp_pause_soft): stop the calling thread's OpenMP workers (OpenMP 5.0).
OMP_PAUSE_SOFT = 1
_libgomps: list[ctypes.CDLL] | None = None


def _loaded_libgomps() -> list[ctypes.CDLL]:
    """The GNU OpenMP runtimes mapped into this process (torch's CPU wheels bundle one).
    Looked up at the first fork that finds one loaded, then remembered."""
    global _libgomps
    if _libgomps is not None:
        return _libgomps
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:  # no /proc: not Linux
        paths = set()
    libs = [ctypes.CDLL(p) for p in sorted(paths) if p.startswith("/")]
    libs = [lib for lib in libs if hasattr(lib, "omp_pause_resource_all")]
    if libs:
        _libgomps = libs
    return libs


def _release_openmp_threads() -> None:
    for libgomp in _loaded_libgomps():
        libgomp.omp_pause_resource_all(OMP_PAUSE_SOFT)


def _forget_inductor_threads() -> None:
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:  # only a process that compiled has the pool
        async_compile.AsyncCompile.pool.cache_clear()


os.register_at_fork(before=_release_openmp_threads, after_in_child=_forget_inductor_threads)


def cuda_is_initialized() -> bool:
    """True once this process has created a CUDA context. Asks nothing of the
    driver (``torch.cuda.is_available()`` would, and forking after that breaks
    CUDA in the child) and imports no torch that was never imported."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def _maybe_force_spawn() -> None:
    """Switch the start method to ``spawn`` (in the environment, so children
    inherit it) when forking would not be safe."""
    if os.environ.get(MULTIPROC_METHOD_ENV) == "spawn":
        return
    reasons = []
    if cuda_is_initialized():
        reasons.append("CUDA is initialized")
    if reasons:
        logger.warning(
            "The process start method must be 'spawn'; setting %s=spawn (%s). A script that "
            'builds an engine at import time now needs an `if __name__ == "__main__":` guard.',
            MULTIPROC_METHOD_ENV,
            "; ".join(reasons),
        )
        os.environ[MULTIPROC_METHOD_ENV] = "spawn"


def get_mp_method() -> str:
    """The start method asked for in the environment (default ``fork``)."""
    method = os.environ.get(MULTIPROC_METHOD_ENV, "fork").strip().lower() or "fork"
    if method not in MULTIPROC_METHODS:
        raise ValueError(
            f"{MULTIPROC_METHOD_ENV} must be one of {', '.join(MULTIPROC_METHODS)}, got {method!r}"
        )
    return method


def get_mp_context() -> BaseContext:
    """The multiprocessing context processes are started with: ``fork``
    unless the environment or an initialised CUDA says ``spawn``."""
    _maybe_force_spawn()
    return multiprocessing.get_context(get_mp_method())

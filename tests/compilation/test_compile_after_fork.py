"""A process forked after its parent compiled can compile too.

EngineCore and the TP workers start with ``fork`` on the CPU. A parent that
already ran Inductor (a compiled engine in a notebook, an earlier test) holds
Inductor's compile thread pool; the child inherits the pool but not its
threads, so without ``system_utils``'s fork hook its first compile
waited forever on a job no thread would run.
"""

from __future__ import annotations

import multiprocessing

import torch
import torch._inductor.config as inductor_config
from torch._inductor.async_compile import AsyncCompile

import engine.utils.system_utils  # noqa: F401  (registers the fork hooks)


def _compile_in_child(done) -> None:
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.cos(x) * 3 - 2, backend="inductor")
    x = torch.arange(8.0)
    done.put(bool(torch.allclose(fn(x), torch.cos(x) * 3 - 2)))


def test_a_forked_child_compiles_after_its_parent_did(tmp_path, monkeypatch) -> None:
    # Fresh code in the child (no cache hit), built through the thread pool.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    monkeypatch.setattr(inductor_config, "compile_threads", 2)
    # What a compile leaves in the parent: Inductor's thread pool, with a live thread.
    AsyncCompile.pool().submit(int).result()

    ctx = multiprocessing.get_context("fork")
    done = ctx.Queue()
    child = ctx.Process(target=_compile_in_child, args=(done,))
    child.start()
    child.join(120)
    hung = child.is_alive()
    if hung:
        child.kill()
        child.join()
    torch._dynamo.reset()
    assert not hung, "the forked child never finished its compile (Inductor's pool)"
    assert child.exitcode == 0 and done.get(timeout=5)

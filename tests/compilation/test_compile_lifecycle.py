"""Compiled engines that come and go in one process (notebooks, tests).

Dynamo keeps compiled code per code object, and every model of a class shares
``forward.__code__``; with the guards dropped, the code an engine compiled
last would serve every engine of that class. Each model therefore runs the
bytecode of its own first call (``TorchCompileWithNoGuardsWrapper``), and a
shut-down engine leaves nothing behind: Dynamo's cache entry, its backend
(which Dynamo keeps for the life of the process) and the compiled graph all
let go of the model, the KV cache and the pieces.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.helpers.hf_checkpoints import save_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("in_process_engine")

PROMPT = [{"prompt_token_ids": [3, 5, 7, 11, 13, 17]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _llm(model: Path, tmp_path: Path, max_model_len: int) -> LLM:
    compilation = {"mode": 3, "backend": "eager", "cache_dir": str(tmp_path / "cc")}
    return LLM(
        str(model),
        skip_tokenizer_init=True,
        num_gpu_blocks_override=64,
        max_model_len=max_model_len,
        compilation_config=compilation,
    )


def _tokens(llm: LLM) -> list[int]:
    return list(llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


def test_each_engine_runs_its_own_compiled_code(tmp_path: Path) -> None:
    save_tiny_checkpoint("llama", tmp_path / "a", seed=0)
    save_tiny_checkpoint("llama", tmp_path / "b", seed=1)
    first = _llm(tmp_path / "a", tmp_path, max_model_len=128)
    second = _llm(tmp_path / "b", tmp_path, max_model_len=64)
    try:
        before = _tokens(first)
        other = _tokens(second)  # compiles the same forward again, for other weights and sizes
        calls = []

        def counted(general):
            return lambda *args: calls.append(1) or general(*args)

        for piece in _runner(second).model.model.compile_backend.piecewise_backends:
            piece.compiled_graph_for_general_shape = counted(piece.compiled_graph_for_general_shape)
        after = _tokens(first)
        assert after == before != other
        assert calls == [], "the first engine ran the second engine's pieces"
        assert _tokens(second) == other and calls
    finally:
        first.shutdown()
        second.shutdown()


def test_shutdown_releases_model_kv_cache_and_compiled_graph(tmp_path: Path) -> None:
    import torch

    from engine.model_executor.models import llama

    save_tiny_checkpoint("llama", tmp_path / "a", seed=0)
    # An earlier engine's code may still wait in a reference cycle for the collector.
    gc.collect()
    compiled_fns = {k for k in vars(llama) if k.startswith("__compiled_fn")}
    llm = _llm(tmp_path / "a", tmp_path, max_model_len=128)
    _tokens(llm)
    runner = _runner(llm)
    backend = runner.model.model.compile_backend
    alive = {
        "model": weakref.ref(runner.model),
        "kv cache": weakref.ref(runner.kv_caches[0]),
        "split graph": weakref.ref(backend.split_gm),
    }
    forward = type(runner.model.model).forward.__code__
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(forward)) == 1
    del runner, backend
    llm.shutdown()
    gc.collect()
    # The config (which the caller still holds) no longer reaches the layers.
    assert not llm.llm_engine.glassbox_config.compilation_config.static_forward_context
    assert [name for name, ref in alive.items() if ref() is not None] == []
    assert torch._dynamo.eval_frame._debug_get_cache_entry_list(forward) == []
    assert {k for k in vars(llama) if k.startswith("__compiled_fn")} <= compiled_fns

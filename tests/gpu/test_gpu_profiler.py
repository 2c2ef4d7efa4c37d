"""Profiling windows on CUDA (docs/profiling.md): the torch profiler records
the device's kernels too, the op table is sorted by device time, and the CUDA
profiler's start/stop (for nsys) runs without an outside tool.

Marked ``gpu``: skipped without CUDA (CI), run by ``make test-gpu``.
"""

from __future__ import annotations

import gzip
import json

import pytest

from engine import LLM, SamplingParams
from tests.helpers.gpu import decode_graphs
from tests.helpers.hf_checkpoints import save_tiny_checkpoint

pytestmark = pytest.mark.gpu

ENGINE = {"skip_tokenizer_init": True, "max_model_len": 64, "num_gpu_blocks_override": 32}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gpu_profiler") / "llama"
    save_tiny_checkpoint("llama", path, seed=3)
    return str(path)


def test_torch_profiler_records_kernels_under_step_labels(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path)}
    config["torch_profiler_with_stack"] = False
    llm = LLM(checkpoint, profiler_config=config, device="cuda", **ENGINE, **decode_graphs())
    try:
        want = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        llm.start_profile("cuda")
        got = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        llm.stop_profile()
    finally:
        llm.shutdown()
    assert got == want  # profiling changes no token
    (trace,) = tmp_path.glob("cuda_tp0_rank0.*.pt.trace.json.gz")
    events = json.load(gzip.open(trace))["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # device activity, not only host ops
    labels = [e["name"] for e in events if e.get("name", "").startswith("execute_context_")]
    assert labels[0] == "execute_context_1(5)_generation_0(0)"
    table = (tmp_path / "profiler_out_0.txt").read_text()
    assert "Self CUDA time total" in table  # device time measured (and sorted by)


def test_cuda_profiler_brackets_the_window(checkpoint, monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    config = {"profiler": "cuda"}
    llm = LLM(checkpoint, profiler_config=config, device="cuda", **ENGINE, **decode_graphs())
    try:
        llm.start_profile()
        out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
        llm.stop_profile()
        assert len(out.token_ids) == GREEDY.max_tokens
    finally:
        llm.shutdown()

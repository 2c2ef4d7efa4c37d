"""``LLM.collective_rpc`` and ``LLM.apply_model`` (vLLM's names): a function
runs in every worker, one answer per rank.

* In-process (one rank, and two ranks in worker processes): answers per rank,
  keyword arguments, a ``WorkerMethod`` by name, a bad name refused naming
  the choices, a worker's error raised, the engine still serving.
* EngineCore in its own process: refused unless
  ``GLASSBOX_ALLOW_INSECURE_SERIALIZATION=1`` (the call travels pickled), and
  then the same answers; a lambda is refused with a clear message.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.v1.serial_utils import ALLOW_INSECURE_SERIALIZATION_ENV
from tests.helpers import worker_calls
from tests.helpers.hf_checkpoints import TINY_CONFIG, save_tiny_checkpoint

ENGINE = {"skip_tokenizer_init": True, "max_model_len": 64, "num_gpu_blocks_override": 16}
PROMPT = {"prompt_token_ids": [5, 6, 7]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rpc") / "llama"
    save_tiny_checkpoint("llama", path, seed=1)
    return str(path)


def _tiny_llama_params(tp: int) -> int:
    """The tiny Llama's parameters on one of ``tp`` ranks (vocabulary and
    projections split; norms replicated), counted from its config."""
    c = TINY_CONFIG
    h, i, layers, vocab = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["vocab_size"],
    )
    head_dim = h // c["num_attention_heads"]
    qkv = h * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim
    per_layer = (qkv + h * h + 3 * h * i) // tp + 2 * h
    return 2 * vocab * h // tp + layers * per_layer + h


@pytest.mark.parametrize("tp", [1, 2])
def test_every_rank_answers(checkpoint, tp, monkeypatch) -> None:
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(checkpoint, tensor_parallel_size=tp, **ENGINE)
    try:
        assert llm.apply_model(worker_calls.num_params) == [_tiny_llama_params(tp)] * tp
        answers = llm.collective_rpc(worker_calls.rank_and_sum, args=(3,), kwargs={"y": 4})
        assert answers == [(rank, 7) for rank in range(tp)]
        # A WorkerMethod by name: apply_model is collective_rpc("apply_model").
        by_name = llm.collective_rpc("apply_model", args=(worker_calls.num_params,))
        assert by_name == [_tiny_llama_params(tp)] * tp
    finally:
        llm.shutdown()


def test_bad_calls_fail_clearly_and_the_engine_serves_on(checkpoint, monkeypatch) -> None:
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(checkpoint, **ENGINE)
    try:
        with pytest.raises(ValueError, match=r"no method 'nope' to call by name \(get_kv_cache"):
            llm.collective_rpc("nope")
        with pytest.raises(ValueError, match="keyword arguments go with a function"):
            llm.collective_rpc("apply_model", kwargs={"fn": len})
        with pytest.raises(RuntimeError, match="rank 0 refuses"):
            llm.collective_rpc(worker_calls.fail)
        assert len(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_a_separate_engine_process_needs_the_users_consent(checkpoint, monkeypatch) -> None:
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.setenv(ALLOW_INSECURE_SERIALIZATION_ENV, "1")  # EngineCore inherits it
    llm = LLM(checkpoint, **ENGINE)
    try:
        monkeypatch.delenv(ALLOW_INSECURE_SERIALIZATION_ENV)  # the front end asks first
        with pytest.raises(ValueError, match=f"pickled: set {ALLOW_INSECURE_SERIALIZATION_ENV}=1"):
            llm.apply_model(worker_calls.num_params)
        monkeypatch.setenv(ALLOW_INSECURE_SERIALIZATION_ENV, "1")
        assert llm.apply_model(worker_calls.num_params) == [_tiny_llama_params(1)]
        row = llm.apply_model(worker_calls.first_weight_row)
        assert len(row) == 1 and len(row[0]) == 4
        with pytest.raises(ValueError, match="cannot send its arguments to the EngineCore process"):
            llm.apply_model(lambda model: 0)
        with pytest.raises(RuntimeError, match="rank 0 refuses"):
            llm.collective_rpc(worker_calls.fail)
        assert len(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()

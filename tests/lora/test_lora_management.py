"""The engine's adapter calls, as vLLM's ``LLMEngine`` has them: ``add_lora``
(load now, so a broken adapter fails this call and not a step),
``list_loras``, ``remove_lora`` and ``pin_lora`` (kept in host memory).

* An added adapter serves requests with the same tokens as one loaded by the
  first request naming it; the trace records the load outside a step.
* A garbage weights file, an adapter trained for a base model of another
  size and one with layers this model lacks are refused, naming the adapter
  and the reason; the engine keeps serving. So is a request naming one
  without ``add_lora`` (the front end has the workers read a new adapter
  once, ``check_lora``), where the step loading it used to end the engine.
* Pinning: a pinned adapter survives the LRU host cache; at most
  ``max_cpu_loras - max_loras`` may be pinned, and only loaded ones.
* Through the EngineCore process: the ``LoRARequest`` argument survives the
  utility call (msgpack -> struct), ``list_loras`` comes back as a set.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.lora.request import LoRARequest
from engine.tracing import load_trace
from tests.helpers.hf_checkpoints import TINY_CONFIG, save_tiny_checkpoint
from tests.helpers.lora_adapters import save_peft_adapter

VOCAB = TINY_CONFIG["vocab_size"]
PROMPT = {"prompt_token_ids": [(7 * j + 3) % VOCAB for j in range(12)]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ENGINE = {"skip_tokenizer_init": True, "max_model_len": 64, "num_gpu_blocks_override": 32}
LORA = {"enable_lora": True, "max_lora_rank": 8}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_management")
    save_tiny_checkpoint("llama", root / "base", seed=1)
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        save_peft_adapter(root / "base", root / name, seed=seed, r=4)
    garbage = root / "garbage"
    save_peft_adapter(root / "base", garbage, seed=4, r=4)
    (garbage / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    # Adapters trained on other base models: wider layers, one more layer.
    save_tiny_checkpoint("llama", root / "wide", seed=1, hidden_size=32, intermediate_size=64)
    save_peft_adapter(root / "wide", root / "for_wide", seed=5, r=4)
    save_tiny_checkpoint("llama", root / "deep", seed=1, num_hidden_layers=3)
    save_peft_adapter(root / "deep", root / "for_deep", seed=6, r=4, targets=["q_proj"])
    requests = {
        name: LoRARequest(name, i, str(root / name))
        for i, name in enumerate(("a", "b", "c", "garbage", "for_wide", "for_deep"), start=1)
    }
    return {"base": str(root / "base"), **requests}


def _tokens(llm: LLM, lora_request: LoRARequest | None) -> list[int]:
    (out,) = llm.generate([PROMPT], GREEDY, lora_request=lora_request, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def test_added_adapters_serve_and_broken_ones_are_refused(adapters, tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    lazy = LLM(adapters["base"], **LORA, **ENGINE)
    want = _tokens(lazy, adapters["a"])  # loaded by the step that first ran it
    lazy.shutdown()
    trace = tmp_path / "trace.jsonl"
    llm = LLM(adapters["base"], **LORA, **ENGINE, trace_path=str(trace))
    engine = llm.llm_engine
    try:
        assert engine.add_lora(adapters["a"]) is True
        assert engine.add_lora(adapters["a"]) is False  # already loaded
        assert engine.list_loras() == {1}
        for name, reason in (
            ("garbage", "header"),
            ("for_wide", r"do not fit this model's layer \(lora_A \[4, 64\]"),
            ("for_deep", r"model.layers.2.self_attn.q_proj: no such layer in this model"),
        ):
            message = rf"LoRA adapter '{name}' \(.*\) could not be loaded: .*{reason}"
            with pytest.raises(ValueError, match=message):
                engine.add_lora(adapters[name])
        assert engine.list_loras() == {1}  # nothing half-loaded
        with pytest.raises(ValueError, match=r"LoRA adapter 'for_wide' .* could not be loaded"):
            _tokens(llm, adapters["for_wide"])  # never added: checked when first named
        assert engine.list_loras() == {1} and not engine.has_unfinished_requests()
        assert _tokens(llm, adapters["a"]) == want
        assert engine.remove_lora(1) is True and engine.list_loras() == set()
        assert _tokens(llm, adapters["a"]) == want  # named again: loaded again
    finally:
        llm.shutdown()
    slots = [e for e in load_trace(str(trace)) if e.kind == "lora.slots"]
    assert slots[0].loaded == [1] and slots[0].token_slots == {}  # add_lora, outside a step
    plain = LLM(adapters["base"], **ENGINE)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.llm_engine.add_lora(adapters["a"])
    plain.shutdown()


def test_a_pinned_adapter_outlives_the_lru(adapters, monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(adapters["base"], **LORA, max_loras=1, max_cpu_loras=2, **ENGINE)
    engine = llm.llm_engine
    try:
        with pytest.raises(ValueError, match="LoRA 1 is not loaded: add_lora it first"):
            engine.pin_lora(1)
        engine.add_lora(adapters["a"])
        assert engine.pin_lora(1) is True
        engine.add_lora(adapters["b"])
        with pytest.raises(ValueError, match=r"at most max_cpu_loras - max_loras = 1 adapters"):
            engine.pin_lora(2)
        engine.add_lora(adapters["c"])  # the host cache holds 2: b goes, pinned a stays
        assert engine.list_loras() == {1, 3}
        _tokens(llm, adapters["b"])  # b comes back for its request, c makes room
        assert engine.list_loras() == {1, 2}
    finally:
        llm.shutdown()


def test_adapter_calls_cross_the_process_boundary(adapters, monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(adapters["base"], **LORA, **ENGINE)
    engine = llm.llm_engine
    try:
        assert engine.add_lora(adapters["b"]) is True
        assert engine.list_loras() == {2}
        with pytest.raises(RuntimeError, match=r"add_lora failed: LoRA adapter 'garbage'"):
            engine.add_lora(adapters["garbage"])
        with pytest.raises(ValueError, match=r"^LoRA adapter 'garbage' \(.*\) could not be loaded"):
            _tokens(llm, adapters["garbage"])
        assert len(_tokens(llm, adapters["b"])) == GREEDY.max_tokens  # still serving
        assert engine.remove_lora(2) is True
    finally:
        llm.shutdown()

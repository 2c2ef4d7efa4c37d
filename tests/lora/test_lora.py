"""Multi-LoRA serving on the CPU, against HF ``peft`` as the oracle.

* One batch mixing two adapters (rank 8, and rank 4 with rsLoRA scaling) and
  the base model: every request's greedy tokens equal ``peft``'s with its
  adapter, logprobs within 1e-4 (fp32).
* The embedded default model with an adapter: the same against ``peft``.
* One slot (``max_loras=1``, ``max_cpu_loras=1``): adapters are evicted and
  reloaded between requests, outputs unchanged; the scheduler never puts two
  adapters in one step; the trace records loads, evictions and slots.
* The prefix cache keeps adapters apart: the same prompt under another
  adapter gets no cached blocks.
* Bad input fails before the request enters the engine, naming the problem,
  and leaves the engine usable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.lora.request import LoRARequest
from tests.helpers.hf_checkpoints import TINY_CONFIG, hf_greedy, save_tiny_checkpoint
from tests.helpers.lora_adapters import save_peft_adapter

pytestmark = pytest.mark.usefixtures("in_process_engine")

VOCAB = TINY_CONFIG["vocab_size"]
PROMPT = [(7 * j + 3) % VOCAB for j in range(12)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
ENGINE = {"skip_tokenizer_init": True, "max_model_len": 64, "num_gpu_blocks_override": 32}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_checkpoint("llama", root / "base", seed=1)
    a = save_peft_adapter(root / "base", root / "a", seed=1, r=8)
    b = save_peft_adapter(root / "base", root / "b", seed=2, r=4, use_rslora=True)
    return {
        "base_dir": str(root / "base"),
        "a": LoRARequest("a", 1, str(root / "a")),
        "b": LoRARequest("b", 2, str(root / "b")),
        "want": {name: hf_greedy(m, PROMPT, 6) for name, m in (("a", a), ("b", b), ("base", base))},
        "root": root,
    }


def _assert_matches(out, want, atol: float = 1e-4) -> None:
    assert list(out.outputs[0].token_ids) == want.token_ids
    for pos, logprobs in enumerate(out.outputs[0].logprobs):
        for token, lp in logprobs.items():
            assert abs(lp.logprob - want.logprobs[pos, token].item()) <= atol, (pos, token)


def test_a_mixed_batch_equals_peft_per_adapter(models) -> None:
    llm = LLM(models["base_dir"], enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    prompts = [{"prompt_token_ids": PROMPT}] * 3
    outs = llm.generate(prompts, GREEDY, lora_request=[models["a"], models["b"], None])
    llm.shutdown()
    for out, name in zip(outs, ("a", "b", "base"), strict=True):
        _assert_matches(out, models["want"][name])
        assert out.lora_request == models.get(name)  # echoed back, None for the base model


def test_one_slot_evicts_and_reloads(models, tmp_path: Path) -> None:
    from engine.tracing import LoRASlots, RequestAdded, SchedStep, load_trace

    trace = tmp_path / "trace.jsonl"
    llm = LLM(
        models["base_dir"],
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
        max_lora_rank=8,
        trace_path=str(trace),
        **ENGINE,
    )
    order = ["a", "b", "a", "base"]
    for name in order:  # one at a time: every switch evicts and reloads
        (out,) = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, lora_request=models.get(name))
        _assert_matches(out, models["want"][name])
    # Submitted together: the scheduler runs them one adapter at a time.
    outs = llm.generate(
        [{"prompt_token_ids": PROMPT}] * 2, GREEDY, lora_request=[models["a"], models["b"]]
    )
    llm.shutdown()
    for out, name in zip(outs, ("a", "b"), strict=True):
        _assert_matches(out, models["want"][name])
    events = load_trace(str(trace))
    lora_of = {e.request_id: e.lora_name for e in events if isinstance(e, RequestAdded)}
    for step in (e for e in events if isinstance(e, SchedStep)):
        assert len({lora_of[r] for r in step.num_scheduled_tokens} - {""}) <= 1
    slots = [e for e in events if isinstance(e, LoRASlots)]
    # a, b, a; the base model loads nothing; then a (still in its slot) and b.
    assert [e.loaded for e in slots if e.loaded] == [[1], [2], [1], [2]]
    assert any(e.evicted_from_slots == [1] and e.evicted_from_cpu == [1] for e in slots)
    assert all(len(e.slots) == 1 for e in slots)


def test_prefix_cache_keeps_adapters_apart(models) -> None:
    llm = LLM(models["base_dir"], enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    long_prompt = {"prompt_token_ids": [(5 * j + 1) % VOCAB for j in range(40)]}
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    (first,) = llm.generate([long_prompt], params, lora_request=models["a"])
    (other,) = llm.generate([long_prompt], params, lora_request=models["b"])
    (again,) = llm.generate([long_prompt], params, lora_request=models["a"])
    llm.shutdown()
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens == 32  # two full 16-token blocks


def test_default_model_with_an_adapter_equals_peft(tmp_path: Path) -> None:
    from tests.helpers.hf_checkpoints import default_model_path

    base = default_model_path()
    peft_model = save_peft_adapter(base, tmp_path / "a", seed=3, r=8, scale_b=0.05)
    prompt = [1, 504, 3575, 282, 4649, 314, 2]
    want = hf_greedy(peft_model, prompt, 5)
    llm = LLM(base, enable_lora=True, max_lora_rank=8, max_model_len=64, num_gpu_blocks_override=16)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    (out,) = llm.generate(
        [{"prompt_token_ids": prompt}],
        params,
        lora_request=LoRARequest("a", 1, str(tmp_path / "a")),
    )
    llm.shutdown()
    _assert_matches(out, want)


def test_bad_adapters_are_refused_before_the_engine(models, tmp_path: Path) -> None:
    root = models["root"]
    save_peft_adapter(models["base_dir"], tmp_path / "r16", seed=4, r=16)
    embed = tmp_path / "embed"
    save_peft_adapter(models["base_dir"], embed, seed=5, r=4, targets=["q_proj"])
    config = json.loads((embed / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "lm_head"]
    (embed / "adapter_config.json").write_text(json.dumps(config))
    llm = LLM(models["base_dir"], enable_lora=True, max_lora_rank=8, **ENGINE)
    prompt = {"prompt_token_ids": PROMPT}
    cases = [
        (LoRARequest("gone", 3, str(root / "nowhere")), "no adapter_config.json"),
        (LoRARequest("big", 4, str(tmp_path / "r16")), r"rank r=16 is larger than max_lora_rank=8"),
        (LoRARequest("head", 5, str(embed)), r"target modules \['lm_head'\] are not supported"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt], GREEDY, lora_request=request)
    with pytest.raises(ValueError, match="lora_request has 2 entries but there are 1 prompts"):
        llm.generate([prompt], GREEDY, lora_request=[models["a"], models["b"]])
    # Nothing was left behind: the engine still serves.
    assert not llm.llm_engine.has_unfinished_requests()
    (out,) = llm.generate([prompt], GREEDY, lora_request=models["a"])
    llm.shutdown()
    _assert_matches(out, models["want"]["a"])
    plain = LLM(models["base_dir"], **ENGINE)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate([prompt], GREEDY, lora_request=models["a"])
    plain.shutdown()
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, "x")
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be an integer >= max_loras"):
        LLM(models["base_dir"], enable_lora=True, max_loras=2, max_cpu_loras=1, **ENGINE)

"""Tests for engine/entrypoints/llm.py (twin of vllm/entrypoints/llm.py).

The whole offline stack runs for real -- LLM -> LLMEngine -> InputProcessor ->
InprocClient -> EngineCore -> Scheduler/KVCacheManager -> executor ->
OutputProcessor -- with ``CountingExecutor`` as the model (next token = last
token + 1) and the tiny word-level tokenizer, so every expected output below is
exact: the prompt "w5" continues " w6 w7 w8 ...".
"""

from __future__ import annotations

import pytest

from engine import LLM
from engine.logprobs import Logprob
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.v1.metrics.reader import Counter, Gauge
from tests.helpers.counting_executor import CountingExecutor, non_blocking
from tests.helpers.engine_fixtures import (
    ASSISTANT,
    BOS,
    EOS,
    SYSTEM,
    UNK,
    USER,
    VOCAB_SIZE,
    assert_engine_idle,
    get_executor,
    get_scheduler,
    ids,
    make_llm,
    metrics_by_name,
    num_gpu_blocks,
    scheduled_new_req_order,
)
from tests.helpers.tiny_model import make_tiny_model_dir


def user_ids(internal_ids: list[str]) -> list[str]:
    """The user's ids back from internal ones ("{user id}-{8 hex}")."""
    return [r.rsplit("-", 1)[0] for r in internal_ids]


def only_value(d: dict):
    (value,) = d.values()
    return value


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llm") / "tiny")


@pytest.fixture(scope="module")
def model_dir_no_tokenizer(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llm") / "notok", with_tokenizer=False)


@pytest.fixture
def llm(model_dir):
    return make_llm(model_dir, block_size=4)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def only(outputs: list[RequestOutput]) -> CompletionOutput:
    assert len(outputs) == 1
    assert len(outputs[0].outputs) == 1
    return outputs[0].outputs[0]


# ---------------------------------------------------------------------------
# Prompt forms and sampling-params forms
# ---------------------------------------------------------------------------
def test_generate_single_string(llm):
    outputs = llm.generate("w5", greedy(max_tokens=3), use_tqdm=False)
    assert len(outputs) == 1
    out = outputs[0]
    assert out.request_id == "0"
    assert out.prompt == "w5"
    assert out.prompt_token_ids == ids("w5")
    assert out.finished is True
    assert out.prompt_logprobs is None
    assert out.num_cached_tokens == 0
    completion = out.outputs[0]
    assert completion.index == 0
    assert completion.text == " w6 w7 w8"
    assert list(completion.token_ids) == ids("w6 w7 w8")
    assert completion.finish_reason == "length"
    assert completion.stop_reason is None
    assert completion.cumulative_logprob is None
    assert completion.logprobs is None
    assert_engine_idle(llm)


def test_generate_prompt_forms(llm):
    prompts = [
        "w1 w2",
        {"prompt": "w10"},
        {"prompt_token_ids": ids("w20 w21 w22")},
        {"prompt_token_ids": ids("w30"), "prompt": "custom text"},
    ]
    outputs = llm.generate(prompts, greedy(max_tokens=2), use_tqdm=False)
    assert [o.request_id for o in outputs] == ["0", "1", "2", "3"]
    assert [o.prompt for o in outputs] == ["w1 w2", "w10", None, "custom text"]
    assert [o.prompt_token_ids for o in outputs] == [
        ids("w1 w2"),
        ids("w10"),
        ids("w20 w21 w22"),
        ids("w30"),
    ]
    assert [list(o.outputs[0].token_ids) for o in outputs] == [
        ids("w3 w4"),
        ids("w11 w12"),
        ids("w23 w24"),
        ids("w31 w32"),
    ]
    # The text is decoded from the tokens, whatever prompt text was given.
    assert [o.outputs[0].text for o in outputs] == [" w3 w4", " w11 w12", " w23 w24", " w31 w32"]
    assert_engine_idle(llm)


def test_generate_single_token_ids_dict(llm):
    outputs = llm.generate({"prompt_token_ids": ids("w40")}, greedy(max_tokens=1), use_tqdm=False)
    assert only(outputs).token_ids == ids("w41")
    assert outputs[0].prompt is None


def test_generate_one_sampling_params_per_prompt(llm):
    params = [greedy(max_tokens=1), greedy(max_tokens=4), greedy(max_tokens=2)]
    outputs = llm.generate(["w0", "w10", "w20"], params, use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == [" w1", " w11 w12 w13 w14", " w21 w22"]
    # The caller's objects are not modified (LLM forces FINAL_ONLY on a clone).
    assert [p.max_tokens for p in params] == [1, 4, 2]
    assert all(p.output_kind == 0 for p in params)
    assert all(p.eos_token_id is None for p in params)


def test_sampling_params_length_mismatch(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["w1", "w2", "w3"], [greedy(), greedy()], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["w1"], ["not params"], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["w1"], {"max_tokens": 3}, use_tqdm=False)
    assert_engine_idle(llm)


def test_prompts_must_be_non_empty_and_typed(llm):
    with pytest.raises(ValueError, match="prompts is empty"):
        llm.generate([], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(42, greedy(), use_tqdm=False)
    assert_engine_idle(llm)


def test_outputs_in_input_order_when_finishing_out_of_order(llm):
    finished_order: list[str] = []
    real_step = llm.llm_engine.step

    def recording_step():
        outs = real_step()
        finished_order.extend(o.request_id for o in outs if o.finished)
        return outs

    llm.llm_engine.step = recording_step
    params = [greedy(max_tokens=5), greedy(max_tokens=1), greedy(max_tokens=3)]
    outputs = llm.generate(["w0", "w10", "w20"], params, use_tqdm=False)
    # Request "1" (1 token) finished first and "0" (5 tokens) last ...
    assert finished_order == ["1", "2", "0"]
    # ... but generate() hands them back in input order.
    assert [o.request_id for o in outputs] == ["0", "1", "2"]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 1, 3]
    assert [o.outputs[0].text for o in outputs] == [" w1 w2 w3 w4 w5", " w11", " w21 w22 w23"]


def test_request_ids_keep_counting_across_calls(llm):
    first = llm.generate(["w1", "w2"], greedy(max_tokens=1), use_tqdm=False)
    second = llm.generate("w3", greedy(max_tokens=1), use_tqdm=False)
    assert [o.request_id for o in first] == ["0", "1"]
    assert [o.request_id for o in second] == ["2"]


def test_default_sampling_params_come_from_generation_config(tmp_path):
    model = make_tiny_model_dir(
        tmp_path / "m",
        generation_config={
            "eos_token_id": EOS,
            "max_new_tokens": 4,
            "temperature": 0.0,
            "top_k": 5,
        },
    )
    llm = make_llm(model)
    defaults = llm.get_default_sampling_params()
    assert defaults.max_tokens == 4
    assert defaults.temperature == 0.0
    # Greedy turns top_k off (SamplingParams normalisation).
    assert defaults.top_k == 0
    outputs = llm.generate("w5", use_tqdm=False)
    assert only(outputs).text == " w6 w7 w8 w9"
    assert only(outputs).finish_reason == "length"


def test_generation_config_vllm_and_overrides(tmp_path):
    """--generation-config vllm ignores the model's defaults (its EOS still
    counts); override_generation_config replaces single keys."""
    model = make_tiny_model_dir(
        tmp_path / "m",
        generation_config={"eos_token_id": EOS, "max_new_tokens": 4, "temperature": 0.0},
    )
    neutral = make_llm(model, generation_config="vllm")
    defaults = neutral.get_default_sampling_params()
    assert (defaults.max_tokens, defaults.temperature) == (16, 1.0)
    overridden = make_llm(model, override_generation_config={"max_new_tokens": 2})
    defaults = overridden.get_default_sampling_params()
    assert (defaults.max_tokens, defaults.temperature) == (2, 0.0)
    assert only(overridden.generate("w5", use_tqdm=False)).text == " w6 w7"


def test_default_sampling_params_without_generation_defaults(llm):
    defaults = llm.get_default_sampling_params()
    assert defaults.max_tokens == 16
    assert defaults.temperature == 1.0
    outputs = llm.generate("w5", use_tqdm=False)
    assert len(only(outputs).token_ids) == 16


# ---------------------------------------------------------------------------
# Priority scheduling
# ---------------------------------------------------------------------------
def test_priority_orders_admission(model_dir):
    llm = make_llm(model_dir, scheduling_policy="priority", max_num_seqs=1)
    outputs = llm.generate(
        ["w1", "w2", "w3"], greedy(max_tokens=2), use_tqdm=False, priority=[2, 0, 1]
    )
    # One request runs at a time; the lowest priority value goes first.
    assert user_ids(scheduled_new_req_order(get_executor(llm))) == ["1", "2", "0"]
    assert [o.request_id for o in outputs] == ["0", "1", "2"]
    assert [o.outputs[0].text for o in outputs] == [" w2 w3", " w3 w4", " w4 w5"]
    assert_engine_idle(llm)


def test_fcfs_admission_order(model_dir):
    llm = make_llm(model_dir, max_num_seqs=1)
    llm.generate(["w1", "w2", "w3"], greedy(max_tokens=2), use_tqdm=False, priority=[0, 0, 0])
    assert user_ids(scheduled_new_req_order(get_executor(llm))) == ["0", "1", "2"]


def test_priority_under_fcfs_is_rejected(llm):
    with pytest.raises(ValueError, match="scheduling_policy"):
        llm.generate(["w1", "w2"], greedy(), use_tqdm=False, priority=[0, 1])
    # The first prompt (priority 0) was accepted before the second failed:
    # it must have been taken back out.
    assert_engine_idle(llm)


@pytest.mark.parametrize("priority", [[0], [0, 0, 0], 3])
def test_priority_wrong_length(model_dir, priority):
    llm = make_llm(model_dir, scheduling_policy="priority")
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["w1", "w2"], greedy(), use_tqdm=False, priority=priority)
    assert_engine_idle(llm)


# ---------------------------------------------------------------------------
# Progress bar
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("use_tqdm", [False, True])
def test_use_tqdm(llm, capsys, use_tqdm):
    outputs = llm.generate(["w1", "w2"], greedy(max_tokens=2), use_tqdm=use_tqdm)
    assert [o.outputs[0].text for o in outputs] == [" w2 w3", " w3 w4"]
    err = capsys.readouterr().err
    if use_tqdm:
        assert "Processed prompts" in err
        assert "2/2" in err
    else:
        assert "Processed prompts" not in err


# ---------------------------------------------------------------------------
# Parallel sampling (n > 1)
# ---------------------------------------------------------------------------
def test_parallel_sampling_returns_n_completions(llm):
    outputs = llm.generate(
        ["w5", "w20"],
        [SamplingParams(n=3, temperature=0.8, max_tokens=3), greedy(max_tokens=1)],
        use_tqdm=False,
    )
    assert [o.request_id for o in outputs] == ["0", "1"]
    first = outputs[0]
    assert first.finished
    assert [c.index for c in first.outputs] == [0, 1, 2]
    for c in first.outputs:
        # The counting model ignores temperature: every sample is the same.
        assert c.text == " w6 w7 w8"
        assert list(c.token_ids) == ids("w6 w7 w8")
        assert c.finish_reason == "length"
    assert only([outputs[1]]).text == " w21"
    # EngineCore only ever saw n=1 children, named "{index}_{parent's internal id}".
    order = scheduled_new_req_order(get_executor(llm))
    assert sorted(user_ids(order)) == ["0_0", "1", "1_0", "2_0"]
    parent = next(r for r in order if r.startswith("0_")).removeprefix("0_")
    assert sorted(r for r in order if r.endswith(parent)) == [f"{i}_{parent}" for i in range(3)]
    assert_engine_idle(llm)


def test_parallel_sampling_with_stop_strings(llm):
    outputs = llm.generate(
        "w5", SamplingParams(n=2, temperature=1.0, max_tokens=10, stop=["w8"]), use_tqdm=False
    )
    completions = outputs[0].outputs
    assert [(c.index, c.text, c.finish_reason, c.stop_reason) for c in completions] == [
        (0, " w6 w7 ", "stop", "w8"),
        (1, " w6 w7 ", "stop", "w8"),
    ]
    # Both children were aborted in the core when the front end saw "w8".
    assert_engine_idle(llm)


def test_greedy_parallel_sampling_is_rejected():
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(n=2, temperature=0.0)


# ---------------------------------------------------------------------------
# Stopping
# ---------------------------------------------------------------------------
def test_eos_from_generation_config_stops(llm):
    # w58 -> w59 system user assistant <unk> <s> </s>: the counting model
    # reaches EOS (id 2) after wrapping around the vocabulary.
    outputs = llm.generate("w58", greedy(max_tokens=20), use_tqdm=False)
    c = only(outputs)
    assert list(c.token_ids) == [*ids("w59"), SYSTEM, USER, ASSISTANT, UNK, BOS, EOS]
    assert c.finish_reason == "stop"
    assert c.stop_reason is None
    # Specials are skipped, and the EOS token's text is never added.
    assert c.text == " w59 system user assistant"
    assert_engine_idle(llm)


def test_ignore_eos(llm):
    outputs = llm.generate(
        {"prompt_token_ids": [ASSISTANT]}, greedy(max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    c = only(outputs)
    assert list(c.token_ids) == [UNK, BOS, EOS, 3, 4, 5]
    assert c.finish_reason == "length"
    assert c.stop_reason is None


def test_stop_token_ids(llm):
    outputs = llm.generate("w5", greedy(max_tokens=10, stop_token_ids=ids("w8")), use_tqdm=False)
    c = only(outputs)
    assert list(c.token_ids) == ids("w6 w7 w8")  # the stop token is kept in the ids
    assert c.text == " w6 w7"  # but not in the text
    assert c.finish_reason == "stop"
    assert c.stop_reason == ids("w8")[0]
    assert_engine_idle(llm)


def test_stop_token_text_kept_with_include_stop_str_in_output(llm):
    # vLLM (v1/engine/detokenizer.py, BaseIncrementalDetokenizer.update) only
    # leaves the stop token out of the text when include_stop_str_in_output is
    # False; with it set, the stop token's text is part of the output.
    outputs = llm.generate(
        "w5",
        greedy(max_tokens=10, stop_token_ids=ids("w8"), include_stop_str_in_output=True),
        use_tqdm=False,
    )
    c = only(outputs)
    assert list(c.token_ids) == ids("w6 w7 w8")
    assert c.finish_reason == "stop"
    assert c.stop_reason == ids("w8")[0]
    assert c.text == " w6 w7 w8"


def test_stop_string_truncates_and_aborts_in_core(llm):
    outputs = llm.generate("w5", greedy(max_tokens=10, stop=["w8"]), use_tqdm=False)
    c = only(outputs)
    assert c.text == " w6 w7 "
    assert list(c.token_ids) == ids("w6 w7 w8")
    assert c.finish_reason == "stop"
    assert c.stop_reason == "w8"
    # The core was told to abort the request: no request left, KV blocks back.
    assert_engine_idle(llm)
    # It stopped after the third step instead of running to max_tokens=10.
    assert len(get_executor(llm).steps) == 3


def test_stop_string_included_in_output(llm):
    outputs = llm.generate(
        "w5", greedy(max_tokens=10, stop=["w8"], include_stop_str_in_output=True), use_tqdm=False
    )
    c = only(outputs)
    assert c.text == " w6 w7 w8"
    assert c.finish_reason == "stop"
    assert c.stop_reason == "w8"
    assert_engine_idle(llm)


def test_first_listed_stop_string_wins(llm):
    # Both appear in " w6 w7"; the list is searched in order.
    outputs = llm.generate("w5", greedy(max_tokens=10, stop=["w7", "w6"]), use_tqdm=False)
    c = only(outputs)
    assert c.stop_reason == "w6"
    assert c.text == " "
    assert list(c.token_ids) == ids("w6")


def test_stop_string_on_the_last_allowed_token_reports_stop(llm):
    # "w8" is both the stop string and the max_tokens-th token. vLLM's
    # OutputProcessor.process_outputs sets finish_reason=STOP and
    # stop_reason=<the string> whenever the detokenizer finds a stop string,
    # even if EngineCore already finished the request for another reason.
    outputs = llm.generate("w5", greedy(max_tokens=3, stop=["w8"]), use_tqdm=False)
    c = only(outputs)
    assert c.text == " w6 w7 "
    assert c.finish_reason == "stop"
    assert c.stop_reason == "w8"
    assert_engine_idle(llm)


def test_stop_strings_wait_for_min_tokens(llm):
    # vLLM's detokenizer (BaseIncrementalDetokenizer.update) does not look
    # for stop strings in the first min_tokens output tokens, exactly as
    # check_stop ignores EOS / stop_token_ids there.
    outputs = llm.generate("w5", greedy(max_tokens=5, min_tokens=2, stop=["w6"]), use_tqdm=False)
    c = only(outputs)
    assert list(c.token_ids) == ids("w6 w7 w8 w9 w10")
    assert c.text == " w6 w7 w8 w9 w10"
    assert c.finish_reason == "length"
    assert c.stop_reason is None


def test_max_tokens_and_max_model_len_cap(model_dir):
    llm = make_llm(model_dir, max_model_len=8)
    prompt = {"prompt_token_ids": ids("w0 w1 w2 w3 w4")}
    capped = llm.generate(prompt, greedy(max_tokens=100), use_tqdm=False)
    # 8 - 5 = 3 positions are left for output.
    assert list(only(capped).token_ids) == ids("w5 w6 w7")
    assert only(capped).finish_reason == "length"
    open_ended = llm.generate(prompt, greedy(max_tokens=None), use_tqdm=False)
    assert list(only(open_ended).token_ids) == ids("w5 w6 w7")
    assert only(open_ended).finish_reason == "length"
    # A prompt of max_model_len - 1 tokens still gets exactly one token.
    longest = llm.generate(
        {"prompt_token_ids": ids("w0 w1 w2 w3 w4 w5 w6")}, greedy(max_tokens=4), use_tqdm=False
    )
    assert list(only(longest).token_ids) == ids("w7")
    assert_engine_idle(llm)


def test_min_tokens_masks_eos_and_stop_token_ids(llm):
    # "system" continues user assistant <unk> <s> </s>: EOS is the 5th token.
    plain = llm.generate({"prompt_token_ids": [SYSTEM]}, greedy(max_tokens=8), use_tqdm=False)
    assert list(only(plain).token_ids) == [USER, ASSISTANT, UNK, BOS, EOS]
    held = llm.generate(
        {"prompt_token_ids": [SYSTEM]}, greedy(max_tokens=8, min_tokens=6), use_tqdm=False
    )
    assert list(only(held).token_ids) == [USER, ASSISTANT, UNK, BOS, EOS, 3, 4, 5]
    assert only(held).finish_reason == "length"
    # A stop token id inside the first min_tokens tokens is ignored too; one
    # after them stops.
    outputs = llm.generate(
        "w5", greedy(max_tokens=6, min_tokens=2, stop_token_ids=ids("w6 w9")), use_tqdm=False
    )
    c = only(outputs)
    assert list(c.token_ids) == ids("w6 w7 w8 w9")
    assert c.stop_reason == ids("w9")[0]
    assert c.finish_reason == "stop"
    assert_engine_idle(llm)


# ---------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------
def test_logprobs(llm):
    outputs = llm.generate("w5", greedy(max_tokens=3, logprobs=2), use_tqdm=False)
    c = only(outputs)
    # CountingExecutor reports the sampled token with logprob -0.5 at rank 1
    # and the runner-up (sampled + 1) with -1.5 at rank 2.
    assert c.logprobs == [
        {10: Logprob(-0.5, 1, "w6"), 11: Logprob(-1.5, 2, "w7")},
        {11: Logprob(-0.5, 1, "w7"), 12: Logprob(-1.5, 2, "w8")},
        {12: Logprob(-0.5, 1, "w8"), 13: Logprob(-1.5, 2, "w9")},
    ]
    assert c.cumulative_logprob == pytest.approx(-1.5)


def test_logprobs_zero_gives_only_sampled_token(llm):
    outputs = llm.generate("w5", greedy(max_tokens=2, logprobs=0), use_tqdm=False)
    c = only(outputs)
    assert c.logprobs == [{10: Logprob(-0.5, 1, "w6")}, {11: Logprob(-0.5, 1, "w7")}]
    assert c.cumulative_logprob == pytest.approx(-1.0)


# ---------------------------------------------------------------------------
# Prefix caching
# ---------------------------------------------------------------------------
SHARED = "w0 w1 w2 w3 w4 w5 w6 w7"  # two full blocks of 4


def test_num_cached_tokens_with_prefix_caching(llm):
    first = llm.generate(SHARED + " w8 w9", greedy(max_tokens=2), use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    second = llm.generate(SHARED + " w20 w21", greedy(max_tokens=2), use_tqdm=False)
    assert second[0].num_cached_tokens == 8
    assert only(second).text == " w22 w23"
    assert_engine_idle(llm)


def test_num_cached_tokens_within_one_batch(llm):
    # The first request's full blocks are cached when they are allocated, so
    # the second request hits them in the same schedule() call.
    outputs = llm.generate(
        [SHARED + " w8 w9", SHARED + " w20 w21"], greedy(max_tokens=2), use_tqdm=False
    )
    assert [o.num_cached_tokens for o in outputs] == [0, 8]


def test_identical_prompt_recomputes_its_last_token(llm):
    prompt = SHARED  # exactly two blocks
    llm.generate(prompt, greedy(max_tokens=1), use_tqdm=False)
    again = llm.generate(prompt, greedy(max_tokens=1), use_tqdm=False)
    # The last prompt token must run through the model, so only the first
    # block (4 tokens) can be a hit.
    assert again[0].num_cached_tokens == 4


def test_no_cached_tokens_without_prefix_caching(model_dir):
    llm = make_llm(model_dir, block_size=4, enable_prefix_caching=False)
    llm.generate(SHARED + " w8 w9", greedy(max_tokens=2), use_tqdm=False)
    second = llm.generate(SHARED + " w20 w21", greedy(max_tokens=2), use_tqdm=False)
    assert second[0].num_cached_tokens == 0
    assert metrics_by_name(llm)["glassbox:prefix_cache_queries"].value == 0
    assert_engine_idle(llm)


def test_reset_prefix_cache(llm):
    llm.generate(SHARED + " w8", greedy(max_tokens=1), use_tqdm=False)
    assert llm.reset_prefix_cache() is True
    again = llm.generate(SHARED + " w9", greedy(max_tokens=1), use_tqdm=False)
    assert again[0].num_cached_tokens == 0


# ---------------------------------------------------------------------------
# Bad input leaves nothing behind
# ---------------------------------------------------------------------------
BAD_PROMPTS = {
    "empty text": ("", "empty"),
    "empty ids": ({"prompt_token_ids": []}, "empty"),
    "too long ids": ({"prompt_token_ids": list(range(4, 20))}, "max_model_len"),
    "too long text": (" ".join(["w1"] * 16), "max_model_len"),
    "id past vocab": ({"prompt_token_ids": [4, VOCAB_SIZE]}, "vocab"),
    "negative id": ({"prompt_token_ids": [4, -1]}, "vocab"),
    "non-int id": ({"prompt_token_ids": [4, "5"]}, "prompt_token_ids"),
    "bool id": ({"prompt_token_ids": [4, True]}, "prompt_token_ids"),
    "wrong type": (42, "prompt"),
    "text not str": ({"prompt": 5}, "prompt must be a string"),
    "unknown dict": ({"text": "w1"}, "prompt"),
}


@pytest.mark.parametrize("bad,match", list(BAD_PROMPTS.values()), ids=list(BAD_PROMPTS))
def test_bad_prompt_rejects_the_whole_batch(model_dir, bad, match):
    llm = make_llm(model_dir, block_size=4, max_model_len=16)
    prompts = ["w1", "w2 w3", bad, "w4"]
    params = [
        greedy(max_tokens=2),
        SamplingParams(n=2, temperature=1.0, max_tokens=2),  # a parent with children
        greedy(max_tokens=2),
        greedy(max_tokens=2),
    ]
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert_engine_idle(llm)
    # The engine is still usable and returns only the new request.
    outputs = llm.generate("w5", greedy(max_tokens=2), use_tqdm=False)
    assert len(outputs) == 1
    assert only(outputs).text == " w6 w7"
    assert_engine_idle(llm)


def test_skip_tokenizer_init(model_dir_no_tokenizer):
    llm = make_llm(model_dir_no_tokenizer, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate("w5", greedy(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate([{"prompt_token_ids": ids("w5")}, "w5"], greedy(max_tokens=2), use_tqdm=False)
    assert_engine_idle(llm)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.get_tokenizer()

    outputs = llm.generate({"prompt_token_ids": ids("w5")}, greedy(max_tokens=3), use_tqdm=False)
    c = only(outputs)
    assert list(c.token_ids) == ids("w6 w7 w8")
    assert c.text == ""
    assert outputs[0].prompt is None
    # With no tokenizer there is no primary EOS; generation_config's
    # eos_token_id becomes an ordinary stop token id (as in vLLM).
    eos = llm.generate({"prompt_token_ids": [BOS]}, greedy(max_tokens=5), use_tqdm=False)
    assert list(only(eos).token_ids) == [EOS]
    assert only(eos).finish_reason == "stop"
    assert only(eos).stop_reason == EOS
    assert_engine_idle(llm)


def test_unknown_keyword_is_a_type_error(model_dir):
    with pytest.raises(TypeError, match="not_a_real_arg"):
        make_llm(model_dir, not_a_real_arg=1)
    with pytest.raises(TypeError, match="gpu_blocks"):
        make_llm(model_dir, gpu_blocks=4)


# ---------------------------------------------------------------------------
# Preemption and chunked prefill
# ---------------------------------------------------------------------------
def test_preemption_under_a_tiny_pool_gives_complete_outputs(model_dir):
    # 9 usable blocks of 4 tokens; each request ends with 8 + 16 = 24 tokens
    # = 6 blocks, so three of them cannot all stay resident.
    llm = make_llm(model_dir, block_size=4, max_model_len=32, num_gpu_blocks_override=10)
    prompts = [{"prompt_token_ids": list(range(4 + 10 * i, 12 + 10 * i))} for i in range(3)]
    outputs = llm.generate(prompts, greedy(max_tokens=16), use_tqdm=False)
    for i, out in enumerate(outputs):
        c = only([out])
        assert list(c.token_ids) == list(range(12 + 10 * i, 28 + 10 * i))
        assert c.finish_reason == "length"
    metrics = metrics_by_name(llm)
    assert metrics["glassbox:num_preemptions"].value > 0
    # Recomputing a preempted prompt counts neither as new prompt tokens nor
    # as a fresh prefix-cache query.
    assert metrics["glassbox:prompt_tokens"].value == 24
    assert metrics["glassbox:prefix_cache_queries"].value == 24
    assert metrics["glassbox:num_preemptions"].value == get_scheduler(llm).num_preemptions_total
    assert metrics["glassbox:generation_tokens"].value == 48
    assert any(step.preempted_req_ids for step in get_executor(llm).steps)
    assert_engine_idle(llm)


def test_chunked_prefill_of_a_long_prompt(model_dir):
    llm = make_llm(model_dir, block_size=4, max_num_batched_tokens=8)
    prompt = {"prompt_token_ids": list(range(4, 24))}  # 20 tokens
    outputs = llm.generate(prompt, greedy(max_tokens=2), use_tqdm=False)
    assert list(only(outputs).token_ids) == [24, 25]
    steps = get_executor(llm).steps
    assert [only_value(s.num_scheduled_tokens) for s in steps] == [8, 8, 4, 1]
    assert_engine_idle(llm)


# ---------------------------------------------------------------------------
# Chat
# ---------------------------------------------------------------------------
def test_chat_applies_the_template(llm):
    outputs = llm.chat([{"role": "user", "content": "w1 w2"}], greedy(max_tokens=5), use_tqdm=False)
    out = outputs[0]
    assert out.prompt == "user w1 w2 assistant"
    assert out.prompt_token_ids == [USER, *ids("w1 w2"), ASSISTANT]
    c = only(outputs)
    # After "assistant" the counting model wraps around to <unk> <s> </s>.
    assert list(c.token_ids) == [UNK, BOS, EOS]
    assert c.finish_reason == "stop"
    assert c.text == ""
    assert_engine_idle(llm)


def test_chat_without_generation_prompt(llm):
    outputs = llm.chat(
        [{"role": "system", "content": "w0"}, {"role": "user", "content": "w1 w2"}],
        greedy(max_tokens=3),
        use_tqdm=False,
        add_generation_prompt=False,
    )
    assert outputs[0].prompt == "system w0 user w1 w2 "
    assert outputs[0].prompt_token_ids == [SYSTEM, *ids("w0"), USER, *ids("w1 w2")]
    assert only(outputs).text == " w3 w4 w5"


def test_chat_batch_of_conversations(llm):
    conversations = [
        [{"role": "user", "content": "w10"}],
        [{"role": "user", "content": "w20 w21"}],
    ]
    outputs = llm.chat(
        conversations, greedy(max_tokens=2), use_tqdm=False, add_generation_prompt=False
    )
    assert [o.prompt_token_ids for o in outputs] == [
        [USER, *ids("w10")],
        [USER, *ids("w20 w21")],
    ]
    assert [o.outputs[0].text for o in outputs] == [" w11 w12", " w22 w23"]


def test_chat_custom_template(llm):
    outputs = llm.chat(
        [{"role": "user", "content": "w30"}],
        greedy(max_tokens=1),
        use_tqdm=False,
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    assert outputs[0].prompt_token_ids == ids("w30")
    assert only(outputs).text == " w31"


@pytest.mark.parametrize(
    "messages",
    [[], "w1", [{"role": "user"}], [{"content": "w1"}], [["not a dict"]]],
    ids=["empty", "string", "no content", "no role", "not a dict"],
)
def test_chat_rejects_bad_messages(llm, messages):
    with pytest.raises(ValueError):
        llm.chat(messages, greedy(), use_tqdm=False)
    assert_engine_idle(llm)


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------
METRIC_TYPES = {
    "glassbox:num_requests_running": Gauge,
    "glassbox:num_requests_waiting": Gauge,
    "glassbox:kv_cache_usage_perc": Gauge,
    "glassbox:num_preemptions": Counter,
    "glassbox:prefix_cache_queries": Counter,
    "glassbox:prefix_cache_hits": Counter,
    "glassbox:prompt_tokens": Counter,
    "glassbox:generation_tokens": Counter,
    "glassbox:engine_dead": Gauge,
}


def test_get_metrics(llm, model_dir):
    llm.generate(SHARED + " w8 w9", greedy(max_tokens=4), use_tqdm=False)
    llm.generate(SHARED + " w20 w21", greedy(max_tokens=3), use_tqdm=False)
    metrics = llm.get_metrics()
    assert [m.name for m in metrics] == list(METRIC_TYPES)
    by_name = {m.name: m for m in metrics}
    for name, kind in METRIC_TYPES.items():
        metric = by_name[name]
        assert type(metric) is kind, name
        assert metric.labels == {"model_name": str(model_dir)}
        assert isinstance(metric.value, float if kind is Gauge else int), name
    values = {name: m.value for name, m in by_name.items()}
    assert values == {
        # Nothing is left running; the last snapshot is taken after freeing.
        "glassbox:num_requests_running": 0.0,
        "glassbox:num_requests_waiting": 0.0,
        "glassbox:kv_cache_usage_perc": 0.0,
        "glassbox:num_preemptions": 0,
        # Two 10-token prompts looked up; the second hit two blocks of 4.
        "glassbox:prefix_cache_queries": 20,
        "glassbox:prefix_cache_hits": 8,
        "glassbox:prompt_tokens": 20,
        "glassbox:generation_tokens": 7,
        "glassbox:engine_dead": 0.0,
    }


def test_metrics_while_requests_are_in_flight(model_dir):
    llm = make_llm(model_dir, block_size=4, max_num_seqs=1)
    engine = llm.llm_engine
    params = greedy(max_tokens=3)
    engine.add_request("a", "w0 w1 w2 w3 w4", params)
    engine.add_request("b", "w10", params)
    engine.step()
    values = {m.name: m.value for m in llm.get_metrics()}
    assert values["glassbox:num_requests_running"] == 1.0
    assert values["glassbox:num_requests_waiting"] == 1.0
    # "a" holds 2 of the 255 usable blocks (5 prompt tokens + 1 slot).
    assert values["glassbox:kv_cache_usage_perc"] == pytest.approx(2 / (num_gpu_blocks(llm) - 1))
    assert values["glassbox:prompt_tokens"] == 5
    assert values["glassbox:generation_tokens"] == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_idle(llm)


def test_metrics_off_with_disable_log_stats(model_dir):
    llm = make_llm(model_dir, disable_log_stats=True)
    llm.generate("w1", greedy(max_tokens=1), use_tqdm=False)
    with pytest.raises(RuntimeError, match="disable_log_stats"):
        llm.get_metrics()


def test_llm_collects_no_statistics_unless_asked(model_dir, monkeypatch):
    """vLLM's LLM sets disable_log_stats=True unless told otherwise."""
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(model_dir), distributed_executor_backend=CountingExecutor)
    try:
        assert llm.llm_engine.stat_logger is None
        with pytest.raises(RuntimeError, match=r"LLM's default, as in vLLM\); pass disable_log"):
            llm.get_metrics()
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------
# LLMEngine underneath
# ---------------------------------------------------------------------------
def test_llm_forces_final_only_outputs(llm):
    params = greedy(max_tokens=3, output_kind=RequestOutputKind.DELTA)
    outputs = llm.generate("w5", params, use_tqdm=False)
    # One complete output per request, whatever output_kind the caller set.
    assert only(outputs).text == " w6 w7 w8"
    assert params.output_kind == RequestOutputKind.DELTA


def test_llm_engine_streams_deltas(llm):
    engine = llm.llm_engine
    engine.add_request("s", "w5", greedy(max_tokens=3, output_kind=RequestOutputKind.DELTA))
    seen = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.append((o.request_id, o.outputs[0].text, list(o.outputs[0].token_ids), o.finished))
    assert seen == [
        ("s", " w6", ids("w6"), False),
        ("s", " w7", ids("w7"), False),
        ("s", " w8", ids("w8"), True),
    ]
    assert_engine_idle(llm)


def test_llm_engine_request_ids(llm):
    """The user's id may be reused while in flight (as in vLLM): each request
    gets its own internal id, and an abort by the user's id takes them all."""
    engine = llm.llm_engine
    x1 = engine.add_request("x", "w1", greedy(max_tokens=1))
    x2 = engine.add_request("x", "w2", greedy())
    assert x1 != x2 and user_ids([x1, x2]) == ["x", "x"]
    engine.add_request("p", "w1", SamplingParams(n=2, temperature=1.0))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("", "w2", greedy())
    assert engine.get_num_unfinished_requests() == 4  # x twice and p's two children
    engine.abort_request(["x", "p"])
    assert_engine_idle(llm)


def test_engine_failure_mid_generate_leaves_nothing_queued(model_dir):
    class FailsOnce(CountingExecutor):
        failed = False

        @non_blocking
        def execute_model(self, scheduler_output):
            if len(self.steps) == 2 and not self.failed:
                self.failed = True
                raise RuntimeError("worker died")
            return super().execute_model(scheduler_output)

    llm = make_llm(model_dir, executor=FailsOnce, block_size=4)
    with pytest.raises(RuntimeError, match="worker died"):
        llm.generate(["w1 w2 w3 w4 w5", "w10"], greedy(max_tokens=5), use_tqdm=False)
    # Every request of the interrupted call was aborted and its blocks freed.
    assert_engine_idle(llm)
    outputs = llm.generate("w20", greedy(max_tokens=2), use_tqdm=False)
    assert only(outputs).text == " w21 w22"
    assert_engine_idle(llm)


def test_shutdown_shuts_the_executor_down(llm):
    executor = get_executor(llm)
    assert not executor.is_shutdown
    llm.shutdown()
    assert executor.is_shutdown
    assert isinstance(executor, CountingExecutor)


def test_from_engine_args_takes_every_field(model_dir, monkeypatch):
    """vLLM's ``LLM.from_engine_args``: the fields as given, so statistics
    follow ``EngineArgs``' own default (on), not ``LLM()``'s (off)."""
    from engine.engine.arg_utils import EngineArgs

    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    args = EngineArgs(
        model=str(model_dir), block_size=4, distributed_executor_backend=CountingExecutor
    )
    llm = LLM.from_engine_args(args)
    try:
        assert llm.llm_engine.glassbox_config.cache_config.block_size == 4
        assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1
        assert only(llm.generate("w5", greedy(max_tokens=2), use_tqdm=False)).text == " w6 w7"
        assert metrics_by_name(llm)  # statistics on, as EngineArgs has them
    finally:
        llm.shutdown()


def test_enqueue_then_wait_for_completion(llm):
    """vLLM's two-part generate: requests queued by several ``enqueue`` calls
    run together in ``wait_for_completion``, their outputs in the order added."""
    first = llm.enqueue(["w5", "w20"], greedy(max_tokens=2))
    second = llm.enqueue("w9", greedy(max_tokens=3))
    assert llm.llm_engine.get_num_unfinished_requests() == 3
    assert get_executor(llm).steps == []  # nothing ran yet
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == user_ids(first + second)
    assert [o.outputs[0].text for o in outputs] == [" w6 w7", " w21 w22", " w10 w11 w12"]
    # All three were scheduled in the first step.
    assert len(get_executor(llm).steps[0].scheduled_new_reqs) == 3
    assert llm.wait_for_completion(use_tqdm=False) == []
    assert_engine_idle(llm)

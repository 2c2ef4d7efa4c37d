"""What speculative decoding refuses, as vLLM does, each with a one-line
error naming the field: per-request min_p / logit_bias (the rejection
sampler does not apply them to drafts), custom logits processors, async
scheduling with n-gram, and the methods Glassbox does not build yet."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.engine.arg_utils import EngineArgs
from engine.v1.sample.logits_processor import (
    STR_SPEC_DEC_REJECTS_LOGITSPROCS,
    MinTokensLogitsProcessor,
    build_logitsprocs,
)
from tests.helpers.tiny_model import make_tiny_model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
TINY = {
    "load_format": "dummy",
    "device": "cpu",
    "dtype": "float32",
    "hf_overrides": {"intermediate_size": 32},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("spec_guards") / "tiny"))


@pytest.fixture(scope="module")
def llm(model_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    try:
        yield LLM(model_dir, **TINY, speculative_config=NGRAM)
    finally:
        mp.undo()


@pytest.mark.parametrize(
    "params", [SamplingParams(min_p=0.1, max_tokens=2), SamplingParams(logit_bias={3: 1.0})]
)
def test_min_p_and_logit_bias_are_refused(llm, params):
    with pytest.raises(ValueError, match="min_p and logit_bias are not supported with spec"):
        llm.generate(["w1 w2"], params, use_tqdm=False)
    # Nothing was left behind: the engine still serves a plain request.
    (out,) = llm.generate(["w1 w2"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_only_min_tokens_is_built_and_custom_processors_are_refused(model_dir):
    config = EngineArgs(model=model_dir, **TINY, speculative_config=NGRAM).create_engine_config()
    procs = build_logitsprocs(config, device="cpu", is_pin_memory=False)
    assert [type(p) for p in procs.all] == [MinTokensLogitsProcessor]
    with pytest.raises(ValueError, match=STR_SPEC_DEC_REJECTS_LOGITSPROCS):
        build_logitsprocs(
            config, "cpu", False, custom_logitsprocs=["engine.v1.sample.logits_processor:X"]
        )


def test_ngram_turns_async_scheduling_off_and_refuses_it_when_asked(model_dir):
    config = EngineArgs(model=model_dir, **TINY, speculative_config=NGRAM).create_engine_config()
    assert config.scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match="async"):
        EngineArgs(
            model=model_dir, **TINY, speculative_config=NGRAM, async_scheduling=True
        ).create_engine_config()


@pytest.mark.parametrize("method, default", [("draft_model", False), ("eagle", True)])
def test_model_drafters_follow_vllms_async_scheduling_rule(model_dir, method, default):
    # vLLM's rule: EAGLE overlaps steps by default, a draft model when asked;
    # asking for the serial loop is always allowed.
    spec = {"method": method, "model": model_dir, "num_speculative_tokens": 2}
    config = EngineArgs(model=model_dir, **TINY, speculative_config=spec).create_engine_config()
    assert config.scheduler_config.async_scheduling is default
    draft = config.speculative_config.draft_model_config
    assert draft.max_model_len == config.model_config.max_model_len
    expected = "EagleLlamaForCausalLM" if method == "eagle" else "LlamaForCausalLM"
    assert draft.architectures == [expected]
    for asked in (True, False):
        config = EngineArgs(
            model=model_dir, **TINY, speculative_config=spec, async_scheduling=asked
        ).create_engine_config()
        assert config.scheduler_config.async_scheduling is asked


def test_a_speculative_config_that_is_not_an_object_is_refused(model_dir):
    with pytest.raises(ValueError, match="speculative_config must be a JSON object"):
        EngineArgs(model=model_dir, **TINY, speculative_config="ngram").create_engine_config()


def test_more_drafts_than_one_step_can_verify_are_refused(model_dir):
    spec = {**NGRAM, "num_speculative_tokens": 16}
    with pytest.raises(ValueError, match=r"1 \+ 16 tokens .* max_num_batched_tokens=16"):
        EngineArgs(
            model=model_dir, **TINY, speculative_config=spec, max_num_batched_tokens=16
        ).create_engine_config()
    # 1 + 15 fits exactly.
    spec = {**NGRAM, "num_speculative_tokens": 15}
    EngineArgs(
        model=model_dir, **TINY, speculative_config=spec, max_num_batched_tokens=16
    ).create_engine_config()

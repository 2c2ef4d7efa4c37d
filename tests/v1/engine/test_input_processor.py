"""Tests for engine/v1/engine/input_processor.py (twin of
vllm/v1/engine/input_processor.py): what a prompt and its SamplingParams look
like by the time they become an ``EngineCoreRequest``."""

from __future__ import annotations

import time

import pytest

from engine.engine.arg_utils import EngineArgs
from engine.sampling_params import SamplingParams
from engine.transformers_utils.tokenizer import get_tokenizer
from engine.v1.engine import EngineCoreRequest
from engine.v1.engine.input_processor import InputProcessor
from tests.helpers.engine_fixtures import EOS, VOCAB_SIZE, ids, make_config
from tests.helpers.tiny_model import make_tiny_model_dir

MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("ip") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return get_tokenizer(str(model_dir))


@pytest.fixture
def processor(model_dir, tokenizer):
    return InputProcessor(make_config(model_dir, max_model_len=MAX_MODEL_LEN), tokenizer)


def test_text_prompt_is_tokenized(processor):
    text, request = processor.process_inputs("r1", "w1 w2 w3", SamplingParams())
    assert text == "w1 w2 w3"
    assert isinstance(request, EngineCoreRequest)
    assert request.request_id == "r1"
    assert request.prompt_token_ids == ids("w1 w2 w3")


def test_prompt_dict_forms(processor):
    text, request = processor.process_inputs("a", {"prompt": "w7"}, SamplingParams())
    assert (text, request.prompt_token_ids) == ("w7", ids("w7"))
    text, request = processor.process_inputs("b", {"prompt_token_ids": (9, 10)}, SamplingParams())
    assert (text, request.prompt_token_ids) == (None, [9, 10])
    # Given token ids win; the text is only carried along, not re-tokenized.
    text, request = processor.process_inputs(
        "c", {"prompt_token_ids": [9], "prompt": "anything"}, SamplingParams()
    )
    assert (text, request.prompt_token_ids) == ("anything", [9])


def test_max_tokens_none_fills_the_remaining_context(processor):
    _, request = processor.process_inputs("r", "w1 w2 w3", SamplingParams(max_tokens=None))
    assert request.sampling_params.max_tokens == MAX_MODEL_LEN - 3


def test_explicit_max_tokens_is_kept(processor):
    # Even beyond the remaining context: the scheduler caps at max_model_len.
    _, request = processor.process_inputs("r", "w1", SamplingParams(max_tokens=100))
    assert request.sampling_params.max_tokens == 100


def test_eos_from_tokenizer(processor):
    _, request = processor.process_inputs("r", "w1", SamplingParams(stop_token_ids=[20]))
    sp = request.sampling_params
    assert sp.eos_token_id == EOS
    # generation_config's only EOS id is the tokenizer's: not repeated.
    assert sp.stop_token_ids == [20]
    assert sp.all_stop_token_ids == {EOS, 20}


def test_extra_eos_ids_from_generation_config(tmp_path, tokenizer):
    model = make_tiny_model_dir(tmp_path / "m", generation_config={"eos_token_id": [EOS, 7, 8]})
    processor = InputProcessor(make_config(model), tokenizer)
    assert processor.generation_config == {"eos_token_id": [EOS, 7, 8]}
    _, request = processor.process_inputs("r", "w1", SamplingParams(stop_token_ids=[8, 30]))
    sp = request.sampling_params
    assert sp.eos_token_id == EOS
    assert sp.stop_token_ids == [8, 30, 7]
    assert sp.all_stop_token_ids == {EOS, 7, 8, 30}

    _, request = processor.process_inputs("r2", "w1", SamplingParams(ignore_eos=True))
    sp = request.sampling_params
    # ignore_eos: nothing stops on EOS, but min_tokens still masks all of them.
    assert sp.eos_token_id is None
    assert sp.stop_token_ids == []
    assert sp.all_stop_token_ids == {EOS, 7, 8}


def test_no_tokenizer_no_primary_eos(model_dir):
    processor = InputProcessor(make_config(model_dir, skip_tokenizer_init=True), None)
    assert processor.get_eos_token_id() is None
    _, request = processor.process_inputs("r", {"prompt_token_ids": [9]}, SamplingParams())
    sp = request.sampling_params
    assert sp.eos_token_id is None
    assert sp.stop_token_ids == [EOS]
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        processor.process_inputs("t", "w1", SamplingParams())


def test_params_are_cloned(processor):
    caller = SamplingParams(max_tokens=None, stop_token_ids=[20], stop=["x"])
    _, request = processor.process_inputs("r", "w1", caller)
    assert request.sampling_params is not caller
    assert request.sampling_params.max_tokens == MAX_MODEL_LEN - 1
    # The caller's object is exactly as it was.
    assert caller.max_tokens is None
    assert caller.stop_token_ids == [20]
    assert caller.eos_token_id is None
    assert caller.all_stop_token_ids == {20}
    assert caller.stop == ["x"]
    # Mutating the request's params does not reach back either.
    request.sampling_params.stop_token_ids.append(99)
    assert caller.stop_token_ids == [20]


def test_arrival_time_and_priority(model_dir, tokenizer):
    processor = InputProcessor(make_config(model_dir, scheduling_policy="priority"), tokenizer)
    before = time.time()
    _, request = processor.process_inputs("a", "w1", SamplingParams(), priority=-3)
    assert before <= request.arrival_time <= time.time()
    assert request.priority == -3
    _, request = processor.process_inputs("b", "w1", SamplingParams(), arrival_time=12.5)
    assert request.arrival_time == 12.5
    assert request.priority == 0


@pytest.mark.parametrize(
    "prompt,match",
    [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": list(range(4, 4 + MAX_MODEL_LEN))}, f"max_model_len={MAX_MODEL_LEN}"),
        ({"prompt_token_ids": [4, VOCAB_SIZE]}, f"{VOCAB_SIZE} is out of vocabulary"),
        ({"prompt_token_ids": [-1]}, "-1 is out of vocabulary"),
        ({"prompt_token_ids": [4, 5.0]}, "prompt_token_ids"),
        ({"prompt_token_ids": [False]}, "prompt_token_ids"),
        ({"prompt_token_ids": "w1"}, "prompt_token_ids"),
        ({"prompt": ["w1"]}, "prompt must be a string"),
        ({"text": "w1"}, "a prompt must be"),
        (None, "a prompt must be"),
    ],
)
def test_bad_prompts(processor, prompt, match):
    with pytest.raises(ValueError, match=match):
        processor.process_inputs("r", prompt, SamplingParams())


def test_longest_allowed_prompt(processor):
    _, request = processor.process_inputs(
        "r",
        {"prompt_token_ids": list(range(4, 4 + MAX_MODEL_LEN - 1))},
        SamplingParams(max_tokens=None),
    )
    assert request.sampling_params.max_tokens == 1


def test_bad_params_and_priority(processor):
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        processor.process_inputs("r", "w1", {"max_tokens": 3})
    with pytest.raises(ValueError, match="scheduling_policy"):
        processor.process_inputs("r", "w1", SamplingParams(), priority=1)
    with pytest.raises(ValueError, match="priority must be an integer"):
        processor.process_inputs("r", "w1", SamplingParams(), priority=True)
    with pytest.raises(ValueError, match="priority must be an integer"):
        processor.process_inputs("r", "w1", SamplingParams(), priority=1.5)


def test_tokenizer_checks_on_params(processor):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        processor.process_inputs("r", "w1", SamplingParams(allowed_token_ids=[VOCAB_SIZE]))
    _, request = processor.process_inputs("r", "w1", SamplingParams(bad_words=["w3"]))
    assert request.sampling_params.bad_words_token_ids == [ids("w3")]


def test_generation_config_sources(tmp_path, model_dir):
    """vLLM's generation_config: "auto" (the model's file), "vllm" (no sampling
    defaults, the model's EOS still read) or a folder; then the overrides."""
    import json

    def config(**kwargs):
        return EngineArgs(model=str(model_dir), **kwargs).create_engine_config().model_config

    assert config().try_get_generation_config() == {"eos_token_id": EOS}
    assert config().get_diff_sampling_param() == {}
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7, "do_sample": True})
    )
    chosen = config(generation_config=str(folder))
    assert chosen.get_diff_sampling_param() == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    overridden = config(generation_config=str(folder), override_generation_config={"top_p": 0.5})
    assert overridden.get_diff_sampling_param()["top_p"] == 0.5
    neutral = config(generation_config="vllm", override_generation_config={"top_k": 5})
    assert neutral.get_diff_sampling_param() == {"top_k": 5}
    assert neutral.try_get_generation_config() == {"eos_token_id": EOS}
    with pytest.raises(ValueError, match="generation_config: .* is not a folder with a gen"):
        config(generation_config=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="override_generation_config must be a JSON object"):
        config(override_generation_config="top_p=0.5")


def test_assign_request_id_keeps_the_users_id_and_adds_a_random_suffix(processor):
    _, request = processor.process_inputs("chat-7", "w1", SamplingParams())
    assert (request.request_id, request.external_req_id) == ("chat-7", None)
    InputProcessor.assign_request_id(request)
    assert request.external_req_id == "chat-7"
    prefix, suffix = request.request_id.rsplit("-", 1)
    assert prefix == "chat-7" and len(suffix) == 8 and int(suffix, 16) >= 0
    # Each request gets its own internal id, even under the same user id.
    _, again = processor.process_inputs("chat-7", "w1", SamplingParams())
    processor.assign_request_id(again)
    assert again.request_id != request.request_id


def test_assign_request_id_refuses_a_request_that_already_has_one(processor):
    _, request = processor.process_inputs("x", "w1", SamplingParams())
    processor.assign_request_id(request)
    with pytest.raises(ValueError, match="external_req_id field should not be set"):
        processor.assign_request_id(request)

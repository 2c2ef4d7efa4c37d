"""Tests for engine/sampling_params.py (twin of vllm/sampling_params.py)."""

from __future__ import annotations

import logging
import re

import msgspec
import pytest

from engine.sampling_params import RequestOutputKind, SamplingParams, SamplingType


class FakeTokenizer:
    """Word-level tokenizer with GPT-2 style leading-space tokens ("Ġword").

    A word that has no "Ġword" entry is encoded after a space as
    [SPACE, word], mimicking tokenizers that split the space off.
    """

    SPACE = 1

    def __init__(self, vocab: dict[str, int], **attrs):
        self.vocab = {"Ġ": self.SPACE, **vocab}
        for key, value in attrs.items():
            setattr(self, key, value)
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        ids: list[int] = []
        for piece in re.findall(r" ?[^ ]+| ", text):
            if piece.startswith(" "):
                word = piece[1:]
                if "Ġ" + word in self.vocab:
                    ids.append(self.vocab["Ġ" + word])
                    continue
                ids.append(self.SPACE)
                if not word:
                    continue
                piece = word
            ids.append(self.vocab[piece])
        return ids


class TokenizerWithLen(FakeTokenizer):
    def __len__(self) -> int:
        return max(self.vocab.values()) + 1


VOCAB = {"hello": 10, "Ġhello": 11, "world": 12, "Ġworld": 12, "foo": 13, "bar": 14, "Ġbar": 15}


# --------------------------------------------------------------------------
# Defaults and enums
# --------------------------------------------------------------------------


def test_defaults_match_vllm():
    p = SamplingParams()
    assert p.n == 1
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and p.bad_words == []
    assert p.ignore_eos is False
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert p.include_stop_str_in_output is False
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.logit_bias is None and p.allowed_token_ids is None and p.extra_args is None
    assert p.eos_token_id is None
    assert p.all_stop_token_ids == set()
    assert p.bad_words_token_ids is None
    assert p.output_text_buffer_length == 0
    assert p.skip_reading_prefix_cache is False
    assert p.sampling_type is SamplingType.RANDOM


def test_enum_values():
    assert [(k.name, k.value) for k in RequestOutputKind] == [
        ("CUMULATIVE", 0),
        ("DELTA", 1),
        ("FINAL_ONLY", 2),
    ]
    assert [(k.name, k.value) for k in SamplingType] == [
        ("GREEDY", 0),
        ("RANDOM", 1),
        ("RANDOM_SEED", 2),
    ]


# --------------------------------------------------------------------------
# Validation: each bad value names its field and the allowed range
# --------------------------------------------------------------------------

BAD_VALUES = [
    ({"n": 0}, "n must be at least 1, got 0"),
    ({"n": -3}, "n must be at least 1"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"presence_penalty": -2.01}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3.0"),
    ({"frequency_penalty": 2.1}, "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero, got 0.0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty must be greater than zero"),
    ({"temperature": -1.0}, "temperature must be non-negative, got -1.0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_k": -2}, "top_k must be 0 or -1 (disabled), or at least 1, got -2"),
    ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
    ({"min_p": 1.01}, "min_p must be in [0, 1], got 1.01"),
    ({"max_tokens": 0}, "max_tokens must be at least 1 (or None), got 0"),
    ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1"),
    (
        {"max_tokens": 4, "min_tokens": 5},
        "min_tokens must be less than or equal to max_tokens=4, got 5",
    ),
    ({"logprobs": -2}, "logprobs must be non-negative or -1, got -2"),
    ({"prompt_logprobs": -5}, "prompt_logprobs must be non-negative or -1, got -5"),
    ({"stop": ["ok", ""]}, "stop cannot contain an empty string"),
    ({"stop": ""}, "stop cannot contain an empty string"),
    ({"stop": "x", "detokenize": False}, "stop strings need detokenize=True"),
    ({"bad_words": [""]}, "bad_words cannot contain an empty string"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids must contain only integers"),
    ({"stop_token_ids": [1, 2.0]}, "stop_token_ids must contain only integers"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of ints"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be None or a non-empty list"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids must be non-negative token ids, got [-1]"),
    ({"allowed_token_ids": [3, "a"]}, "allowed_token_ids must contain only integers"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias keys must be token ids (ints), got key 'abc'"),
    ({"logit_bias": {-4: 1.0}}, "logit_bias keys must be non-negative token ids, got -4"),
    ({"logit_bias": {4: "big"}}, "logit_bias[4] must be a number"),
    ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
    ({"output_kind": 7}, "output_kind must be a RequestOutputKind"),
    ({"extra_args": ["x"]}, "extra_args must be a dict or None"),
    # Wider than a signed 64-bit integer: msgpack could not carry it to EngineCore.
    ({"top_k": 2**63}, f"top_k must be a 64-bit integer (from -2**63 to 2**63 - 1), got {2**63}."),
    ({"seed": 2**64 + 1}, "seed must be a 64-bit integer"),
    ({"seed": -(2**63) - 1}, "seed must be a 64-bit integer"),
    ({"max_tokens": 2**64 + 1}, "max_tokens must be a 64-bit integer"),
    ({"max_tokens": None, "min_tokens": 2**63}, "min_tokens must be a 64-bit integer"),
    ({"logprobs": 2**64}, "logprobs must be a 64-bit integer"),
    ({"prompt_logprobs": 2**64}, "prompt_logprobs must be a 64-bit integer"),
    ({"stop_token_ids": [1, 2**64]}, "stop_token_ids token ids must each be a 64-bit integer"),
    ({"stop_token_ids": [-(2**63) - 1]}, "stop_token_ids token ids must each be a 64-bit"),
    ({"allowed_token_ids": [2**64]}, "allowed_token_ids token ids must each be a 64-bit integer"),
    ({"logit_bias": {2**64: 1.0}}, "logit_bias token ids must each be a 64-bit integer"),
    ({"logit_bias": {str(2**64): 1.0}}, "logit_bias token ids must each be a 64-bit integer"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_VALUES, ids=[str(k) for k, _ in BAD_VALUES])
def test_bad_value_raises_named_error(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert message in str(excinfo.value)


BAD_TYPES = [
    ("temperature", "hot", "temperature must be a number, got str 'hot'"),
    ("top_p", None, "top_p must be a number, got NoneType None"),
    ("presence_penalty", [0.1], "presence_penalty must be a number"),
    ("min_p", True, "min_p must be a number, got bool True"),
    ("temperature", float("nan"), "temperature must be a finite number, got nan"),
    ("top_p", float("inf"), "top_p must be a finite number"),
    ("n", 2.0, "n must be an int, got float 2.0"),
    ("n", True, "n must be an int, got bool True"),
    ("top_k", 5.5, "top_k must be an int, got float 5.5"),
    ("seed", "42", "seed must be an int or None, got str '42'"),
    ("max_tokens", 10.0, "max_tokens must be an int or None"),
    ("min_tokens", None, "min_tokens must be an int, got NoneType None"),
    ("logprobs", 2.5, "logprobs must be an int or None"),
    ("prompt_logprobs", "1", "prompt_logprobs must be an int or None"),
    ("stop", 3, "stop must be a string or a list of strings, got int 3"),
    ("stop", ["a", 3], "stop must contain only strings"),
    ("bad_words", [b"x"], "bad_words must contain only strings"),
    ("ignore_eos", 1, "ignore_eos must be a bool, got int 1"),
    ("detokenize", "yes", "detokenize must be a bool"),
    ("skip_special_tokens", None, "skip_special_tokens must be a bool"),
    ("spaces_between_special_tokens", 0, "spaces_between_special_tokens must be a bool"),
    ("include_stop_str_in_output", "no", "include_stop_str_in_output must be a bool"),
    ("skip_reading_prefix_cache", 1, "skip_reading_prefix_cache must be a bool or None"),
]


@pytest.mark.parametrize(
    ("field", "value", "message"), BAD_TYPES, ids=[f"{f}={v!r}" for f, v, _ in BAD_TYPES]
)
def test_bad_type_raises_named_value_error(field, value, message):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    assert message in str(excinfo.value)


def test_boundary_values_are_accepted():
    p = SamplingParams(
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=1e-3,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        max_tokens=1,
        min_tokens=1,
        logprobs=0,
        prompt_logprobs=0,
        temperature=0.7,
    )
    assert (p.top_k, p.min_p, p.max_tokens, p.min_tokens) == (1, 1.0, 1, 1)
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1


def test_n_upper_bound_comes_from_environment(monkeypatch):
    assert SamplingParams(n=16384).n == 16384
    with pytest.raises(ValueError, match=r"n must be at most 16384, got 16385"):
        SamplingParams(n=16385)
    monkeypatch.setenv("GLASSBOX_MAX_N_SEQUENCES", "4")
    assert SamplingParams(n=4).n == 4
    with pytest.raises(ValueError, match=r"n must be at most 4, got 5.*GLASSBOX_MAX_N_SEQUENCES"):
        SamplingParams(n=5)
    monkeypatch.setenv("GLASSBOX_MAX_N_SEQUENCES", "lots")
    with pytest.raises(ValueError, match="GLASSBOX_MAX_N_SEQUENCES must be a positive integer"):
        SamplingParams()


def test_64_bit_extremes_are_accepted_and_travel_to_engine_core():
    p = SamplingParams(
        temperature=1.0,
        top_k=2**63 - 1,
        seed=-(2**63),
        max_tokens=2**63 - 1,
        min_tokens=2**63 - 1,
        logprobs=2**63 - 1,
        stop_token_ids=[2**63 - 1, -(2**63)],
        allowed_token_ids=[2**63 - 1],
        logit_bias={2**63 - 1: 1.0},
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert (decoded.top_k, decoded.seed, decoded.max_tokens) == (2**63 - 1, -(2**63), 2**63 - 1)
    assert decoded.stop_token_ids == [2**63 - 1, -(2**63)]
    assert decoded.logit_bias == {2**63 - 1: 1.0}


def test_max_tokens_none_allows_any_min_tokens():
    p = SamplingParams(max_tokens=None, min_tokens=10_000)
    assert p.max_tokens is None and p.min_tokens == 10_000
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5


# --------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------


def test_stop_string_becomes_list_and_sequences_become_lists():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]
    assert SamplingParams(bad_words="darn").bad_words == ["darn"]
    assert SamplingParams(allowed_token_ids=(1, 2)).allowed_token_ids == [1, 2]


def test_seed_minus_one_means_no_seed_and_top_k_minus_one_means_disabled():
    p = SamplingParams(seed=-1, top_k=-1)
    assert p.seed is None
    assert p.top_k == 0
    assert p.sampling_type is SamplingType.RANDOM
    assert SamplingParams(seed=-7).seed == -7  # only -1 is special, as in vLLM


def test_logprobs_true_means_one():
    p = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert p.logprobs == 1 and p.prompt_logprobs == 1
    assert SamplingParams(logprobs=False).logprobs == 0


def test_integer_floats_fields_are_stored_as_float():
    p = SamplingParams(temperature=1, top_p=1, presence_penalty=1, repetition_penalty=2, min_p=0)
    for name in ("temperature", "top_p", "presence_penalty", "repetition_penalty", "min_p"):
        assert type(getattr(p, name)) is float, name


def test_logit_bias_accepts_string_keys():
    p = SamplingParams(logit_bias={"5": 1, 7: -2.5})
    assert p.logit_bias == {5: 1.0, 7: -2.5}
    assert all(type(k) is int for k in p.logit_bias)
    # Unlike from_optional, the constructor does not clamp.
    assert SamplingParams(logit_bias={1: 250}).logit_bias == {1: 250.0}


def test_output_kind_accepts_int():
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind == 2


def test_tiny_temperature_is_raised_with_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.sampling_params"):
        p = SamplingParams(temperature=0.001)
    assert p.temperature == 0.01
    assert "temperature=0.001" in caplog.text
    assert p.sampling_type is SamplingType.RANDOM


def test_output_text_buffer_length():
    assert SamplingParams(stop=["ab", "abcd"]).output_text_buffer_length == 3
    assert SamplingParams(stop="x").output_text_buffer_length == 0
    assert (
        SamplingParams(stop=["abcd"], include_stop_str_in_output=True).output_text_buffer_length
        == 0
    )
    assert SamplingParams().output_text_buffer_length == 0


def test_all_stop_token_ids_starts_from_stop_token_ids():
    p = SamplingParams(stop_token_ids=[4, 9, 4])
    assert p.all_stop_token_ids == {4, 9}


def test_skip_reading_prefix_cache_follows_prompt_logprobs():
    assert SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache is True
    assert SamplingParams(logprobs=3).skip_reading_prefix_cache is False
    assert (
        SamplingParams(prompt_logprobs=2, skip_reading_prefix_cache=False).skip_reading_prefix_cache
        is False
    )


# --------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0])
def test_greedy_resets_filters(temperature):
    p = SamplingParams(temperature=temperature, top_p=0.5, top_k=20, min_p=0.3)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.sampling_type is SamplingType.GREEDY


def test_positive_temperature_is_never_greedy():
    # The clamp to 0.01 runs first, so only temperature == 0 is greedy (as in vLLM).
    p = SamplingParams(temperature=9e-6, top_k=20)
    assert p.temperature == 0.01 and p.top_k == 20
    assert p.sampling_type is SamplingType.RANDOM


def test_greedy_ignores_seed_for_sampling_type():
    assert SamplingParams(temperature=0.0, seed=1).sampling_type is SamplingType.GREEDY


def test_greedy_with_n_greater_than_one_is_rejected():
    with pytest.raises(ValueError, match=r"n must be 1 when using greedy sampling.*got 3"):
        SamplingParams(temperature=0.0, n=3)
    assert SamplingParams(temperature=0.5, n=3).n == 3


def test_greedy_still_validates_filters_before_reset():
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(temperature=0.0, top_p=0.0)
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingParams(temperature=0.0, min_p=2.0)


def test_sampling_type_random_and_seeded():
    assert SamplingParams(temperature=0.8).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.8, seed=0).sampling_type is SamplingType.RANDOM_SEED


# --------------------------------------------------------------------------
# from_optional
# --------------------------------------------------------------------------


def test_from_optional_replaces_none_with_defaults():
    p = SamplingParams.from_optional(
        n=None,
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=None,
        temperature=None,
        top_p=None,
    )
    assert isinstance(p, SamplingParams)
    assert (p.n, p.presence_penalty, p.frequency_penalty) == (1, 0.0, 0.0)
    assert (p.repetition_penalty, p.temperature, p.top_p) == (1.0, 1.0, 1.0)


def test_from_optional_passes_values_through_and_validates():
    p = SamplingParams.from_optional(
        n=2,
        temperature=0.3,
        top_k=5,
        stop="END",
        max_tokens=None,
        output_kind=RequestOutputKind.DELTA,
    )
    assert (p.n, p.temperature, p.top_k, p.stop, p.max_tokens) == (2, 0.3, 5, ["END"], None)
    assert p.output_kind is RequestOutputKind.DELTA
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams.from_optional(top_p=2.0)


def test_from_optional_clamps_and_converts_logit_bias():
    p = SamplingParams.from_optional(logit_bias={"3": 150, "4": -1000, 5: 2})
    assert p.logit_bias == {3: 100.0, 4: -100.0, 5: 2.0}
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        SamplingParams.from_optional(logit_bias={"x1": 1.0})


# --------------------------------------------------------------------------
# update_from_generation_config
# --------------------------------------------------------------------------


def test_generation_config_sets_eos_and_stop_set():
    p = SamplingParams(stop_token_ids=[50])
    p.update_from_generation_config({}, eos_token_id=2)
    assert p.eos_token_id == 2
    assert p.all_stop_token_ids == {2, 50}
    assert p.stop_token_ids == [50]


def test_generation_config_extra_eos_become_stop_token_ids():
    p = SamplingParams(stop_token_ids=[50, 7])
    p.update_from_generation_config({"eos_token_id": [2, 7, 8, 8]}, eos_token_id=2)
    assert p.eos_token_id == 2
    # The primary EOS is not duplicated into stop_token_ids; existing ids keep order.
    assert p.stop_token_ids == [50, 7, 8]
    assert p.all_stop_token_ids == {2, 7, 8, 50}


def test_generation_config_single_int_eos():
    p = SamplingParams()
    p.update_from_generation_config({"eos_token_id": 9}, eos_token_id=2)
    assert p.stop_token_ids == [9]
    assert p.all_stop_token_ids == {2, 9}
    q = SamplingParams()
    q.update_from_generation_config({"eos_token_id": 2}, eos_token_id=2)
    assert q.stop_token_ids == [] and q.all_stop_token_ids == {2}


def test_generation_config_with_ignore_eos():
    p = SamplingParams(ignore_eos=True)
    p.update_from_generation_config({"eos_token_id": [2, 3]}, eos_token_id=2)
    # Nothing stops generation on EOS, but min_tokens still needs to know them.
    assert p.eos_token_id is None
    assert p.stop_token_ids == []
    assert p.all_stop_token_ids == {2, 3}


def test_generation_config_without_tokenizer_eos():
    p = SamplingParams()
    p.update_from_generation_config({"eos_token_id": [4, 5]}, eos_token_id=None)
    assert p.eos_token_id is None
    assert p.stop_token_ids == [4, 5]
    assert p.all_stop_token_ids == {4, 5}


def test_generation_config_bad_values():
    with pytest.raises(
        ValueError, match=r"generation_config\['eos_token_id'\] must contain only integers"
    ):
        SamplingParams().update_from_generation_config({"eos_token_id": ["</s>"]}, 2)
    with pytest.raises(ValueError, match="eos_token_id must be an int"):
        SamplingParams().update_from_generation_config({}, "2")


# --------------------------------------------------------------------------
# update_from_tokenizer
# --------------------------------------------------------------------------


def test_bad_words_encoded_with_and_without_leading_space():
    tok = FakeTokenizer(VOCAB)
    p = SamplingParams(bad_words=["hello", " bar"])
    p.update_from_tokenizer(tok)
    # "hello" -> [10], " hello" -> [11]; "bar" -> [14], " bar" -> [15].
    assert p.bad_words_token_ids == [[10], [11], [14], [15]]
    assert all(add_special is False for _, add_special in tok.calls)
    assert ("bar", False) in tok.calls and (" bar", False) in tok.calls


def test_bad_words_spaced_variant_skipped_when_not_a_new_token():
    tok = FakeTokenizer(VOCAB)
    # " foo" -> [SPACE, 13]: different length, so only [13] is banned.
    # " world" -> [12] == "world" -> [12]: same first token, so listed once.
    p = SamplingParams(bad_words=["foo", "world", "hello world"])
    p.update_from_tokenizer(tok)
    assert p.bad_words_token_ids == [[13], [12], [10, 12], [11, 12]]


def test_bad_words_that_encode_to_nothing_are_rejected():
    p = SamplingParams(bad_words=["   "])
    with pytest.raises(ValueError, match="bad_words entry '   ' encodes to no tokens"):
        p.update_from_tokenizer(FakeTokenizer(VOCAB))


def test_bad_words_out_of_vocab():
    tok = FakeTokenizer(VOCAB, max_token_id=12)
    p = SamplingParams(bad_words=["bar"])
    with pytest.raises(
        ValueError, match=r"bad_words encode to token ids outside \[0, 12\].*\[14, 15\]"
    ):
        p.update_from_tokenizer(tok)


def test_no_bad_words_leaves_token_ids_unset():
    p = SamplingParams()
    p.update_from_tokenizer(FakeTokenizer(VOCAB))
    assert p.bad_words_token_ids is None


@pytest.mark.parametrize(
    "tokenizer",
    [
        FakeTokenizer(VOCAB, max_token_id=15),
        TokenizerWithLen(VOCAB),
        FakeTokenizer(VOCAB, vocab_size=16),
    ],
    ids=["max_token_id", "len", "vocab_size"],
)
def test_allowed_token_ids_and_logit_bias_checked_against_vocab(tokenizer):
    SamplingParams(allowed_token_ids=[0, 15], logit_bias={15: 1.0}).update_from_tokenizer(tokenizer)
    with pytest.raises(ValueError, match=r"allowed_token_ids must be in \[0, 15\].*\[16, 99\]"):
        SamplingParams(allowed_token_ids=[3, 16, 99]).update_from_tokenizer(tokenizer)
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 15\].*\[16\]"):
        SamplingParams(logit_bias={"16": 1.0}).update_from_tokenizer(tokenizer)


def test_tokenizer_without_vocab_size_skips_range_checks():
    tok = FakeTokenizer(VOCAB)
    p = SamplingParams(allowed_token_ids=[10_000], logit_bias={10_000: 1.0}, bad_words=["bar"])
    p.update_from_tokenizer(tok)
    assert p.bad_words_token_ids == [[14], [15]]


# --------------------------------------------------------------------------
# msgspec wire format
# --------------------------------------------------------------------------


def _fully_loaded_params() -> SamplingParams:
    p = SamplingParams(
        n=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        stop=["\n\n", "###"],
        stop_token_ids=[50],
        max_tokens=None,
        min_tokens=2,
        logprobs=5,
        prompt_logprobs=1,
        include_stop_str_in_output=True,
        output_kind=RequestOutputKind.DELTA,
        logit_bias={"7": 3.0},
        allowed_token_ids=[7, 8, 9, 10, 11],
        bad_words=["hello"],
        extra_args={"note": "x", "k": [1, 2]},
    )
    p.update_from_generation_config({"eos_token_id": [2, 3]}, eos_token_id=2)
    p.update_from_tokenizer(FakeTokenizer(VOCAB, max_token_id=20))
    return p


def _field_values(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in p.__struct_fields__}


@pytest.mark.parametrize("codec", [msgspec.msgpack, msgspec.json], ids=["msgpack", "json"])
def test_round_trip_preserves_all_fields_including_private(codec):
    p = _fully_loaded_params()
    decoded = codec.decode(codec.encode(p), type=SamplingParams)
    assert _field_values(decoded) == _field_values(p)
    assert decoded == p
    # The private fields vLLM sends across the process boundary:
    assert decoded.eos_token_id == 2
    assert decoded.all_stop_token_ids == {2, 3, 50}
    assert decoded.bad_words_token_ids == [[10], [11]]
    assert decoded.output_kind is RequestOutputKind.DELTA
    assert decoded.logit_bias == {7: 3.0}
    assert decoded.sampling_type is SamplingType.RANDOM_SEED


def test_round_trip_of_defaults_and_omit_defaults():
    p = SamplingParams()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    on_wire = msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams(temperature=0.5)))
    # Fields still at their declared default are left off the wire. The list
    # fields default to None but are normalised to [] (as in vLLM), and
    # skip_reading_prefix_cache is derived, so those travel.
    assert on_wire == {
        "temperature": 0.5,
        "stop": [],
        "stop_token_ids": [],
        "bad_words": [],
        "skip_reading_prefix_cache": False,
    }


def test_decoding_validates_like_the_constructor():
    payload = msgspec.msgpack.encode({"top_p": 0.0})
    with pytest.raises(msgspec.ValidationError, match=r"top_p must be in \(0, 1\]"):
        msgspec.msgpack.decode(payload, type=SamplingParams)
    payload = msgspec.json.encode({"temperature": "hot"})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(payload, type=SamplingParams)


def test_decoding_normalises_like_the_constructor():
    payload = msgspec.json.encode({"stop": "END", "seed": -1, "temperature": 0.0, "top_k": 5})
    p = msgspec.json.decode(payload, type=SamplingParams)
    assert p.stop == ["END"] and p.seed is None and p.top_k == 0
    assert p.sampling_type is SamplingType.GREEDY


# --------------------------------------------------------------------------
# clone / repr
# --------------------------------------------------------------------------


def test_clone_is_deep_and_independent():
    p = _fully_loaded_params()
    c = p.clone()
    assert c == p and c is not p
    c.stop.append("more")
    c.all_stop_token_ids.add(999)
    c.extra_args["k"].append(3)
    assert p.stop == ["\n\n", "###"]
    assert 999 not in p.all_stop_token_ids
    assert p.extra_args["k"] == [1, 2]


def test_clone_with_skip_clone_is_shallow():
    p = SamplingParams(stop=["a"], skip_clone=True)
    c = p.clone()
    assert c is not p and c == p
    assert c.stop is p.stop


def test_sampling_type_is_cached_like_vllm():
    p = SamplingParams(temperature=0.5)
    assert p.sampling_type is SamplingType.RANDOM
    assert "sampling_type" in p.__dict__


def test_repr_lists_main_fields():
    text = repr(SamplingParams(temperature=0.2, top_k=3, stop="x", max_tokens=9, seed=5))
    assert text.startswith("SamplingParams(n=1, ")
    for fragment in (
        "temperature=0.2",
        "top_k=3",
        "stop=['x']",
        "max_tokens=9",
        "seed=5",
        "output_kind=CUMULATIVE",
    ):
        assert fragment in text

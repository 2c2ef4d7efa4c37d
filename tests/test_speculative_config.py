"""Tests for engine/config/speculative.py (twin of vllm/config/speculative.py and
the speculative-decoding rule for async scheduling in vllm/config/vllm.py)."""

from __future__ import annotations

import json
import logging
import re
from types import SimpleNamespace

import pytest

from engine.config.speculative import SpeculativeConfig


# ---------------------------------------------------------------------------
# Method inference and defaults
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("spelling", ["ngram", "[ngram]"])
def test_ngram_spellings(spelling):
    by_method = SpeculativeConfig(method=spelling, num_speculative_tokens=3)
    by_model = SpeculativeConfig(model=spelling, num_speculative_tokens=3)
    for config in (by_method, by_model):
        assert (config.method, config.model) == ("ngram", "ngram")
        assert not config.use_eagle() and not config.uses_draft_model()


def test_a_model_without_a_method_is_a_draft_model():
    config = SpeculativeConfig(model="/ckpt/small-llama", num_speculative_tokens=2)
    assert config.method == "draft_model"
    assert config.uses_draft_model() and not config.use_eagle()


@pytest.mark.parametrize("method", [None, "draft_model"])
def test_an_eagle_checkpoint_name_selects_eagle(method):
    # vLLM's name rule: "eagle-" in the draft's name means an EAGLE head.
    config = SpeculativeConfig(
        method=method, model="yuhuili/EAGLE-LLaMA3-Instruct-8B", num_speculative_tokens=2
    )
    assert config.method == "eagle"
    assert config.use_eagle() and not config.uses_draft_model()


def test_explicit_eagle_keeps_its_method():
    config = SpeculativeConfig(method="eagle", model="/ckpt/head", num_speculative_tokens=4)
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "eagle",
        "/ckpt/head",
        4,
    )
    assert config.prompt_lookup_min is None and config.prompt_lookup_max is None


@pytest.mark.parametrize(
    "given, expected",
    [
        ({}, (5, 5)),  # vLLM's defaults
        ({"prompt_lookup_min": 2}, (2, 2)),  # the missing bound copies the given one
        ({"prompt_lookup_max": 7}, (7, 7)),
        ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4)),
    ],
)
def test_prompt_lookup_window(given, expected):
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, **given)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == expected


# ---------------------------------------------------------------------------
# Each bad value is a ValueError naming its field (and the value)
# ---------------------------------------------------------------------------
BAD_CONFIGS = {
    "unknown method": (
        {"method": "lookahead", "num_speculative_tokens": 2},
        "method='lookahead' is not a speculative method",
    ),
    "vLLM-only method": (
        {"method": "eagle3", "model": "x", "num_speculative_tokens": 2},
        "method='eagle3' is a vLLM method Glassbox does not implement",
    ),
    "eagle3 by name": (
        {"model": "AngelSlim/Qwen3-8B_eagle3", "num_speculative_tokens": 2},
        "eagle3",
    ),
    "k missing": ({"method": "ngram"}, "num_speculative_tokens is required"),
    "k zero": ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    "k negative": ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
    "k float": ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    "k bool": ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    "k over the sampler's limit": (
        {"method": "ngram", "num_speculative_tokens": 129},
        "num_speculative_tokens must be at most 128",
    ),
    "min > max": (
        {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 4,
            "prompt_lookup_max": 3,
        },
        "prompt_lookup_min=4",
    ),
    "min 0": (
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
        "prompt_lookup_min",
    ),
    "max 0": (
        {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 0,
        },
        "prompt_lookup_max",
    ),
    "draft model without model": (
        {"method": "draft_model", "num_speculative_tokens": 2},
        "model is required for method='draft_model'",
    ),
    "eagle without model": (
        {"method": "eagle", "num_speculative_tokens": 2},
        "model is required for method='eagle'",
    ),
    "nothing but k": ({"num_speculative_tokens": 2}, "model is required"),
    "ngram with a model": (
        {"method": "ngram", "model": "/ckpt/small", "num_speculative_tokens": 2},
        "model='/ckpt/small'",
    ),
    "lookup with a draft model": (
        {"model": "/ckpt/small", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
        "prompt_lookup_max=3",
    ),
    "draft tp 0": (
        {"model": "/ckpt/small", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0},
        "draft_tensor_parallel_size must be an integer >= 1, got 0",
    ),
    "draft max_model_len 0": (
        {"model": "/ckpt/small", "num_speculative_tokens": 2, "max_model_len": 0},
        "max_model_len",
    ),
}


@pytest.mark.parametrize("kwargs, field", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^[^\n]*{re.escape(field)}[^\n]*$"):
        SpeculativeConfig(**kwargs)
    # The same through the dict path LLM(speculative_config=...) takes.
    with pytest.raises(ValueError, match=re.escape(field)):
        SpeculativeConfig.from_dict(kwargs)


# ---------------------------------------------------------------------------
# The dict / JSON path
# ---------------------------------------------------------------------------
def test_from_dict_builds_the_same_config():
    data = json.loads(
        '{"method": "ngram", "num_speculative_tokens": 4,'
        ' "prompt_lookup_min": 2, "prompt_lookup_max": 3}'
    )
    assert SpeculativeConfig.from_dict(data) == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3
    )


@pytest.mark.parametrize(
    "key, hint",
    [
        ("num_spec_tokens", "known keys:"),  # a typo: list what is accepted
        ("quantization", "vLLM option Glassbox does not implement"),
        ("tensor_parallel_size", "use draft_tensor_parallel_size"),
    ],
)
def test_from_dict_names_an_unknown_key(key, hint):
    data = {"method": "ngram", "num_speculative_tokens": 2, key: 1}
    with pytest.raises(ValueError, match=f"unknown key '{key}'.*{hint}"):
        SpeculativeConfig.from_dict(data)


def test_from_dict_wants_a_mapping():
    with pytest.raises(ValueError, match="speculative_config must be a dict"):
        SpeculativeConfig.from_dict('{"method": "ngram"}')  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Async scheduling: vLLM's rule per method
# ---------------------------------------------------------------------------
def _config(method: str) -> SpeculativeConfig:
    model = None if method == "ngram" else "/ckpt/small"
    return SpeculativeConfig(method=method, model=model, num_speculative_tokens=2)


@pytest.mark.parametrize(
    "method, unset, asked",
    [
        ("eagle", None, True),  # on by default, allowed when asked
        ("draft_model", False, True),  # off by default, allowed when asked
        ("ngram", False, "error"),  # off by default, an error when asked
    ],
)
def test_async_scheduling_rule(method, unset, asked, caplog):
    config = _config(method)
    with caplog.at_level(logging.WARNING, logger="engine.config.speculative"):
        assert config.resolve_async_scheduling(None) is unset
    # Turning it off says why, naming the method.
    assert (f"{method} speculative decoding" in caplog.text) == (unset is False)
    assert config.resolve_async_scheduling(False) is False
    if asked == "error":
        with pytest.raises(ValueError, match=f"async_scheduling: .*method='{method}'"):
            config.resolve_async_scheduling(True)
    else:
        assert config.resolve_async_scheduling(True) is True
    assert config.supports_async_scheduling() == (asked is True)
    assert config.enables_async_scheduling_by_default() == (unset is None)


# ---------------------------------------------------------------------------
# Checks the engine runs once the draft's ModelConfig exists
# ---------------------------------------------------------------------------
def test_vocab_size_mismatch_is_an_error_for_a_draft_model():
    target, draft = SimpleNamespace(vocab_size=32000), SimpleNamespace(vocab_size=32001)
    config = _config("draft_model")
    with pytest.raises(
        ValueError, match=r"model='/ckpt/small'.*vocab_size=32001.*vocab_size=32000"
    ):
        config.verify_equal_vocab_size_if_draft_model(target, draft)
    config.verify_equal_vocab_size_if_draft_model(target, SimpleNamespace(vocab_size=32000))
    # vLLM checks only draft models (an EAGLE head uses the target's LM head).
    _config("eagle").verify_equal_vocab_size_if_draft_model(target, draft)


def test_draft_max_model_len():
    override = SpeculativeConfig._maybe_override_draft_max_model_len
    assert override(None, 2048, 4096) == 2048
    assert override(None, 8192, 4096) == 4096
    assert override(1000, 2048, 4096) == 1000
    with pytest.raises(ValueError, match="max_model_len=3000 .* draft model's max_model_len=2048"):
        override(3000, 2048, 4096)
    with pytest.raises(ValueError, match="max_model_len=3000 .* target model's max_model_len=2500"):
        override(3000, 4096, 2500)


def test_spec_aliases_fill_the_speculative_config():
    """vLLM's --spec-method / --spec-model / --spec-tokens (and LLM keywords)."""
    import argparse

    from engine.engine.arg_utils import EngineArgs
    from engine.entrypoints.openai.cli_args import engine_args_from_cli, make_arg_parser

    spec = EngineArgs(spec_method="ngram", spec_tokens=3)._speculative_config()
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    # An alias may complete a JSON config, never contradict it.
    spec = EngineArgs(
        spec_tokens=2, speculative_config={"method": "ngram", "prompt_lookup_max": 4}
    )._speculative_config()
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max) == (2, 4)
    with pytest.raises(ValueError, match=r"spec_method and speculative_config\['method'\] are"):
        EngineArgs(
            spec_method="ngram", speculative_config={"method": "ngram", "num_speculative_tokens": 2}
        )._speculative_config()
    assert EngineArgs()._speculative_config() is None
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(
        ["m", "--spec-method", "ngram", "--spec-tokens", "4"]
    )
    assert (args.spec_method, args.spec_tokens) == ("ngram", 4)
    spec = engine_args_from_cli(args)._speculative_config()
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 4)

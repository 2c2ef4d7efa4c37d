"""50 seeded requests per constraint kind on the default model (SmolLM2-135M),
temperature 1.0: every output must satisfy its constraint.

One ``generate`` call holds all 200 requests (one batch, one model load).
The constraints are bounded (string lengths, integer ranges, repetition
counts) and JSON is compact (``disable_any_whitespace``), so every output
can end within ``max_tokens``: a ``length`` finish would be a failure of the
test's design, and is reported as such.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.entrypoints.llm import LLM
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers.hf_checkpoints import default_model_path

N = 50
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Berlin", "Tokyo"]},
        "student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "student"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,8}@(example|test)\.(com|org)"
CHOICE = ["positive", "negative", "neutral"]
# Arithmetic: up to four operands, each a number or a parenthesised pair.
GRAMMAR = r"""
root ::= term (op term){0,3}
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]{0,2}
"""


def assert_parses(expr: str) -> None:
    """The grammar is regular (no recursion), so a regex of the same shape parses it."""
    num = r"[1-9][0-9]{0,2}"
    term = rf"(?:{num}|\({num}[-+*]{num}\))"
    assert re.fullmatch(rf"{term}(?:[-+*]{term}){{0,3}}", expr), expr


@pytest.fixture(scope="module")
def outputs(monkeypatch_module_env) -> dict[str, list]:
    llm = LLM(
        default_model_path(),
        max_model_len=512,
        max_num_seqs=256,
        async_scheduling=True,
        structured_outputs_config={"disable_any_whitespace": True},
    )
    kinds = {
        "json": StructuredOutputsParams(json=SCHEMA),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICE),
        "grammar": StructuredOutputsParams(grammar=GRAMMAR),
    }
    prompts = {
        "json": "Describe a person as JSON.",
        "regex": "Write an email address.",
        "choice": "Is this review positive? 'Great food!'",
        "grammar": "Write an arithmetic expression.",
    }
    all_prompts, all_params, order = [], [], []
    for kind, so in kinds.items():
        for seed in range(N):
            all_prompts.append(prompts[kind])
            all_params.append(
                SamplingParams(temperature=1.0, seed=seed, max_tokens=64, structured_outputs=so)
            )
            order.append(kind)
    try:
        outs = llm.generate(all_prompts, all_params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    result: dict[str, list] = {k: [] for k in kinds}
    for kind, out in zip(order, outs, strict=True):
        result[kind].append(out.outputs[0])
    return result


@pytest.fixture(scope="module")
def monkeypatch_module_env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
        yield


def _finished(completions) -> None:
    reasons = [c.finish_reason for c in completions]
    assert reasons == ["stop"] * N, [(c.text, c.finish_reason) for c in completions]


def test_json_schema(outputs) -> None:
    _finished(outputs["json"])
    for c in outputs["json"]:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in outputs["json"]}) > 10  # sampled, not one answer


def test_regex(outputs) -> None:
    _finished(outputs["regex"])
    for c in outputs["regex"]:
        assert re.fullmatch(REGEX, c.text), c.text


def test_choice(outputs) -> None:
    _finished(outputs["choice"])
    assert {c.text for c in outputs["choice"]} <= set(CHOICE)


def test_grammar(outputs) -> None:
    _finished(outputs["grammar"])
    for c in outputs["grammar"]:
        assert_parses(c.text)

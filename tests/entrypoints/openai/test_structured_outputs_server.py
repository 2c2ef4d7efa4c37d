"""Structured outputs through the OpenAI-compatible server (session 06; twin of
vLLM's ``response_format`` / ``structured_outputs`` handling in
vllm/entrypoints/openai/{chat_completion,completion,engine}/protocol.py).

``glassbox serve`` on the embedded default model (SmolLM2-135M-Instruct, CPU),
the real ``openai`` client: a ``json_schema`` response format gives JSON that
validates against the schema, streamed or not; ``json_object`` gives a JSON
object; vLLM's ``structured_outputs`` extra body field (``choice``,
``regex``) constrains completions; ``max_tokens`` cuts a JSON short with
``finish_reason="length"``. Every bad constraint is a 400 naming its field
before the request reaches the engine, streaming or not. Schemas use bounded
strings and small ranges so greedy outputs finish in a few tokens.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from engine.entrypoints.openai.completion.protocol import CompletionRequest
from tests.entrypoints.openai.utils import RemoteOpenAIServer
from tests.helpers.hf_checkpoints import default_model_path

# A short context keeps the KV cache (and start-up) small, as in
# tests/entrypoints/test_default_model_e2e.py.
FLAGS = ["--max-model-len", "512", "--num-gpu-blocks-override", "96"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def server():
    with RemoteOpenAIServer(default_model_path(), FLAGS) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.get_client()


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_chat_json_schema_streamed_and_not(client, model):
    kwargs = dict(
        model=model,
        messages=ASK_PERSON,
        response_format=PERSON_FORMAT,
        max_tokens=32,
        temperature=0,
    )
    full = client.chat.completions.create(**kwargs)
    (choice,) = full.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish_reasons[-1] == "stop" and set(finish_reasons[:-1]) == {None}
    jsonschema.validate(json.loads(text), PERSON)
    assert text == choice.message.content


def test_chat_json_object(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}
        ],
        response_format={"type": "json_object"},
        max_tokens=16,
        temperature=0,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_cuts_the_json_short(client, model, stream):
    kwargs = dict(
        model=model,
        messages=ASK_PERSON,
        response_format=PERSON_FORMAT,
        max_tokens=4,
        temperature=0,
    )
    if stream:
        chunks = list(
            client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish_reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        out = client.chat.completions.create(**kwargs)
        text, finish_reason, usage = (
            out.choices[0].message.content,
            out.choices[0].finish_reason,
            out.usage,
        )
    assert finish_reason == "length" and usage.completion_tokens == 4
    assert text.lstrip().startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_completions_structured_outputs_choice_and_regex(client, model):
    choice = client.completions.create(
        model=model,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].text in ("yes", "no")
    assert choice.choices[0].finish_reason == "stop"

    pattern = r"[0-9]{3}-[0-9]{4}"
    regex = client.completions.create(
        model=model,
        prompt="A phone number:",
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, regex.choices[0].text), regex.choices[0].text
    assert regex.choices[0].finish_reason == "stop"


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}


def nested(levels: int) -> dict:
    """An object schema ``levels`` JSON objects deep."""
    schema: dict = {"type": "object"}
    for _ in range(levels // 2 - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# (endpoint, extra body, param, text the message must contain)
BAD_CONSTRAINTS = [
    (
        "v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": BAD_SCHEMA},
            }
        },
        "response_format",
        "response_format.json_schema.schema is not a valid JSON schema",
    ),
    (
        "v1/completions",
        {"structured_outputs": {"json": BAD_SCHEMA}},
        "structured_outputs",
        "structured_outputs.json is not a valid JSON schema",
    ),
    (
        "v1/completions",
        {"structured_outputs": {"regex": "(unclosed"}},
        "structured_outputs",
        "structured_outputs.regex is not a valid regex",
    ),
    (
        "v1/chat/completions",
        {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
        "structured_outputs",
        "structured_outputs.grammar is not a valid EBNF grammar",
    ),
    (
        "v1/completions",
        {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
        "structured_outputs",
        "one kind of constraint",
    ),
    (
        "v1/chat/completions",
        {"structured_outputs": {}},
        "structured_outputs",
        "needs one constraint",
    ),
    (
        # Deep enough to hit Python's recursion limit in the engine (a 500) if let through.
        "v1/completions",
        {"structured_outputs": {"json": nested(600)}},
        "structured_outputs",
        "structured_outputs.json: the schema is nested more than 64 levels deep",
    ),
    (
        "v1/completions",
        {"structured_outputs": {"choice": []}},
        "structured_outputs",
        "choice must not be an empty list",
    ),
    (
        "v1/completions",
        {"structured_outputs": {"json_object": False}},
        "structured_outputs",
        "json_object",
    ),
    (
        "v1/chat/completions",
        {"response_format": {"type": "json_schema"}},
        "response_format",
        "json_schema.schema",
    ),
    (
        "v1/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        "json_schema.schema",
    ),
    (
        "v1/chat/completions",
        {"response_format": {"type": "structural_tag", "format": {}}},
        "response_format",
        "does not support structural tags",
    ),
    (
        "v1/completions",
        {"structured_outputs": {"structural_tag": "{}"}},
        "structured_outputs",
        "does not support structural tags",
    ),
    (
        "v1/chat/completions",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
        "structured_outputs",
        "two constraints",
    ),
]


def test_bad_constraints_are_400s_naming_the_field(server):
    """Each bad input, streamed and not: a 400 in OpenAI's error body naming
    the field, before the engine sees the request (no prompt tokens counted)."""
    before = server.metrics()["glassbox:prompt_tokens_total"]
    for endpoint, extra, param, text in BAD_CONSTRAINTS:
        if endpoint == "v1/completions":
            body = {"prompt": "Hi", "max_tokens": 4, **extra}
        else:
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
        for stream in (False, True):
            response = httpx.post(
                server.url_for(endpoint), json={**body, "stream": stream}, timeout=30
            )
            assert response.status_code == 400, (extra, response.text)
            error = response.json()["error"]
            assert (error["type"], error["param"], error["code"]) == (
                "BadRequestError",
                param,
                400,
            ), (extra, error)
            assert text in error["message"], (extra, error)
    metrics = server.metrics()
    assert metrics["glassbox:prompt_tokens_total"] == before
    assert metrics["glassbox:num_requests_running"] == metrics["glassbox:num_requests_waiting"] == 0


def test_openai_client_gets_bad_request_for_a_bad_schema(client, model):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model=model,
            messages=ASK_PERSON,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": 5}},
            },
            max_tokens=4,
        )
    assert excinfo.value.status_code == 400
    assert excinfo.value.body["param"] == "response_format"
    assert "response_format.json_schema.schema" in excinfo.value.body["message"]


@pytest.mark.parametrize(
    "structured_outputs,response_format,expected",
    [
        # response_format's constraint replaces structured_outputs' of the same kind.
        ({"json": {"type": "string"}}, PERSON_FORMAT, {"json": PERSON}),
        ({"json_object": True}, {"type": "json_object"}, {"json_object": True}),
        # {"type": "text"} adds nothing.
        ({"choice": ["a", "b"]}, {"type": "text"}, {"choice": ["a", "b"]}),
        (None, {"type": "text"}, None),
        (None, {"type": "json_object"}, {"json_object": True}),
    ],
)
def test_response_format_merges_into_structured_outputs(
    structured_outputs, response_format, expected
):
    """No server: the request body -> StructuredOutputsParams (vLLM's merge)."""
    body = {"prompt": "Hi", "response_format": response_format}
    if structured_outputs is not None:
        body["structured_outputs"] = structured_outputs
    params = CompletionRequest.model_validate(body).sampling_kwargs()["structured_outputs"]
    if expected is None:
        assert params is None
    else:
        constraints = ("json", "regex", "choice", "grammar", "json_object")
        got = {k: getattr(params, k) for k in constraints if getattr(params, k) is not None}
        assert got == expected

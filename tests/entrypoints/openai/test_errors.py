"""Bad requests get OpenAI-style 4xx errors and never disturb the server
(twin of vllm/entrypoints/openai/server_utils.py's error handlers and
``OpenAIServing.create_error_response``).

Every error body is ``{"error": {"message", "type", "param", "code"}}`` with
``param`` naming the offending field; unknown models are 404; with
``--api-key`` the /v1 routes answer 401 without the bearer token.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from tests.entrypoints.openai.utils import COUNTING_EXECUTOR, RemoteOpenAIServer
from tests.helpers.tiny_model import make_tiny_model_dir

FLAGS = [
    "--distributed-executor-backend",
    COUNTING_EXECUTOR,
    "--block-size",
    "4",
    "--max-model-len",
    "64",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("errors") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir):
    with RemoteOpenAIServer(model_dir, FLAGS) as server:
        yield server


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url_for(path), timeout=30, **kwargs)


def assert_error(
    response: httpx.Response, status: int, param: str | None, err_type: str = "BadRequestError"
) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["type"] == err_type
    assert error["param"] == param, error
    assert error["message"]
    return error


GOOD_COMPLETION = {"prompt": "w1", "max_tokens": 2, "temperature": 0}
GOOD_CHAT = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 2, "temperature": 0}

# (endpoint, field, bad value): a wrong JSON type for the field.
WRONG_TYPES = [
    ("v1/completions", "max_tokens", "abc"),
    ("v1/completions", "max_tokens", 2.5),
    ("v1/completions", "temperature", "hot"),
    ("v1/completions", "prompt", 5),
    ("v1/completions", "prompt", [1, "w2"]),
    ("v1/completions", "n", "2"),
    ("v1/completions", "stream", "yes"),
    ("v1/completions", "stop", 7),
    ("v1/completions", "logprobs", True),
    ("v1/completions", "stream_options", "usage"),
    ("v1/chat/completions", "messages", "hi"),
    ("v1/chat/completions", "messages", [{"content": "w1"}]),
    ("v1/chat/completions", "top_logprobs", "3"),
    ("v1/chat/completions", "ignore_eos", "no"),
    ("v1/chat/completions", "priority", 1.5),
]


@pytest.mark.parametrize("endpoint,field,value", WRONG_TYPES)
def test_wrong_types_are_400_naming_the_field(server, endpoint, field, value):
    body = dict(GOOD_COMPLETION if endpoint == "v1/completions" else GOOD_CHAT)
    body[field] = value
    error = assert_error(post(server, endpoint, json=body), 400, field)
    assert field in error["message"]


# (endpoint, field, out-of-range value)
OUT_OF_RANGE = [
    ("v1/completions", "temperature", -1.0),
    ("v1/completions", "top_p", 1.5),
    ("v1/completions", "top_k", -5),
    ("v1/completions", "min_p", 2.0),
    ("v1/completions", "n", 0),
    ("v1/completions", "max_tokens", 0),
    ("v1/completions", "presence_penalty", 3.0),
    ("v1/completions", "frequency_penalty", -3.0),
    ("v1/completions", "repetition_penalty", 0.0),
    ("v1/completions", "logprobs", 21),
    ("v1/completions", "min_tokens", -1),
    ("v1/completions", "stop", [""]),
    ("v1/completions", "logit_bias", {"not-a-token": 1.0}),
    ("v1/completions", "prompt", ""),
    ("v1/completions", "prompt", " ".join(["w1"] * 64)),  # > max_model_len
    ("v1/completions", "prompt", [4, 999]),  # out of vocabulary
    ("v1/completions", "priority", 1),  # not allowed under fcfs
    ("v1/chat/completions", "messages", []),
    ("v1/chat/completions", "top_logprobs", 5),  # without logprobs=true
    ("v1/chat/completions", "max_completion_tokens", -3),
    ("v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("v1/completions", "suffix", " the end"),
    ("v1/completions", "prompt_logprobs", -2),
    ("v1/completions", "cache_salt", ""),
    ("v1/chat/completions", "cache_salt", ""),
]


@pytest.mark.parametrize("endpoint,field,value", OUT_OF_RANGE)
def test_out_of_range_values_are_400_naming_the_field(server, endpoint, field, value):
    body = dict(GOOD_COMPLETION if endpoint == "v1/completions" else GOOD_CHAT)
    body[field] = value
    assert_error(post(server, endpoint, json=body), 400, field)
    # The same rejection when streaming: a 400, not a 200 with an error event.
    body["stream"] = True
    assert_error(post(server, endpoint, json=body), 400, field)


@pytest.mark.parametrize("endpoint", ["v1/completions", "v1/chat/completions"])
def test_malformed_bodies(server, endpoint):
    assert_error(
        post(
            server,
            endpoint,
            content=b'{"prompt": "w1", "max_tokens": ',
            headers={"Content-Type": "application/json"},
        ),
        400,
        None,
    )
    assert_error(
        post(
            server,
            endpoint,
            content=b"not json at all",
            headers={"Content-Type": "application/json"},
        ),
        400,
        None,
    )
    required = "prompt" if endpoint == "v1/completions" else "messages"
    assert_error(post(server, endpoint, json=["a", "list"]), 400, None)
    assert_error(post(server, endpoint, json={"max_tokens": 2}), 400, required)


def test_unknown_model_is_404(server):
    client = server.get_client()
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.completions.create(model="no-such-model", prompt="w1")
    assert excinfo.value.status_code == 404
    body = excinfo.value.body
    assert body["type"] == "NotFoundError" and body["param"] == "model"
    assert_error(
        post(server, "v1/chat/completions", json={**GOOD_CHAT, "model": "gpt-4"}),
        404,
        "model",
        "NotFoundError",
    )


def test_unknown_route_is_404_in_the_error_schema(server):
    response = httpx.get(server.url_for("v1/nothing-here"))
    assert_error(response, 404, None, "Not Found")


def test_openai_client_raises_bad_request(server, model_dir):
    client = server.get_client()
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model=str(model_dir), messages=[{"role": "user", "content": "w1"}], temperature=-2
        )
    assert excinfo.value.body["param"] == "temperature"
    assert "temperature" in excinfo.value.body["message"]


def test_bad_requests_never_disturb_good_ones(server, model_dir):
    client = server.get_client()

    def good(i: int) -> str:
        return (
            client.completions.create(
                model=str(model_dir), prompt=f"w{i}", max_tokens=3, temperature=0
            )
            .choices[0]
            .text
        )

    def bad(i: int) -> int:
        return post(
            server, "v1/completions", json={**GOOD_COMPLETION, "temperature": -float(i + 1)}
        ).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good, i) for i in range(8)]
        bads = [pool.submit(bad, i) for i in range(8)]
        assert [f.result() for f in goods] == [f" w{i + 1} w{i + 2} w{i + 3}" for i in range(8)]
        assert [f.result() for f in bads] == [400] * 8
    assert httpx.get(server.url_for("health")).status_code == 200
    assert server.metrics()["glassbox:num_requests_running"] == 0


def test_api_key(model_dir):
    with RemoteOpenAIServer(model_dir, [*FLAGS, "--api-key", "sesame"]) as server:
        # No key, a wrong key, a wrong scheme: 401 in OpenAI's error schema.
        assert_error(httpx.get(server.url_for("v1/models")), 401, None, "AuthenticationError")
        wrong = httpx.post(
            server.url_for("v1/completions"),
            json=GOOD_COMPLETION,
            headers={"Authorization": "Bearer nope"},
        )
        assert_error(wrong, 401, None, "AuthenticationError")
        basic = httpx.get(server.url_for("v1/models"), headers={"Authorization": "Basic sesame"})
        assert basic.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            server.get_client(api_key="nope").models.list()
        # The right key works; health and metrics stay open for probes.
        client = server.get_client(api_key="sesame")
        assert (
            client.completions.create(
                model=str(model_dir), prompt="w1", max_tokens=1, temperature=0
            )
            .choices[0]
            .text
            == " w2"
        )
        assert httpx.get(server.url_for("health")).status_code == 200
        assert httpx.get(server.url_for("metrics")).status_code == 200

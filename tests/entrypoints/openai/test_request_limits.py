"""How much work one request may ask for, and how many may queue (issue 17,
points 1 and 9).

- Every integer field has a range (vLLM's where it has one, a signed 64-bit
  integer everywhere else): a value outside it is a 400 naming the field --
  never a 500 from msgpack -- and leaves nothing registered, so the same
  request id works at once.
- ``max_tokens`` (or ``max_completion_tokens``) above ``max_model_len`` is a
  400, so is a prompt that leaves less room than ``max_tokens`` asks for (vLLM's
  render-step rule); without ``max_tokens`` a request runs to the end of the
  context, or to ``generation_config``'s ``max_new_tokens``.
- Errors from the vocabulary checks name ``allowed_token_ids`` / ``logit_bias``
  / ``min_tokens``, not the prompt; a 404 quotes at most 100 characters of an
  unknown model's name.
- ``--max-waiting-requests`` (Glassbox's own): beyond ``max_num_seqs`` +
  that many unfinished sequences a request gets 503 -- a streaming one too, as a
  status code -- and an ``n`` that could never fit gets 400.
"""

from __future__ import annotations

import httpx
import pytest

from engine.engine.arg_utils import EngineArgs
from tests.entrypoints.openai.test_errors import assert_error
from tests.entrypoints.openai.utils import (
    COUNTING_EXECUTOR,
    SLOW_EXECUTOR,
    RemoteOpenAIServer,
    wait_until,
)
from tests.helpers.tiny_model import make_tiny_model_dir

MAX_MODEL_LEN = 64
BIG = 2**64 + 1  # wider than anything msgpack can carry to EngineCore
FLAGS = [
    "--distributed-executor-backend",
    COUNTING_EXECUTOR,
    "--block-size",
    "4",
    "--max-model-len",
    str(MAX_MODEL_LEN),
]
COMPLETION = {"prompt": "w1", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("limits") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir):
    with RemoteOpenAIServer(model_dir, FLAGS) as server:
        yield server


def post(server, endpoint: str, body: dict) -> httpx.Response:
    return httpx.post(server.url_for(endpoint), json=body, timeout=30)


def body_for(endpoint: str, **fields) -> dict:
    return {**(COMPLETION if endpoint == "v1/completions" else CHAT), **fields}


def assert_nothing_registered(server) -> None:
    engine = server.engine_client

    def idle() -> bool:
        return (
            engine.output_processor.request_states == {}
            and engine.output_processor.external_req_ids == {}
            and server.metrics()["glassbox:num_requests_running"] == 0
            and server.metrics()["glassbox:num_requests_waiting"] == 0
        )

    assert wait_until(idle, 5), server.metrics()


# (endpoint, extra fields, the field the 400 must name)
HUGE_INTEGERS = [
    ("v1/completions", {"max_tokens": BIG}, "max_tokens"),
    ("v1/completions", {"n": BIG, "temperature": 1.0}, "n"),
    ("v1/completions", {"seed": BIG}, "seed"),
    ("v1/completions", {"seed": 2**63}, "seed"),  # vLLM's int64 bound, exactly
    ("v1/completions", {"seed": -(2**63) - 1}, "seed"),
    ("v1/completions", {"top_k": BIG, "temperature": 1.0}, "top_k"),
    ("v1/completions", {"min_tokens": BIG}, "min_tokens"),
    ("v1/completions", {"logprobs": BIG}, "logprobs"),
    ("v1/completions", {"best_of": BIG}, "best_of"),
    ("v1/completions", {"priority": BIG}, "priority"),
    ("v1/completions", {"stop_token_ids": [5, BIG]}, "stop_token_ids"),
    ("v1/completions", {"allowed_token_ids": [BIG]}, "allowed_token_ids"),
    ("v1/completions", {"logit_bias": {str(BIG): 1.0}}, "logit_bias"),
    ("v1/completions", {"prompt": [5, BIG]}, "prompt"),
    ("v1/chat/completions", {"max_tokens": BIG}, "max_tokens"),
    ("v1/chat/completions", {"max_completion_tokens": BIG}, "max_completion_tokens"),
    ("v1/chat/completions", {"max_tokens": None, "min_tokens": BIG}, "min_tokens"),
    ("v1/chat/completions", {"logprobs": True, "top_logprobs": BIG}, "top_logprobs"),
    ("v1/chat/completions", {"seed": BIG}, "seed"),
    ("v1/chat/completions", {"n": BIG, "temperature": 1.0}, "n"),
    ("v1/chat/completions", {"priority": -(2**63) - 1}, "priority"),
]


@pytest.mark.parametrize(
    "endpoint,extra,param",
    HUGE_INTEGERS,
    ids=[f"{e.removeprefix('v1/')}-{'-'.join(x)}" for e, x, _ in HUGE_INTEGERS],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_out_of_range_integers_are_400_and_leave_nothing_behind(
    server, endpoint, extra, param, stream
):
    request_id = f"huge-{param}-{stream}"
    body = body_for(endpoint, **extra, stream=stream, request_id=request_id)
    error = assert_error(post(server, endpoint, body), 400, param)
    assert param in error["message"]
    assert_nothing_registered(server)
    # The id was never taken: a good request may use it at once.
    good = post(server, endpoint, body_for(endpoint, request_id=request_id))
    assert good.status_code == 200, good.text
    assert good.json()["id"] == request_id


def test_64_bit_boundaries_are_accepted(server):
    body = body_for("v1/completions", seed=2**63 - 1, temperature=1.0, top_k=2**63 - 1)
    assert post(server, "v1/completions", body).status_code == 200
    body = body_for("v1/chat/completions", seed=-(2**63), temperature=1.0)
    assert post(server, "v1/chat/completions", body).status_code == 200


def prompt_tokens(server, endpoint: str) -> int:
    response = post(server, endpoint, body_for(endpoint, max_tokens=1))
    return response.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "endpoint,field,prompt_field",
    [
        ("v1/completions", "max_tokens", "prompt"),
        ("v1/chat/completions", "max_tokens", "messages"),
        ("v1/chat/completions", "max_completion_tokens", "messages"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_max_tokens_must_fit_the_context(server, endpoint, field, prompt_field, stream):
    fields = {"max_tokens": None, "ignore_eos": True, "stream": stream}
    # Far beyond the context: a 400 naming the field, before any tokenizing.
    error = assert_error(
        post(server, endpoint, body_for(endpoint, **{**fields, field: 10**9})), 400, field
    )
    assert f"max_model_len={MAX_MODEL_LEN}" in error["message"]
    assert_error(
        post(server, endpoint, body_for(endpoint, **{**fields, field: MAX_MODEL_LEN + 1})),
        400,
        field,
    )
    # Fits on its own, but not after this prompt: vLLM's "maximum context length" 400.
    room = MAX_MODEL_LEN - prompt_tokens(server, endpoint)
    error = assert_error(
        post(server, endpoint, body_for(endpoint, **{**fields, field: room + 1})),
        400,
        prompt_field,
    )
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert field in error["message"]
    # Exactly the room left is fine.
    response = post(
        server, endpoint, body_for(endpoint, **{**fields, field: room, "stream": False})
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == room
    assert_nothing_registered(server)


def test_completion_default_max_tokens_counts_too(server):
    # max_tokens defaults to 16 for completions (OpenAI's and vLLM's default).
    body = {"prompt": " ".join(["w1"] * 49), "temperature": 0}
    error = assert_error(post(server, "v1/completions", body), 400, "prompt")
    assert "49-token prompt plus max_tokens=16 needs 65" in error["message"]
    body["prompt"] = " ".join(["w1"] * 48)
    assert post(server, "v1/completions", body).status_code == 200


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(server):
    room = MAX_MODEL_LEN - prompt_tokens(server, "v1/chat/completions")
    response = post(
        server,
        "v1/chat/completions",
        body_for("v1/chat/completions", max_tokens=None, ignore_eos=True),
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert response.json()["usage"]["completion_tokens"] == room
    assert choice["finish_reason"] == "length"


# (endpoint, extra fields, the field the 400 must name): checks that need the
# tokenizer or the prompt, which used to be reported as the prompt's fault.
VOCAB_CHECKS = [
    ("v1/completions", {"allowed_token_ids": [4, 999]}, "allowed_token_ids"),
    ("v1/completions", {"logit_bias": {"999": 5.0}}, "logit_bias"),
    ("v1/chat/completions", {"allowed_token_ids": [999]}, "allowed_token_ids"),
    ("v1/chat/completions", {"logit_bias": {"999": 5.0}}, "logit_bias"),
    ("v1/chat/completions", {"max_tokens": None, "min_tokens": 100}, "min_tokens"),
]


@pytest.mark.parametrize("endpoint,extra,param", VOCAB_CHECKS)
def test_vocabulary_errors_name_their_field(server, endpoint, extra, param):
    error = assert_error(post(server, endpoint, body_for(endpoint, **extra)), 400, param)
    assert error["message"].startswith(param)


def test_unknown_model_404_quotes_a_truncated_name(server):
    name = "m" * 1_000_000
    response = post(server, "v1/completions", body_for("v1/completions", model=name))
    error = assert_error(response, 404, "model", "NotFoundError")
    assert error["message"] == f"The model `{'m' * 100}...` does not exist."
    assert len(response.content) < 400
    short = assert_error(
        post(server, "v1/chat/completions", body_for("v1/chat/completions", model="gpt-4")),
        404,
        "model",
        "NotFoundError",
    )
    assert short["message"] == "The model `gpt-4` does not exist."


# -- the waiting-queue limit -------------------------------------------------------


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """2 running + 1 waiting sequences at most; 20 ms per engine step; the
    checkpoint's generation_config caps open-ended requests at 5 tokens."""
    model = make_tiny_model_dir(
        tmp_path_factory.mktemp("queue") / "tiny",
        generation_config={"eos_token_id": 2, "max_new_tokens": 5},
    )
    flags = [
        *FLAGS,
        "--distributed-executor-backend",
        SLOW_EXECUTOR,
        "--max-num-seqs",
        "2",
        "--max-waiting-requests",
        "1",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLASSBOX_TEST_STEP_DELAY_S", "0.02")  # read by the EngineCore process
        with RemoteOpenAIServer(model, flags) as server:
            yield server


def test_max_new_tokens_caps_requests_without_max_tokens(small_server):
    response = post(
        small_server,
        "v1/chat/completions",
        body_for("v1/chat/completions", max_tokens=None, ignore_eos=True),
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5
    # An explicit max_tokens still wins, as in vLLM.
    response = post(
        small_server,
        "v1/chat/completions",
        body_for("v1/chat/completions", max_tokens=7, ignore_eos=True),
    )
    assert response.json()["usage"]["completion_tokens"] == 7


def test_waiting_queue_limit_answers_503(small_server):
    server = small_server
    long_stream = body_for("v1/completions", max_tokens=60, ignore_eos=True, stream=True)
    with httpx.Client(timeout=30) as client:
        streams = [
            client.stream("POST", server.url_for("v1/completions"), json=long_stream)
            for _ in range(3)
        ]
        try:
            for stream in streams:
                response = stream.__enter__()
                assert response.status_code == 200
            assert wait_until(
                lambda: server.engine_client.output_processor.get_num_unfinished_requests() == 3,
                5,
            )
            # Full: 2 running + 1 waiting. Plain and streaming requests alike get 503.
            for endpoint in ("v1/completions", "v1/chat/completions"):
                for stream_flag in (False, True):
                    response = post(server, endpoint, body_for(endpoint, stream=stream_flag))
                    assert response.headers.get("retry-after") == "1"
                    error = assert_error(response, 503, None, "ServiceUnavailableError")
                    assert "overloaded" in error["message"]
                    assert "max_waiting_requests" in error["message"]
            # An n that could never fit is the request's fault, not the load's.
            error = assert_error(
                post(server, "v1/completions", body_for("v1/completions", n=4, temperature=1.0)),
                400,
                "n",
            )
            assert "max_num_seqs + max_waiting_requests = 3" in error["message"]
            assert server.engine_client.output_processor.get_num_unfinished_requests() == 3
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)  # hangs up: the requests are aborted
    assert_nothing_registered(server)
    # Room again (every slot held by the refused requests was given back): n=3
    # fills the whole engine and is served.
    response = post(server, "v1/completions", body_for("v1/completions", n=3, temperature=1.0))
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 3


def test_max_waiting_requests_option(model_dir):
    def limit(**kwargs):
        config = EngineArgs(model=str(model_dir), **kwargs).create_engine_config()
        return config.scheduler_config.max_unfinished_sequences

    assert limit() == 128 + 1024
    assert limit(max_num_seqs=4, max_waiting_requests=0) == 4
    assert limit(max_waiting_requests=-1) is None  # no limit, as in vLLM
    with pytest.raises(ValueError, match="max_waiting_requests must be an integer >= 0, or -1"):
        limit(max_waiting_requests=-2)


# A client's request id is echoed in responses, logs and traces: short and plain only.
@pytest.mark.parametrize("endpoint", ["v1/completions", "v1/chat/completions"])
@pytest.mark.parametrize(
    "bad_id", ["x" * 8192, "<script>alert(1)</script>", "a b", "ü", "id\nx"], ids=repr
)
def test_request_id_is_capped_in_the_body_and_the_header(server, endpoint, bad_id):
    response = post(server, endpoint, body_for(endpoint, request_id=bad_id))
    error = assert_error(response, 400, "request_id")
    assert len(error["message"]) < 200  # the id is not echoed whole
    if "\n" not in bad_id:  # httpx refuses a newline in a header value itself
        response = httpx.post(
            server.url_for(endpoint),
            json=body_for(endpoint),
            headers={"X-Request-Id": bad_id.encode("utf-8")},
            timeout=30,
        )
        assert_error(response, 400, "X-Request-Id")
    assert_nothing_registered(server)


def test_a_plain_request_id_is_used(server):
    good = "run-7.a_b:c" + "x" * 117  # 128 characters, every allowed kind
    response = post(server, "v1/completions", body_for("v1/completions", request_id=good))
    assert response.status_code == 200, response.text
    assert good in response.json()["id"]


@pytest.mark.parametrize("limit, ok, refused", [(20, [0, 20], [21, -1]), (-1, [-1, 500], [-2])])
def test_logprobs_limit_is_the_engines_max_logprobs(model_dir, limit, ok, refused):
    """--max-logprobs reaches the server's check (20 by default, vLLM's)."""
    import types

    from engine.entrypoints.openai.completion.protocol import CompletionRequest
    from engine.entrypoints.openai.engine.serving import GlassboxValidationError, OpenAIServing
    from engine.sampling_params import RequestOutputKind

    config = EngineArgs(model=str(model_dir), max_logprobs=limit).create_engine_config()
    client = types.SimpleNamespace(model_config=config.model_config, tokenizer=None)
    serving = OpenAIServing(client, models=None)  # type: ignore[arg-type]
    request = CompletionRequest(model="m", prompt="w1")
    final = RequestOutputKind.FINAL_ONLY
    for n in ok:
        assert serving.build_sampling_params(request, 4, n, final).logprobs == n
    for n in refused:
        with pytest.raises(
            GlassboxValidationError, match=r"logprobs must be .* \(--max-logprobs\)"
        ):
            serving.build_sampling_params(request, 4, n, final)


def test_server_defaults_follow_generation_config(tmp_path):
    """--generation-config / --override-generation-config reach the endpoints."""
    import types

    from engine.entrypoints.openai.engine.serving import OpenAIServing

    model = make_tiny_model_dir(
        tmp_path / "m", generation_config={"eos_token_id": 2, "max_new_tokens": 5, "top_p": 0.9}
    )

    def serving(**kwargs):
        config = EngineArgs(model=str(model), **kwargs).create_engine_config()
        client = types.SimpleNamespace(model_config=config.model_config, tokenizer=None)
        return OpenAIServing(client, models=None)  # type: ignore[arg-type]

    auto = serving()
    assert (auto.default_max_tokens, auto.default_sampling_params) == (5, {"top_p": 0.9})
    neutral = serving(generation_config="vllm")
    assert (neutral.default_max_tokens, neutral.default_sampling_params) == (None, {})
    override = serving(override_generation_config={"top_p": 0.5, "max_new_tokens": 3})
    assert (override.default_max_tokens, override.default_sampling_params) == (3, {"top_p": 0.5})

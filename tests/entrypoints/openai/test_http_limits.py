"""What one HTTP client may send, and how the server answers beyond it
(issue 17, points 3, 7 and 8).

- Tokenizing runs on the renderer thread: ``/health`` answers while a long
  ``/tokenize`` is in progress.
- A body over ``--max-request-body-size`` is a 413 before it is parsed (with or
  without ``Content-Length``); a prompt longer than ``--max-input-chars``, or than
  ``max_model_len`` times the longest token, is a 400 naming the field and the
  limit, before tokenizing.
- ``/tokenize`` and ``/detokenize`` need the API key.
- A 405 keeps its ``Allow`` header.
- Over a real socket: a 1 MB header gets 431 (not a reset), too many headers
  431, a head sent byte by byte 408 after ``--header-read-timeout``, a body that
  stalls 408 after ``--body-read-timeout``, and connections beyond
  ``--limit-concurrency`` 503.
- ``/v1/models`` shows the model as the user named it in ``root``.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.test_errors import assert_error
from tests.entrypoints.openai.utils import COUNTING_EXECUTOR, RemoteOpenAIServer
from tests.helpers.tiny_model import make_tiny_model_dir

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 64
LONGEST_TOKEN = len("assistant")  # the tiny vocabulary's longest token text
HEADER_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 1.0
LIMIT_CONCURRENCY = 8
FLAGS = [
    "--distributed-executor-backend",
    COUNTING_EXECUTOR,
    "--block-size",
    "4",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--api-key",
    KEY,
    "--max-request-body-size",
    "4096",
    "--max-input-chars",
    "200",
    "--h11-max-header-count",
    "20",
    "--header-read-timeout",
    str(HEADER_TIMEOUT_S),
    "--body-read-timeout",
    str(BODY_TIMEOUT_S),
    "--limit-concurrency",
    str(LIMIT_CONCURRENCY),
    "--served-model-name",
    "tiny",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("http") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir):
    with RemoteOpenAIServer(model_dir, FLAGS) as server:
        yield server


def post(server, path: str, **kwargs) -> httpx.Response:
    kwargs.setdefault("headers", AUTH)
    return httpx.post(server.url_for(path), timeout=30, **kwargs)


# -- point 3: tokenizing off the event loop ---------------------------------------------


def test_health_answers_while_a_long_prompt_is_tokenized(tmp_path):
    # A context big enough that a 6 MB prompt is allowed to reach the tokenizer.
    big = make_tiny_model_dir(tmp_path / "big", max_position_embeddings=2**21)
    flags = [
        "--distributed-executor-backend",
        COUNTING_EXECUTOR,
        "--max-model-len",
        str(2**21),
        "--block-size",
        "16",
        "--num-gpu-blocks-override",
        str(2**21 // 16 + 2),
    ]
    with RemoteOpenAIServer(big, flags) as server:
        prompt = "w1 w2 w3 " * 400_000  # 3.6 MB, 1.2M tokens
        done = threading.Event()
        result: dict = {}

        def tokenize() -> None:
            start = time.monotonic()
            response = httpx.post(server.url_for("tokenize"), json={"prompt": prompt}, timeout=120)
            result["status"] = response.status_code
            result["count"] = response.json().get("count")
            result["elapsed"] = time.monotonic() - start
            done.set()

        thread = threading.Thread(target=tokenize)
        thread.start()
        time.sleep(0.3)  # let the body arrive and the tokenizer start
        latencies = []
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                start = time.monotonic()
                assert client.get(server.url_for("health")).status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.05)
        thread.join()
        assert result["status"] == 200 and result["count"] == 3 * 400_000
        # On the event loop the tokenizer held every request for its whole run
        # (seconds); off it, health waits at most for a little JSON work.
        assert latencies, "the tokenize request finished before health was asked"
        assert max(latencies) < 1.0, (max(latencies), result["elapsed"])


# -- point 3: size limits ---------------------------------------------------------------


@pytest.mark.parametrize("path", ["v1/completions", "tokenize"])
def test_body_over_the_limit_is_413_before_parsing(server, path):
    body = b'{"prompt": "' + b"w1 " * 2000 + b'"}'  # 6 KB > 4096
    response = post(server, path, content=body, headers={**AUTH, "Content-Type": "json"})
    error = assert_error(response, 413, None, "Request Entity Too Large")
    assert "--max-request-body-size=4096" in error["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b"w1 " * 200

    response = post(server, path, content=chunks())
    assert_error(response, 413, None, "Request Entity Too Large")
    # The server is fine afterwards.
    assert post(server, "tokenize", json={"prompt": "w1"}).json()["tokens"] == [5]


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("v1/completions", {"prompt": "w1 " * 70, "max_tokens": 1}, "prompt"),
        ("v1/completions", {"prompt": ["w1", "w1 " * 70], "max_tokens": 1}, "prompt"),
        (
            "v1/chat/completions",
            {"messages": [{"role": "user", "content": "w1 " * 70}], "max_tokens": 1},
            "messages",
        ),
        ("tokenize", {"prompt": "w1 " * 70}, "prompt"),
        ("tokenize", {"messages": [{"role": "user", "content": "w1 " * 70}]}, "messages"),
    ],
)
def test_prompt_over_max_input_chars_is_400(server, path, body, field):
    error = assert_error(post(server, path, json=body), 400, field)
    assert "--max-input-chars=200" in error["message"], error
    assert "210 characters" in error["message"]


def test_prompt_longer_than_the_context_can_hold_is_400_before_tokenizing(model_dir):
    # Without --max-input-chars: vLLM's bound, max_model_len x the longest token.
    flags = [f for f in FLAGS if f not in ("--max-input-chars", "200")]
    limit = MAX_MODEL_LEN * LONGEST_TOKEN
    with RemoteOpenAIServer(model_dir, flags) as server:
        prompt = "w1 " * (limit // 3 + 1)
        error = assert_error(post(server, "tokenize", json={"prompt": prompt}), 400, "prompt")
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
        assert f"at most {limit} characters" in error["message"]
        # With max_tokens the room shrinks, and the message says by how much.
        body = {"prompt": "w1 " * 100, "max_tokens": 40}
        error = assert_error(post(server, "v1/completions", json=body), 400, "prompt")
        assert "max_tokens=40 leaves 24 of them" in error["message"]
        assert f"at most {24 * LONGEST_TOKEN} characters" in error["message"]
        # Just under the bound, a too-long prompt is still caught by its token count.
        error = assert_error(
            post(server, "v1/completions", json={"prompt": "w1 " * 30, "max_tokens": 40}),
            400,
            "prompt",
        )
        assert "maximum context length" in error["message"]


def test_tokenize_and_detokenize_need_the_api_key(server):
    for path, body in (("tokenize", {"prompt": "w1"}), ("detokenize", {"tokens": [5]})):
        assert_error(post(server, path, json=body, headers={}), 401, None, "AuthenticationError")
        assert post(server, path, json=body).status_code == 200
    # Probes stay open.
    assert httpx.get(server.url_for("health")).status_code == 200
    assert httpx.get(server.url_for("version")).status_code == 200


# -- point 7: HTTP conformance ---------------------------------------------------------


def test_405_keeps_the_allow_header(server):
    response = httpx.get(server.url_for("v1/completions"), headers=AUTH)
    assert_error(response, 405, None, "Method Not Allowed")
    assert response.headers["allow"] == "POST"
    response = httpx.delete(server.url_for("health"))
    assert response.status_code == 405 and response.headers["allow"] == "GET"


def test_openapi_declares_the_real_answers(server):
    schema = httpx.get(server.url_for("openapi.json")).json()
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert set(completions) >= {"200", "400", "401", "404", "413", "503"}
    assert "422" not in completions
    assert "text/event-stream" in completions["200"]["content"]
    assert completions["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"
    }
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    assert schema["paths"]["/health"]["get"]["responses"]["200"].get("content", {}) == {}


# -- point 8: limits over a real socket ------------------------------------------------


def raw_exchange(server, data: bytes, *, wait_s: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as sock:
        sock.sendall(data)
        return read_to_close(sock)


def read_to_close(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def test_a_1mb_header_gets_431_not_a_reset(server):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1024 * 1024 + b"\r\n\r\n"
    answer = raw_exchange(server, request)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"--h11-max-incomplete-event-size=65536" in answer
    assert httpx.get(server.url_for("health")).status_code == 200


def test_too_many_headers_get_431(server):
    headers = {f"X-H{i}": "1" for i in range(30)}
    response = httpx.get(server.url_for("health"), headers=headers)
    error = assert_error(response, 431, None, "Request Header Fields Too Large")
    assert "--h11-max-header-count=20" in error["message"]


def test_a_head_sent_byte_by_byte_times_out_with_408(server):
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.settimeout(0.2)
        answer = b""
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            try:
                sock.send(bytes([byte]))
            except OSError:
                break  # closed by the server
            try:
                answer += sock.recv(65536)
                break
            except TimeoutError:
                continue
        sock.settimeout(10)
        answer += read_to_close(sock)
    elapsed = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"--header-read-timeout=1.5" in answer
    assert HEADER_TIMEOUT_S <= elapsed < HEADER_TIMEOUT_S + 5


def test_an_idle_connection_is_closed_after_the_header_timeout(server):
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        assert read_to_close(sock) == b""  # nothing asked, nothing answered
    assert time.monotonic() - start < HEADER_TIMEOUT_S + 5


def test_a_stalled_body_gets_408(server):
    head = (
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n"
    ).encode()
    answer = raw_exchange(server, head + b'{"prompt": "w1')
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"--body-read-timeout=1" in answer


def test_connections_beyond_the_limit_get_503(server):
    idle = [
        socket.create_connection(("127.0.0.1", server.port), timeout=10)
        for _ in range(LIMIT_CONCURRENCY)
    ]
    try:
        assert httpx.get(server.url_for("health")).status_code == 503
    finally:
        for sock in idle:
            sock.close()
    # The idle ones gone, requests are served again.
    deadline = time.monotonic() + 5
    while httpx.get(server.url_for("health")).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_models_root_is_the_model_as_named(server, model_dir, monkeypatch):
    data = httpx.get(server.url_for("v1/models"), headers=AUTH).json()["data"]
    assert [(m["id"], m["root"]) for m in data] == [("tiny", str(model_dir))]


def test_models_root_is_not_the_resolved_folder(model_dir):
    # A relative path resolves to an absolute folder inside the engine; /v1/models
    # shows what the user typed, as vLLM does (its root is args.model).
    relative = os.path.relpath(model_dir)
    flags = ["--distributed-executor-backend", COUNTING_EXECUTOR, "--max-model-len", "64"]
    with RemoteOpenAIServer(relative, flags) as server:
        data = httpx.get(server.url_for("v1/models")).json()["data"]
        assert [m["root"] for m in data] == [relative]


def test_metrics_label_is_the_served_model_name(server, model_dir):
    # vLLM labels its metrics with model_config.served_model_name (the first
    # --served-model-name, else the model as typed), never the resolved folder.
    text = httpx.get(server.url_for("metrics")).text
    assert 'model_name="tiny"' in text
    assert str(model_dir) not in text


@pytest.mark.parametrize(
    "flag", ["--max-request-body-size", "--max-input-chars", "--header-read-timeout"]
)
def test_limit_flags_must_be_positive(flag):
    import argparse

    from engine.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args

    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["m", flag, "0"])
    with pytest.raises(ValueError, match=f"{flag} must be positive, got 0"):
        validate_parsed_serve_args(args)

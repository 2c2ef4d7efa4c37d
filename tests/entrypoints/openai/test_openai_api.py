"""The OpenAI-compatible server through the real ``openai`` client
(twin of vllm/entrypoints/openai/api_server.py and the chat/completion
serving classes).

A real uvicorn server on 127.0.0.1 at a free port, EngineCore in its own
process, the tiny word-level tokenizer and ``CountingExecutor`` (next token =
last token + 1), so every text below is exact. Streamed text must equal the
non-streamed text, which must equal ``LLM.generate`` / ``LLM.chat`` offline.
"""

from __future__ import annotations

import gzip
import json
import os
import re

import httpx
import openai
import pytest

from engine.entrypoints.llm import LLM
from engine.entrypoints.serve import SERVER_DEV_MODE_ENV
from engine.sampling_params import SamplingParams
from tests.entrypoints.openai.utils import COUNTING_EXECUTOR, RemoteOpenAIServer
from tests.helpers.counting_executor import CountingExecutor
from tests.helpers.tiny_model import make_tiny_model_dir

ENGINE_FLAGS = ["--block-size", "4", "--num-gpu-blocks-override", "512"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("openai_api") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir):
    with RemoteOpenAIServer(
        model_dir, ["--distributed-executor-backend", COUNTING_EXECUTOR, *ENGINE_FLAGS]
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.get_client()


@pytest.fixture(scope="module")
def offline(model_dir):
    """The same engine offline, in-process."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(
            str(model_dir),
            distributed_executor_backend=CountingExecutor,
            block_size=4,
            num_gpu_blocks_override=512,
        )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return str(model_dir)


def test_models_list(client, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    assert models.data[0].max_model_len == 256
    assert models.data[0].owned_by == "glassbox"


COMPLETION_CASES = {
    "greedy": dict(prompt="w5", max_tokens=5),
    "stop string": dict(prompt="w1 w2", max_tokens=20, stop=["w7"]),
    "stop token": dict(prompt="w30", max_tokens=20, extra_body={"stop_token_ids": [4 + 33]}),
    "wraps to eos": dict(prompt="w57", max_tokens=30),
    "ignore_eos": dict(prompt="w57", max_tokens=9, extra_body={"ignore_eos": True}),
    "token ids": dict(prompt=[4 + 10, 4 + 11], max_tokens=3),
}


@pytest.mark.parametrize("case", list(COMPLETION_CASES), ids=list(COMPLETION_CASES))
def test_completion_stream_equals_non_stream_equals_offline(client, offline, model, case):
    kwargs = dict(COMPLETION_CASES[case], temperature=0.0)
    full = client.completions.create(model=model, **kwargs)
    chunks = list(
        client.completions.create(
            model=model, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]

    extra = kwargs.pop("extra_body", {})
    prompt = kwargs.pop("prompt")
    prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    (reference,) = offline.generate(prompt, SamplingParams(**kwargs, **extra), use_tqdm=False)
    expected = reference.outputs[0]

    assert full.object == "text_completion"
    assert full.choices[0].text == streamed == expected.text
    assert full.choices[0].finish_reason == expected.finish_reason == finish[-1]
    assert len(finish) == 1  # only the last chunk carries a finish_reason
    assert full.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert full.usage.completion_tokens == len(expected.token_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    # include_usage: every chunk but the last has usage null; the last has no choices.
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert {c.id for c in chunks} == {chunks[0].id}


def test_stop_reason_is_reported(client, model):
    out = client.completions.create(
        model=model, prompt="w1 w2", max_tokens=20, stop=["w7"], temperature=0
    )
    assert (out.choices[0].text, out.choices[0].finish_reason) == (" w3 w4 w5 w6 ", "stop")
    assert out.choices[0].model_extra["stop_reason"] == "w7"


def chat_messages(content: str) -> list[dict]:
    return [{"role": "system", "content": "w0"}, {"role": "user", "content": content}]


@pytest.mark.parametrize("max_tokens", [3, None])
def test_chat_stream_equals_non_stream_equals_offline(client, offline, model, max_tokens):
    messages = chat_messages("w1 w2")
    kwargs = dict(
        model=model,
        messages=messages,
        temperature=0.0,
        max_tokens=max_tokens,
        extra_body={"add_generation_prompt": False},
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    (reference,) = offline.chat(
        messages,
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        use_tqdm=False,
        add_generation_prompt=False,
    )
    expected = reference.outputs[0]

    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == expected.text
    assert full.choices[0].finish_reason == expected.finish_reason
    # The first chunk only announces the role; then the content streams.
    assert chunks[0].object == "chat.completion.chunk"
    assert (
        chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert full.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert full.usage.completion_tokens == len(expected.token_ids)


def test_chat_with_generation_prompt_runs_into_eos(client, model):
    # "... assistant" -> <unk> <s> </s>: specials are not shown, EOS stops it.
    out = client.chat.completions.create(
        model=model, messages=chat_messages("w5"), temperature=0, max_tokens=10
    )
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == ("", "stop")
    assert out.usage.completion_tokens == 3


def test_n_choices_and_completion_logprobs(client, model):
    out = client.completions.create(
        model=model, prompt="w10", max_tokens=3, n=2, temperature=0.7, logprobs=2, seed=3
    )
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert choice.text == " w11 w12 w13"
        lp = choice.logprobs
        assert lp.tokens == ["w11", "w12", "w13"]
        assert lp.token_logprobs == [-0.5, -0.5, -0.5]
        assert lp.top_logprobs[0] == {"w11": -0.5, "w12": -1.5}
        assert lp.text_offset == [0, 3, 6]
    assert out.usage.completion_tokens == 6


def test_streamed_completion_logprobs_match(client, model):
    kwargs = dict(model=model, prompt="w10", max_tokens=4, temperature=0, logprobs=1)
    full = client.completions.create(**kwargs).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, **kwargs))
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    token_logprobs = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
    assert tokens == full.tokens and token_logprobs == full.token_logprobs
    # Each chunk's offsets start where the text streamed so far ends (as vLLM).
    text = ""
    for c in chunks:
        assert c.choices[0].logprobs.text_offset[0] == len(text)
        text += c.choices[0].text


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=chat_messages("w1"),
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"add_generation_prompt": False},
    )
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == ["w2", "w3"]
    assert content[0].logprob == -0.5 and content[0].bytes == list(b"w2")
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("w2", -0.5), ("w3", -1.5)]


def test_sampling_and_vllm_extra_fields_are_accepted(client, model):
    out = client.completions.create(
        model=model,
        prompt="w57",
        max_tokens=10,
        temperature=0.5,
        top_p=0.9,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "min_tokens": 9,
            "ignore_eos": False,
        },
    )
    # The counting model reaches </s> as its 8th token; with min_tokens=9
    # that EOS does not stop the request, so it runs to max_tokens.
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 10


def test_multiple_prompts_give_one_choice_each(client, model):
    out = client.completions.create(
        model=model, prompt=["w1", "w20 w21"], max_tokens=2, temperature=0
    )
    assert [(c.index, c.text) for c in out.choices] == [(0, " w2 w3"), (1, " w22 w23")]
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4
    chunks = list(
        client.completions.create(
            model=model, prompt=["w1", "w20 w21"], max_tokens=2, temperature=0, stream=True
        )
    )
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == {0: " w2 w3", 1: " w22 w23"}


def test_model_name_may_be_left_out(server):
    response = httpx.post(
        server.url_for("v1/completions"), json={"prompt": "w3", "max_tokens": 2, "temperature": 0}
    )
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == " w4 w5"


def test_raw_sse_format(server, model):
    with httpx.stream(
        "POST",
        server.url_for("v1/chat/completions"),
        json={
            "model": model,
            "messages": chat_messages("w1"),
            "max_tokens": 2,
            "temperature": 0,
            "stream": True,
            "add_generation_prompt": False,
        },
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert '"role":"assistant"' in events[0] and '"finish_reason":null' in events[0]


def test_tokenize_and_detokenize(server, model):
    tokens = httpx.post(server.url_for("tokenize"), json={"model": model, "prompt": "w1 w2"}).json()
    assert tokens["tokens"] == [5, 6] and tokens["count"] == 2 and tokens["max_model_len"] == 256
    chat = httpx.post(
        server.url_for("tokenize"), json={"messages": [{"role": "user", "content": "w1"}]}
    ).json()
    assert chat["tokens"] == [4 + 60 + 1, 5, 4 + 60 + 2]  # user w1 assistant
    text = httpx.post(server.url_for("detokenize"), json={"tokens": [5, 6]}).json()
    assert text == {"prompt": "w1 w2"}


def test_health_version_and_metrics(server, client, model):
    assert httpx.get(server.url_for("health")).status_code == 200
    assert httpx.get(server.url_for("version")).json() == {"version": "0.1.0"}
    client.completions.create(model=model, prompt="w1", max_tokens=3, temperature=0)
    response = httpx.get(server.url_for("metrics"))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in (
        "glassbox:num_requests_running",
        "glassbox:num_requests_waiting",
        "glassbox:kv_cache_usage_perc",
        "glassbox:prompt_tokens_total",
        "glassbox:generation_tokens_total",
        "glassbox:time_to_first_token_seconds_bucket",
        "glassbox:inter_token_latency_seconds_count",
        "glassbox:e2e_request_latency_seconds_sum",
        "glassbox:request_success_total",
    ):
        assert name in text, name
    assert 'glassbox:cache_config_info{block_size="4",num_gpu_blocks="512"} 1.0' in text
    metrics = server.metrics()
    assert metrics["glassbox:time_to_first_token_seconds_count"] >= 1
    assert metrics["glassbox:num_requests_running"] == 0


def test_server_trace_links_the_http_request_to_both_processes(model_dir, tmp_path):
    trace = tmp_path / "server.jsonl"
    flags = [
        "--distributed-executor-backend",
        COUNTING_EXECUTOR,
        *ENGINE_FLAGS,
        "--trace-path",
        str(trace),
    ]
    with RemoteOpenAIServer(model_dir, flags) as server:
        chunks = list(
            server.get_client().completions.create(
                model=str(model_dir),
                prompt="w5",
                max_tokens=3,
                temperature=0,
                stream=True,
                extra_body={"request_id": "traced"},
            )
        )
        core_pid = server.engine_core_pid
    assert "".join(c.choices[0].text for c in chunks) == " w6 w7 w8"
    from engine.tracing import load_trace

    events = load_trace(str(trace))  # merged at shutdown: one file, both processes
    kinds = [e.kind for e in events]
    for kind in (
        "api.request",
        "api.chunk",
        "request.sent",
        "request.received",
        "output.sent",
        "output.received",
    ):
        assert kind in kinds, kind
    api_request = next(e for e in events if e.kind == "api.request")
    assert api_request.request_id == "traced" and api_request.stream is True
    # The engine request of prompt 0 is "<http request id>-0"; inside the
    # engine it is known by its internal id, that plus 8 random hex characters.
    received = next(e for e in events if e.kind == "request.received")
    assert re.fullmatch(r"traced-0-[0-9a-f]{8}", received.request_id)
    assert received.pid == core_pid
    api_chunks = [e for e in events if e.kind == "api.chunk"]
    assert {e.request_id for e in api_chunks} == {"traced"}
    assert api_request.ts <= received.ts <= api_chunks[-1].ts


def test_repetition_detection_ends_a_repeating_completion(client, model, server):
    # CountingExecutor's output cycles through the 67-token vocabulary.
    detect = {"max_pattern_size": 67, "min_count": 2}
    answer = client.completions.create(
        model=model,
        prompt="w1",
        max_tokens=200,
        temperature=0,
        extra_body={"ignore_eos": True, "repetition_detection": detect},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "repetition" and answer.usage.completion_tokens == 134
    assert choice.stop_reason == "repetition_detected"
    bad = httpx.post(
        server.url_for("v1", "completions"),
        json={"model": model, "prompt": "w1", "repetition_detection": {"max_pattern_size": 4}},
    )
    assert bad.status_code == 400 and "min_count must be >= 2" in bad.text


def test_profile_endpoints_exist_only_with_a_profiler(server):
    # As vLLM: without --profiler-config a client cannot make the server profile.
    assert httpx.post(server.url_for("start_profile")).status_code == 404
    assert httpx.post(server.url_for("stop_profile")).status_code == 404


def test_profile_endpoints_write_the_worker_and_front_end_traces(model_dir, tmp_path):
    out = tmp_path / "traces"
    # No Python stacks: torch cannot always read their names back for the op table.
    config = {
        "profiler": "torch",
        "torch_profiler_dir": str(out),
        "torch_profiler_with_stack": False,
    }
    # The tiny tokenizer's folder with random weights: a real worker to profile.
    flags = ["--load-format", "dummy", "--hf-overrides", '{"intermediate_size": 32}']
    flags += [*ENGINE_FLAGS, "--profiler-config", json.dumps(config)]
    with RemoteOpenAIServer(model_dir, flags) as server:
        assert httpx.post(server.url_for("start_profile"), timeout=30).status_code == 200
        answer = server.get_client().completions.create(
            model=str(model_dir), prompt="w5", max_tokens=3, temperature=0
        )
        assert answer.usage.completion_tokens == 3
        assert httpx.post(server.url_for("stop_profile"), timeout=30).status_code == 200
        core_pid = server.engine_core_pid
    (worker,) = out.glob("tp0_rank0.*.pt.trace.json.gz")
    events = json.load(gzip.open(worker))["traceEvents"]
    assert core_pid in {e["pid"] for e in events if e.get("ph") == "X"}
    labels = [e["name"] for e in events if e.get("name", "").startswith("execute_context_")]
    assert labels[0] == "execute_context_1(1)_generation_0(0)"
    (front_end,) = out.glob(f"*_{os.getpid()}.async_llm.*.pt.trace.json.gz")
    assert json.load(gzip.open(front_end))["traceEvents"]
    assert (out / "profiler_out_0.txt").exists()


def test_dev_mode_routes_reset_the_cache_and_pause(server, model_dir, monkeypatch):
    for route in ("reset_prefix_cache", "pause", "resume"):
        assert httpx.post(server.url_for(route)).status_code == 404
    assert httpx.get(server.url_for("is_paused")).status_code == 404
    monkeypatch.setenv(SERVER_DEV_MODE_ENV, "1")
    flags = ["--distributed-executor-backend", COUNTING_EXECUTOR, *ENGINE_FLAGS]
    with RemoteOpenAIServer(model_dir, flags) as dev:
        prompt = "w1 w2 w3 w4 w5 w6 w7 w8 w9"  # two full 4-token blocks to cache

        def hits_after_one_request() -> float:
            before = dev.metrics()["glassbox:prefix_cache_hits_total"]
            dev.get_client().completions.create(
                model=str(model_dir), prompt=prompt, max_tokens=1, temperature=0
            )
            return dev.metrics()["glassbox:prefix_cache_hits_total"] - before

        assert hits_after_one_request() == 0  # cold
        assert hits_after_one_request() == 8  # the two blocks, cached
        answer = httpx.post(dev.url_for("reset_prefix_cache"))
        assert answer.status_code == 200 and answer.json() == {"reset": True}
        assert hits_after_one_request() == 0  # cold again
        # Pausing (vLLM's rlhf routes): the state is visible, a bad mode is a 400.
        assert httpx.get(dev.url_for("is_paused")).json() == {"is_paused": False}
        bad = httpx.post(dev.url_for("pause"), params={"mode": "later"})
        assert bad.status_code == 400 and "'abort', 'wait' or 'keep'" in bad.text
        paused = httpx.post(dev.url_for("pause"), params={"mode": "keep"})
        assert paused.json() == {"status": "paused"}
        assert httpx.get(dev.url_for("is_paused")).json() == {"is_paused": True}
        assert httpx.post(dev.url_for("resume")).json() == {"status": "resumed"}
        # Serving again, from a cold cache: the pause cleared it (clear_cache=true).
        assert hits_after_one_request() == 0
        assert hits_after_one_request() == 8

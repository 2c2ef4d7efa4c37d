"""Many streams at once, and streams whose client walks away.

64 concurrent streaming requests (real ``AsyncOpenAI`` client, real sockets)
must all finish with the right text and ``usage``. A client that disconnects
mid-stream must get its request aborted: ``glassbox:num_requests_running``
back to 0 within seconds and every KV block back in the pool
(``glassbox:kv_cache_usage_perc`` exactly 0), and the request must not have
run to its ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.entrypoints.openai.utils import SLOW_EXECUTOR, RemoteOpenAIServer, wait_until
from tests.helpers.tiny_model import make_tiny_model_dir

NUM_STREAMS = 64
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("load") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLASSBOX_TEST_STEP_DELAY_S", "0.01")  # read by the EngineCore process
        flags = [
            "--distributed-executor-backend",
            SLOW_EXECUTOR,
            "--block-size",
            "4",
            "--num-gpu-blocks-override",
            "1024",
        ]
        with RemoteOpenAIServer(model_dir, flags) as server:
            yield server


def expected_text(start: int, n: int) -> str:
    return "".join(f" w{start + k}" for k in range(1, n + 1))


def test_64_concurrent_streams_complete_with_correct_usage(server, model_dir):
    client = server.get_async_client()

    async def completion_stream(i: int):
        prompt = f"w{i % 40} w{i % 40 + 1}"
        stream = await client.completions.create(
            model=str(model_dir),
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage, finish

    async def chat_stream(i: int):
        stream = await client.chat.completions.create(
            model=str(model_dir),
            messages=[{"role": "user", "content": f"w{i % 40}"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"add_generation_prompt": False},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage, finish

    async def run_all():
        jobs = [completion_stream(i) if i % 2 == 0 else chat_stream(i) for i in range(NUM_STREAMS)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(run_all())
    assert len(results) == NUM_STREAMS
    for i, (text, usage, finish) in enumerate(results):
        assert finish == "length", i
        assert usage is not None, i
        assert usage.completion_tokens == MAX_TOKENS
        if i % 2 == 0:
            assert text == expected_text(i % 40 + 1, MAX_TOKENS)
            assert usage.prompt_tokens == 2
        else:
            # chat template without generation prompt: "user w{i} "
            assert text == expected_text(i % 40, MAX_TOKENS)
            assert usage.prompt_tokens == 2
        assert usage.total_tokens == usage.prompt_tokens + MAX_TOKENS
    assert wait_until(lambda: server.metrics()["glassbox:num_requests_running"] == 0, 5)


@pytest.mark.parametrize("endpoint", ["v1/completions", "v1/chat/completions"])
def test_disconnect_mid_stream_aborts_and_frees_blocks(server, model_dir, endpoint):
    long_request = {
        "model": str(model_dir),
        "max_tokens": 240,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    if endpoint == "v1/completions":
        long_request["prompt"] = "w1 w2 w3"
    else:
        long_request["messages"] = [{"role": "user", "content": "w1 w2"}]
    before = server.metrics()
    with httpx.stream("POST", server.url_for(endpoint), json=long_request, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or line == "" for line in received)
        assert server.metrics()["glassbox:num_requests_running"] == 1
        # Leaving the block closes the connection mid-stream.
    closed_at = time.monotonic()

    def idle() -> bool:
        m = server.metrics()
        return m["glassbox:num_requests_running"] == 0 and m["glassbox:kv_cache_usage_perc"] == 0.0

    assert wait_until(idle, 5), server.metrics()
    assert time.monotonic() - closed_at < 5
    after = server.metrics()
    generated = (
        after["glassbox:generation_tokens_total"] - before["glassbox:generation_tokens_total"]
    )
    assert 0 < generated < 240, "the request ran on after its client left"
    assert server.engine_client.output_processor.request_states == {}
    assert server.engine_client.output_processor.external_req_ids == {}
    # The server is as good as new.
    out = server.get_client().completions.create(
        model=str(model_dir), prompt="w7", max_tokens=2, temperature=0
    )
    assert out.choices[0].text == " w8 w9"


def test_disconnect_of_a_non_streaming_request_aborts_it(server, model_dir):
    async def hang_up():
        async with httpx.AsyncClient(timeout=30) as client:
            task = asyncio.create_task(
                client.post(
                    server.url_for("v1/completions"),
                    json={
                        "model": str(model_dir),
                        "prompt": "w1",
                        "max_tokens": 240,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                )
            )
            await asyncio.sleep(0.5)
            task.cancel()  # closes the connection before the response
            with pytest.raises(asyncio.CancelledError):
                await task

    before = server.metrics()["glassbox:generation_tokens_total"]
    asyncio.run(hang_up())
    assert wait_until(
        lambda: (
            server.metrics()["glassbox:num_requests_running"] == 0
            and server.metrics()["glassbox:kv_cache_usage_perc"] == 0.0
        ),
        5,
    )
    assert server.metrics()["glassbox:generation_tokens_total"] - before < 240

"""The soak's fast subset: ~100 mixed requests against the tiny model.

The load of ``tests/reliability/soak.py`` (completions and chat, streaming and
not, ``n`` up to 3, clients that leave part-way) against an in-process server
whose EngineCore runs the counting executor with a 2 ms step, so requests
overlap and some aborts land mid-generation. Afterwards: no request errored
or hung, the ``/metrics`` gauges are back to zero, and nothing is left in the
front end's output processor or in EngineCore's scheduler. The long run
(thousands of requests, the default model, RSS over time) is the script.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.entrypoints.openai.utils import SLOW_EXECUTOR, RemoteOpenAIServer
from tests.helpers.tiny_model import make_tiny_model_dir
from tests.reliability.soak import make_specs, run_load, wait_for_idle_gauges

NUM_REQUESTS = 100
TINY_WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("soak") / "tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLASSBOX_TEST_STEP_DELAY_S", "0.002")  # read by the EngineCore process
        flags = ["--distributed-executor-backend", SLOW_EXECUTOR, "--block-size", "4"]
        with RemoteOpenAIServer(model_dir, flags) as server:
            yield server, str(model_dir)


def test_mixed_load_leaves_nothing_behind(server):
    server, model = server
    specs = make_specs(NUM_REQUESTS, seed=1, abort_fraction=0.15)
    # The tiny model's context is 256 tokens: prompt + max_tokens (<= 64) must fit.
    stats = asyncio.run(
        run_load(
            server.url_root,
            model,
            specs,
            concurrency=16,
            words=TINY_WORDS,
            max_prompt_words=120,
            stall_timeout_s=20,
        )
    )
    summary = stats.summary()
    assert stats.errored == 0 and stats.hung == 0, summary
    assert stats.ok + stats.aborted_on_purpose == NUM_REQUESTS
    assert stats.aborted_on_purpose > 0 and len(summary["by_kind"]) == 4

    idle, _, gauges = wait_for_idle_gauges(server.url_root, timeout_s=5)
    assert idle, gauges
    processor = server.engine_client.output_processor
    assert processor.request_states == {}
    assert processor.parent_requests == {}
    assert not processor.external_req_ids
    unfinished = asyncio.run_coroutine_threadsafe(
        server.engine_client.engine_core.call_utility_async("get_num_unfinished_requests"),
        server.loop,
    ).result(timeout=10)
    assert unfinished == 0

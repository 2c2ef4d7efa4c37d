"""End to end: ``glassbox trace --headless`` records a real run of the
embedded default model (SmolLM2-135M-Instruct, CPU), prints the lifecycle
summary, and the recorded trace replays in the app, every panel agreeing with
the replay model.

The model folder is ``tests.helpers.hf_checkpoints.default_model_path``: the
default model in the cache ``LLM()`` uses, converted there if it is not yet.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from engine.entrypoints.cli.main import main
from engine.tracing import TraceReplay
from tests.helpers.hf_checkpoints import default_model_path
from tests.tui.pilot_helpers import assert_panels_match_replay, wait_ready
from tui.app import TraceApp
from tui.session import open_session

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def recorded(model_path, tmp_path_factory) -> tuple[str, str]:
    trace = str(tmp_path_factory.mktemp("e2e") / "run.jsonl")
    argv = [
        "trace",
        "What is the capital of France?",
        "--headless",
        "--model",
        model_path,
        "--device",
        "cpu",
        "--trace-level",
        "lifecycle",
        "--concurrent",
        "2",
        # Short raw prompts and 4 tokens each keep the CPU run to a few seconds.
        "--raw-prompt",
        "--max-tokens",
        "4",
        "--max-num-batched-tokens",
        "16",
        "--trace-path",
        trace,
    ]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return trace, out.getvalue()


def test_headless_trace_prints_the_prompts_lifecycle(recorded, capsys):
    trace, out = recorded
    session = open_session(trace)
    # The engine's internal id for the prompt: the id it was sent under, "-", 8 hex digits.
    followed = session.info.followed_request_id
    assert re.fullmatch(r"prompt-[0-9a-f]{8}", followed), followed
    assert f"Request prompt (followed; internal id {followed})" in out
    for piece in (
        "queued:",
        "admitted",
        "prefill",
        "first output token",
        "finished:",
        "Other requests:",
        f"glassbox tui {trace}",
    ):
        assert piece in out, piece
    assert session.resolve_request_id("prompt") == followed
    assert session.info.trace_level == "lifecycle"
    # The engine's shutdown closed the tracer: the file ends with trace.end.
    assert session.truncated is None and not out.startswith("WARNING")
    sent_under = {session.timelines[r].external_req_id: r for r in session.request_ids}
    assert set(sent_under) == {"prompt", "bg-1", "bg-2"} and len(session.request_ids) == 3
    for sent, rid in sent_under.items():
        assert rid.startswith(f"{sent}-") and session.request_label(rid) == sent
    # glassbox tui --follow takes the id the request was sent under.
    assert main(["tui", trace, "--summary", "--follow", "bg-1"]) == 0
    assert f"Request bg-1 (internal id {sent_under['bg-1']})" in capsys.readouterr().out
    # Token texts were added, so the output reads as text.
    tl = session.timelines[followed]
    assert len(tl.output_tokens) >= 1
    assert all(session.token_text(t) is not None for _, t in tl.output_tokens)


@pytest.mark.asyncio
async def test_the_recorded_trace_replays_in_the_app(recorded):
    trace, _ = recorded
    session = open_session(trace)
    replay = TraceReplay(session.events)
    app = TraceApp(trace)  # opened by the app itself, in its worker
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_ready(app, pilot)
        assert app.error is None and app.follow == session.resolve_request_id("prompt")
        assert app.follow == session.info.followed_request_id
        await pilot.press("home")
        for _ in range(replay.last_step + 1):
            assert_panels_match_replay(app, replay, app.session)
            await pilot.press("right")
        assert app.step == replay.last_step

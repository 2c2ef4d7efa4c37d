"""``glassbox tui`` and ``glassbox trace``: arguments, bad input, the plan of
a traced run. (Running ``glassbox trace`` on the real model is
``test_tui_e2e.py``.)"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from engine.entrypoints.cli import trace as trace_cli
from engine.entrypoints.cli.main import COMMANDS, build_parser, main
from engine.tracing import (
    RequestAdded,
    RunnerInputs,
    SamplerSampled,
    SamplerStage,
    SchedUpdate,
    TensorSummary,
)


def test_commands_are_registered():
    assert {"trace", "tui"} <= set(COMMANDS)
    args = build_parser().parse_args(["trace", "Hi", "--headless", "--concurrent", "2"])
    assert (args.prompt, args.headless, args.concurrent) == ("Hi", True, 2)
    assert args.trace_level == "full" and args.max_num_batched_tokens == 64


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no trace file at"),
        ("", "is empty"),
        ('{"ts": 1, "pid": 1, "kind": "kv.init", "num_bl', "is truncated"),
        (
            '{"ts": 0, "pid": 1, "seq": 0, "kind": "trace.header", "trace_format_version": "99"}\n',
            "trace format version '99'",
        ),
        ('{"a": 1}\n', "not a Glassbox trace"),
    ],
    ids=["missing", "empty", "truncated", "other-version", "not-a-trace"],
)
def test_tui_reports_bad_traces_in_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "t.jsonl"
    if content is not None:
        path.write_text(content)
    # --summary opens the trace here (the app itself shows the same message).
    args = ["tui", str(path), "--summary"] if content else ["tui", str(path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("glassbox tui: ") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


ROOT = Path(__file__).resolve().parents[2]


def _without_a_terminal(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``glassbox ARGV`` with stdin, stdout and stderr not terminals (as
    from a script or CI); a TUI started anyway would spin until the timeout."""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli.main", *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    return result, time.monotonic() - start


def test_tui_without_a_terminal_exits_at_once_pointing_at_summary(small_trace_path):
    result, seconds = _without_a_terminal("tui", small_trace_path)
    assert result.returncode == 2 and seconds < 15
    assert result.stderr.startswith("glassbox tui: the TUI needs a terminal (stdin, stdout and ")
    assert f"glassbox tui {small_trace_path} --summary" in result.stderr
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1
    # The text summary needs no terminal.
    result, _ = _without_a_terminal("tui", small_trace_path, "--summary")
    assert result.returncode == 0 and "Request prompt (followed)" in result.stdout


def test_trace_without_a_terminal_stops_before_recording_pointing_at_headless():
    result, seconds = _without_a_terminal("trace", "Hi")
    assert result.returncode == 2 and seconds < 15
    assert "the TUI needs a terminal" in result.stderr and "--headless" in result.stderr


def test_missing_terminal_names_the_streams_that_are_not_terminals():
    from tui.terminal import missing_terminal

    class Stream:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    def streams(*ttys: bool) -> dict:
        return dict(zip(("stdin", "stdout", "stderr"), (Stream(t) for t in ttys)))

    assert missing_terminal(streams(True, True, True)) is None
    assert missing_terminal(streams(False, True, True)) == "stdin is not a terminal"
    assert missing_terminal(streams(True, False, False)) == ("stdout and stderr are not terminals")
    assert missing_terminal({"stdin": None, "stdout": Stream(True)}) == "stdin is not a terminal"


def test_tui_summary_of_a_truncated_trace_says_so_first(capsys, cut_trace_path):
    assert main(["tui", cut_trace_path, "--summary"]) == 0
    first, *rest = capsys.readouterr().out.splitlines()
    assert first.startswith(f"WARNING: {cut_trace_path} is truncated: the process that wrote it")
    assert "no trace.end line" in first
    # The token texts were cut off: tokens show as ids, and the warning says why.
    assert any(line.endswith("first output token: #504") for line in rest)


def test_tui_summary_of_the_small_trace(capsys, small_trace_path):
    assert main(["tui", small_trace_path, "--summary", "--follow", "bg-5"]) == 0
    out = capsys.readouterr().out
    assert "Request bg-5" in out and "preempted" in out and "resumed" in out
    assert main(["tui", small_trace_path, "--summary", "--follow", "nope"]) == 2
    assert "--follow must be one of" in capsys.readouterr().err


def test_tui_follows_a_request_by_the_id_it_was_sent_under(tmp_path, capsys, internal_id_trace):
    """Since format 1.2 the trace names requests by internal ids; --follow
    takes the id the request was sent under, or the internal id."""
    events, internal = internal_id_trace
    path = tmp_path / "ids.jsonl"
    path.write_bytes(msgspec.json.Encoder().encode_lines(events))
    for follow in ("bg-5", internal["bg-5"]):
        assert main(["tui", str(path), "--summary", "--follow", follow]) == 0
        out = capsys.readouterr().out
        assert f"Request bg-5 (internal id {internal['bg-5']})" in out and "preempted" in out
    assert main(["tui", str(path), "--summary", "--follow", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--follow must be one of the trace's requests (bg-1, bg-2," in err  # the sent ids


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trace", "  "], "PROMPT must not be empty"),
        (["trace", "Hi", "--concurrent", "-1"], "--concurrent must be >= 0"),
        (["trace", "Hi", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["trace", "Hi", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
    ],
)
def test_trace_rejects_bad_arguments(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    trace_cli.add_arguments(parser)
    return parser.parse_args(["What is the capital of France?", *kw.pop("extra", [])])


def test_the_plan_puts_your_prompt_last_among_the_first_arrivals():
    planned = trace_cli.plan_requests(_args())
    ids = [r.request_id for r in planned]
    assert len(planned) == trace_cli.DEFAULT_CONCURRENT + 1
    first = [r.request_id for r in planned if r.arrival_step == 0]
    assert first[-1] == "prompt" and ids.index("prompt") == len(first) - 1
    # One background request repeats your prompt (a prefix hit on all of it).
    assert sum(r.text == "What is the capital of France?" for r in planned) == 2
    # --max-tokens caps every request; arrivals are in order.
    assert all(r.max_tokens <= 48 for r in planned)
    steps = [r.arrival_step for r in planned]
    assert steps == sorted(steps)
    none = trace_cli.plan_requests(_args(extra=["--concurrent", "0", "--max-tokens", "5"]))
    assert [(r.request_id, r.max_tokens) for r in none] == [("prompt", 5)]
    many = trace_cli.plan_requests(_args(extra=["--concurrent", "9"]))
    assert len({r.request_id for r in many}) == 10


def test_pool_size_is_small_but_holds_one_full_sequence():
    planned = trace_cli.plan_requests(_args())
    for r in planned:
        r.prompt_token_ids = [0] * 60
    total = sum(-(-(60 + r.max_tokens) // 16) for r in planned)
    size = trace_cli._pool_size(planned, 16, max_model_len=112)
    assert size == max(112 // 16 + 3, int(trace_cli.POOL_FRACTION * total) + 1)
    assert size < total  # small enough that requests must wait or be preempted
    assert trace_cli._pool_size(planned, 16, max_model_len=1024) == 1024 // 16 + 3


def test_token_texts_cover_every_id_in_the_trace(tmp_path):
    empty = TensorSummary(shape=[0], dtype="int32")
    events = [
        RequestAdded(
            ts=1, pid=1, seq=1, request_id="a", num_prompt_tokens=2, prompt_token_ids=[5, 6]
        ),
        SchedUpdate(ts=2, pid=1, seq=2, new_token_ids={"a": [7]}),
        SamplerSampled(
            ts=3,
            pid=1,
            seq=3,
            request_id="a",
            row=0,
            token_id=7,
            logprob=-0.5,
            stages=[SamplerStage(stage="raw", token_ids=[7, 8], probs=[0.6, 0.4])],
        ),
        RunnerInputs(
            ts=4,
            pid=1,
            seq=4,
            input_ids=TensorSummary(shape=[40], dtype="int32", head=[9], tail=[10]),
            positions=empty,
            query_start_loc=empty,
            seq_lens=empty,
            slot_mapping=empty,
            block_table=empty,
            logits_indices=empty,
        ),
    ]
    path = tmp_path / "t.jsonl"
    path.write_bytes(msgspec.json.Encoder().encode_lines(events))

    class Tok:
        def decode(self, ids):
            return f"<{ids[0]}>"

    assert trace_cli._token_texts(str(path), Tok()) == {str(i): f"<{i}>" for i in range(5, 11)}


def test_the_tui_quits_when_its_terminal_hangs_up(small_trace_path):
    """Closing the terminal under a running ``glassbox tui`` (a window closed, a tmux
    session killed) must end it. Under ``make run`` the hangup signal goes to make, which
    waits for its child: the child, modelled here by ignoring SIGHUP, sees only a hung-up
    terminal -- and Textual's input thread spins on it at ~80% of a core."""
    import os
    import pty
    import select
    import signal

    argv = [sys.executable, "-m", "engine.entrypoints.cli.main", "tui", small_trace_path]
    pid, master = pty.fork()
    if pid == 0:  # the child: a session of its own on the pty's slave end
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        os.execv(sys.executable, argv)
    seen = b""
    deadline = time.monotonic() + 60
    while b"Requests" not in seen and time.monotonic() < deadline:  # the panels are up
        if select.select([master], [], [], 1)[0]:
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
    assert b"Requests" in seen, seen[-500:]
    os.close(master)  # the terminal goes away
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("glassbox tui still running 10 s after its terminal hung up")
    assert os.waitstatus_to_exitcode(status) == 129  # 128 + SIGHUP

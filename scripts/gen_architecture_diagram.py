#!/usr/bin/env python3
"""Draw docs/images/architecture.svg: one request's life, HTTP to SSE, from a real trace.

The diagram is not drawn by hand. It is built from a trace of one streamed
chat completion served by ``glassbox serve`` (API server and EngineCore in two
processes), committed as ``docs/data/architecture_trace.jsonl``:

* every box is a stage the trace shows the request passing through, labelled
  with the Glassbox function that does it, the vLLM name it mirrors, and the
  time that stage took in this run;
* the two processes are the two clusters, identified by the ``pid`` of the
  events (the API server writes ``api.*``, the core writes ``kv.init``);
* the trace is read with ``load_trace``: typed events (``engine/tracing/events.py``);
* every box links to the module's row in ``docs/source_map.md``.

The same numbers go into the table between the ``timings`` markers of
``docs/architecture.md``.

    .venv/bin/python scripts/gen_architecture_diagram.py           # trace -> SVG + table
    .venv/bin/python scripts/gen_architecture_diagram.py --record  # record the trace first
    .venv/bin/python scripts/gen_architecture_diagram.py --check   # exit 1 if the table is stale

``--record`` starts ``glassbox serve`` on a free local port with tracing on,
streams one chat completion with httpx, stops the server with SIGINT (which
merges the two processes' trace parts) and stores the trace. Rendering needs
Graphviz's ``dot``; ``--check`` does not.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TypeVar

import msgspec

# The source map's own row anchors (this script runs from scripts/, next to it),
# so a box's link and the row it points at cannot drift apart.
from gen_source_map import anchor

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.tracing import (  # noqa: E402 (after the path is set)
    ApiChunk,
    ApiRequest,
    KVCacheHit,
    KVInit,
    OutputReceived,
    OutputSent,
    RequestAdded,
    RequestOutputEvent,
    RequestReceived,
    RequestSent,
    RunnerBatch,
    RunnerForward,
    RunnerInit,
    SchedQueued,
    SchedStep,
    SchedUpdate,
    TraceEvent,
    load_trace,
    read_events,
)

E = TypeVar("E", bound=TraceEvent)

TRACE = ROOT / "docs" / "data" / "architecture_trace.jsonl"
SVG = ROOT / "docs" / "images" / "architecture.svg"
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- timings:begin (scripts/gen_architecture_diagram.py) -->", "<!-- timings:end -->"
# Links from the SVG (in docs/images/) into the source map (in docs/).
MAP = "../source_map.md"
QUESTION = "Name one primary colour."


# ---------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(out: Path) -> None:
    import httpx

    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="glassbox-arch-"))
    trace = workdir / "serve.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "engine.entrypoints.cli.main",
        "serve",
        "--port",
        str(port),
        "--trace-path",
        str(trace),
        "--trace-level",
        "lifecycle",
        "--max-model-len",
        "512",
        "--num-gpu-blocks-override",
        "64",
        "--disable-log-stats",
    ]
    log = open(workdir / "server.log", "w")
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited early; see {workdir / 'server.log'}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("the server did not become healthy within 300 s")
            time.sleep(0.5)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        # A warm-up request first (other words, not streamed): the first forward
        # passes of a fresh process pay one-off set-up costs that would hide
        # the steady-state picture. The diagram shows the second request.
        warm = {
            "model": model,
            "max_tokens": 32,
            "messages": [{"role": "user", "content": "Say hello."}],
        }
        httpx.post(f"{base}/v1/chat/completions", json=warm, timeout=120).raise_for_status()
        body = {
            "model": model,
            "stream": True,
            "temperature": 0,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": QUESTION}],
        }
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=body, timeout=120
        ) as response:
            response.raise_for_status()
            chunks = [line for line in response.iter_lines() if line.startswith("data: ")]
        print(f"streamed {len(chunks)} SSE events")
    finally:
        server.send_signal(signal.SIGINT)  # graceful: the front end merges the trace parts
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    events = read_events(str(trace))  # file order, headers included
    for event in events:
        if isinstance(event, RunnerInit):
            event.model = Path(event.model).name  # no local paths in the repo
    out.write_bytes(msgspec.json.Encoder().encode_lines(events))
    print(f"wrote {out}")


# ---------------------------------------------------------------------------
# The stages, from the trace
# ---------------------------------------------------------------------------
def load(path: Path) -> list[TraceEvent]:
    """The trace's events, typed and ordered by time (headers checked, left out)."""
    return load_trace(str(path))


def concerns(event: TraceEvent, rid: str, steps: set[int]) -> bool:
    """Whether ``event`` is about request ``rid`` or one of the ``steps`` it ran in."""
    return (
        getattr(event, "request_id", None) == rid
        or rid in (getattr(event, "request_ids", None) or ())
        or event.step in steps
    )


def stages(events: list[TraceEvent]) -> dict:
    """Times (ms) of each stage of the last (streamed) request in the trace."""
    api = [e for e in events if isinstance(e, ApiRequest)][-1]
    rid = api.request_id
    front, core = api.pid, next(e.pid for e in events if isinstance(e, KVInit))
    its_steps = {
        e.step for e in events if isinstance(e, SchedStep) and rid in e.num_scheduled_tokens
    }
    mine = [e for e in events if concerns(e, rid, its_steps)]

    def one(kind: type[E]) -> E:
        return next(e for e in mine if isinstance(e, kind))

    def every(kind: type[E]) -> list[E]:
        return [e for e in mine if isinstance(e, kind)]

    def ms(a: TraceEvent, b: TraceEvent) -> float:
        return (b.ts - a.ts) / 1e6

    steps = every(SchedStep)
    forwards = every(RunnerForward)
    chunks = every(ApiChunk)
    outputs = every(RequestOutputEvent)
    sent, received = every(OutputSent), every(OutputReceived)
    first_text_chunk = next(c for c in chunks if c.ts > outputs[0].ts)
    hops_out = [ms(s, r) for s, r in zip(sent, received)]
    batch0 = next(b for b in every(RunnerBatch) if b.step == steps[0].step)
    init = next(e for e in events if isinstance(e, RunnerInit))
    added = one(RequestAdded)
    return {
        "request_id": rid,
        "pids": {"api": front, "core": core},
        "model": init.architecture,
        "device": init.device,
        "attn_backend": init.attn_backend,
        "prompt_tokens": added.num_prompt_tokens,
        "cached_tokens": one(KVCacheHit).num_cached_tokens,
        "output_tokens": outputs[-1].num_output_tokens,
        "steps": len(steps),
        "sse_events": len(chunks),
        "preprocess_ms": ms(api, added),
        "hop_in_ms": ms(one(RequestSent), one(RequestReceived)),
        "queue_ms": ms(one(RequestReceived), one(SchedQueued)),
        "wait_for_step_ms": ms(one(SchedQueued), steps[0]),
        "schedule_ms": [s.duration_ns / 1e6 for s in steps],
        "prefill_tokens": batch0.num_tokens,
        "forward_ms": [f.duration_ns / 1e6 for f in forwards],
        "update_ms": [u.duration_ns / 1e6 for u in every(SchedUpdate) if u.new_token_ids],
        "hop_out_ms": hops_out,
        "detok_sse_ms": ms(received[0], first_text_chunk),
        "ttft_ms": ms(api, first_text_chunk),
        "total_ms": ms(api, chunks[-1]),
        "texts": [o.text_delta for o in outputs],
    }


def fmt(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def timings_table(s: dict) -> str:
    rows = [
        (
            "API server",
            "template + tokenize + `InputProcessor` → `request.added`",
            f"{s['preprocess_ms']:.1f}",
        ),
        (
            "ZMQ →",
            "`request.sent` → `request.received` (front end → core)",
            f"{s['hop_in_ms']:.2f}",
        ),
        (
            "EngineCore",
            "input thread → `Scheduler.add_request` (`sched.queued`)",
            f"{s['queue_ms']:.2f}",
        ),
        (
            "EngineCore",
            "queued → the busy loop's next `schedule()`",
            f"{s['wait_for_step_ms']:.2f}",
        ),
        ("EngineCore", f"`schedule()`, per step ({s['steps']} steps)", fmt(s["schedule_ms"])),
        (
            "EngineCore",
            f"forward + LM head, per step (prefill of {s['prefill_tokens']} tokens, "
            f"{s['cached_tokens']} more from the prefix cache; then decodes)",
            fmt(s["forward_ms"]),
        ),
        ("EngineCore", "`update_from_output()`, per step", fmt(s["update_ms"])),
        ("ZMQ ←", "`output.sent` → `output.received`, per step", fmt(s["hop_out_ms"])),
        (
            "API server",
            "first output received → detokenised → first SSE chunk with text",
            f"{s['detok_sse_ms']:.1f}",
        ),
        ("end to end", "HTTP request in → first SSE chunk with text (TTFT)", f"{s['ttft_ms']:.1f}"),
        (
            "end to end",
            f"HTTP request in → last SSE event ({s['output_tokens']} tokens, "
            f"{s['sse_events']} SSE events)",
            f"{s['total_ms']:.1f}",
        ),
    ]
    out = [
        f"Recorded on `{s['device']}` ({s['model']}, `{s['attn_backend']}` attention): the "
        "second request to a fresh server (the first one warms it up), "
        f"{s['prompt_tokens']} prompt tokens, greedy, `max_tokens=4`, streamed.",
        "",
        "| where | stage (trace events) | ms |",
        "| --- | --- | --: |",
    ]
    out += [f"| {w} | {what} | {t} |" for w, what, t in rows]
    return "\n".join(out)


# ---------------------------------------------------------------------------
# The diagram
# ---------------------------------------------------------------------------
def node(
    name: str, title: str, glassbox: str, vllm: str, module: str, timing: str, colour: str
) -> str:
    label = (
        f'<<TABLE BORDER="0" CELLSPACING="0" CELLPADDING="2">'
        f"<TR><TD><B>{title}</B></TD></TR>"
        f'<TR><TD><FONT FACE="monospace" POINT-SIZE="9">{glassbox}</FONT></TD></TR>'
        f'<TR><TD><FONT POINT-SIZE="8" COLOR="#555555">vLLM: {vllm}</FONT></TD></TR>'
        f'<TR><TD><FONT POINT-SIZE="9" COLOR="#9b2226">{timing}</FONT></TD></TR></TABLE>>'
    )
    return (
        f'{name} [label={label}, URL="{MAP}#{anchor(module)}", target="_top", '
        f'tooltip="{module}", style="rounded,filled", fillcolor="{colour}"];'
    )


def dot_source(s: dict) -> str:
    api, core = "#e8f1fb", "#fdf0e6"
    text = "".join(s["texts"]).replace('"', "'")
    lines = [
        "digraph lifecycle {",
        'graph [rankdir=TB, fontname="Helvetica", fontsize=11, nodesep=0.35, ranksep=0.35, '
        f'label="One streamed chat completion through Glassbox, from its trace '
        f'(reply: \\"{text}\\"). '
        "Numbers are this run's; boxes link to docs/source_map.md.\", labelloc=b];",
        'node [shape=box, fontname="Helvetica", fontsize=10, margin="0.08,0.04"];',
        'edge [fontname="Helvetica", fontsize=9, color="#444444"];',
        'client [label="HTTP client\\nPOST /v1/chat/completions\\nstream=true", shape=oval];',
        "subgraph cluster_api {",
        f'label="API server process (pid {s["pids"]["api"]}): asyncio, FastAPI + AsyncLLM"; '
        'style=rounded; color="#457b9d";',
        node(
            "handler",
            "1. route + chat template",
            "create_chat_completion",
            "OpenAIServingChat.create_chat_completion",
            "engine/entrypoints/openai/chat_completion/serving.py",
            f"{s['preprocess_ms']:.1f} ms to request.added",
            api,
        ),
        node(
            "generate",
            "2. AsyncLLM.generate",
            "AsyncLLM.add_request → InputProcessor",
            "AsyncLLM.generate / add_request",
            "engine/v1/engine/async_llm.py",
            "tokens → EngineCoreRequest",
            api,
        ),
        node(
            "client_send",
            "3. send over ZMQ",
            "AsyncMPClient.add_request_async",
            "AsyncMPClient.add_request_async",
            "engine/v1/engine/core_client.py",
            "msgpack, ROUTER/DEALER",
            api,
        ),
        node(
            "output_handler",
            "9. output_handler task",
            "get_output_async → OutputProcessor",
            "AsyncLLM._run_output_handler",
            "engine/v1/engine/output_processor.py",
            "detokenize, per-request queue",
            api,
        ),
        node(
            "sse",
            "10. SSE chunks",
            "chat_completion_stream_generator",
            "OpenAIServingChat.chat_completion_stream_generator",
            "engine/entrypoints/openai/chat_completion/serving.py",
            f"first text {s['detok_sse_ms']:.1f} ms after output arrived",
            api,
        ),
        "}",
        "subgraph cluster_core {",
        f'label="EngineCore process (pid {s["pids"]["core"]}): busy loop + input/output '
        'threads"; style=rounded; color="#bc6c25";',
        node(
            "core_in",
            "4. input thread → add_request",
            "EngineCoreProc → Scheduler.add_request",
            "EngineCoreProc.process_input_sockets",
            "engine/v1/engine/core.py",
            f"queued {s['queue_ms']:.2f} ms after arrival",
            core,
        ),
        node(
            "schedule",
            "5. Scheduler.schedule",
            "token budget, KV blocks",
            "Scheduler.schedule",
            "engine/v1/core/sched/scheduler.py",
            f"{fmt(s['schedule_ms'])} ms per step",
            core,
        ),
        node(
            "kv",
            "5a. KVCacheManager",
            "get_computed_blocks, allocate_slots",
            "KVCacheManager",
            "engine/v1/core/kv_cache_manager.py",
            "prefix lookup, block ids",
            core,
        ),
        node(
            "runner",
            "6. execute_model",
            "Executor → Worker → GPUModelRunner",
            "GPUModelRunner.execute_model",
            "engine/v1/worker/gpu_model_runner.py",
            (
                f"prefill {s['prefill_tokens']} tok {s['forward_ms'][0]:.1f} ms; decode "
                f"{fmt(s['forward_ms'][1:])} ms"
            ),
            core,
        ),
        node(
            "sampler",
            "7. sample_tokens",
            "Sampler.forward",
            "Sampler.forward",
            "engine/v1/sample/sampler.py",
            "one token per request",
            core,
        ),
        node(
            "update",
            "8. update_from_output",
            "append tokens, stop checks, free",
            "Scheduler.update_from_output",
            "engine/v1/core/sched/scheduler.py",
            f"{fmt(s['update_ms'])} ms per step",
            core,
        ),
        "}",
        "client -> handler;",
        "handler -> generate;",
        "generate -> client_send;",
        f'client_send -> core_in [label=" ZMQ {s["hop_in_ms"]:.2f} ms", color="#9b2226", '
        "penwidth=1.6];",
        'core_in -> schedule [label=" next step"];',
        "schedule -> kv [dir=both, arrowsize=0.6];",
        'schedule -> runner [label=" SchedulerOutput"];',
        "runner -> sampler;",
        'sampler -> update [label=" ModelRunnerOutput"];',
        f'update -> schedule [label=" {s["steps"]} steps", style=dashed];',
        'update -> output_handler [label=" EngineCoreOutputs\\n '
        f'ZMQ {fmt(s["hop_out_ms"])} ms", color="#9b2226", penwidth=1.6];',
        "output_handler -> sse;",
        'sse -> client [constraint=false, label=" data: … [DONE]\\n '
        f'TTFT {s["ttft_ms"]:.0f} ms, total {s["total_ms"]:.0f} ms"];',
        "generate -> output_handler [style=invis]; client_send -> sse [style=invis];",
        "}",
    ]
    return "\n".join(lines)


def update_doc(table: str, check: bool) -> bool:
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC.relative_to(ROOT)} has no timings markers")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{table}\n{END}{tail}"
    if check:
        return new == doc
    DOC.write_text(new)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--record", action="store_true", help="serve one request and re-record the trace first"
    )
    parser.add_argument(
        "--check", action="store_true", help="fail if docs/architecture.md's table is stale"
    )
    args = parser.parse_args()
    if args.record:
        record(TRACE)
    s = stages(load(TRACE))
    table = timings_table(s)
    if args.check:
        if not update_doc(table, check=True):
            print(
                (
                    "docs/architecture.md's timings table is stale: run "
                    "scripts/gen_architecture_diagram.py"
                ),
                file=sys.stderr,
            )
            return 1
        return 0
    update_doc(table, check=False)
    SVG.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["dot", "-Tsvg"], input=dot_source(s), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"dot failed: {result.stderr}")
    SVG.write_text(result.stdout)
    print(f"wrote {SVG.relative_to(ROOT)} and the table in {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

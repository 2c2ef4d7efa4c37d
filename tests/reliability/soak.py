"""Soak: thousands of mixed requests against ``glassbox serve``, and whether memory plateaus.

Issue 17, point 10: EngineCore's memory grew 2.32 -> 2.75 GB over ~1,950
requests in shrinking steps. This script runs a longer mixed load and reports
whether the resident memory (RSS) of both server processes levels off.

Run (the default model; ~5,000 requests take a while on a small CPU)::

    .venv/bin/python -m tests.reliability.soak --requests 5000 --out soak.json

The server is ``glassbox serve`` started as a subprocess (``python -m
engine.entrypoints.cli.main serve``) on a free port: that is how it runs for a
user, with its own front-end process whose RSS is then the server's alone --
in-process, the load generator's own clients and buffers would be counted
with it. ``--server-arg`` passes flags through (repeat it), ``--model``
names another model. EngineCore is found as the server's child process.

The load (seeded, ``--seed``), at most ``--concurrency`` requests at once:
completions and chat, streaming and not, ``n`` of 1-3, prompts of 1-300
words, ``max_tokens`` of 1-64, greedy or sampled, some with logprobs, and
``--abort-fraction`` of the requests (default 8%) abandoned by their client
part-way (a stream closed after a few chunks, a plain request cancelled
after a short wait). A stream that sends nothing for ``--stall-timeout-s``
counts as hung and is closed.

Every ``--sample-every`` finished requests the RSS of the front end and of
EngineCore is read (psutil; ``/proc/PID/status`` ``VmRSS`` where psutil is
missing). At the end: requests ok / errored / aborted on purpose / hung, the
error kinds, the RSS series, whether ``/metrics`` gauges came back to zero,
and a plateau verdict per process: growth over the last 40% of the requests
against the first 60% (``plateau`` when the last 40% grew by at most
``--plateau-tolerance-mb`` or at under a quarter of the earlier rate per
request). The exit code is 0 when nothing errored or hung and both processes
plateaued, else 1.

``run_load`` is also used by ``tests/reliability/test_soak_fast.py`` against
an in-process server with the tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks import results_store

REPO_ROOT = Path(__file__).resolve().parents[2]

# Plain words for the default model's prompts.
ENGLISH_WORDS = (
    "the a cache block token request engine model memory scheduler batch stream chat "
    "answer question short long river mountain quick brown fox jumps over lazy dog "
    "paged attention key value prefix hash queue waiting running preempt free sample "
    "greedy random seed number one two three four five six seven eight nine ten"
).split()


@dataclass
class RequestSpec:
    index: int
    endpoint: str  # "completions" | "chat"
    stream: bool
    n: int
    max_tokens: int
    prompt_words: int
    temperature: float
    logprobs: bool
    abort_after: float | None  # non-streaming: cancel after this many seconds
    abort_after_chunks: int | None  # streaming: close after this many chunks


@dataclass
class LoadStats:
    ok: int = 0
    errored: int = 0
    aborted_on_purpose: int = 0
    hung: int = 0
    by_kind: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    error_examples: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)

    @property
    def done(self) -> int:
        return self.ok + self.errored + self.aborted_on_purpose + self.hung

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s)

        def pct(p: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))], 3) if lat else None

        return {
            "requests_done": self.done,
            "ok": self.ok,
            "errored": self.errored,
            "aborted_on_purpose": self.aborted_on_purpose,
            "hung_streams": self.hung,
            "by_kind": dict(sorted(self.by_kind.items())),
            "errors": dict(self.errors),
            "error_examples": self.error_examples,
            "latency_s_ok": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": pct(1.0)},
        }


def make_specs(count: int, seed: int, abort_fraction: float) -> list[RequestSpec]:
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        stream = rng.random() < 0.5
        abort = rng.random() < abort_fraction
        n = rng.choices((1, 2, 3), weights=(80, 15, 5))[0]
        # n > 1 needs random sampling (greedy copies are refused with a 400, as in vLLM).
        temperature = rng.choice((0.0, 0.0, 0.7, 1.0) if n == 1 else (0.7, 1.0))
        specs.append(
            RequestSpec(
                index=i,
                endpoint=rng.choice(("completions", "chat")),
                stream=stream,
                n=n,
                max_tokens=rng.choice((1, 4, 8, 16, 32, 64)),
                prompt_words=rng.choice((1, 3, 8, 20, 50, 120, 300)),
                temperature=temperature,
                logprobs=rng.random() < 0.1,
                abort_after=rng.uniform(0.02, 0.5) if abort and not stream else None,
                abort_after_chunks=rng.randint(1, 4) if abort and stream else None,
            )
        )
    return specs


def request_body(
    spec: RequestSpec, model: str, words: Sequence[str], max_prompt_words: int
) -> dict[str, Any]:
    rng = random.Random(spec.index)
    text = " ".join(rng.choice(words) for _ in range(min(spec.prompt_words, max_prompt_words)))
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "n": spec.n,
        "temperature": spec.temperature,
        "stream": spec.stream,
    }
    if spec.temperature > 0:
        body["seed"] = spec.index
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.endpoint == "completions":
        body["prompt"] = text
        if spec.logprobs:
            body["logprobs"] = 2
    else:
        body["messages"] = [{"role": "user", "content": text}]
        if spec.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = 2
    return body


def check_choices(choices: list[dict[str, Any]], n: int) -> str | None:
    """None when every one of the ``n`` choices is there and finished."""
    indices = sorted(c.get("index") for c in choices)
    if indices != list(range(n)):
        return f"choice indices {indices}, expected 0..{n - 1}"
    if any(not c.get("finish_reason") for c in choices):
        return "a choice without finish_reason"
    return None


async def one_request(
    client: httpx.AsyncClient,
    spec: RequestSpec,
    body: dict[str, Any],
    stats: LoadStats,
    stall_timeout_s: float,
) -> None:
    path = "/v1/completions" if spec.endpoint == "completions" else "/v1/chat/completions"
    kind = f"{spec.endpoint}-{'stream' if spec.stream else 'plain'}"
    stats.by_kind[kind] += 1
    start = time.monotonic()

    def fail(reason: str) -> None:
        stats.errored += 1
        stats.errors[reason.split(":")[0]] += 1
        if len(stats.error_examples) < 20:
            stats.error_examples.append(f"#{spec.index} {kind} n={spec.n}: {reason[:300]}")

    try:
        if not spec.stream:
            task = asyncio.ensure_future(client.post(path, json=body))
            if spec.abort_after is not None:
                done, _ = await asyncio.wait({task}, timeout=spec.abort_after)
                if not done:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                        await task
                    stats.aborted_on_purpose += 1
                    return
            response = await task
            if response.status_code != 200:
                return fail(f"HTTP {response.status_code}: {response.text}")
            problem = check_choices(response.json().get("choices", []), spec.n)
            if problem:
                return fail(f"bad body: {problem}")
            stats.ok += 1
            stats.latencies_s.append(time.monotonic() - start)
            return
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return fail(f"HTTP {response.status_code}: {response.text}")
            finished: dict[int, str] = {}
            chunks = 0
            saw_done = False
            lines = response.aiter_lines()
            while True:
                try:
                    line = await asyncio.wait_for(lines.__anext__(), stall_timeout_s)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    stats.hung += 1
                    if len(stats.error_examples) < 20:
                        stats.error_examples.append(f"#{spec.index} {kind}: hung")
                    return
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    saw_done = True
                    break
                payload = json.loads(data)
                if "error" in payload:
                    return fail(f"error event: {data}")
                for choice in payload.get("choices", []):
                    if choice.get("finish_reason"):
                        finished[choice["index"]] = choice["finish_reason"]
                chunks += 1
                if spec.abort_after_chunks is not None and chunks >= spec.abort_after_chunks:
                    stats.aborted_on_purpose += 1  # leaving the block closes the connection
                    return
            if not saw_done:
                return fail("stream ended without [DONE]")
            # (A request meant to be abandoned that finished first counts as ok.)
            if sorted(finished) != list(range(spec.n)):
                return fail(f"finish_reason for choices {sorted(finished)} of {spec.n}")
            stats.ok += 1
            stats.latencies_s.append(time.monotonic() - start)
    except httpx.HTTPError as e:
        fail(f"{type(e).__name__}: {e}")


async def run_load(
    base_url: str,
    model: str,
    specs: Sequence[RequestSpec],
    *,
    concurrency: int = 16,
    words: Sequence[str] = ENGLISH_WORDS,
    max_prompt_words: int = 300,
    stall_timeout_s: float = 60.0,
    request_timeout_s: float = 600.0,
    on_progress: Callable[[int], Any] | None = None,
    progress_every: int = 50,
) -> LoadStats:
    """Send ``specs`` with at most ``concurrency`` in flight; ``on_progress(done)``
    runs every ``progress_every`` finished requests (an await point: it may be
    a coroutine function)."""
    stats = LoadStats()
    queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    next_report = progress_every
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            nonlocal next_report
            while not queue.empty():
                spec = queue.get_nowait()
                body = request_body(spec, model, words, max_prompt_words)
                await one_request(client, spec, body, stats, stall_timeout_s)
                if on_progress is not None and stats.done >= next_report:
                    next_report += progress_every
                    result = on_progress(stats.done)
                    if asyncio.iscoroutine(result):
                        await result

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return stats


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------
def rss_bytes(pid: int) -> int | None:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # the process is gone
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def plateau_verdict(
    series: list[tuple[int, float]], total: int, tolerance_mb: float
) -> dict[str, Any]:
    """``series``: (requests done, RSS MB). Compares the growth over the last
    40% of the requests with the first 60%."""
    if len(series) < 3:
        return {"verdict": "too few samples", "samples": len(series)}
    cut = 0.6 * total
    first = [s for s in series if s[0] <= cut]
    last = [s for s in series if s[0] >= cut]
    if not first or len(last) < 2:
        return {"verdict": "too few samples", "samples": len(series)}
    start, mid, end = first[0], first[-1], last[-1]
    growth_first = mid[1] - start[1]
    growth_last = end[1] - mid[1]
    rate_first = growth_first / max(1, mid[0] - start[0]) * 1024  # KB per request
    rate_last = growth_last / max(1, end[0] - mid[0]) * 1024
    plateau = growth_last <= tolerance_mb or (rate_first > 0 and rate_last < 0.25 * rate_first)
    return {
        "verdict": "plateau" if plateau else "growing",
        "start_mb": round(start[1], 1),
        "at_60pct_mb": round(mid[1], 1),
        "end_mb": round(end[1], 1),
        "max_mb": round(max(s[1] for s in series), 1),
        "growth_first_60pct_mb": round(growth_first, 1),
        "growth_last_40pct_mb": round(growth_last, 1),
        "kb_per_request_first_60pct": round(rate_first, 2),
        "kb_per_request_last_40pct": round(rate_last, 2),
        "tolerance_mb": tolerance_mb,
    }


# ---------------------------------------------------------------------------
# The server subprocess
# ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_core_pid(server_pid: int) -> int | None:
    """The EngineCore child of the server (spawned by multiprocessing; its
    resource tracker is a child too, and is skipped)."""
    try:
        import psutil

        children = psutil.Process(server_pid).children()
        cmdlines = {c.pid: " ".join(c.cmdline()) for c in children}
    except ImportError:
        cmdlines = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid:
                    cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    cmdlines[int(entry.name)] = cmdline
            except (OSError, ValueError, IndexError):
                continue
    for pid, cmdline in cmdlines.items():
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            return pid
    return None


def metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        if "le=" in name_labels or "finished_reason=" in name_labels:
            continue
        values[name_labels.split("{", 1)[0]] = float(value)
    return values


GAUGES = (
    "glassbox:num_requests_running",
    "glassbox:num_requests_waiting",
    "glassbox:kv_cache_usage_perc",
)


def wait_for_idle_gauges(base_url: str, timeout_s: float = 10.0) -> tuple[bool, float, dict]:
    """(all gauges 0, seconds it took, last values)."""
    start = time.monotonic()
    values: dict[str, float] = {}
    while True:
        try:
            m = metrics(base_url)
            values = {g: m.get(g, float("nan")) for g in GAUGES}
        except httpx.HTTPError:
            values = {}
        if values and all(v == 0 for v in values.values()):
            return True, round(time.monotonic() - start, 2), values
        if time.monotonic() - start > timeout_s:
            return False, round(time.monotonic() - start, 2), values
        time.sleep(0.05)


@contextlib.contextmanager
def serve_subprocess(
    model: str | None, server_args: list[str], log_path: Path, startup_timeout_s: float
):
    port = free_port()
    cmd = [sys.executable, "-m", "engine.entrypoints.cli.main", "serve"]
    if model:
        cmd.append(model)
    cmd += ["--host", "127.0.0.1", "--port", str(port), *server_args]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"glassbox serve exited with {proc.returncode}; see {log_path}:\n"
                    + log_path.read_text()[-3000:]
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"glassbox serve did not answer /health in {startup_timeout_s} s"
                )
            time.sleep(0.5)
        yield proc, base_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000, help="requests to send")
    parser.add_argument("--out", help="where the JSON figures go (default: stdout)")
    parser.add_argument("--model", help="model to serve (default: the embedded default model)")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="a flag for glassbox serve (repeatable)"
    )
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    parser.add_argument("--abort-fraction", type=float, default=0.08, help="share abandoned")
    parser.add_argument("--sample-every", type=int, help="requests between RSS samples")
    parser.add_argument(
        "--stall-timeout-s", type=float, default=60.0, help="a stream silent this long is hung"
    )
    parser.add_argument(
        "--plateau-tolerance-mb", type=float, default=32.0, help="see the docstring"
    )
    parser.add_argument("--startup-timeout-s", type=float, default=600.0, help="for /health")
    args = parser.parse_args(argv)
    if args.requests < 10:
        parser.error("--requests must be >= 10")
    sample_every = args.sample_every or max(10, args.requests // 100)
    log_path = Path(args.out or "soak").with_suffix(".server.log")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    specs = make_specs(args.requests, args.seed, args.abort_fraction)
    samples: list[dict[str, Any]] = []
    started = time.time()
    load_start = os.getloadavg()
    with serve_subprocess(args.model, args.server_arg, log_path, args.startup_timeout_s) as (
        proc,
        base_url,
    ):
        core_pid = engine_core_pid(proc.pid)
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]

        def sample(done: int) -> None:
            fe, core = rss_bytes(proc.pid), rss_bytes(core_pid) if core_pid else None
            samples.append(
                {
                    "requests_done": done,
                    "t_s": round(time.time() - started, 1),
                    "front_end_rss_mb": round(fe / 2**20, 1) if fe else None,
                    "engine_core_rss_mb": round(core / 2**20, 1) if core else None,
                }
            )
            last = samples[-1]
            print(
                f"{done:6d} requests  front end {last['front_end_rss_mb']} MB  "
                f"EngineCore {last['engine_core_rss_mb']} MB",
                file=sys.stderr,
                flush=True,
            )

        sample(0)
        stats = asyncio.run(
            run_load(
                base_url,
                model,
                specs,
                concurrency=args.concurrency,
                stall_timeout_s=args.stall_timeout_s,
                on_progress=sample,
                progress_every=sample_every,
            )
        )
        gauges_zero, gauges_after_s, gauges = wait_for_idle_gauges(base_url)
        sample(stats.done)
        health = httpx.get(f"{base_url}/health", timeout=10).status_code
    server_exit = proc.returncode
    core_gone = core_pid is None or rss_bytes(core_pid) is None

    def series(key: str) -> list[tuple[int, float]]:
        # The first sample is before any request: the model loaded, nothing warmed.
        return [(s["requests_done"], s[key]) for s in samples[1:] if s[key] is not None]

    plateau = {
        "front_end": plateau_verdict(
            series("front_end_rss_mb"), args.requests, args.plateau_tolerance_mb
        ),
        "engine_core": plateau_verdict(
            series("engine_core_rss_mb"), args.requests, args.plateau_tolerance_mb
        ),
    }
    result = {
        "script": "tests/reliability/soak.py",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": results_store.commit_id(),
        "config": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "abort_fraction": args.abort_fraction,
            "model": args.model or "default",
            "served_model": model,
            "server_args": args.server_arg,
            "sample_every": sample_every,
        },
        "machine": {
            "logical_cpus": os.cpu_count(),
            "load_average_at_start": [round(x, 2) for x in load_start],
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "elapsed_s": round(time.time() - started, 1),
        **stats.summary(),
        "gauges_back_to_zero": gauges_zero,
        "gauges_back_to_zero_after_s": gauges_after_s,
        "gauges_at_end": gauges,
        "health_at_end": health,
        "server_exit_code": server_exit,
        "engine_core_exited": core_gone,
        "plateau": plateau,
        "rss_samples": samples,
        "server_log": str(log_path),
    }
    text = json.dumps(result, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    brief = {k: result[k] for k in ("ok", "errored", "aborted_on_purpose", "hung_streams")}
    print(json.dumps({**brief, "plateau": plateau}, indent=1), file=sys.stderr)
    good = (
        stats.errored == 0
        and stats.hung == 0
        and gauges_zero
        and all(p.get("verdict") == "plateau" for p in plateau.values())
    )
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())

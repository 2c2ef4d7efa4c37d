"""Tensor-parallel ranks in a trace: each worker process's share of a step.

vLLM twin: none (vLLM's ``WorkerProc.worker_busy_loop`` records nothing per
call). With ``tensor_parallel_size`` N, ``MultiprocExecutor`` puts each call
of EngineCore -- ``execute_model(scheduler_output)``, then
``sample_tokens(grammar_output)`` -- once on the shared-memory broadcast
ring. Every rank's worker process takes it off (``worker.rpc_received``),
runs it on its slice of the model and records its end (``worker.rpc_done``:
its time, the all-reduces and all-gathers it ran); only the output rank (0)
answers. ``rpc_calls`` pairs those events into calls (``RpcCall``);
``rank_steps`` turns a step's calls into one ``RankStep`` per rank: when the
rank took the step's ``SchedulerOutput`` off the ring, how long its forward
and sampling ran, the collectives they ran, and whether it answered.

Read it for what the broadcast looks like from the ranks' side: the
replay's ``StepView.ranks``, the TUI's runner panel and the Perfetto
export's ``worker TP<rank>`` tracks all draw these records.

A call's step: ``execute_model`` carries its ``SchedulerOutput``'s step;
every other call (``sample_tokens``, ...) belongs to the step of the
latest ``execute_model`` the rank received before it, as EngineCore
always samples a step before it launches the next one. (The event's own
``step`` is not used for them: no argument names their step, and rank 0's
tracer may still hold an older step while its output thread finishes one.)
Sessions: 07 (tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.tracing.events import TraceEvent, WorkerRpcDone, WorkerRpcReceived

EXECUTE_MODEL = "execute_model"
SAMPLE_TOKENS = "sample_tokens"


@dataclass(frozen=True)
class RpcCall:
    """One call a worker process took off the broadcast ring, and its end."""

    pid: int
    tp_rank: int
    method: str
    # The engine step it belongs to (see the module's docstring); None
    # before the first ``execute_model`` (start-up calls).
    step: int | None
    received_ts: int  # ns, when this rank took it off the ring
    done: WorkerRpcDone | None  # None: the trace ends before the call did

    @property
    def seconds(self) -> float | None:
        return self.done.seconds if self.done is not None else None


@dataclass(frozen=True)
class RankStep:
    """One tensor-parallel rank's share of one step: its ``execute_model``
    call and the ``sample_tokens`` call after it (when the step sampled)."""

    tp_rank: int
    pid: int
    received_ts: int  # ns, when the rank took the step's execute_model off the ring
    # ``received_ts`` minus the step's launch (``engine.step_launched``), in
    # ms; without a launch event, minus the first rank's ``received_ts``. The
    # engine records the launch after putting its calls on the ring, so an
    # idle rank can be slightly negative; a rank still busy with the previous
    # step (async scheduling) takes the call when that one is done.
    received_after_launch_ms: float
    execute_seconds: float | None  # its execute_model, host clock (None: not finished)
    sample_seconds: float | None  # its sample_tokens (None: the step sampled nothing)
    # Collectives on the TP group during the two calls, with their host time
    # and the bytes this rank contributed.
    all_reduce_count: int
    all_gather_count: int
    collective_seconds: float
    collective_bytes: int
    replied: bool  # this rank answered the executor (the output rank)


def rpc_calls(events: Iterable[TraceEvent]) -> list[RpcCall]:
    """Every worker call in ``events`` (``worker.rpc_received`` paired with the
    ``worker.rpc_done`` after it, per process), ordered by receive time then rank."""
    by_pid: dict[int, list[TraceEvent]] = {}
    for e in events:
        t = type(e)
        if (t is WorkerRpcReceived or t is WorkerRpcDone) and e.tp_rank is not None:
            by_pid.setdefault(e.pid, []).append(e)
    calls: list[RpcCall] = []
    for pid, stream in by_pid.items():
        stream.sort(key=_seq)
        last_step: int | None = None  # of the latest execute_model received
        open_call: RpcCall | None = None
        for e in stream:
            if type(e) is WorkerRpcReceived:
                if open_call is not None:  # its end was never written
                    calls.append(open_call)
                if e.method == EXECUTE_MODEL:
                    last_step = e.step
                open_call = RpcCall(pid, e.tp_rank, e.method, last_step, e.ts, None)
            elif open_call is not None and open_call.method == e.method:
                calls.append(
                    RpcCall(pid, e.tp_rank, e.method, open_call.step, open_call.received_ts, e)
                )
                open_call = None
        if open_call is not None:
            calls.append(open_call)
    calls.sort(key=lambda c: (c.received_ts, c.tp_rank))
    return calls


def rank_steps(
    calls: Iterable[RpcCall], launched_ts: dict[int, int] | None = None
) -> dict[int, list[RankStep]]:
    """Step -> one ``RankStep`` per rank that received the step's
    ``execute_model``, by rank. ``launched_ts``: step -> its
    ``engine.step_launched`` ts (steps missing: measured from the first rank)."""
    launched_ts = launched_ts or {}
    # (step, rank) -> [execute_model call, sample_tokens call]
    pairs: dict[tuple[int, int], list[RpcCall | None]] = {}
    for c in calls:
        if c.step is None or c.method not in (EXECUTE_MODEL, SAMPLE_TOKENS):
            continue
        slot = pairs.setdefault((c.step, c.tp_rank), [None, None])
        i = 0 if c.method == EXECUTE_MODEL else 1
        if slot[i] is None:
            slot[i] = c
    out: dict[int, list[RankStep]] = {}
    by_step: dict[int, list[tuple[RpcCall, RpcCall | None]]] = {}
    for (step, _), (execute, sample) in pairs.items():
        if execute is not None:
            by_step.setdefault(step, []).append((execute, sample))
    for step, items in by_step.items():
        base = launched_ts.get(step)
        if base is None:
            base = min(execute.received_ts for execute, _ in items)
        ranks = []
        for execute, sample in sorted(items, key=lambda p: p[0].tp_rank):
            done = [c.done for c in (execute, sample) if c is not None and c.done is not None]
            ranks.append(
                RankStep(
                    tp_rank=execute.tp_rank,
                    pid=execute.pid,
                    received_ts=execute.received_ts,
                    received_after_launch_ms=(execute.received_ts - base) / 1e6,
                    execute_seconds=execute.seconds,
                    sample_seconds=sample.seconds if sample is not None else None,
                    all_reduce_count=sum(d.all_reduce_count for d in done),
                    all_gather_count=sum(d.all_gather_count for d in done),
                    collective_seconds=sum(d.collective_seconds for d in done),
                    collective_bytes=sum(d.collective_bytes for d in done),
                    replied=any(d.replied for d in done),
                )
            )
        out[step] = ranks
    return out


def _seq(event: TraceEvent) -> int:
    return event.seq


__all__ = ["RankStep", "RpcCall", "rank_steps", "rpc_calls"]

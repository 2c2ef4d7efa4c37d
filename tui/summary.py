"""The text summary of one request's lifecycle (``glassbox trace --headless``).

vLLM twin: none. Read it for a plain-text walk through what the engine did to
one request -- the same lifecycle the TUI's timeline panel shows, for a
terminal without a TUI, a CI log, or a test. A truncated trace says so on
its first line; what the run shows that the request does not (a
preemption, a prefix hit, a chunked prefill) is named with the request to
follow to see it.
Sessions: 01 (the engine loop, end to end), 02 (scheduling), 03 (KV cache).
"""

from __future__ import annotations

from engine.tracing import SamplingParamsSummary
from tui.session import TraceSession
from tui.timelines import GRAMMAR, PHASE_NAMES, STALLED, visible_whitespace

# Timeline letters, as in the TUI's legend.
TIMELINE_LEGEND = "w waiting, p prefill, r recompute, d decode, s stalled, x preempted, f finished"


def compress_phases(phases: str, max_len: int = 80) -> str:
    """``wwppddd...`` as is when short, else run-length encoded (``w2 p2 d40 f``)."""
    if len(phases) <= max_len:
        return phases
    runs: list[str] = []
    i = 0
    while i < len(phases):
        j = i
        while j < len(phases) and phases[j] == phases[i]:
            j += 1
        n = j - i
        runs.append(phases[i] + (str(n) if n > 1 else ""))
        i = j
    return " ".join(runs)


def _shorten(text: str, limit: int) -> str:
    text = visible_whitespace(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def request_summary(session: TraceSession, request_id: str | None = None) -> str:
    """A multi-line account of ``request_id`` (default: the followed request):
    an internal id, or the id the user gave (``TraceSession.resolve_request_id``)."""
    if request_id is None:
        rid = session.info.followed_request_id
        if rid is None:
            return "The trace holds no requests."
    else:
        rid = session.resolve_request_id(request_id)
        if rid is None:
            known = ", ".join(session.request_label(r) for r in session.request_ids)
            raise ValueError(
                f"request_id must be one of the trace's requests ({known}), got {request_id!r}"
            )
    tl = session.timelines[rid]
    info = session.info
    lines: list[str] = []
    if session.truncated:
        lines.append(f"WARNING: {session.truncated}.")
    model = (info.model or "?").rstrip("/").rsplit("/", 1)[-1]
    lines.append(
        f"Trace {session.path or ''}: {session.num_steps - 1} engine steps, "
        f"{len(session.request_ids)} requests, model {model} on {info.device or '?'}"
        f" ({info.attn_backend or '?'} attention), trace level {info.trace_level}"
    )
    lines.append(
        f"Engine: {info.num_blocks} KV blocks of {info.block_size} tokens, "
        f"{info.max_num_batched_tokens} tokens per step, prefix caching "
        f"{'on' if info.enable_prefix_caching else 'off'}, policy {info.policy}"
    )
    lines.append(engine_loop_summary(session))
    lines.append("")
    notes = ["followed"] if rid == info.followed_request_id else []
    if tl.label != rid:
        notes.append(f"internal id {rid}")
    lines.append(f"Request {tl.label}" + (f" ({'; '.join(notes)})" if notes else ""))
    if tl.prompt is not None:
        lines.append(f"  prompt: {_shorten(tl.prompt, 240)!s}")
    lines.append(
        f"  {tl.num_prompt_tokens} prompt tokens, up to {tl.max_tokens} new tokens"
        + _sampling_text(tl.sampling_params)
    )
    phases = "".join(tl.phases)
    lines.append(f"  timeline from step {tl.queued_step}: {compress_phases(phases)}")
    legend = TIMELINE_LEGEND + (", g waiting for grammar" if GRAMMAR in phases else "")
    lines.append(f"    ({legend})")
    for ev in tl.events:
        steps = f"{ev.step}" if ev.end_step is None else f"{ev.step}-{ev.end_step}"
        lines.append(f"  step {steps:>9}  {ev.text}")
    pieces = session.output_pieces(rid, session.last_step)
    text = "".join(pieces)
    lines.append(f"  output ({len(tl.output_tokens)} tokens): {text!r}")
    if pieces:
        lines.append("  tokens: " + "|".join(visible_whitespace(p) for p in pieces))
    counts = {p: phases.count(p) for p in PHASE_NAMES}
    # Steps that ran the request, from its lifecycle lines (a last decode
    # step is also its finishing step on the timeline).
    runs = {
        kind: sum(ev.last_step - ev.step + 1 for ev in tl.events if ev.kind == kind)
        for kind in ("prefill", "recompute", "decode")
    }
    first = tl.output_tokens[0][0] if tl.output_tokens else None
    end = f"finished at step {tl.finished_step}" if tl.finished_step is not None else "unfinished"
    lines.append(
        f"  in short: queued at step {tl.queued_step}, "
        f"first token at step {first if first is not None else '-'}, {end}; "
        f"{runs['prefill']} prefill step(s), {runs['recompute']} recompute step(s), "
        f"{runs['decode']} decode step(s), {counts[STALLED]} stalled, "
        f"{tl.num_preemptions} preemption(s), "
        f"prefix-cache hit {tl.num_cached_tokens} of {tl.num_prompt_tokens} prompt tokens"
    )
    elsewhere = session.highlights_elsewhere(rid)
    if elsewhere:
        lines.append("  not in this request, but elsewhere in the run:")
        for h in elsewhere:
            label = session.request_label(h.request_id)
            lines.append(f"    {h.what:<16} {label}, {h.text} (--follow {label})")
    others = [r for r in session.request_ids if r != rid]
    if others:
        lines.append("")
        lines.append("Other requests:")
        for r in others:
            o = session.timelines[r]
            end = (
                f"finished step {o.finished_step}" if o.finished_step is not None else "unfinished"
            )
            lines.append(
                f"  {o.label:<10} queued step {o.queued_step:<4} {end:<20} "
                f"{len(o.output_tokens):>4} tokens  {o.num_preemptions} preemption(s)  "
                f"prefix hit {o.num_cached_tokens}/{o.num_prompt_tokens}"
            )
    return "\n".join(lines)


def engine_loop_summary(session: TraceSession) -> str:
    """One line: was the run scheduled asynchronously, how many steps
    overlapped the one before, how long the host blocked for tokens."""
    replay = session.replay
    steps = [p for s, p in replay.step_phases.items() if s > 0 and p.scheduled_ts is not None]
    waits = [p.wait_ns for p in steps if p.wait_ns is not None]
    waited = ""
    if waits:
        waited = (
            f"; the host blocked {sum(waits) / 1e6:.1f} ms in all for steps' tokens "
            f"({sum(waits) / len(waits) / 1e6:.2f} ms per step)"
        )
    if replay.async_scheduling:
        overlapped = len(replay.overlapped_steps)
        return (
            f"Engine loop: async scheduling, up to {replay.max_in_flight} steps in flight; "
            f"{overlapped} of {len(steps)} steps were scheduled and launched before the "
            f"previous step's tokens were read{waited}"
        )
    return f"Engine loop: synchronous, one step in flight at a time ({len(steps)} steps){waited}"


def _sampling_text(params: SamplingParamsSummary | None) -> str:
    if params is None:
        return ""
    temperature = params.temperature
    if temperature < 1e-5:
        return ", greedy"
    bits = [f"temperature {temperature}"]
    if params.top_p != 1.0:
        bits.append(f"top_p {params.top_p}")
    if params.top_k not in (0, -1):
        bits.append(f"top_k {params.top_k}")
    if params.min_p:
        bits.append(f"min_p {params.min_p}")
    if params.seed is not None:
        bits.append(f"seed {params.seed}")
    return ", " + ", ".join(bits)

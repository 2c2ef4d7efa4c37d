"""The scheduler's decision at this step: the token budget and who got it.

vLLM twin: ``vllm/v1/core/sched/scheduler.py`` (``Scheduler.schedule``).
Read it next to that method: running requests are served first (one decode
token each, or their next prefill chunk), then waiting ones are admitted
while the budget (``max_num_batched_tokens``) and the KV pool allow; when a
running request cannot get a block, the newest running request is
preempted. Fields come from the ``sched.step`` event and the replay state.

With async scheduling (``async_scheduler.py``) the step is scheduled while
the previous one is still in flight: a decoding request's next input is the
token that step is still sampling, a placeholder (``◌``) whose id the runner
takes on the device; the scheduler only counts it
(``num_output_placeholders``).

With speculative decoding a decode also verifies the drafts proposed after
the previous step: they are scheduled after the request's last known token
and count in its tokens (``tok 9-12 (3 drafts)``); the rejected ones are rolled back
after the step (the sampler and KV panels show which).

With structured outputs a request waits for its grammar to compile in a
second queue, ``skipped_waiting``, shown under the waiting queue while it
holds any; FCFS admits from it first once a grammar is ready.
Sessions: 01 (engine loop), 02 (scheduler), 06 (speculative decoding, structured outputs).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from engine.tracing import (
    KVAllocationFailed,
    SchedAdmitted,
    SchedFinished,
    SchedPreempted,
    SchedQueued,
)
from tui.timelines import DECODE, PREFILL, RECOMPUTE
from tui.widgets.common import DIM, Panel, StepContext, id_list, request_chip

_KIND_OF_PHASE = {DECODE: "decode", PREFILL: "prefill", RECOMPUTE: "recompute"}
# Marks a scheduled token that is a placeholder (async scheduling).
PLACEHOLDER = "◌"
PLACEHOLDER_STYLE = Style(color="#ff7f0e", bold=True)


class SchedulerPanel(Panel):
    TITLE = "Scheduler"

    def update_titles(self, ctx: StepContext) -> None:
        sched = ctx.view.sched_step
        self.border_title = "Scheduler"
        if sched is not None:
            used = sched.total_num_scheduled_tokens
            self.border_title = f"Scheduler · {used}/{sched.token_budget} tokens"
        # No duration (0, left out of the file) when the trace did not time schedule().
        self.border_subtitle = (
            f"{sched.duration_ns / 1e6:.2f} ms" if sched is not None and sched.duration_ns else ""
        )

    def render_step(self, ctx: StepContext, width: int) -> RenderableType:
        return render_scheduler(ctx, width)


def scheduled_rows(ctx: StepContext) -> list[tuple[str, str, int, int, int]]:
    """(request id, kind, first token index, last token index, tokens) per
    scheduled request, in the scheduler's order."""
    sched = ctx.view.sched_step
    if sched is None:
        return []
    rows = []
    spec = ctx.view.spec
    for rid, n in sched.num_scheduled_tokens.items():
        req = ctx.view.state.requests.get(rid)
        end = req.num_computed_tokens if req is not None else n
        verdict = spec.verified.get(rid) if spec is not None else None
        if verdict is not None:  # the cursor schedule() left, before the rollback
            end = verdict.num_computed_tokens_scheduled
        tl = ctx.session.timelines.get(rid)
        phase = tl.phase_at(ctx.step) if tl is not None else ""
        kind = _KIND_OF_PHASE.get(phase)
        if kind is None:  # finished this step: its last decode, or a last chunk
            prompt = req.num_prompt_tokens if req is not None else 0
            drafts = len(sched.scheduled_spec_decode_tokens.get(rid, ()))
            kind = "decode" if n == 1 + drafts and end - 1 - drafts >= prompt else "prefill"
        rows.append((rid, kind, end - n, end - 1, n))
    return rows


def render_scheduler(ctx: StepContext, width: int) -> RenderableType:
    view = ctx.view
    sched = view.sched_step
    parts: list[RenderableType] = []
    if sched is None:
        parts.append(
            Text(
                "Step 0: before the first schedule(). Requests added so far wait in the queue."
                if ctx.step == 0
                else f"No scheduler step was recorded at step {ctx.step}.",
                style=DIM,
            )
        )
    else:
        budget = sched.token_budget
        used = sched.total_num_scheduled_tokens or budget - sched.token_budget_left
        rows = scheduled_rows(ctx)
        head = Text()
        decode = sum(n for _, k, _, _, n in rows if k == "decode")
        head.append(f"{decode}", style=Style(bold=True))
        head.append(" decode + ", style=DIM)
        head.append(f"{used - decode}", style=Style(bold=True))
        head.append(f" prefill of {budget}", style=DIM)
        parts.append(head)
        parts.append(budget_bar(ctx, rows, budget, width))
        in_flight = [s for s in view.in_flight if s != ctx.step]
        if in_flight:
            line = Text(f"scheduled while step {', '.join(map(str, in_flight))} ", style=DIM)
            line.append("in flight", style=PLACEHOLDER_STYLE)
            line.append(" (async scheduling)", style=DIM)
            parts.append(line)
        table = Table.grid(padding=(0, 1))
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True, justify="right")
        table.add_column(no_wrap=True, style=DIM)
        for rid, kind, first, last, n in rows:
            table.add_row(request_chip(ctx, rid), kind, str(n), token_span(ctx, rid, first, last))
        if rows:
            parts.append(table)
        if view.num_placeholder_inputs:
            before = ", ".join(map(str, in_flight)) or "the previous one"
            legend = Text(PLACEHOLDER, style=PLACEHOLDER_STYLE)
            legend.append(
                f" placeholder: a token step {before} is still sampling; the runner "
                "takes its id on the device",
                style=DIM,
            )
            parts.append(legend)
    state = view.state
    queues = Table.grid(padding=(0, 1))
    queues.add_column(no_wrap=True, style=DIM)
    queues.add_column()
    queues.add_row(f"running {len(state.running)}", id_list(ctx, state.running))
    queues.add_row(f"waiting {len(state.waiting)}", id_list(ctx, state.waiting))
    if state.skipped_waiting:
        # Structured outputs: the second queue, of requests whose grammar compiles.
        skipped = id_list(ctx, state.skipped_waiting)
        blocked = sum(state.requests[r].waiting_for_grammar for r in state.skipped_waiting)
        why = "compiling their grammar" if blocked else "grammar ready, admitted first"
        if 0 < blocked < len(state.skipped_waiting):
            why = f"{blocked} compiling their grammar"
        skipped.append(f"  skipped_waiting: {why}", style=DIM)
        queues.add_row(f"skipped {len(state.skipped_waiting)}", skipped)
    parts.append(queues)
    changes = Table.grid(padding=(0, 1))
    changes.add_column(no_wrap=True, style=DIM)
    changes.add_column()
    admitted = [e for e in view.events if isinstance(e, SchedAdmitted)]
    preempted = [e for e in view.events if isinstance(e, SchedPreempted)]
    finished = [e for e in view.events if isinstance(e, SchedFinished)]
    queued = [e for e in view.events if isinstance(e, SchedQueued)]
    if admitted:
        text = Text()
        for i, e in enumerate(admitted):
            if i:
                text.append(", ")
            text.append_text(request_chip(ctx, e.request_id))
            hit = e.num_computed_tokens
            extra = "resumed" if e.resumed else ""
            if hit:
                extra = (extra + ", " if extra else "") + f"hit {hit}"
            if extra:
                text.append(f" ({extra})", style=DIM)
        changes.add_row("admitted", text)
    if preempted:
        text = Text()
        for i, e in enumerate(preempted):
            if i:
                text.append(", ")
            text.append_text(request_chip(ctx, e.request_id))
            if e.for_request_id:
                text.append(" for ", style=DIM)
                text.append_text(request_chip(ctx, e.for_request_id))
        changes.add_row(Text("preempted", style=Style(color="#d62728", bold=True)), text)
    if finished:
        changes.add_row("finished", id_list(ctx, [e.request_id for e in finished]))
    if queued:
        changes.add_row("arrived", id_list(ctx, [e.request_id for e in queued]))
    failed = next((e for e in view.events if isinstance(e, KVAllocationFailed)), None)
    if failed is not None:
        changes.add_row(
            Text("no blocks", style=Style(color="#d62728")),
            Text(
                f"{failed.request_id} needed {failed.num_blocks_needed}, "
                f"{failed.num_free_blocks} free",
            ),
        )
    if changes.row_count:
        parts.append(changes)
    return Group(*parts)


def token_span(ctx: StepContext, request_id: str, first: int, last: int) -> str | Text:
    """``tok 12-15``, after a ``◌`` when some of those tokens are
    placeholders (first, so a narrow panel cuts the numbers, not the mark),
    and ``(3 drafts)`` when the last of them are drafts to verify."""
    span = f"tok {first}" if first == last else f"tok {first}-{last}"
    sched = ctx.view.sched_step
    drafts = len(sched.scheduled_spec_decode_tokens.get(request_id, ())) if sched else 0
    if drafts:
        span += f" ({drafts} draft{'s' if drafts != 1 else ''})"
    if not ctx.view.num_placeholder_inputs.get(request_id, 0):
        return span
    return Text.assemble((PLACEHOLDER, PLACEHOLDER_STYLE), span)


def budget_bar(
    ctx: StepContext, rows: list[tuple[str, str, int, int, int]], budget: int, width: int
) -> Text:
    """The budget as a bar: one coloured segment per scheduled request."""
    bar = Text()
    if budget <= 0:
        return bar
    cells = max(10, width)
    used_cells = 0
    for rid, kind, _, _, n in rows:
        k = max(1, round(n * cells / budget))
        k = min(k, cells - used_cells)
        if k <= 0:
            break
        colour = ctx.session.request_colour(rid)
        glyph = "▄" if kind == "decode" else "█"
        bar.append(glyph * k, style=Style(color=colour))
        used_cells += k
    bar.append("─" * (cells - used_cells), style=DIM)
    return bar

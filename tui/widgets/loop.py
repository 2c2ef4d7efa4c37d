"""The engine loop around this step, drawn against time: which steps were in
flight together.

vLLM twin: ``vllm/v1/engine/core.py`` (``EngineCore.step_with_batch_queue``,
its default loop with async scheduling; ``step`` without). Read it next to
that method: with async scheduling step n+1 is scheduled and launched while
step n is still in flight (launched, its tokens not yet read), so two
batches overlap; without, each step is scheduled, run and updated before
the next one starts. One row per step (this one, and the steps in flight
with it), over the time from this step's ``schedule()`` to the end of its
``update_from_output()``: ``▓`` schedule(), ``█`` the forward (GPU time
between CUDA events, or host time on the CPU), ``━`` in flight, ``▒``
update. Fields come from ``StepView.phases`` (``sched.step``,
``engine.step_launched``, ``runner.forward``, ``engine.output_ready``,
``sched.update``); traces before format 1.4 lack the launch and read
times, and get no strip.
Sessions: 01 (engine loop).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.style import Style
from rich.text import Text

from engine.tracing import StepPhases
from tui.widgets.common import DIM, StepContext

# (glyph, colour) per phase, weightiest first: where two fall in one cell, it wins.
LOOP_GLYPHS: dict[str, tuple[str, str]] = {
    "forward": ("█", "#2ca02c"),
    "schedule": ("▓", "#1f77b4"),
    "update": ("▒", "#9467bd"),
    "in flight": ("━", "#ff7f0e"),
}
_LABEL_WIDTH = 8  # "step 123 " fits most runs; longer numbers push the strip right


def loop_rows(ctx: StepContext) -> list[int]:
    """The steps the strip shows: this one and every step in flight with it."""
    steps = set(ctx.view.in_flight)
    after = ctx.session.replay.in_flight_after_launch(ctx.step + 1)
    if ctx.step in after:
        steps.update(after)
    steps.add(ctx.step)
    phases = ctx.session.replay.step_phases
    return sorted(s for s in steps if s in phases)


def _window(p: StepPhases) -> tuple[int, int] | None:
    """This step's life: the start of its schedule() to the end of its update."""
    start = p.schedule_start_ts if p.schedule_start_ts is not None else p.launched_ts
    end = p.updated_ts if p.updated_ts is not None else p.output_ready_ts
    if start is None or end is None or end <= start:
        return None
    return start, end


def _spans(p: StepPhases, previous_forward_end: int | None) -> dict[str, tuple[int, int]]:
    spans: dict[str, tuple[int, int]] = {}
    if p.schedule_start_ts is not None and p.scheduled_ts is not None:
        spans["schedule"] = (p.schedule_start_ts, p.scheduled_ts)
    if p.forward_start_ts is not None and p.forward_ns is not None:
        # On CUDA the forward's length is device time from its launch; one
        # stream runs a forward launched while the previous one ran after it.
        start = max(p.forward_start_ts, previous_forward_end or p.forward_start_ts)
        spans["forward"] = (start, start + p.forward_ns)
    in_flight = p.in_flight_span
    if in_flight is not None:
        spans["in flight"] = in_flight
    if p.update_start_ts is not None and p.updated_ts is not None:
        spans["update"] = (p.update_start_ts, p.updated_ts)
    return spans


def render_engine_loop(ctx: StepContext, width: int) -> RenderableType | None:
    """The strip, or None when the trace has no launch times for this step
    (step 0, traces before format 1.4)."""
    phases = ctx.view.phases
    if phases is None or phases.launched_ts is None:
        return None
    window = _window(phases)
    if window is None:
        return None
    t0, t1 = window
    cells = max(8, width - _LABEL_WIDTH - 1)
    ns_per_cell = (t1 - t0) / cells
    rows: list[Text] = []
    all_phases = ctx.session.replay.step_phases
    previous_forward_end = None
    for step in loop_rows(ctx):
        glyphs = [" "] * cells
        styles: list[Style | None] = [None] * cells
        spans = _spans(all_phases[step], previous_forward_end)
        if "forward" in spans:
            previous_forward_end = spans["forward"][1]
        # Lightest first, so a weightier phase overwrites it.
        for kind, (lo, hi) in sorted(spans.items(), key=lambda kv: -list(LOOP_GLYPHS).index(kv[0])):
            if hi < t0 or lo > t1:
                continue
            a = max(0, min(cells - 1, int((lo - t0) / ns_per_cell)))
            b = max(a + 1, min(cells, round((hi - t0) / ns_per_cell)))
            glyph, colour = LOOP_GLYPHS[kind]
            for i in range(a, b):
                glyphs[i] = glyph
                styles[i] = Style(color=colour, bold=step == ctx.step)
        line = Text(f"step {step}".ljust(_LABEL_WIDTH), style=Style(bold=step == ctx.step))
        if len(line) > _LABEL_WIDTH:
            line.append(" ")
        for glyph, style in zip(glyphs, styles):
            line.append(glyph, style=style or DIM)
        rows.append(line)
    head = Text()
    head.append("Engine loop", style=Style(bold=True))
    head.append(f" · {(t1 - t0) / 1e6:.2f} ms, step {ctx.step}'s life", style=DIM)
    legend = Text()
    for kind, (glyph, colour) in LOOP_GLYPHS.items():
        if legend:
            legend.append(" ")
        legend.append(glyph, style=Style(color=colour, bold=True))
        legend.append(kind, style=DIM)
    return Group(head, *rows, legend, Text(in_flight_sentence(ctx), style=DIM))


def in_flight_sentence(ctx: StepContext) -> str:
    """What overlapped this step, in words."""
    step = ctx.step
    before = [s for s in ctx.view.in_flight if s != step]
    after = [step + 1] if step in ctx.session.replay.in_flight_after_launch(step + 1) else []
    wait = ctx.view.phases.wait_ns if ctx.view.phases is not None else None
    parts = []
    if before:
        parts.append(f"launched while step {', '.join(map(str, before))} was in flight")
    if after:
        parts.append(
            f"step {after[0]} was scheduled and launched before step {step}'s tokens were read"
        )
    if not parts:
        parts.append("no other step in flight with it (one step at a time)")
    text = f"Step {step}: " + "; ".join(parts)
    if wait is not None:
        text += f"; the host waited {wait / 1e6:.2f} ms for its tokens"
    return text + "."

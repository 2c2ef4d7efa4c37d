"""The followed request's lifecycle: a timeline strip and its events, with
the current step marked.

vLLM twin: none; it shows what ``engine/v1/request.py``'s ``RequestStatus``
goes through inside ``engine/v1/core/sched/scheduler.py``: WAITING ->
RUNNING (prefill chunks, then one decode token per step) -> PREEMPTED and
back to WAITING when KV blocks run out -> FINISHED_*. A request with
structured outputs starts in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR (``┄``,
in ``skipped_waiting``) until its grammar has compiled. Under the strip, what
the run shows that this request does not (a preemption, a prefix hit, a
chunked prefill) and which request to follow to see it
(``TraceSession.highlights_elsewhere``).
Sessions: 01 (engine loop), 02 (scheduler).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui.timelines import PHASE_NAMES, RequestTimeline
from tui.widgets.common import DIM, PHASE_STYLES, Panel, StepContext, phase_legend


class LifecyclePanel(Panel):
    """Timeline strip on top (never scrolls away), the events below it (scroll)."""

    TITLE = "Lifecycle"
    DEFAULT_CSS = """
    LifecyclePanel { height: 1fr; }
    LifecyclePanel > #lifecycle-head { height: auto; }
    LifecyclePanel > #lifecycle-events { height: 1fr; scrollbar-size-vertical: 1; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._head = Static("", id="lifecycle-head")
        self._events = VerticalScroll(self._body, id="lifecycle-events")
        self.head_renderable: RenderableType = Text("")

    def compose(self):
        yield self._head
        yield self._events

    def update_titles(self, ctx: StepContext) -> None:
        if ctx.follow is None:
            self.border_title = "Lifecycle"
            return
        tl = ctx.session.timelines[ctx.follow]
        self.border_title = f"Lifecycle of {ctx.follow}"
        self.border_subtitle = PHASE_NAMES[tl.phase_at(ctx.step)]

    def show(self, ctx: StepContext) -> None:
        moved = ctx.step != self.shown_step or ctx.follow != self.shown_follow
        self._ctx = ctx
        width = self.content_width()
        self.head_renderable = render_lifecycle_head(ctx, width)
        self._head.update(self.head_renderable)
        super().show(ctx)
        if moved:
            # After the new content is laid out, or the scroll range is stale.
            self.call_after_refresh(self.scroll_to_current_event)

    def render_step(self, ctx: StepContext, width: int) -> RenderableType:
        return render_lifecycle_events(ctx, width)

    def plain_text(self, width: int | None = None) -> str:
        return self._plain(self.head_renderable, width) + self._plain(self.renderable, width)

    def scroll_to_current_event(self) -> None:
        """Keep the highlighted event line in view as the step moves."""
        lines = self._plain(self.renderable).splitlines()
        index = next(
            (i for i, line in enumerate(lines) if line.lstrip().startswith(("▶", "▷"))), None
        )
        if index is None:
            return
        scroller = self._events
        visible = max(1, scroller.scrollable_content_region.height)
        if not scroller.scroll_y <= index < scroller.scroll_y + visible:
            scroller.scroll_to(y=max(0, index - visible // 3), animate=False, immediate=True)


def timeline_window(tl: RequestTimeline, step: int, width: int, last_step: int) -> tuple[int, int]:
    """The steps [lo, hi] the strip shows: the request's whole life when it
    fits, else a window of ``width`` steps around ``step``."""
    start = tl.queued_step
    end = tl.finished_step if tl.finished_step is not None else last_step
    if end - start + 1 <= width:
        return start, end
    lo = max(start, min(step - width // 2, end - width + 1))
    return lo, lo + width - 1


def render_timeline(tl: RequestTimeline, step: int, width: int, last_step: int) -> Text:
    """Three lines: step numbers, the phase strip, the current-step marker.
    A short life is drawn with up to 3 cells per step so it is easy to see."""
    lo, hi = timeline_window(tl, step, width - 2, last_step)
    span = hi - lo + 1
    scale = max(1, min(3, (width - 2) // span))
    strip = Text()
    strip.append("‹" if lo > tl.queued_step else "│", style=DIM)
    for s in range(lo, hi + 1):
        glyph, colour = PHASE_STYLES[tl.phase_at(s)]
        style = Style(color=colour or None, bold=True, underline=s == step)
        strip.append((glyph if glyph.strip() else " ") * scale, style=style)
    end = tl.finished_step if tl.finished_step is not None else last_step
    strip.append("›" if hi < end else "│", style=DIM)
    marker = Text("")
    if lo <= step <= hi:
        col = (step - lo) * scale + 1 + scale // 2
        label = f"▲ step {step}"
        if col + len(label) > width:
            label = f"step {step} ▲"
            col = max(0, col - len(label) + 1)
        marker = Text(" " * col) + Text(label, style=Style(bold=True))
    elif step < lo:
        marker = Text(f"← step {step}: not queued yet", style=DIM)
    else:
        marker = Text(f"step {step} → after its end", style=DIM)
    ruler = Text(f" {lo}", style=DIM)
    if hi > lo:
        tail = str(hi)
        gap = max(1, span * scale + 2 - len(ruler) - len(tail))
        ruler.append(" " * gap + tail, style=DIM)
    return Text("\n").join([ruler, strip, marker])


def render_lifecycle_head(ctx: StepContext, width: int) -> RenderableType:
    if ctx.follow is None:
        return Text("No request to follow: the trace has none.", style=DIM)
    tl = ctx.session.timelines[ctx.follow]
    parts = [
        render_timeline(tl, ctx.step, width, ctx.session.last_step),
        phase_legend(tl.phases),
    ]
    elsewhere = render_elsewhere(ctx)
    if elsewhere is not None:
        parts.append(elsewhere)
    return Group(*parts)


def render_elsewhere(ctx: StepContext) -> Text | None:
    """Where to see what the followed request does not show (None: it shows
    it all, or the run has none of it)."""
    hints = ctx.session.highlights_elsewhere(ctx.follow)
    if not hints:
        return None
    out = Text()
    out.append("Elsewhere (follow: f or ⏎):", style=DIM)
    for h in hints:
        out.append("\n")
        out.append(
            ctx.session.request_label(h.request_id),
            style=Style(color=ctx.session.request_colour(h.request_id), bold=True),
        )
        out.append(f" {h.text}", style=DIM)
    return out


def render_lifecycle_events(ctx: StepContext, width: int) -> RenderableType:
    if ctx.follow is None:
        return Text("")
    tl = ctx.session.timelines[ctx.follow]
    # Lines that happen at this step are highlighted; between events, the
    # latest earlier line is marked as the context.
    covering = {i for i, ev in enumerate(tl.events) if ev.covers(ctx.step)}
    latest = tl.event_index_at(ctx.step)
    events = Table.grid(padding=(0, 1))
    events.add_column(no_wrap=True, justify="right")
    events.add_column(ratio=1)
    if ctx.step < tl.queued_step:
        events.add_row(Text("", style=DIM), Text(f"arrives at step {tl.queued_step}", style=DIM))
    for i, ev in enumerate(tl.events):
        steps = f"{ev.step}" if ev.end_step is None else f"{ev.step}-{ev.end_step}"
        if i in covering:
            mark, style = "▶", Style(bold=True, reverse=True)
        elif not covering and i == latest:
            mark, style = "▷", Style(bold=True)
        else:
            mark, style = " ", DIM if ev.step > ctx.step else Style()
        events.add_row(
            Text(f"{mark}{steps}", style=Style(bold=mark != " ")), Text(ev.text, style=style)
        )
    return events

"""The step scrubber: which engine step is shown, of how many, and where the
followed request's life and events fall on the run.

vLLM twin: none. ``EngineCore.step()`` is the unit of time here: step n is
one schedule -> execute -> update round (``engine/v1/engine/core.py``), and
the state shown is the engine's right after it -- with async scheduling
(``step_with_batch_queue``) right after step n is launched and step n-1's
tokens are applied, step n still in flight.
Sessions: all.
"""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual import events
from textual.message import Message
from textual.widgets import Static

from tui.session import TraceSession
from tui.timelines import PHASE_NAMES
from tui.widgets.common import DIM, StepContext


class Scrubber(Static):
    """Two lines: the step counter and play state, then a bar of the whole run."""

    DEFAULT_CSS = """
    Scrubber { height: auto; }
    """

    class Seek(Message):
        """The user clicked the bar: go to ``step``."""

        def __init__(self, step: int) -> None:
            super().__init__()
            self.step = step

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id)
        self.border_title = "Step"
        self._last_steps = 1
        self._args: tuple[StepContext, bool, float] | None = None
        self.renderable = Text("")

    def show(self, ctx: StepContext, playing: bool, speed: float) -> None:
        self._args = (ctx, playing, speed)
        width = max(self.content_size.width or 98, 20)
        self.renderable = render_scrubber(ctx, playing, speed, width)
        self._last_steps = ctx.session.num_steps
        # Always two lines: no layout pass needed.
        self.update(self.renderable, layout=False)

    def on_resize(self) -> None:
        if self._args is not None:
            self.show(*self._args)

    def on_click(self, event: events.Click) -> None:
        # The bar is the second content line; x runs over the bar's width.
        width = max(self.content_size.width, 20)
        offset = event.get_content_offset(self)
        if offset is None or offset.y != 1 or not 0 <= offset.x < width:
            return
        x = offset.x
        steps = self._last_steps
        self.post_message(self.Seek(min(steps - 1, x * steps // width)))


def render_scrubber(ctx: StepContext, playing: bool, speed: float, width: int) -> Text:
    session: TraceSession = ctx.session
    last = session.last_step
    out = Text(no_wrap=True, overflow="ellipsis")
    out.append("step ", style=DIM)
    out.append(f"{ctx.step:>{len(str(last))}}", style=Style(bold=True))
    out.append(f" / {last}", style=DIM)
    if session.truncated:
        # Events the run wrote are missing from the file (the summary says which).
        out.append(" ⚠ truncated", style=Style(color="#d62728", bold=True))
    out.append("   ")
    out.append("▶ playing" if playing else "■ paused", style=Style(bold=playing))
    out.append(f" {speed:g} steps/s", style=DIM)
    if ctx.follow is not None:
        tl = session.timelines[ctx.follow]
        out.append("   following ", style=DIM)
        out.append(ctx.follow, style=Style(color=tl.colour, bold=True))
        out.append(f" ({PHASE_NAMES[tl.phase_at(ctx.step)]})", style=DIM)
        nxt = session.next_event_step(ctx.follow, ctx.step)
        out.append(f"   next event: {'step ' + str(nxt) if nxt is not None else 'none'}", style=DIM)
    out.append("\n")
    out.append_text(render_bar(ctx, width))
    return out


def render_bar(ctx: StepContext, width: int) -> Text:
    """One character per bucket of steps: the current step, the followed
    request's events (┃) and life (━), the rest of the run (─)."""
    session = ctx.session
    steps = session.num_steps
    tl = session.timelines.get(ctx.follow) if ctx.follow is not None else None
    event_steps = set(tl.event_steps()) if tl is not None else set()
    colour = tl.colour if tl is not None else "#8a8a8a"
    end = tl.finished_step if tl is not None and tl.finished_step is not None else session.last_step
    bar = Text()
    marked = False
    for x in range(width):
        lo = x * steps // width
        hi = max(lo, (x + 1) * steps // width - 1)
        if lo <= ctx.step <= hi and not marked:
            marked = True
            bar.append("●", style=Style(bold=True))
        elif tl is not None and any(lo <= s <= hi for s in event_steps):
            bar.append("┃", style=Style(color=colour, bold=True))
        elif tl is not None and hi >= tl.queued_step and lo <= end:
            bar.append("━", style=Style(color=colour))
        else:
            bar.append("─", style=DIM)
    return bar

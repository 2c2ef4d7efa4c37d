"""What every TUI panel shares: the step context, the panel base class, colours.

vLLM twin: none. Read it for the one rule of the TUI: every panel is a pure
function of (trace session, step, followed request), rebuilt by ``show`` when
the step or the followed request changes, so all panels always agree.
Sessions: all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rich.console import Console, RenderableType
from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Static

from engine.tracing import StepView
from tui.session import TraceSession
from tui.timelines import (
    DECODE,
    FINISHED,
    GRAMMAR,
    NOT_ARRIVED,
    PREEMPTED,
    PREFILL,
    RECOMPUTE,
    STALLED,
    WAITING,
)

# Phase colours and glyphs: the glyph shapes differ too, so the timeline reads
# without colour; the colours are mid-luminance (dark and light themes).
PHASE_STYLES: dict[str, tuple[str, str]] = {
    NOT_ARRIVED: (" ", ""),
    WAITING: ("─", "#8a8a8a"),
    GRAMMAR: ("┄", "#17becf"),
    PREFILL: ("█", "#1f77b4"),
    RECOMPUTE: ("▓", "#ff7f0e"),
    DECODE: ("▄", "#2ca02c"),
    STALLED: ("▁", "#bcbd22"),
    PREEMPTED: ("✕", "#d62728"),
    FINISHED: ("■", "#9467bd"),
}
PHASE_LABELS: dict[str, str] = {
    WAITING: "wait",
    PREFILL: "prefill",
    RECOMPUTE: "recomp",
    DECODE: "decode",
    STALLED: "stall",
    PREEMPTED: "preempt",
    FINISHED: "done",
}
# Phases only some runs have: in the legend only where a timeline shows them.
OPTIONAL_PHASE_LABELS: dict[str, str] = {GRAMMAR: "grammar"}

DIM = Style(dim=True)
BOLD = Style(bold=True)


@dataclass(frozen=True)
class StepContext:
    """What a panel draws from: the session, the replay's view of the step,
    and the request being followed."""

    session: TraceSession
    step: int
    view: StepView
    follow: str | None


def contrast_text(hex_colour: str) -> str:
    """Black or white, whichever reads better on ``hex_colour``."""
    h = hex_colour.lstrip("#")
    r, g, b = (int(h[i : i + 2], 16) for i in (0, 2, 4))
    luminance = 0.299 * r + 0.587 * g + 0.114 * b
    return "#000000" if luminance > 150 else "#ffffff"


def request_chip(ctx: StepContext, request_id: str, bold_followed: bool = True) -> Text:
    """A request id in its colour (followed one bold and underlined)."""
    colour = ctx.session.request_colour(request_id)
    style = Style(
        color=colour,
        bold=bold_followed and request_id == ctx.follow,
        underline=bold_followed and request_id == ctx.follow,
    )
    return Text(request_id, style=style)


def id_list(ctx: StepContext, request_ids: list[str], empty: str = "none") -> Text:
    if not request_ids:
        return Text(empty, style=DIM)
    out = Text()
    for i, rid in enumerate(request_ids):
        if i:
            out.append(" ")
        out.append_text(request_chip(ctx, rid))
    return out


def zoom_bindings(name: str) -> list[Binding]:
    """``z`` on a focusable panel: the footer names the panel it zooms
    (``Zoom KV blocks``), and says ``Unzoom`` while one is zoomed
    (``TraceApp.check_action`` hides the one that does not apply)."""
    return [
        Binding("z", "app.zoom", f"Zoom {name}"),
        Binding("z", "app.unzoom", "Unzoom"),
    ]


def phase_legend(phases: Iterable[str] = ()) -> Text:
    """Glyph and name of every phase, plus the optional ones among ``phases``."""
    shown = set(phases)
    out = Text()
    for phase in PHASE_STYLES:  # in the order of the phases' styles
        label = PHASE_LABELS.get(phase)
        if label is None and phase in shown:
            label = OPTIONAL_PHASE_LABELS.get(phase)
        if label is None:
            continue
        glyph, colour = PHASE_STYLES[phase]
        if out:
            out.append(" ")
        out.append(glyph, style=Style(color=colour, bold=True))
        out.append(label, style=DIM)
    return out


class Panel(VerticalScroll):
    """A bordered, scrollable panel whose body is rebuilt by ``show``.

    Subclasses implement ``render_step(ctx, width) -> renderable``; the last
    renderable is kept so tests can read the panel as plain text.
    """

    DEFAULT_CSS = """
    Panel { height: 1fr; }
    Panel .panel-body { width: 1fr; height: auto; }
    """
    TITLE = ""
    ALLOW_MAXIMIZE = True  # z zooms the focused panel

    def __init_subclass__(cls, **kwargs) -> None:
        # Before Textual's own hook, which merges each class's BINDINGS.
        if "BINDINGS" not in cls.__dict__ and cls.TITLE:
            cls.BINDINGS = zoom_bindings(cls.TITLE)
        super().__init_subclass__(**kwargs)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = self.TITLE
        self._body = Static("", classes="panel-body")
        self.renderable: RenderableType = Text("")
        self.shown_step: int | None = None
        self.shown_follow: str | None = None
        self._ctx: StepContext | None = None

    def compose(self):
        yield self._body

    def on_resize(self) -> None:
        # Bars, windows and column widths depend on the width: redraw.
        if self._ctx is not None:
            self.show(self._ctx)

    def content_width(self) -> int:
        # Inside the border (2), the left padding (1) and a scrollbar's worth
        # (1), so text never jumps when a scrollbar appears.
        width = self.size.width - 4 if self.size.width else 40
        return max(width, 20)

    def show(self, ctx: StepContext) -> None:
        self._ctx = ctx
        self.renderable = self.render_step(ctx, self.content_width())
        self.shown_step = ctx.step
        self.shown_follow = ctx.follow
        self.update_titles(ctx)
        self._body.update(self.renderable)

    def update_titles(self, ctx: StepContext) -> None:
        pass

    def render_step(self, ctx: StepContext, width: int) -> RenderableType:
        raise NotImplementedError

    def plain_text(self, width: int | None = None) -> str:
        """The panel's current content as plain text (what a reader sees, no colour)."""
        return self._plain(self.renderable, width)

    def _plain(self, renderable: RenderableType, width: int | None = None) -> str:
        console = Console(
            width=width or self.content_width(),
            record=True,
            file=_NullFile(),
            color_system=None,
            legacy_windows=False,
        )
        console.print(renderable)
        return console.export_text()


class _NullFile:
    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass

"""The Glassbox tracer: a Textual app that replays a recorded run step by step,
following one request through the scheduler, KV cache, model runner and sampler.

vLLM twin: none (vLLM has no trace viewer). Read it for how the screen is
wired: one ``TraceSession`` (``tui/session.py``), two reactive values (the
step and the followed request), and six panels, each a pure function of
(session, step, request) redrawn whenever either changes.
Start it with ``glassbox trace "PROMPT"`` (record, then view) or
``glassbox tui TRACE.jsonl`` (view a recorded run).
Sessions: all.
"""

from __future__ import annotations

import gc
import os
from functools import partial

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.containers import Grid, Vertical
from textual.reactive import reactive, var
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Footer, LoadingIndicator, Static

from tui.session import TraceLoadError, TraceSession, open_session
from tui.terminal import terminal_hung_up
from tui.widgets.common import Panel, StepContext
from tui.widgets.help import HelpScreen
from tui.widgets.kv_blocks import KVBlocksPanel
from tui.widgets.lifecycle import LifecyclePanel
from tui.widgets.requests import RequestList
from tui.widgets.runner import RunnerPanel
from tui.widgets.sampler import SamplerPanel
from tui.widgets.scheduler import SchedulerPanel
from tui.widgets.scrubber import Scrubber

PLAY_SPEEDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
# A trace still opening after this long gets a spinner (most open faster).
SPINNER_DELAY_S = 0.5
# How often the app checks that its terminal is still there (tui/terminal.py).
TERMINAL_CHECK_S = 1.0
HANGUP_EXIT_CODE = 129  # 128 + SIGHUP, what a shell reports for a hung-up program
DEFAULT_SPEED = 4.0
DARK_THEME = "textual-dark"
LIGHT_THEME = "textual-light"
# Panels in focus order (keys 1..6).
PANEL_IDS = ("requests", "lifecycle", "scheduler", "kv", "runner", "sampler")
_MAIN_SCREEN_ACTIONS = frozenset(
    {
        "step",
        "first_step",
        "last_step",
        "toggle_play",
        "faster",
        "slower",
        "next_event",
        "previous_event",
        "follow_next",
        "follow_previous",
        "zoom",
        "unzoom",
        "focus_panel",
    }
)


class TraceCommands(Provider):
    """Command-palette entries: follow a request, go to a step, play, theme."""

    def _commands(self) -> list[tuple[str, object, str]]:
        app = self.app
        assert isinstance(app, TraceApp)
        commands: list[tuple[str, object, str]] = []
        if app.session is None:
            return commands
        for rid in app.session.request_ids:
            commands.append(
                (
                    f"Follow request {app.session.request_label(rid)}",
                    partial(app.follow_request, rid),
                    "show this request in every panel",
                )
            )
        commands += [
            ("Play / pause", app.action_toggle_play, "step through the run automatically"),
            ("Next event of the followed request", app.action_next_event, ""),
            ("Previous event of the followed request", app.action_previous_event, ""),
            ("First step", app.action_first_step, ""),
            ("Last step", app.action_last_step, ""),
            ("Toggle light / dark theme", app.action_toggle_theme, ""),
            ("Help", app.action_help, "keys, panels and colours"),
        ]
        return commands

    async def discover(self) -> Hits:
        for name, callback, help_text in self._commands():
            yield DiscoveryHit(name, callback, help=help_text or None)

    async def search(self, query: str) -> Hits:
        app = self.app
        assert isinstance(app, TraceApp)
        words = query.strip().lower().split()
        # "step 42", "go 42" or just "42": go to that step.
        numbers = [w for w in words if w.isdigit()]
        if app.session is not None and numbers:
            step = min(int(numbers[0]), app.session.last_step)
            yield Hit(
                1.0,
                Text(f"Go to step {step}"),
                partial(app.go_to_step, step),
                help=f"of {app.session.last_step}",
            )
        matcher = self.matcher(query)
        for name, callback, help_text in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, help=help_text or None)


class ErrorView(Static):
    """What the app shows instead of the panels when the trace cannot be read."""


class LoadingView(Vertical):
    """Shown while a trace is opened in a worker thread (a spinner joins it
    after ``SPINNER_DELAY_S``)."""

    def __init__(self, path: str) -> None:
        super().__init__(id="loading")
        self.path = path

    def compose(self) -> ComposeResult:
        size = ""
        try:
            size = f" ({os.path.getsize(self.path) / 1e6:.1f} MB)"
        except OSError:
            pass
        yield Static(f"Opening {self.path}{size}: replaying the engine's state…", id="loading-text")

    def on_mount(self) -> None:
        # The spinner only if opening takes a while: its animation competes
        # with the loading thread for the interpreter (a third slower).
        self.set_timer(SPINNER_DELAY_S, self._show_spinner)

    def _show_spinner(self) -> None:
        self.mount(LoadingIndicator())


class TraceApp(App[None]):
    """Replay ``trace`` (a path or an opened ``TraceSession``). ``follow``: the
    id the request was sent under, or its internal id; ``self.follow`` is
    always the internal id (the one every event names)."""

    CSS_PATH = "styles.tcss"
    TITLE = "Glassbox tracer"
    COMMANDS = App.COMMANDS | {TraceCommands}
    BINDINGS = [
        Binding("left", "step(-1)", "Step", key_display="←→", priority=True),
        Binding("right", "step(1)", "Step", show=False, priority=True),
        Binding("shift+left,pageup", "step(-10)", "-10", show=False, priority=True),
        Binding("shift+right,pagedown", "step(10)", "+10", show=False, priority=True),
        Binding("home", "first_step", "First", show=False, priority=True),
        Binding("end", "last_step", "Last", show=False, priority=True),
        Binding("space", "toggle_play", "Play", priority=True),
        Binding("plus,equals_sign", "faster", "Faster", show=False),
        Binding("minus", "slower", "Slower", show=False),
        Binding("n", "next_event", "Next event"),
        Binding("p", "previous_event", "Prev event", show=False),
        Binding("f", "follow_next", "Follow next"),
        Binding("F", "follow_previous", "Follow prev", show=False),
        Binding("t", "toggle_theme", "Theme", show=False),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
        *(
            Binding(str(i + 1), f"focus_panel('{pid}')", pid, show=False)
            for i, pid in enumerate(PANEL_IDS)
        ),
    ]

    step: reactive[int] = reactive(0, init=False)
    follow: reactive[str | None] = reactive(None, init=False)
    playing: var[bool] = var(False)
    speed: var[float] = var(DEFAULT_SPEED)

    def __init__(
        self,
        trace: str | TraceSession,
        follow: str | None = None,
        step: int | None = None,
        theme: str | None = None,
    ) -> None:
        super().__init__()
        self.session: TraceSession | None = None
        self.error: str | None = None
        self.trace_path: str | None = None
        if isinstance(trace, TraceSession):
            self.session = trace
            self.trace_path = trace.path
        else:
            # Opened in a worker thread once the screen is up: a long trace
            # shows a loading indicator instead of a blank terminal.
            self.trace_path = trace
        self._initial_follow = follow
        self._initial_step = step
        self._play_timer: Timer | None = None
        self._prefetch_timer: Timer | None = None
        self._started = False  # panels composed, step and request chosen
        self._gc_frozen = False
        if theme is not None:
            self.theme = theme

    # -- layout -----------------------------------------------------------------
    def compose(self) -> ComposeResult:
        if self.error is not None:
            yield ErrorView(
                Text.assemble(
                    ("Cannot open the trace\n\n", "bold"),
                    (self.error, ""),
                    ("\n\nPress q to quit.", "dim"),
                ),
                id="error",
            )
            yield Footer()
            return
        if self.session is None:
            yield LoadingView(self.trace_path or "")
            yield Footer()
            return
        yield Scrubber(id="scrubber")
        with Grid(id="main"):
            with Vertical(id="left"):
                yield RequestList(id="requests")
                yield LifecyclePanel(id="lifecycle")
            yield SchedulerPanel(id="scheduler")
            yield KVBlocksPanel(id="kv")
            yield RunnerPanel(id="runner")
            yield SamplerPanel(id="sampler")
        yield Footer()

    def on_mount(self) -> None:
        self._play_timer = self.set_interval(1 / self.speed, self._tick, pause=True)
        if not self.is_headless:  # tests drive the app without a terminal
            self.set_interval(TERMINAL_CHECK_S, self._quit_if_terminal_hung_up)
        if self.session is not None:
            self._start()
        elif self.error is None and self.trace_path is not None:
            self.run_worker(self._load, thread=True, exclusive=True, exit_on_error=False)

    def _quit_if_terminal_hung_up(self) -> None:
        # End the process at once, as a hangup signal would: there is no terminal left to
        # restore, and Textual's own exit blocks writing its last screen to one that is gone.
        # Nothing else needs closing: the trace was written before the app started.
        if terminal_hung_up():
            os._exit(HANGUP_EXIT_CODE)

    def _load(self) -> None:
        assert self.trace_path is not None
        try:
            session = open_session(self.trace_path)
        except TraceLoadError as e:
            self.call_from_thread(self._loaded, None, str(e))
        except Exception as e:  # noqa: BLE001 - shown, not raised: never a traceback
            self.call_from_thread(
                self._loaded,
                None,
                f"{self.trace_path}: unexpected error while reading the "
                f"trace ({type(e).__name__}: {e})",
            )
        else:
            self.call_from_thread(self._loaded, session, None)

    async def _loaded(self, session: TraceSession | None, error: str | None) -> None:
        self.session, self.error = session, error
        if session is not None:
            self._freeze_gc()
        await self.recompose()
        if session is not None:
            self._start()

    def _freeze_gc(self) -> None:
        """The trace lives as long as the app: move its objects (10^5 for a
        long run) out of the cyclic collector's sight, or every full
        collection would scan them again (undone on exit)."""
        if not self._gc_frozen:
            gc.freeze()
            self._gc_frozen = True

    def on_unmount(self) -> None:
        if self._gc_frozen:
            gc.unfreeze()
            self._gc_frozen = False

    def _start(self) -> None:
        session = self.session
        assert session is not None
        self._freeze_gc()
        self.sub_title = f"{session.path or 'trace'} · {session.num_steps - 1} steps"
        if session.truncated:
            # The step line (the scrubber) says "⚠ truncated" for as long as the app runs.
            self.notify(session.truncated, title="Truncated trace", severity="warning", timeout=20)
        follow = self._initial_follow
        if follow is not None:
            # The user's id (or the list's label) names the request by its internal id.
            resolved = session.resolve_request_id(follow)
            if resolved is None:
                self.notify(
                    f"No request {follow!r} in this trace; following "
                    f"{session.info.followed_request_id}",
                    severity="warning",
                )
            follow = resolved
        follow = follow or session.info.followed_request_id
        step = self._initial_step
        if step is None:
            # Start where the followed request arrives (the story starts
            # there), but not at step 0, where nothing has run yet.
            step = session.timelines[follow].queued_step if follow else 0
            step = max(step, min(1, session.last_step))
        self.set_reactive(TraceApp.follow, follow)
        self.set_reactive(TraceApp.step, max(0, min(step, session.last_step)))
        self._started = True
        self.query_one("#requests", RequestList).focus()
        self.refresh_panels()

    @property
    def ready(self) -> bool:
        """The trace is open and the panels are up."""
        return self._started

    def on_resize(self) -> None:
        self.call_after_refresh(self.refresh_panels)

    # -- state changes ------------------------------------------------------------
    def watch_step(self) -> None:
        self.refresh_panels()

    def watch_follow(self) -> None:
        self.refresh_panels()

    def context(self) -> StepContext:
        assert self.session is not None
        return StepContext(self.session, self.step, self.session.view(self.step), self.follow)

    def refresh_panels(self) -> None:
        if not self.ready:
            return
        ctx = self.context()
        self.query_one(Scrubber).show(ctx, self.playing, self.speed)
        self.query_one(RequestList).show(ctx)
        for panel in self.query(Panel):
            panel.show(ctx)
        # Build the neighbouring steps' views while the user reads this one.
        if self._prefetch_timer is not None:
            self._prefetch_timer.stop()
        self._prefetch_timer = self.set_timer(0.05, self._prefetch)

    def _prefetch(self) -> None:
        self._prefetch_timer = None
        session = self.session
        if session is None:
            return
        for step in (self.step + 1, self.step - 1):
            if 0 <= step <= session.last_step:
                session.view(step)

    def go_to_step(self, step: int) -> None:
        if not self.ready or self.session is None:
            return
        self.step = max(0, min(step, self.session.last_step))

    def follow_request(self, request_id: str) -> None:
        if self.ready and self.session is not None and request_id in self.session.timelines:
            self.follow = request_id

    def on_request_list_follow(self, message: RequestList.Follow) -> None:
        self.follow_request(message.request_id)

    def on_scrubber_seek(self, message: Scrubber.Seek) -> None:
        self.go_to_step(message.step)

    # -- actions ---------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # The stepping keys are priority bindings (a focused panel must not
        # take ←/→); under a modal screen (help, palette) they do nothing.
        if action in _MAIN_SCREEN_ACTIONS and isinstance(self.screen, ModalScreen):
            return False
        # Each focusable panel binds z twice (``zoom_bindings``): the footer
        # shows "Zoom <panel>", or "Unzoom" while a panel is zoomed.
        if action == "zoom":
            return self.screen.maximized is None
        if action == "unzoom":
            return self.screen.maximized is not None
        return True

    def action_step(self, delta: int) -> None:
        self.go_to_step(self.step + delta)

    def action_first_step(self) -> None:
        self.go_to_step(0)

    def action_last_step(self) -> None:
        if self.session is not None:
            self.go_to_step(self.session.last_step)

    def action_next_event(self) -> None:
        if not self.ready or self.session is None or self.follow is None:
            return
        nxt = self.session.next_event_step(self.follow, self.step)
        if nxt is None:
            self.notify(f"{self.follow} has no later event", timeout=2)
        else:
            self.go_to_step(nxt)

    def action_previous_event(self) -> None:
        if not self.ready or self.session is None or self.follow is None:
            return
        prev = self.session.previous_event_step(self.follow, self.step)
        if prev is not None:
            self.go_to_step(prev)

    def _cycle_follow(self, delta: int) -> None:
        if not self.ready or self.session is None or not self.session.request_ids:
            return
        ids = self.session.request_ids
        i = ids.index(self.follow) if self.follow in ids else -delta
        self.follow = ids[(i + delta) % len(ids)]

    def action_follow_next(self) -> None:
        self._cycle_follow(1)

    def action_follow_previous(self) -> None:
        self._cycle_follow(-1)

    def action_toggle_play(self) -> None:
        if not self.ready or self.session is None or self._play_timer is None:
            return
        if not self.playing and self.step >= self.session.last_step:
            self.step = 0
        self.playing = not self.playing
        if self.playing:
            self._play_timer.resume()
        else:
            self._play_timer.pause()
        self.refresh_panels()

    def _tick(self) -> None:
        if self.session is None:
            return
        if self.step >= self.session.last_step:
            self.action_toggle_play()
            return
        self.step += 1

    def _set_speed(self, speed: float) -> None:
        self.speed = speed
        if self._play_timer is not None:
            self._play_timer.stop()
        self._play_timer = self.set_interval(1 / speed, self._tick, pause=not self.playing)
        self.refresh_panels()

    def action_faster(self) -> None:
        faster = [s for s in PLAY_SPEEDS if s > self.speed]
        if faster:
            self._set_speed(faster[0])

    def action_slower(self) -> None:
        slower = [s for s in PLAY_SPEEDS if s < self.speed]
        if slower:
            self._set_speed(slower[-1])

    def action_focus_panel(self, panel_id: str) -> None:
        if self.ready:
            self.query_one(f"#{panel_id}").focus()

    def action_zoom(self) -> None:
        """Fill the screen with the focused panel (the footer names it)."""
        focused = self.focused
        while focused is not None and focused.id not in PANEL_IDS:
            focused = focused.parent if isinstance(focused.parent, Widget) else None
        if focused is not None:
            self.screen.maximize(focused, container=False)
            self.refresh_bindings()
            self.call_after_refresh(self.refresh_panels)

    def action_unzoom(self) -> None:
        self.screen.minimize()
        self.refresh_bindings()
        self.call_after_refresh(self.refresh_panels)

    def action_toggle_theme(self) -> None:
        self.theme = LIGHT_THEME if self.theme != LIGHT_THEME else DARK_THEME

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())


def run_app(
    trace: str | TraceSession,
    follow: str | None = None,
    step: int | None = None,
    theme: str | None = None,
) -> None:
    TraceApp(trace, follow=follow, step=step, theme=theme).run()

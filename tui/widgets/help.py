"""The help screen (``?``): keys, what each panel shows, how to read the colours.

vLLM twin: none.
Sessions: all.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS: list[tuple[str, str]] = [
    ("← →", "previous / next step"),
    ("shift+← shift+→", "10 steps back / forward (also pgup pgdn)"),
    ("home end", "first / last step"),
    ("space", "play / pause;  + - play faster / slower"),
    ("n p", "next / previous event of the followed request"),
    ("f F", "follow the next / previous request (or pick one in Requests, ⏎)"),
    (
        "1 … 6",
        "focus a panel (its border lights up);  z zooms the focused panel, which the footer "
        "names (z again: back)",
    ),
    ("t", "light / dark theme"),
    ("ctrl+p", "command palette: follow a request, go to step N (type the number), …"),
    ("?  esc", "this help / close it"),
    ("q", "quit"),
]

PANELS: list[tuple[str, str]] = [
    (
        "Step",
        "the step shown, of how many (⚠ truncated: the file lacks the end of the run, "
        "e.g. a process was killed); the bar is the whole run: ● now, ━ the followed "
        "request's life, ┃ its events. Click the bar to jump.",
    ),
    ("Requests", "every request and its status after this step (✕n: preempted n times)."),
    (
        "Lifecycle",
        "the followed request, one cell per step: ─ waiting, █ prefill chunk, "
        "▓ recompute after a preemption, ▄ decode, ▁ running but not scheduled, ✕ preempted, "
        "■ finished. Under it, 'Elsewhere': what the run shows that this request does not "
        "(a preemption, a prefix hit, a chunked prefill) and the request to follow for it. "
        "Below, its events; highlighted lines happen at this step.",
    ),
    (
        "Scheduler",
        "the token budget (max_num_batched_tokens) and how it was spent: one "
        "segment per request, █ prefill, ▄ decode. Then the running and waiting queues, "
        "admissions with their prefix-cache hit, preemptions, requests short of blocks. "
        "With async scheduling (the default) the step was scheduled while the previous one "
        "was in flight: ◌ marks a placeholder, a token that step is still sampling.",
    ),
    (
        "KV blocks",
        "the block pool: first the counts (blocks used, free, and how many of the free "
        "ones still hold a cached prefix), then the grid. A cell is a block, labelled with "
        "its id: coloured = used (its owner's colour; underlined = shared by several "
        "requests), grey italic = cached: free but still holding a prefix (hittable until "
        "evicted), plain = free, ∅ = the null block; the key at the bottom draws each. "
        "Then what the KV manager did this step, the followed request's block table (logical "
        "→ physical block, hash, tokens filled, ref count, the text it holds) and the free "
        "queue (its head is handed out, and evicted, first).",
    ),
    (
        "Runner batch",
        "the flat batch the model ran: per request its query length, "
        "positions, KV slots (block:offset+count) and whether its sampled token is kept (a "
        "prefill chunk short of the prompt's end drops it); query_start_loc; on CUDA, the "
        "CUDA-graph padding. Below, the engine loop against time (traces from format 1.4): "
        "one row per step in flight with this one, ▓ schedule(), █ forward, ━ in flight "
        "(launched, tokens not yet read), ▒ update; with async scheduling the next step is "
        "scheduled and launched inside this one's time in flight.",
    ),
    (
        "Sampler",
        "the followed request's chosen token and, in full traces, the top "
        "candidates after each stage: raw, after logits processors (proc), after "
        "temperature (temp), min-p, top-k/top-p. Below, the output so far, alternating "
        "colours at token boundaries.",
    ),
]


def help_renderable() -> Group:
    intro = Text.assemble(
        ("You are replaying a recorded run one ", ""),
        ("engine step", "bold"),
        (
            " at a time (one EngineCore.step(): schedule → run the model → sample → update). "
            "Every panel shows the engine right after the chosen step; with async scheduling "
            "(the default) that step is still in flight: its tokens are placeholders until "
            "the next step's update.",
            "",
        ),
    )
    keys = Table.grid(padding=(0, 2))
    keys.add_column(style="bold", no_wrap=True)
    keys.add_column()
    for key, what in KEYS:
        keys.add_row(key, what)
    panels = Table.grid(padding=(0, 2))
    panels.add_column(style="bold", no_wrap=True)
    panels.add_column()
    for name, what in PANELS:
        panels.add_row(name, what)
    colours = Text(
        "Colours are mid-tones that read on dark and light themes; t switches.", style="dim"
    )
    return Group(
        intro,
        Text(""),
        Text("Keys", style="bold underline"),
        keys,
        Text(""),
        Text("Panels", style="bold underline"),
        panels,
        Text(""),
        colours,
    )


def help_text() -> str:
    """The help as plain text (for tests and ``--help``-like uses)."""
    lines = [f"{k}: {w}" for k, w in KEYS] + [f"{n}: {w}" for n, w in PANELS]
    return "\n".join(lines)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
    ]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 90%; max-width: 110; height: 90%;
        border: round $accent; background: $surface; padding: 0 1;
    }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body") as body:
            body.border_title = "Glassbox tracer · help · esc closes"
            yield Static(help_renderable(), id="help-text")

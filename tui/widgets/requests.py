"""The request list: every request of the run, its status at this step; pick
one to follow. Each is listed under the id it was sent with where that is
unambiguous (``RequestTimeline.label``); the other panels show the internal
id the engine gave it (that id plus ``-`` and 8 hex digits), in the same colour.
A request run with a LoRA adapter shows its name (``lora:NAME``).

vLLM twin: none; the statuses are ``engine/v1/request.py``'s
``RequestStatus`` as the replay model rebuilt them at the shown step
("waiting for grammar": ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``).
Sessions: 01, 02.
"""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.message import Message
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from tui.widgets.common import DIM, StepContext, zoom_bindings


def request_status(ctx: StepContext, request_id: str) -> str:
    """Where ``request_id`` is after the shown step, in a few words."""
    state = ctx.view.state
    req = state.requests.get(request_id)
    if req is None:
        return "not yet arrived"
    if req.is_finished:
        reason = req.finish_reason or req.status.removeprefix("FINISHED_").lower()
        return f"done: {reason}"
    if req.status == "RUNNING":
        if req.num_computed_tokens < req.num_prompt_tokens:
            return f"prefill {req.num_computed_tokens}/{req.num_prompt_tokens}"
        return f"decode {req.num_output_tokens}/{req.max_tokens}"
    if req.waiting_for_grammar:
        # Structured outputs: blocked in skipped_waiting until the grammar compiles.
        return "waiting for grammar"
    position = state.waiting.index(request_id) + 1 if request_id in state.waiting else 0
    where = f" #{position}" if position else ""
    if req.status == "PREEMPTED":
        return f"preempted, queue{where}"
    return f"waiting{where}"


class RequestList(OptionList):
    """One line per request, in arrival order; Enter (or a click) follows it."""

    ALLOW_MAXIMIZE = True
    BINDINGS = zoom_bindings("Requests")

    class Follow(Message):
        def __init__(self, request_id: str) -> None:
            super().__init__()
            self.request_id = request_id

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Requests"
        self._ids: list[str] = []
        self._prompts: list[Text] = []
        self._status_lines: dict[str, tuple[tuple, Text]] = {}
        self.lines: list[str] = []

    def show(self, ctx: StepContext) -> None:
        ids = ctx.session.request_ids
        id_width = min(10, max((len(ctx.session.request_label(r)) for r in ids), default=1))
        prompts = [self._line(ctx, rid, id_width) for rid in ids]
        if ids != self._ids:
            self._ids = list(ids)
            self.set_options([Option(p, id=rid) for p, rid in zip(prompts, ids)])
        else:
            # Only lines that changed: a run of hundreds of requests changes a few per step.
            for i, p in enumerate(prompts):
                if p is not self._prompts[i]:
                    self.replace_option_prompt_at_index(i, p)
        self._prompts = prompts
        self.lines = [p.plain for p in prompts]
        if ctx.follow in ids:
            index = ids.index(ctx.follow)
            if self.highlighted != index:
                self.highlighted = index
        self.border_subtitle = f"{len(ids)} · ⏎ follow"

    def _line(self, ctx: StepContext, rid: str, id_width: int) -> Text:
        req = ctx.view.state.requests.get(rid)
        status = request_status(ctx, rid)
        followed = rid == ctx.follow
        preemptions = req.num_preemptions if req is not None else 0
        key = (status, followed, preemptions, id_width, req is None)
        cached = self._status_lines.get(rid)
        if cached is not None and cached[0] == key:
            return cached[1]  # most lines do not change from one step to the next
        colour = ctx.session.request_colour(rid)
        line = Text()
        line.append("▶" if followed else " ", style=Style(bold=True))
        line.append("● ", style=Style(color=colour))
        label = ctx.session.request_label(rid)
        short = label if len(label) <= id_width else label[: id_width - 1] + "…"
        line.append(f"{short:<{id_width}}", style=Style(color=colour, bold=followed))
        line.append("  ")
        line.append(status, style=Style() if req is not None else DIM)
        if preemptions:
            line.append(f" ✕{preemptions}", style=Style(color="#d62728", bold=True))
        if lora := ctx.session.request_lora(rid):
            line.append(f"  lora:{lora}", style=DIM)
        self._status_lines[rid] = (key, line)
        return line

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id is not None:
            self.post_message(self.Follow(event.option.id))

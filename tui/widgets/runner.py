"""The batch the model runner built for this step.

vLLM twin: ``vllm/v1/worker/gpu_model_runner.py`` (``_prepare_inputs``,
``execute_model``). Read it for the flattened batch: all scheduled tokens of
all requests in one row of ``num_tokens`` (query lengths add up to it), each
token's position (its index in its request), and its KV slot (``block *
block_size + offset``, shown here as runs ``block:offset+count``). A prefill
chunk that does not reach the end of the prompt is computed but its sampled
token is thrown away. On CUDA, the batch is padded up to a captured CUDA
graph size. Fields come from the ``runner.batch`` event (or, without one,
from the scheduler's decision and the block tables). Under the batch, the
engine loop around the step (``loop.py``): with async scheduling the next
step is scheduled and launched while this one is in flight. With tensor
parallelism, one line per rank (``StepView.ranks``): when it took the step's
``execute_model`` off the broadcast ring (after the launch), its time, the
all-reduces and all-gathers it ran and their host time; only the output
rank answers the executor (vLLM twin: ``vllm/v1/executor/multiproc_executor.py``).
Sessions: 01 (engine loop), 04 (worker), 05 (attention), 07 (tensor parallelism).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from engine.tracing import RankStep, RunnerForward
from tui.widgets.common import DIM, Panel, StepContext, request_chip
from tui.widgets.loop import render_engine_loop


class RunnerPanel(Panel):
    TITLE = "Runner batch"

    def update_titles(self, ctx: StepContext) -> None:
        forward = next((e for e in ctx.view.events if isinstance(e, RunnerForward)), None)
        self.border_subtitle = (
            f"forward {forward.duration_ns / 1e6:.1f} ms" if forward is not None else ""
        )

    def render_step(self, ctx: StepContext, width: int) -> RenderableType:
        return render_runner(ctx, width)


def _slots(runs: list[list[int]]) -> str:
    return " ".join(f"{b}:{o}+{n}" if n > 1 else f"{b}:{o}" for b, o, n in runs)


def render_runner(ctx: StepContext, width: int) -> RenderableType:
    parts = [render_batch(ctx, width)]
    for extra in (render_ranks(ctx, width), render_engine_loop(ctx, width)):
        if extra is not None:
            parts += [Text(""), extra]
    return parts[0] if len(parts) == 1 else Group(*parts)


def rank_line(rank: RankStep) -> Text:
    """``TP0 recv +0.04 ms  exec 31.3 ms  5 all-reduce / 1 all-gather 23.5 ms  (answered)``"""
    line = Text()
    line.append(f"TP{rank.tp_rank}", style=Style(bold=True))
    line.append(f" recv {rank.received_after_launch_ms:+.2f} ms")
    seconds = rank.execute_seconds
    line.append(f"  exec {seconds * 1e3:.1f} ms" if seconds is not None else "  exec ?")
    line.append(
        f"  {rank.all_reduce_count} all-reduce / {rank.all_gather_count} all-gather"
        f" {rank.collective_seconds * 1e3:.1f} ms"
    )
    if rank.replied:
        line.append("  (answered)", style=Style(bold=True))
    return line


def render_ranks(ctx: StepContext, width: int) -> RenderableType | None:
    """The tensor-parallel ranks' lines, or None with one rank (or none ran).
    A panel too narrow for the lines gets a table of the same numbers."""
    ranks = ctx.view.ranks
    if not ranks:
        return None
    head = Text()
    head.append(f"Tensor parallel · {len(ranks)} ranks", style=Style(bold=True))
    answering = [f"TP{r.tp_rank}" for r in ranks if r.replied]
    head.append(
        " · SchedulerOutput broadcast to every rank, ModelRunnerOutput from "
        + (", ".join(answering) if answering else "no rank"),
        style=DIM,
    )
    lines = [rank_line(r) for r in ranks]
    if max(len(line) for line in lines) <= width:
        legend = Text(
            "recv: when the rank took execute_model off the ring, after the step's launch · "
            "exec: its execute_model · the collectives over the TP group and their host time "
            "(waiting for the other ranks included)",
            style=DIM,
        )
        return Group(head, *lines, legend)
    table = Table(box=None, padding=(0, 1, 0, 0), pad_edge=False, show_edge=False, header_style=DIM)
    for name in ("", "recv", "exec", "AR/AG", "coll"):
        table.add_column(name, justify="right" if name else "left", no_wrap=True)
    for r in ranks:
        label = Text(f"TP{r.tp_rank}", style=Style(bold=True))
        label.append("✓" if r.replied else " ")
        table.add_row(
            label,
            f"{r.received_after_launch_ms:+.2f}",
            f"{r.execute_seconds * 1e3:.1f}" if r.execute_seconds is not None else "?",
            f"{r.all_reduce_count}/{r.all_gather_count}",
            f"{r.collective_seconds * 1e3:.1f}",
        )
    legend = Text(
        "ms · recv: when the rank took execute_model off the ring, after the step's launch · "
        "exec: its execute_model · AR/AG: all-reduces/all-gathers over the TP group, coll: "
        "their host time · ✓ answered",
        style=DIM,
    )
    return Group(head, table, legend)


def render_batch(ctx: StepContext, width: int) -> RenderableType:
    view = ctx.view
    if not view.batch:
        return Text(
            "No batch ran at this step." if ctx.step else "Step 0: nothing has run yet.",
            style=DIM,
        )
    rb = view.runner_batch  # None: the layout was derived from the scheduler
    if rb is not None:
        num_tokens, padded, mode = rb.num_tokens, rb.num_tokens_padded, rb.cudagraph_mode
    else:
        num_tokens = sum(s.query_len for s in view.batch)
        padded, mode = num_tokens, None
    head = Text()
    head.append(f"{len(view.batch)} requests, {num_tokens} tokens", style=Style(bold=True))
    backend = (rb.attn_backend if rb is not None else None) or ctx.session.info.attn_backend
    if backend:
        head.append(f" · {backend}", style=DIM)
    if ctx.session.info.compilation:
        head.append(f" · compiled {ctx.session.info.compilation}", style=DIM)
    graph = Text()
    if mode and mode != "NONE":
        graph.append(f"CUDA graph {mode}: {num_tokens} tokens padded to {padded}")
        if padded > num_tokens:
            graph.append(f" (+{padded - num_tokens} padding)", style=DIM)
    elif mode == "NONE":
        graph.append("eager (no CUDA graph)", style=DIM)
        if padded > num_tokens:
            graph.append(f", padded to {padded}", style=DIM)
    if view.batch_source != "runner":
        graph.append("  (layout derived from the scheduler; no runner.batch event)", style=DIM)
    rows = []
    for slot in view.batch:
        first, last = slot.num_computed_tokens, slot.seq_len - 1
        positions = str(first) if first == last else f"{first}-{last}"
        sample = Text("✓") if slot.sampled else Text("✗", style=DIM)
        rows.append(
            (
                request_chip(ctx, slot.request_id),
                str(slot.query_len),
                positions,
                _slots(slot.slot_mapping),
                sample,
            )
        )
    # Fixed column widths: ids, counts and positions never truncate; the slot
    # runs take what is left (and end in "…" when a long prefill has many).
    req_w = min(10, max(3, max(len(r[0]) for r in rows)))
    q_w = max(1, max(len(r[1]) for r in rows))
    pos_w = max(3, max(len(r[2]) for r in rows))
    slots_w = max(5, width - req_w - q_w - pos_w - 1 - 4)
    table = Table(
        box=None,
        padding=(0, 1, 0, 0),
        show_edge=False,
        header_style=DIM,
        expand=False,
        collapse_padding=True,
    )
    table.add_column("req", no_wrap=True, width=req_w, overflow="ellipsis")
    table.add_column("q", justify="right", no_wrap=True, width=q_w)
    table.add_column("pos", no_wrap=True, width=pos_w)
    table.add_column("slots", overflow="ellipsis", no_wrap=True, width=slots_w)
    table.add_column("✓", no_wrap=True, width=1)
    for row in rows:
        table.add_row(*row)
    parts: list[RenderableType] = [head]
    if graph:
        parts.append(graph)
    parts.append(table)
    offsets = Text()
    # query_start_loc: where each request's tokens start in the flat batch.
    loc, starts = 0, []
    for slot in view.batch:
        starts.append(loc)
        loc += slot.query_len
    starts.append(loc)
    offsets.append("query_start_loc ", style=DIM)
    offsets.append(str(starts))
    parts.append(offsets)
    parts.append(
        Text(
            "q: tokens computed this step · pos: their positions · slots: where "
            "their K/V go (block:offset+count) · ✓: sampled token kept, ✗ dropped",
            style=DIM,
        )
    )
    return Group(*parts)

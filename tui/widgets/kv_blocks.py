"""The KV block pool and the followed request's block table.

vLLM twin: ``vllm/v1/core/block_pool.py`` (``BlockPool``,
``FreeKVCacheBlockQueue``) and ``vllm/v1/core/single_type_kv_cache_manager.py``
(``req_to_blocks``). Read it for paged attention's bookkeeping: a request
holds a list of fixed-size blocks (its block table); full blocks get a hash
of their tokens (and of the blocks before them) so a later request with the
same prefix reuses them (ref count > 1); freed blocks go to the tail of the
free queue but keep their hash, so they can still be hit until the queue
hands them out again (eviction). Block 0 is the null block, never handed out.

Speculative decoding: a step writes the K/V of its drafts like any scheduled
token; after it, the scheduler steps the request's cursor
(``num_computed_tokens``) back over the rejected drafts ("rollback"): their
slots stay in the request's blocks and are written again by later tokens;
no block is freed for them. With a model drafter (draft model, EAGLE) the
scheduler also reserves ``num_lookahead_tokens`` slots after the scheduled
tokens, where the drafter writes the K/V of its next drafts; the block table
says how many.
Sessions: 03 (KV cache), 06 (speculative decoding).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from engine.tracing import (
    EngineState,
    KVAllocated,
    KVCached,
    KVCacheReset,
    KVEvicted,
    KVFreed,
    KVTouched,
)
from tui.widgets.common import DIM, Panel, StepContext, contrast_text, request_chip

CACHED_FREE_BG = "#a8a8a8"  # a free block that still holds a cached prefix
LEGEND_OWNER_BG = "#1f77b4"  # the key's "in use" cells (the first request's colour)
FREE_FG = "#8a8a8a"
# Beyond this many grid rows the grid switches to one character per block.
MAX_ID_GRID_ROWS = 10
MAX_GRID_BLOCKS = 4096


class KVBlocksPanel(Panel):
    TITLE = "KV blocks"

    def update_titles(self, ctx: StepContext) -> None:
        s = ctx.view.state
        self.border_title = f"KV blocks · {s.num_blocks} × {s.block_size} tokens"
        self.border_subtitle = f"{s.kv_cache_usage:.0%} used"

    def render_step(self, ctx: StepContext, width: int) -> RenderableType:
        return render_kv(ctx, width)


def _owner_colour(ctx: StepContext, owners: tuple[str, ...]) -> str:
    if ctx.follow in owners:
        return ctx.session.request_colour(ctx.follow)
    return ctx.session.request_colour(owners[0])


def grid_is_compact(num_blocks: int, width: int) -> bool:
    """Whether the grid draws one character per block (too many blocks to
    write their ids in ``MAX_ID_GRID_ROWS`` rows)."""
    n = min(num_blocks, MAX_GRID_BLOCKS)
    id_width = len(str(max(n - 1, 0)))
    per_row = max(1, width // (id_width + 1))
    return (n + per_row - 1) // per_row > MAX_ID_GRID_ROWS


def render_grid(ctx: StepContext, state: EngineState, width: int) -> Text:
    n = min(state.num_blocks, MAX_GRID_BLOCKS)
    id_width = len(str(max(n - 1, 0)))
    per_row = max(1, width // (id_width + 1))
    compact = grid_is_compact(state.num_blocks, width)
    if compact:
        per_row = max(1, width)
    followed_blocks = set()
    if ctx.follow is not None and ctx.follow in state.requests:
        followed_blocks = set(state.requests[ctx.follow].block_ids)
    grid = Text()
    for b in range(n):
        if b and b % per_row == 0:
            grid.append("\n")
        elif b and not compact:
            grid.append(" ")
        ref = state.ref_cnt[b]
        cached = state.block_hash[b] is not None
        label = f"{b:>{id_width}}"
        if b == state.null_block_id:
            grid.append("∅" if compact else f"{'∅':>{id_width}}", style=DIM)
        elif ref > 0:
            bg = _owner_colour(ctx, state.owners[b]) if state.owners[b] else "#8a8a8a"
            style = Style(
                bgcolor=bg, color=contrast_text(bg), bold=b in followed_blocks, underline=ref > 1
            )
            grid.append(
                ("▓" if ref > 1 else "█") if compact else label,
                style=Style(color=bg) if compact else style,
            )
        elif cached:
            grid.append(
                "▒" if compact else label,
                style=Style(color=CACHED_FREE_BG)
                if compact
                else Style(bgcolor=CACHED_FREE_BG, color="#000000", italic=True),
            )
        else:
            grid.append("·" if compact else label, style=Style(color=FREE_FG))
    if state.num_blocks > n:
        grid.append(f"\n… {state.num_blocks - n} more blocks not drawn", style=DIM)
    return grid


def grid_legend(compact: bool = False) -> Text:
    """The key to the grid: each entry is drawn as a cell of its kind, with a
    word in it (a sample block id there would read like a count, next to the
    counts above the grid). ``compact``: the one-character-per-block grid."""
    used = Style(bgcolor=LEGEND_OWNER_BG, color=contrast_text(LEGEND_OWNER_BG))
    out = Text()
    out.append("key: ", style=DIM)
    if compact:
        out.append("█", style=Style(color=LEGEND_OWNER_BG))
        out.append(" used ", style=DIM)
        out.append("▓", style=Style(color=LEGEND_OWNER_BG))
        out.append(" shared ", style=DIM)
        out.append("▒", style=Style(color=CACHED_FREE_BG))
        out.append(" cached ", style=DIM)
        out.append("·", style=Style(color=FREE_FG))
        out.append(" free ", style=DIM)
    else:
        out.append("used", style=used)
        out.append(" ")
        out.append("shared", style=used + Style(underline=True))
        out.append(" ")
        out.append("cached", style=Style(bgcolor=CACHED_FREE_BG, color="#000000", italic=True))
        out.append(" ")
        out.append("free", style=Style(color=FREE_FG))
        out.append(" ")
    out.append("∅ null", style=DIM)
    return out


def step_changes(ctx: StepContext) -> Table:
    """What the KV manager did in this step, event by event."""
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True, style=DIM)
    table.add_column()
    for e in ctx.view.events:
        if isinstance(e, KVAllocated):
            text = request_chip(ctx, e.request_id) + Text(f" got {_ids(e.block_ids)}")
            table.add_row("allocated", text)
        elif isinstance(e, KVTouched):
            text = request_chip(ctx, e.request_id) + Text(
                f" reuses {_ids(e.block_ids)} (prefix hit)"
            )
            table.add_row("hit", text)
        elif isinstance(e, KVFreed):
            back = e.to_free_queue
            text = request_chip(ctx, e.request_id) + Text(f" releases {_ids(e.block_ids)}")
            if back:
                text.append(f"; {_ids(back)} to free-queue tail", style=DIM)
            table.add_row("freed", text)
        elif isinstance(e, KVEvicted):
            table.add_row("evicted", Text(f"{e.block_id} (hash {e.block_hash[:6]} dropped)"))
        elif isinstance(e, KVCacheReset):
            table.add_row("reset", Text("prefix cache cleared"))
    cached = [e.block_id for e in ctx.view.events if isinstance(e, KVCached)]
    if cached:
        table.add_row("hashed", Text(f"{_ids(cached)} (full, now hittable)"))
    spec = ctx.view.spec
    for rid, verdict in spec.verified.items() if spec is not None else ():
        if verdict.num_rejected:
            n = verdict.num_rejected
            text = request_chip(ctx, rid) + Text(
                f" cursor {verdict.num_computed_tokens_scheduled} → "
                f"{verdict.num_computed_tokens}: {n} rejected draft{'s' if n != 1 else ''}' "
                "slots will be written again"
            )
            table.add_row("rollback", text)
    return table


def _ids(ids: list[int]) -> str:
    return " ".join(str(b) for b in ids) if ids else "-"


def free_queue_line(state: EngineState, width: int) -> Text:
    queue = state.free_queue
    out = Text()
    out.append(f"free queue ({len(queue)}, head evicted first): ", style=DIM)
    budget = max(width * 2 - len(out), 10)
    shown = 0
    for i, b in enumerate(queue):
        piece = f"{b} "
        if shown + len(piece) > budget:
            out.append(f"… +{len(queue) - i}", style=DIM)
            break
        cached = state.block_hash[b] is not None
        out.append(
            str(b),
            style=Style(italic=True, color="#000000", bgcolor=CACHED_FREE_BG)
            if cached
            else Style(color=FREE_FG),
        )
        out.append(" ")
        shown += len(piece)
    return out


def block_table(ctx: StepContext, width: int) -> RenderableType:
    """The followed request's block table: logical index -> physical block,
    with hash, ref count, fill and the text the block holds."""
    state = ctx.view.state
    rid = ctx.follow
    if rid is None:
        return Text("")
    req = state.requests.get(rid)
    head = Text()
    head.append_text(request_chip(ctx, rid))
    if req is None:
        return head + Text(" has not arrived yet", style=DIM)
    if not req.block_ids:
        reason = "finished, blocks released" if req.is_finished else "holds no blocks"
        return head + Text(f" {reason}", style=DIM)
    head.append(
        f" block table ({len(req.block_ids)} blocks, {req.num_computed_tokens} tokens computed)",
        style=DIM,
    )
    tl = ctx.session.timelines[rid]
    tokens = list(tl.prompt_token_ids or []) + tl.output_ids_until(ctx.step)
    # Fixed widths for the numbers; the block's text takes what is left.
    idx_w = len(str(len(req.block_ids) - 1)) + 1
    id_w = len(str(state.num_blocks - 1))
    fill_w = 2 * len(str(state.block_size)) + 1 + 3
    text_w = max(4, width - idx_w - id_w - 6 - fill_w - 4)
    table = Table.grid(padding=(0, 1))
    table.add_column(justify="right", style=DIM, no_wrap=True, width=idx_w)
    table.add_column(justify="right", no_wrap=True, width=id_w)
    table.add_column(no_wrap=True, width=6)
    table.add_column(no_wrap=True, width=fill_w)
    table.add_column(no_wrap=True, overflow="ellipsis", width=text_w)
    bs = state.block_size
    for i, b in enumerate(req.block_ids):
        h = state.block_hash[b]
        ref = state.ref_cnt[b]
        filled = max(0, min(bs, req.num_computed_tokens - i * bs))
        text = ""
        if tokens and len(tokens) >= i * bs + filled > i * bs:
            pieces = [ctx.session.token_text(t) for t in tokens[i * bs : i * bs + filled]]
            if all(p is not None for p in pieces):
                text = repr("".join(pieces).replace("\n", "↵"))
        ref_text = Text(f"×{ref}", style=Style(bold=True, underline=True) if ref > 1 else DIM)
        table.add_row(
            f"{i}→",
            Text(str(b), style=Style(bold=True)),
            Text(h[:6] if h else "······", style=Style() if h else DIM),
            Text(f"{filled}/{bs}") + Text(" ") + ref_text,
            text,
        )
    sched = ctx.view.sched_step
    if sched is not None and sched.num_lookahead_tokens and rid in sched.num_scheduled_tokens:
        note = Text(
            f"+ {sched.num_lookahead_tokens} lookahead slots reserved after its "
            f"{sched.num_scheduled_tokens[rid]} scheduled tokens: the drafter writes its next "
            "drafts there",
            style=DIM,
        )
        return Group(head, table, note)
    return Group(head, table)


def render_kv(ctx: StepContext, width: int) -> RenderableType:
    state = ctx.view.state
    if state.num_blocks == 0:
        return Text("No KV pool in this trace (no kv.init event).", style=DIM)
    usable = state.num_blocks - 1
    used = usable - state.num_free_blocks
    head = Text()
    head.append(f"{used} used", style=Style(bold=True))
    # Cached blocks are free ones that still hold a prefix: counted among the free.
    head.append(
        f" · {state.num_free_blocks} free ({state.num_cached_free_blocks} cached)", style=DIM
    )
    parts: list[RenderableType] = [head, render_grid(ctx, state, width)]
    changes = step_changes(ctx)
    if changes.row_count:
        parts.append(changes)
    parts.append(block_table(ctx, width))
    parts.append(free_queue_line(state, width))
    parts.append(grid_legend(grid_is_compact(state.num_blocks, width)))
    return Group(*parts)

"""The sampler's view of the followed request at this step.

vLLM twin: ``vllm/v1/sample/sampler.py`` (``Sampler.forward``) and
``vllm/v1/sample/ops/topk_topp_sampler.py``. Read it for the order of the
stages: raw logits -> logits processors and penalties -> greedy argmax, or
temperature -> min-p -> top-k / top-p -> a random draw. ``full`` traces keep
the top candidates (with probabilities) after each stage, so you can watch
temperature sharpen or flatten the distribution and top-k/top-p cut its
tail; ``lifecycle`` traces keep only the chosen token and its logprob.
Below: the output so far, one colour per token so token boundaries show.

Speculative decoding (``vllm/v1/sample/rejection_sampler.py``): a step that
verifies drafts gets a draft row -- each draft, whether the target accepted
it (✓) or rejected it (✗), and the target's own token: the one that
replaced the first rejected draft (the recovered token), or, when every
draft was accepted, the bonus token after them -- then the drafts the
proposer made for the next step. The "chose" line is then the sampler's
pick at the bonus position, kept only when every draft is accepted.

Structured outputs (``vllm/v1/structured_output/__init__.py`` and
``apply_grammar_bitmask`` in ``vllm/v1/structured_output/utils.py``): before
the sampler runs, a constrained request's logits are masked with the
bitmask row its grammar allows (every other token gets -inf), so the stages
below start from the masked logits. A grammar line says how many tokens the
mask allowed; a ``full`` trace adds the mask's effect on the model's own
favourites: its top token before and after the mask, and which of its 5
best candidates were masked away. While the grammar compiles the request
waits in ``skipped_waiting`` and nothing is sampled for it.
Sessions: 05 (sampling), 06 (speculative decoding, structured outputs).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from engine.tracing import (
    SamplerSampled,
    SamplingParamsSummary,
    SpecDecodeRow,
    StructuredOutputRow,
)
from tui.timelines import (
    FINISHED,
    GRAMMAR,
    NOT_ARRIVED,
    PREEMPTED,
    STALLED,
    WAITING,
    visible_whitespace,
)
from tui.widgets.common import DIM, Panel, StepContext

STAGE_LABELS = {
    "raw": "raw",
    "processed": "proc",
    "temperature": "temp",
    "min_p": "min-p",
    "top_k_top_p": "top-k/p",
}
TOKEN_COLUMN = 12
MIN_SHOWN_PROB = 5e-5
ACCEPTED = Style(color="#2ca02c", bold=True)
REJECTED = Style(color="#d62728", bold=True)
GRAMMAR_STYLE = Style(color="#17becf", bold=True)


class SamplerPanel(Panel):
    TITLE = "Sampler"

    def update_titles(self, ctx: StepContext) -> None:
        self.border_title = f"Sampler · {ctx.follow}" if ctx.follow else "Sampler"

    def render_step(self, ctx: StepContext, width: int) -> RenderableType:
        return render_sampler(ctx, width)


def followed_sample(ctx: StepContext) -> SamplerSampled | None:
    return next((e for e in ctx.view.sampler if e.request_id == ctx.follow), None)


def _token(ctx: StepContext, token_id: int, limit: int = TOKEN_COLUMN) -> str:
    text = ctx.session.token_text(token_id)
    label = repr(visible_whitespace(text)) if text is not None else f"#{token_id}"
    return label if len(label) <= limit else label[: limit - 1] + "…"


def why_not_sampled(ctx: StepContext) -> str:
    rid = ctx.follow
    tl = ctx.session.timelines[rid]
    phase = tl.phase_at(ctx.step)
    slot = next((s for s in ctx.view.batch if s.request_id == rid), None)
    if slot is not None and not slot.sampled:
        return (
            f"{rid} ran a prefill chunk (tokens {slot.num_computed_tokens}-{slot.seq_len - 1}) "
            "that stops short of the prompt's end: its sampled token is dropped."
        )
    if phase == NOT_ARRIVED:
        return f"{rid} has not arrived yet (queued at step {tl.queued_step})."
    if phase == GRAMMAR:
        return f"{rid} {_grammar_wait_text(ctx)}"
    if phase == FINISHED:
        return f"{rid} finished at step {tl.finished_step}; nothing more is sampled."
    if phase == WAITING:
        return f"{rid} is waiting in the queue: it is not in this step's batch."
    if phase == PREEMPTED:
        return f"{rid} was preempted at this step: its KV blocks are freed, nothing is sampled."
    if phase == STALLED:
        return f"{rid} is running but got no tokens this step (the budget was spent)."
    if not ctx.view.sampler:
        return "The trace holds no sampler events for this step."
    return f"No sample for {rid} at this step."


def followed_grammar(ctx: StepContext) -> StructuredOutputRow | None:
    """The followed request's structured-output row at this step (None: it
    is not constrained, or the run has no structured outputs)."""
    so = ctx.view.structured_output
    return so.requests.get(ctx.follow) if so is not None and ctx.follow else None


def _grammar_wait_text(ctx: StepContext) -> str:
    """Why a request waiting for its grammar is not sampled, and how its compile went."""
    row = followed_grammar(ctx)
    kind = f"{row.grammar_kind} " if row is not None else ""
    text = (
        f"is waiting for its {kind}grammar to compile: it is queued in skipped_waiting "
        "(WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR), not in this step's batch."
    )
    if row is not None and row.compile_s is not None:
        if row.compile_error:
            text += f" The compile failed: {row.compile_error}."
        else:
            hit = "a cache hit" if row.cache_hit else "not cached"
            text += (
                f" It compiled in {row.compile_s * 1e3:.1f} ms ({hit}) at step "
                f"{row.compiled_step}; the next schedule() finds it ready."
            )
    return text


def _candidate(ctx: StepContext, token_id: int) -> str:
    """A token with its id: ``'text' #id``, or ``#id`` without token texts."""
    text = ctx.session.token_text(token_id)
    if text is None:
        return f"#{token_id}"
    return f"{_token(ctx, token_id)} #{token_id}"


def grammar_lines(ctx: StepContext) -> list[RenderableType]:
    """Structured outputs: what the followed request's grammar mask did this
    step -- tokens allowed and, at ``full``, the model's favourites it
    removed; [] when the step masked nothing for it."""
    row = followed_grammar(ctx)
    if row is None or not row.masked:
        return []
    assert row.num_allowed is not None
    head = Text()
    head.append(f"grammar {row.grammar_kind}: ", style=GRAMMAR_STYLE)
    head.append(f"{row.num_allowed:,}", style=Style(bold=True))
    if row.vocab_size:
        share = row.num_allowed / row.vocab_size
        head.append(f" of {row.vocab_size:,} tokens allowed", style=DIM)
        if row.num_allowed < row.vocab_size:
            head.append(f" ({share:.2%})" if share >= 0.0001 else " (<0.01%)", style=DIM)
        else:
            head.append(" (none masked)", style=DIM)
    else:
        head.append(" tokens allowed", style=DIM)
    if row.num_rows > 1:
        head.append(f" · {row.num_rows} rows: one per draft and the bonus", style=DIM)
    lines: list[RenderableType] = [head]
    mask = row.mask
    if mask is None:
        lines.append(
            Text("What the mask removed needs a full trace (--trace-level full).", style=DIM)
        )
    else:
        top = Text()
        top.append("model's top ", style=DIM)
        top.append(_candidate(ctx, mask.top_token_id_before), style=Style(bold=True))
        if mask.changed_top:
            top.append(" ✗ masked", style=REJECTED)
            top.append(" → top allowed ", style=DIM)
            top.append(_candidate(ctx, mask.top_token_id_after), style=Style(bold=True))
        else:
            top.append(" ✓ allowed: the mask kept it on top", style=DIM)
        lines.append(top)
        if mask.masked_top_token_ids:
            removed = Text()
            removed.append("masked away of its top 5: ", style=DIM)
            for i, t in enumerate(mask.masked_top_token_ids):
                if i:
                    removed.append(", ", style=DIM)
                removed.append(_candidate(ctx, t), style=REJECTED)
            lines.append(removed)
        lines.append(
            Text("the logprob and the stages below come from the masked logits", style=DIM)
        )
    if row.terminated:
        lines.append(Text("the grammar is complete after this step's token", style=DIM))
    return lines


def stage_table(ctx: StepContext, sample: SamplerSampled, width: int) -> Table:
    stages = sample.stages or []
    # Columns that fit: always the first and the last stage, then the others.
    col = 7
    fit = max(2, (width - TOKEN_COLUMN - 1) // col)
    chosen = list(range(len(stages)))
    if len(chosen) > fit:
        chosen = [0] + chosen[1:-1][: fit - 2] + [len(stages) - 1]
    shown = [stages[i] for i in chosen]
    # Candidates a stage masked out (probability 0) are not candidates.
    probs = [{t: p for t, p in zip(s.token_ids, s.probs) if p >= MIN_SHOWN_PROB} for s in shown]
    # Rows: the last stage's candidates first (what the draw saw), then any
    # other stage's candidates not yet listed.
    order: list[int] = []
    for p in [probs[-1]] + probs[:-1]:
        for t in p:
            if t not in order:
                order.append(t)
    order = order[:7]
    table = Table(box=None, padding=(0, 1), show_edge=False, header_style=DIM)
    table.add_column("token", no_wrap=True, min_width=6, max_width=TOKEN_COLUMN)
    for s in shown:
        table.add_column(STAGE_LABELS.get(s.stage, s.stage), justify="right", no_wrap=True)
    for t in order:
        is_chosen = t == sample.token_id
        cells = [Text(_token(ctx, t), style=Style(bold=is_chosen, underline=is_chosen))]
        for p in probs:
            if t in p:
                cells.append(Text(format_prob(p[t]), style=Style(bold=is_chosen)))
            else:
                cells.append(Text("·", style=DIM))
        if is_chosen:
            cells[0].append(" ✓", style=Style(color="#2ca02c", bold=True))
        table.add_row(*cells)
    return table


def format_prob(p: float) -> str:
    return f"{p:.3f}" if p >= 0.001 else f"{p:.0e}"


def output_text(ctx: StepContext) -> Text:
    """The output so far, alternating two colours per token; this step's
    tokens bold and underlined."""
    rid = ctx.follow
    tl = ctx.session.timelines[rid]
    pieces = ctx.session.output_pieces(rid, ctx.step)
    new_here = len(ctx.view.new_token_ids.get(rid, []))
    out = Text()
    n = len(tl.output_ids_until(ctx.step))
    out.append(f"output ({n} token{'' if n == 1 else 's'}): ", style=DIM)
    if not pieces:
        out.append("nothing yet", style=DIM)
        return out
    colour = tl.colour
    for i, piece in enumerate(pieces):
        newest = i >= len(pieces) - new_here
        style = Style(color=colour if i % 2 == 0 else None, bold=newest, underline=newest)
        out.append(visible_whitespace(piece), style=style)
    return out


def render_sampler(ctx: StepContext, width: int) -> RenderableType:
    if ctx.follow is None:
        return Text("No request to follow.", style=DIM)
    tl = ctx.session.timelines[ctx.follow]
    parts: list[RenderableType] = []
    sample = followed_sample(ctx)
    verdict = draft_verdict(ctx, width)
    grammar = grammar_lines(ctx)
    if sample is None:
        parts.append(Text(why_not_sampled(ctx), style=DIM))
        parts.extend(grammar)
        parts.extend(verdict)
    else:
        head = Text()
        head.append("chose ", style=DIM)
        head.append(_token(ctx, sample.token_id, 24), style=Style(bold=True, underline=True))
        if ctx.session.token_text(sample.token_id) is not None:
            head.append(f" (id {sample.token_id})", style=DIM)
        head.append(f" · logprob {sample.logprob:.3f}", style=DIM)
        if sample.rank is not None:
            head.append(f" · rank {sample.rank}", style=DIM)
        if sample.rank_before_mask is not None:
            head.append(f" (rank {sample.rank_before_mask} before the grammar mask)", style=DIM)
        parts.append(head)
        parts.append(Text(_params_text(tl.sampling_params, sample), style=DIM))
        parts.extend(grammar)
        if verdict:
            parts.extend(verdict)
            parts.append(
                Text(
                    "with drafts, the sampler draws at the bonus position (after the last "
                    "draft): its pick above is kept only when every draft is accepted",
                    style=DIM,
                )
            )
        if sample.stages:
            parts.append(stage_table(ctx, sample, width))
        else:
            parts.append(
                Text("Per-stage candidates need a full trace (--trace-level full).", style=DIM)
            )
    next_drafts = proposed_drafts(ctx)
    if next_drafts is not None:
        parts.append(next_drafts)
    parts.append(output_text(ctx))
    return Group(*parts)


def draft_verdict(ctx: StepContext, width: int) -> list[RenderableType]:
    """Speculative decoding: the draft row of the followed request -- the
    drafts this step verified and their fate -- and the verdict in words;
    [] when it verified none (always, in a run without speculation)."""
    spec = ctx.view.spec
    verdict = spec.verified.get(ctx.follow) if spec is not None and ctx.follow else None
    if verdict is None:
        return []
    return [_draft_table(ctx, verdict, width), _verdict_text(ctx, verdict)]


def proposed_drafts(ctx: StepContext) -> Text | None:
    """The drafts the proposer made for the followed request after this step."""
    spec = ctx.view.spec
    proposed = spec.proposed.get(ctx.follow) if spec is not None and ctx.follow else None
    if not proposed:
        return None
    line = Text()
    method = f" ({spec.method})" if spec.method else ""
    line.append(f"next drafts{method}: ", style=DIM)
    line.append(" ".join(_token(ctx, t) for t in proposed))
    req = ctx.view.state.requests.get(ctx.follow)
    if req is not None and req.is_finished:
        line.append(" — dropped: the request finished", style=DIM)
    else:
        line.append(" — for the next step to verify", style=DIM)
    return line


def _draft_table(ctx: StepContext, verdict: SpecDecodeRow, width: int) -> Table:
    """Three rows, one column per draft (and one for a bonus token): the
    drafts, the verdict on each, and the target's tokens (the accepted
    drafts, then its own: recovered or bonus)."""
    drafts = verdict.draft_token_ids
    n_acc = verdict.num_accepted
    cols = len(drafts) + (1 if verdict.all_accepted else 0)
    cell = max(4, min(TOKEN_COLUMN, (width - 8) // max(cols, 1) - 1))
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True, style=DIM)
    for _ in range(cols):
        table.add_column(no_wrap=True, max_width=cell)
    draft_cells: list[Text] = []
    fate_cells: list[Text] = []
    target_cells: list[Text] = []
    for i, t in enumerate(drafts):
        draft_cells.append(Text(_token(ctx, t, cell)))
        if i < n_acc:
            fate_cells.append(Text("✓", style=ACCEPTED))
            target_cells.append(Text(_token(ctx, t, cell)))
        elif i == n_acc:
            fate_cells.append(Text("✗", style=REJECTED))
            own = verdict.token_ids[-1]
            target_cells.append(
                Text(_token(ctx, own, cell), style=Style(bold=True, underline=True))
            )
        else:
            fate_cells.append(Text("✗", style=REJECTED))
            target_cells.append(Text("·", style=DIM))
    if verdict.all_accepted:
        draft_cells.append(Text("", style=DIM))
        fate_cells.append(Text("bonus", style=DIM))
        bonus = verdict.bonus_token_id
        target_cells.append(
            Text(
                _token(ctx, bonus, cell) if bonus is not None else "·",
                style=Style(bold=True, underline=True),
            )
        )
    table.add_row("drafts", *draft_cells)
    table.add_row("verdict", *fate_cells)
    table.add_row("target", *target_cells)
    return table


def _verdict_text(ctx: StepContext, verdict: SpecDecodeRow) -> Text:
    """The verdict in words, with the cursor's rollback."""
    n, acc = len(verdict.draft_token_ids), verdict.num_accepted
    out = Text()
    if verdict.all_accepted:
        out.append(f"all {n} drafts accepted", style=ACCEPTED)
        if verdict.bonus_token_id is not None:
            out.append(f", plus the bonus token {_token(ctx, verdict.bonus_token_id)}")
    else:
        out.append(f"{acc} of {n} drafts accepted", style=ACCEPTED if acc else DIM)
        out.append("; ")
        out.append(f"{verdict.num_rejected} rejected", style=REJECTED)
        recovered = verdict.recovered_token_id
        if recovered is not None:
            first = verdict.rejected_token_ids[0]
            out.append(f": the target's {_token(ctx, recovered)} replaces {_token(ctx, first)}")
        before, after = verdict.num_computed_tokens_scheduled, verdict.num_computed_tokens
        out.append(f"; cursor rolled back {before} → {after}", style=DIM)
    made = len(verdict.token_ids)
    out.append(f" · {made} token{'s' if made != 1 else ''} from one step", style=DIM)
    kept = len(verdict.new_token_ids)
    if kept < made:
        out.append(f" ({kept} kept: the request ended)", style=DIM)
    return out


def _params_text(params: SamplingParamsSummary | None, sample: SamplerSampled) -> str:
    if sample.greedy:
        return "greedy: the argmax after logits processors"
    bits = []
    if params is not None:
        bits.append(f"T={params.temperature}")
        if params.top_k not in (0, -1):
            bits.append(f"top_k={params.top_k}")
        if params.top_p != 1.0:
            bits.append(f"top_p={params.top_p}")
        if params.min_p:
            bits.append(f"min_p={params.min_p}")
    return "random draw" + (" with " + " ".join(bits) if bits else "")

"""The trace objects of the worker: the model runner and the sampler.

vLLM twin: none (the injected-collector pattern of vLLM's
``KVCacheMetricsCollector``). ``GPUModelRunner`` holds a ``RunnerTrace`` and
hands its ``sampler`` (a ``SamplerTrace``) to the ``Sampler``. Read it for
how a trace reads tensors without slowing the step: nothing here waits for
the device. Values are computed on the device beside the step and queued to
the host (``HostListsCopy``); they are read after the runner's own
``.tolist()`` of the sampled tokens has waited anyway. The forward is timed
with a pair of CUDA events for the same reason.

Imported only by the runner and the sampler (it needs torch; the rest of
``engine.tracing`` does not). Sessions: 04 (worker), 05 (sampling).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.tracing.events import (
    GrammarMasked,
    LoRASlots,
    RunnerBatch,
    RunnerCompiled,
    RunnerCudagraphs,
    RunnerForward,
    RunnerInit,
    RunnerInputs,
    RunnerPromptLogprobs,
    SamplerSampled,
    SamplerStage,
    SpecProposed,
    WorkerRpcDone,
    WorkerRpcReceived,
)
from engine.tracing.tensors import HostListsCopy, array_summaries
from engine.tracing.tracer import SubsystemTrace, Tracer

# Rows with temperature below this are greedy (the sampler's constant).
_SAMPLING_EPS = 1e-5
# The integer dtypes of the runner's input buffers, as numpy names them.
_NUMPY_DTYPES = {torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64)}


def _quantization_fields(runner: Any) -> dict[str, Any]:
    """``runner.init``'s quantization, quant method per layer class and weight bytes."""
    methods: dict[str, str] = {}
    for module in runner.model.modules():
        if (method := getattr(module, "quant_method", None)) is not None:
            methods.setdefault(type(module).__name__, type(method).__name__)
    return {
        "quantization": runner.model_config.quantization or "",
        "quant_methods": methods,
        "weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
    }


@dataclass
class _PendingSampled:
    """``sampler.sampled`` values of one call, queued to the host."""

    req_ids: list[str]  # of the traced rows
    rows: list[int]  # their rows in the batch
    tokens: torch.Tensor  # their sampled tokens (read only if the caller has none)
    greedy: list[bool] | None  # known on the host; None: the last of ``values``
    # chosen logprobs [R] (+ full: ranks [R], stage probs and ids [stages, R, C])
    # (+ greedy flags [R] when ``greedy`` is None)
    values: HostListsCopy
    stage_names: list[str]
    # full, structured outputs: ranks before the grammar mask [R] follow the stages
    has_rank_before_mask: bool = False


class SamplerTrace(SubsystemTrace):
    """``Sampler``: the chosen token of every traced row and, at ``full``, the
    top candidates after each stage that ran. Stage snapshots are computed on
    the side and never feed back into sampling."""

    NUM_CANDIDATES = 5

    def __init__(self, tracer: Tracer) -> None:
        super().__init__(tracer)
        self._req_ids: Sequence[str | None] = ()  # per batch row; None: not traced
        self._rows: list[int] = []
        self._index: torch.Tensor | None = None  # the traced rows on the device; None: all
        self._row_logprobs: torch.Tensor | None = None  # raw logprobs of the traced rows
        self._stages: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        # Step -> its queued values; with async scheduling two steps are in flight.
        self._pending: dict[int | None, _PendingSampled] = {}
        # Pinned host buffers for the copies (HostListsCopy's staging): one set
        # per step parity, reused every other step, so the copy of the step
        # still in flight is never overwritten.
        self._staging: tuple[dict[torch.dtype, torch.Tensor], ...] = ({}, {})
        # Structured outputs at full: batch row -> its row in the logits as they
        # were before the grammar mask (set by RunnerTrace.grammar_masked).
        self._before_mask: tuple[dict[int, int], torch.Tensor] | None = None

    @property
    def reads_filtered_logits(self) -> bool:
        """``full`` reads the top-k/top-p filtered logits back, which only the
        torch path leaves behind (FlashInfer filters inside its kernel)."""
        return self.full

    def begin(self, req_ids: Sequence[str | None]) -> None:
        """The request id of each row of the next call (None: not traced)."""
        self._req_ids = req_ids
        self._rows = [i for i, rid in enumerate(req_ids) if rid is not None]
        self._before_mask = None  # RunnerTrace.grammar_masked sets it for this call

    def raw(self, logits: torch.Tensor, raw_logprobs: torch.Tensor | None) -> None:
        """The model's distribution: logits [N, V] (float32), the sampler's raw
        logprobs if it computed them."""
        self._stages = []
        if not self._rows:
            return
        subset = len(self._rows) < len(self._req_ids)
        self._index = (
            torch.tensor(self._rows, dtype=torch.long, device=logits.device) if subset else None
        )
        if raw_logprobs is not None:
            self._row_logprobs = self._select(raw_logprobs)
        else:
            self._row_logprobs = self._select(logits).log_softmax(dim=-1, dtype=torch.float32)
        if self.full:
            self._snapshot("raw", logits)

    def processed(self, logits: torch.Tensor, sampling_metadata: Any) -> None:
        """After masks, bad words, min-tokens, logit bias and penalties. Nothing
        of that ran: the candidates are the raw ones (no kernels spent)."""
        if not (self.full and self._rows):
            return
        if _edits_logits(sampling_metadata):
            self._snapshot("processed", logits)
        else:
            _, top_probs, top_ids = self._stages[-1]
            self._stages.append(("processed", top_probs, top_ids))

    def temperature(self, logits: torch.Tensor) -> None:
        if self.full and self._rows:
            self._snapshot("temperature", logits)

    def min_p(self, logits: torch.Tensor, sampling_metadata: Any) -> None:
        """Only when an argmax-invariant processor (min-p) acts on some row."""
        if self.full and self._rows and _any_active(sampling_metadata.logitsprocs.argmax_invariant):
            self._snapshot("min_p", logits)

    def top_k_top_p(self, logits: torch.Tensor, sampling_metadata: Any) -> None:
        """Only when a row asks for top-k or top-p; ``logits`` were filtered in
        place by the torch path (``reads_filtered_logits``)."""
        md = sampling_metadata
        if self.full and self._rows and (md.top_k is not None or md.top_p is not None):
            self._snapshot("top_k_top_p", logits)

    def sampled(self, sampled: torch.Tensor, sampling_metadata: Any) -> None:
        """Queue what the ``sampler.sampled`` events need to the host without
        waiting; ``emit`` reads it once the runner has the tokens on the host.
        At ``lifecycle`` the device work is one gather; the greedy flags come
        from the host (``temperature_cpu``, or a batch all greedy or all random)."""
        rows = self._rows
        if not rows:
            return
        tokens = self._select(sampled)
        assert self._row_logprobs is not None
        chosen = self._row_logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        values = [chosen]
        stage_names: list[str] = []
        if self.full:
            values.append((self._row_logprobs >= chosen.unsqueeze(-1)).sum(dim=-1))
            stage_names = [name for name, _, _ in self._stages]
            # Two tensors [stages, R, C] instead of two per stage: fewer pieces to copy.
            values.append(torch.stack([probs for _, probs, _ in self._stages]))
            values.append(torch.stack([ids for _, _, ids in self._stages]))
        before_mask = self._rank_before_mask(rows, tokens) if self.full else None
        if before_mask is not None:
            values.append(before_mask)
        md = sampling_metadata
        greedy: list[bool] | None = None
        if md.temperature_cpu is not None:
            greedy = (md.temperature_cpu[rows] < _SAMPLING_EPS).tolist()
        elif md.all_greedy or md.all_random:
            greedy = [md.all_greedy] * len(rows)
        else:
            values.append(self._select(md.temperature) < _SAMPLING_EPS)
        self._stages, self._row_logprobs = [], None
        step = self.tracer.step
        self._pending[step] = _PendingSampled(
            req_ids=[self._req_ids[r] for r in rows],  # type: ignore[misc]
            rows=rows,
            tokens=tokens,
            greedy=greedy,
            values=HostListsCopy(*values, staging=self._staging[(step or 0) % 2]),
            stage_names=stage_names,
            has_rank_before_mask=before_mask is not None,
        )

    def _rank_before_mask(self, rows: list[int], tokens: torch.Tensor) -> torch.Tensor | None:
        """1 + tokens at least as likely as the chosen one before the grammar
        mask, per traced row (-1: the row was not masked)."""
        where_raw, self._before_mask = self._before_mask, None
        if where_raw is None:
            return None
        where, raw = where_raw
        pos = [where.get(r, -1) for r in rows]
        sel = [i for i, p in enumerate(pos) if p >= 0]
        ranks = torch.full((len(rows),), -1, dtype=torch.long, device=tokens.device)
        if sel:
            pre = raw[[pos[i] for i in sel]]
            chosen = pre.gather(1, tokens[sel].unsqueeze(-1))
            ranks[sel] = (pre >= chosen).sum(dim=-1)
        return ranks

    def emit(self, step: int | None = None, sampled_token_ids: Sequence[int] | None = None) -> None:
        """Record the ``sampler.sampled`` events of ``step``'s call (one
        ``record_rows``). ``sampled_token_ids``: the caller's host copy of the
        sampled tokens, one per batch row (the device has then been waited
        for); without it they are copied here."""
        pending = self._pending.pop(step, None)
        if pending is None:
            return
        if sampled_token_ids is None:
            tokens = pending.tokens.tolist()  # waits for the device
        else:
            tokens = [sampled_token_ids[r] for r in pending.rows]
        host = pending.values.lists(synchronized=True)
        greedy = host.pop() if pending.greedy is None else pending.greedy
        columns: dict[str, list[Any]] = {
            "request_id": pending.req_ids,
            "row": pending.rows,
            "token_id": tokens,
            "logprob": host[0],
            "greedy": greedy,
        }
        if len(host) > 1:  # full: the rank and the top candidates of every stage
            columns["rank"] = host[1]
            stage_probs, stage_ids = host[2], host[3]  # [stages][R][C] twice
            columns["stages"] = [
                [
                    SamplerStage(stage=name, token_ids=stage_ids[i][j], probs=stage_probs[i][j])
                    for i, name in enumerate(pending.stage_names)
                ]
                for j in range(len(pending.rows))
            ]
            if pending.has_rank_before_mask:
                columns["rank_before_mask"] = [None if x < 0 else x for x in host[4]]
        self.tracer.record_rows(SamplerSampled, columns)

    def _select(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._index is None else t.index_select(0, self._index)

    def _snapshot(self, stage: str, logits: torch.Tensor) -> None:
        """Keep the top candidates of the traced rows as ``stage`` left them
        (on the device: ``sampled`` queues one copy of them all)."""
        probs = self._select(logits).softmax(dim=-1, dtype=torch.float32)
        top_probs, top_ids = probs.topk(min(self.NUM_CANDIDATES, probs.shape[-1]), dim=-1)
        self._stages.append((stage, top_probs, top_ids))


def _edits_logits(md: Any) -> bool:
    """Whether ``Sampler.apply_logits_processors`` changes anything for this
    batch (``SamplingMetadata``): the conditions under which it applies each
    of its stages."""
    return (
        md.allowed_token_ids_mask is not None
        or bool(md.bad_words_token_ids)
        or _any_active(md.logitsprocs.non_argmax_invariant)
        or not md.no_penalties
    )


def _any_active(processors: Sequence[Any]) -> bool:
    """Whether any of these logits processors changes the logits this step
    (the engine keeps every processor; most steps most of them do nothing)."""
    return any(p.is_active() for p in processors)


@dataclass
class _PendingForward:
    """A traced forward whose duration is read after the step's sync (CUDA only)."""

    step: int
    start_ts: int  # wall clock (time.time_ns) at launch
    events: tuple[torch.cuda.Event, torch.cuda.Event]  # start, end
    num_tokens: int
    num_logits: int


class RunnerTrace(SubsystemTrace):
    """``GPUModelRunner``: its set-up, each step's batch and forward; ``sampler``
    is the trace its ``Sampler`` gets."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__(tracer)
        self.sampler = SamplerTrace.create(tracer)
        self._start: tuple[int, int] = (0, 0)  # (wall ns, perf-counter ns) at launch
        # Pairs of CUDA events, reused once read (one per step in flight: two
        # with async scheduling), and the stream the forward runs on, looked
        # up once: record() without it asks torch.cuda.current_stream(), which
        # costs more host time than the record.
        self._free_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._pending_forward: dict[int, _PendingForward] = {}
        # Speculative decoding: the proposer's method (read at set-up), "" without one.
        self._spec_method = ""
        # Structured outputs at level full: (request id, logits row) of each
        # constrained request, and their 5 best raw candidates [rows, 5] (device).
        self._grammar_rows: list[tuple[str, int]] = []
        self._grammar_top: torch.Tensor | None = None
        # The step whose forward ran last: the one the next sampling is for.
        self._step: int | None = None
        # LoRA: the adapter id per device slot at the last lora.slots event.
        self._lora_slots: list[int] = []

    def initialized(self, runner: Any, kv_cache_config: Any) -> None:
        """``runner.init``, once the KV cache is allocated (and the method of
        the runner's speculative config, for ``spec.proposed``)."""
        speculative_config = getattr(runner, "speculative_config", None)
        self._spec_method = getattr(speculative_config, "method", None) or ""
        self.tracer.record(
            RunnerInit(
                model=runner.model_config.model,
                architecture=type(runner.model).__name__,
                dtype=str(runner.dtype).removeprefix("torch."),
                device=str(runner.device),
                attn_backend=runner.attn_backend.get_name(),
                num_layers=len(runner.kv_caches),
                num_blocks=kv_cache_config.num_blocks,
                block_size=runner.block_size,
                kv_cache_shape=list(runner.kv_caches[0].shape) if runner.kv_caches else [],
                **_quantization_fields(runner),
            )
        )

    def lora_slots(self, lora_manager: Any, req_ids: list[str], row_lora_ids: Any) -> None:
        """``lora.slots`` when the step loaded, evicted or moved an adapter."""
        manager = lora_manager.adapter_manager
        slots = [lora_id or 0 for lora_id in manager.lora_index_to_id]
        changed = lora_manager.loaded or manager.evicted_from_slots or manager.evicted_from_cpu
        if not changed and slots == self._lora_slots:
            return
        self._lora_slots = slots
        slot_of = {lora_id: i for i, lora_id in enumerate(slots) if lora_id}
        self.tracer.record(
            LoRASlots(
                slots=slots,
                loaded=list(lora_manager.loaded),
                evicted_from_slots=list(manager.evicted_from_slots),
                evicted_from_cpu=list(manager.evicted_from_cpu),
                token_slots={
                    r: slot_of.get(int(i), -1) for r, i in zip(req_ids, row_lora_ids, strict=True)
                },
            )
        )

    def prompt_logprobs(
        self, req_id: str, first_position: int, num_positions: int, k: int, done: bool
    ) -> None:
        """``runner.prompt_logprobs``: one request's prompt positions this step."""
        self.tracer.record(
            RunnerPromptLogprobs(
                request_id=req_id,
                first_position=first_position,
                num_positions=num_positions,
                num_logprobs=k,
                done=done,
            )
        )

    def model_compiled(self, model: Any, compilation_config: Any, seconds: float) -> None:
        """``runner.compiled``: the split-and-compile backend's figures, read
        from the compiled module (``support_torch_compile`` sets ``compile_backend``)."""
        backend = next(
            (b for m in model.modules() if (b := getattr(m, "compile_backend", None)) is not None),
            None,
        )
        pieces = getattr(backend, "piecewise_graphs", [])
        compiler = getattr(backend, "compiler", None)
        size_seconds: dict[str, float] = {}
        for piece in getattr(backend, "piecewise_backends", []):
            for size, seconds_ in piece.compile_seconds.items():
                size_seconds[str(size)] = size_seconds.get(str(size), 0.0) + seconds_
        self.tracer.record(
            RunnerCompiled(
                mode=compilation_config.mode.name,
                backend=compilation_config.backend,
                num_pieces=sum(not p.is_splitting_graph for p in pieces),
                num_splits=sum(p.is_splitting_graph for p in pieces),
                compile_sizes=list(compilation_config.compile_sizes or []),
                inductor_compiles=getattr(compiler, "num_compiles", 0),
                cache_hits=getattr(compiler, "num_cache_hits", 0),
                backend_seconds=getattr(backend, "compile_seconds", 0.0),
                size_seconds=size_seconds,
                seconds=seconds,
                cache_dir=getattr(backend, "cache_dir", ""),
                inductor_options={
                    name: value
                    if isinstance(value, (bool, int, float, str, type(None)))
                    else repr(value)
                    for name, value in compilation_config.inductor_compile_config.items()
                },
            )
        )

    def cudagraphs_captured(
        self, mode: str, sizes: list[int], seconds: float, memory_bytes: int
    ) -> None:
        self.tracer.record(
            RunnerCudagraphs(mode=mode, sizes=sizes, seconds=seconds, memory_bytes=memory_bytes)
        )

    def step_started(self, step: int) -> None:
        """Worker and sampler events belong to the scheduler's step (needed
        when the worker runs in a process of its own)."""
        self._step = step
        self.tracer.set_step(step)

    def forward_started(self, device: torch.device) -> None:
        self._start = (time.time_ns(), time.perf_counter_ns())
        if device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.current_stream(device)
            self._events = (
                self._free_events.pop()
                if self._free_events
                else (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
            )
            self._events[0].record(self._stream)

    def forward_done(self, step: int, num_tokens: int, logits: torch.Tensor) -> None:
        """``runner.forward``: the model call plus ``compute_logits``. On CPU
        the host clock is the device clock: record now. On CUDA the launches
        returned before the GPU finished, so the end is an event read by
        ``sampled`` after the runner's sync (a synchronize here would stop
        the host from preparing sampling while the GPU works)."""
        start_ts, start_perf_ns = self._start
        if not logits.is_cuda:
            self.tracer.record(
                RunnerForward(
                    step=step,
                    start_ts=start_ts,
                    duration_ns=time.perf_counter_ns() - start_perf_ns,
                    num_tokens=num_tokens,
                    num_logits=int(logits.shape[0]),
                )
            )
            return
        assert self._events is not None
        self._events[1].record(self._stream)
        self._pending_forward[step] = _PendingForward(
            step, start_ts, self._events, num_tokens, int(logits.shape[0])
        )

    def batch(self, runner: Any, scheduler_output: Any, inputs: Any) -> None:
        """``runner.batch`` (and at ``full`` ``runner.inputs``): how the step's
        tokens were laid out. ``inputs`` is the runner's ``PreparedInputs``."""
        common = inputs.common_attn_metadata
        block_size = runner.block_size
        req_ids = list(runner.input_batch.req_ids)
        query_start_loc = common.query_start_loc_cpu.tolist()
        query_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(req_ids))]
        seq_lens = common.seq_lens_cpu.tolist()
        block_table = runner.input_batch.block_table.block_table_np
        # Per row, runs of consecutive slots: [block id, first offset in it, count].
        if common.max_query_len == 1:
            # Decode (the common step): one slot per row, looked up in one go.
            positions = common.seq_lens_cpu.numpy().astype(np.int64) - 1
            blocks = block_table[np.arange(len(seq_lens)), positions // block_size].tolist()
            slots = [[[b, o, 1]] for b, o in zip(blocks, (positions % block_size).tolist())]
        else:
            slots = []
            for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
                runs = []
                pos, end = seq_len - query_len, seq_len
                while pos < end:
                    block_index, offset = divmod(pos, block_size)
                    n = min(block_size - offset, end - pos)
                    runs.append([int(block_table[row, block_index]), offset, n])
                    pos += n
                slots.append(runs)
        self.tracer.record(
            RunnerBatch(
                step=scheduler_output.step,
                num_reqs=len(req_ids),
                num_tokens=inputs.num_tokens,
                num_tokens_padded=inputs.batch_descriptor.num_tokens,
                attn_backend=runner.attn_backend.get_name(),
                cudagraph_mode=inputs.cudagraph_mode.name,
                req_ids=req_ids,
                query_lens=query_lens,
                num_computed_tokens=[s - q for s, q in zip(seq_lens, query_lens)],
                seq_lens=seq_lens,
                slot_mapping=slots,
                discard_req_ids=[req_ids[i] for i in inputs.discard_rows],
                max_query_len=common.max_query_len,
                max_seq_len=common.max_seq_len,
            )
        )
        if not self.full:
            return
        # From the host arrays the device buffers were filled from (same
        # values, in the device buffers' dtypes): no device work.
        n = inputs.num_tokens
        self.tracer.record(
            RunnerInputs(
                step=scheduler_output.step,
                **array_summaries(
                    input_ids=_as_dtype(inputs.input_ids_np[:n], runner.input_ids),
                    positions=_as_dtype(inputs.positions_np[:n], runner.positions),
                    query_start_loc=common.query_start_loc_cpu.numpy(),
                    seq_lens=common.seq_lens_cpu.numpy(),
                    slot_mapping=_as_dtype(
                        inputs.slot_mapping_np[: common.num_actual_tokens], runner.slot_mapping
                    ),
                    block_table=block_table[: common.num_reqs],
                    logits_indices=inputs.logits_indices_np,
                ),
            )
        )

    def sampling(self, req_ids: Sequence[str], discard_rows: Sequence[int]) -> None:
        """The rows about to be sampled; prefill-chunk rows (discarded) are not
        traced. The sampling is the last forward's: with async scheduling and
        structured outputs it can come after the previous step's update
        (which set the in-process tracer back to that step), so its events
        (``so.masked``, ``sampler.sampled``) get their step here."""
        if self._step is not None:
            self.tracer.set_step(self._step)
        discard = set(discard_rows)
        self.sampler.begin([None if i in discard else r for i, r in enumerate(req_ids)])

    def grammar_mask_started(
        self, logits: torch.Tensor, req_ids: Sequence[str], grammar_output: Any, num_drafts: Any
    ) -> None:
        """Trace level ``full``, before ``apply_grammar_bitmask``: note each
        constrained request's first logits row and its 5 best raw candidates
        (on the device: queued before the mask, so they are the raw ones)."""
        self._grammar_rows = []
        self._grammar_top = None
        if not self.full:
            return
        first_row, row = {}, 0
        for req_id in req_ids:
            first_row[req_id] = row
            row += 1 + num_drafts.get(req_id, 0)
        for req_id in grammar_output.structured_output_request_ids:
            if (r := first_row.get(req_id)) is not None:
                self._grammar_rows.append((req_id, r))
        if self._grammar_rows:
            index = torch.tensor([r for _, r in self._grammar_rows], device=logits.device)
            k = min(5, logits.shape[-1])
            raw = logits.index_select(0, index).float()  # a copy: the mask leaves it be
            self._grammar_top = raw.topk(k, dim=-1).indices
            if not num_drafts:  # one logits row per batch row: the sampler's rows
                where = {r: i for i, (_, r) in enumerate(self._grammar_rows)}
                self.sampler._before_mask = (where, raw)

    def grammar_masked(self, logits: torch.Tensor) -> None:
        """``so.masked`` per row noted by ``grammar_mask_started``: what is
        left allowed (a finite logit), read back in one copy."""
        rows, top = self._grammar_rows, self._grammar_top
        self._grammar_rows, self._grammar_top = [], None
        if not rows or top is None:
            return
        index = torch.tensor([r for _, r in rows], device=logits.device)
        masked = logits.index_select(0, index).float()
        allowed = torch.isfinite(masked)
        values = torch.cat(
            [
                allowed.sum(dim=-1, keepdim=True),
                masked.argmax(dim=-1, keepdim=True),
                top,
                allowed.gather(1, top).long(),
            ],
            dim=1,
        ).tolist()
        k = top.shape[1]
        for (req_id, _), v in zip(rows, values):
            top_ids, kept = v[2 : 2 + k], v[2 + k :]
            self.tracer.record(
                GrammarMasked(
                    request_id=req_id,
                    num_allowed=v[0],
                    masked_top_token_ids=[t for t, ok in zip(top_ids, kept) if not ok],
                    top_token_id_before=top_ids[0],
                    top_token_id_after=v[1],
                )
            )

    def drafts_proposed(
        self,
        req_ids: Sequence[str],
        draft_token_ids: Sequence[Any] | Any,
        rows: Sequence[int] | None = None,
    ) -> None:
        """``spec.proposed``: the drafter's proposals after this step, one
        list per row (``[]``: none; those rows get no event). The next step
        verifies them. Under async scheduling ``draft_token_ids`` is a device
        tensor [num_reqs, k] and ``rows`` says which rows drafted: reading it
        here waits for the drafter (only when tracing)."""
        if hasattr(draft_token_ids, "tolist"):
            draft_token_ids = draft_token_ids.tolist()
        if rows is None:
            rows = [i for i, drafts in enumerate(draft_token_ids) if len(drafts)]
        if not rows:
            return
        self.tracer.record_rows(
            SpecProposed,
            {
                "request_id": [req_ids[i] for i in rows],
                "draft_token_ids": [list(draft_token_ids[i]) for i in rows],
                "method": [self._spec_method] * len(rows),
            },
        )

    def sampled(self, step: int, sampled_token_ids: Sequence[int] | None) -> None:
        """``step``'s sampled tokens reached the host (the device has been
        waited for): record what waited for that. ``sampled_token_ids``: one
        per row, or None to take the sampler's own picks (speculative decoding:
        the bonus rows; ``spec.verified`` says what the request kept). With async scheduling this
        is after the next step was launched, so the events are stamped with
        ``step`` again."""
        self.tracer.set_step(step)
        pending = self._pending_forward.pop(step, None)
        if pending is not None:
            start_event, end_event = pending.events
            end_event.synchronize()  # already complete: the tokens' copy waited
            duration_ns = int(start_event.elapsed_time(end_event) * 1e6)  # ms -> ns
            self._free_events.append(pending.events)
            self.tracer.record(
                RunnerForward(
                    step=pending.step,
                    start_ts=pending.start_ts,
                    duration_ns=duration_ns,
                    num_tokens=pending.num_tokens,
                    num_logits=pending.num_logits,
                )
            )
        self.sampler.emit(step, sampled_token_ids)


def _as_dtype(host: np.ndarray, device_buffer: torch.Tensor) -> np.ndarray:
    """``host`` in the dtype of the device buffer it was copied into."""
    dtype = _NUMPY_DTYPES[device_buffer.dtype]
    return host if host.dtype == dtype else host.astype(dtype)


__all__ = ["RunnerTrace", "SamplerTrace"]


class WorkerProcTrace(SubsystemTrace):
    """A worker process of ``MultiprocExecutor`` / ``RayWorkerWrapper``: each
    call it takes off the broadcast queue (``worker.rpc_received``) and its
    end with the tensor-parallel collectives it ran (``worker.rpc_done``)."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__(tracer)
        self._start = 0.0
        # The step of the last execute_model: the one a sample_tokens call
        # (whose argument names no step) samples.
        self._step: int | None = None

    def _call(self, method: Any, args: tuple[Any, ...]) -> tuple[str, int | None]:
        name = getattr(method, "value", None) or getattr(method, "__name__", str(method))
        step = getattr(args[0], "step", None) if args else None
        if step is not None:
            self._step = step
        return name, self._step

    def rpc_received(self, method: Any, args: tuple[Any, ...]) -> None:
        self._start = time.perf_counter()
        name, step = self._call(method, args)
        self.tracer.record(WorkerRpcReceived(method=name, step=step))

    def rpc_done(self, method: Any, args: tuple[Any, ...], tp_group: Any, replied: bool) -> None:
        """``tp_group``: its ``take_stats()`` gives the collectives since the last call."""
        stats = tp_group.take_stats()
        name, step = self._call(method, args)
        self.tracer.record(
            WorkerRpcDone(
                method=name,
                step=step,
                seconds=time.perf_counter() - self._start,
                all_reduce_count=stats.all_reduce_count,
                all_gather_count=stats.all_gather_count,
                collective_seconds=stats.seconds,
                collective_bytes=stats.nbytes,
                replied=replied,
            )
        )

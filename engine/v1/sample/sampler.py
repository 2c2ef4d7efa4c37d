"""The Sampler: logits [N, V] in, one token per request row out.

vLLM twin: ``vllm/v1/sample/sampler.py`` (``Sampler``).
Read it for the fixed order of operations, which is what decides how the
sampling knobs interact:

1. If any row wants logprobs, take them from the *raw* logits (before any
   penalty, mask or temperature): ``log_softmax`` in float32.
2. Work in float32 from here on.
3. Masks and edits that can change the argmax, so they apply to greedy rows
   too: allowed_token_ids -> bad words -> min-tokens and logit bias ->
   repetition / frequency / presence penalties.
4. Sample. Greedy rows take the argmax now (if every row is greedy, stop
   here). Then temperature (greedy rows divide by 1), min-p, top-k / top-p
   and a random draw; each row keeps its greedy or its random token.
5. Gather logprobs: for each row the sampled token's raw logprob and rank,
   followed by the top ``max_num_logprobs`` raw logprobs.

Tracing (not in vLLM): given ``trace_req_ids`` (a label per row, None for
rows not traced), the sampler prepares one ``sampler.sampled`` event per
traced row -- the chosen token and its raw logprob -- and, at trace level
``full``, the top candidates and their probabilities after each stage that ran:
``raw`` (the model's distribution), ``processed`` (step 3), and for
non-greedy batches ``temperature``, ``min_p`` and ``top_k_top_p``. The
stage snapshots are computed on the side and never feed back into sampling.
The events are written by ``emit_pending_trace``, which the model runner
calls after its ``.tolist()`` of the sampled tokens: by then the values are
ready, so bringing them to the host never stalls the step.

Sessions: 05.

Simpler than vLLM:
- Logprobs are always vLLM's default ``logprobs_mode="raw_logprobs"``; vLLM
  can also return raw logits or the processed (post-penalty / post-top-k)
  logits or logprobs.
- No speculative decoding (bonus tokens, draft-token bad words), no
  ``logprob_token_ids`` scoring API, no thinking-budget state.
- The caller's logits tensor is never modified: the float32 copy made in
  step 2 is always a fresh tensor (vLLM edits fp32 logits in place).
- The sampled token's rank is counted with a plain comparison instead of a
  ``torch.compile``-d helper.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from engine.tracing import NULL_TRACER, Tracer
from engine.tracing.tensors import HostListsCopy
from engine.v1.sample.metadata import SamplingMetadata
from engine.v1.sample.ops.bad_words import apply_bad_words
from engine.v1.sample.ops.penalties import apply_all_penalties
from engine.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
from engine.v1.sample.outputs import LogprobsTensors, SamplerOutput

# Rows with temperature below this are greedy (same constant as SamplingParams).
_SAMPLING_EPS = 1e-5


@dataclass
class PendingSampledTrace:
    """``sampler.sampled`` values of one call, still on the device."""

    req_ids: list[str | None]  # the traced rows' request ids
    rows: list[int]  # their rows in the batch
    tokens: torch.Tensor  # their sampled tokens [R] (copied only if the caller has none)
    # One flag per traced row, known on the host; None: the last of ``values``.
    greedy: list[bool] | None
    # Queued to the host: chosen logprobs [R] (+ full: ranks [R], stage
    # probs and ids [stages, R, C]) (+ greedy flags [R] when ``greedy`` is None).
    values: HostListsCopy
    stage_names: list[str]


@dataclass
class SamplerTraceState:
    """The sampler's tracing state between stages and calls."""

    # ``full`` only: the traced rows [R] (None: all rows) and, per stage that
    # ran in the current call, (name, top-C probs [R, C], their ids [R, C]).
    rows: torch.Tensor | None = None
    stages: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None
    # ``sampler.sampled`` values still on the device, written by
    # ``emit_pending_trace`` once the caller has synced (see _record_sampled).
    pending: PendingSampledTrace | None = None


class Sampler(nn.Module):
    # Candidates per stage in ``full`` traces.
    NUM_TRACE_CANDIDATES = 5

    def __init__(self, tracer: Tracer = NULL_TRACER) -> None:
        super().__init__()
        # ``full`` traces read the filtered logits back: keep the in-place torch filter then.
        self.topk_topp_sampler = TopKTopPSampler(keep_filtered_logits=tracer.full)
        self.tracer = tracer
        # ``full`` tracing only: the traced rows [R] and, per stage that ran
        # in the current call, (name, top-C probs [R, C], their ids [R, C]).
        # A plain holder, not Module attributes: nn.Module.__setattr__ is slow
        # enough to show in a traced step's cost.
        self._trace = SamplerTraceState()
        # Pinned host buffers for the trace values' copy, reused every step
        # (``HostListsCopy``'s ``staging``: the last copy is read first).
        self._trace_staging: dict[torch.dtype, torch.Tensor] = {}

    def forward(
        self,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
        trace_req_ids: Sequence[str | None] | None = None,
    ) -> SamplerOutput:
        """logits [N, V] (any float dtype) -> SamplerOutput.

        ``sampled_token_ids`` is int32 [N, 1]; ``logprobs_tensors`` is None
        unless ``sampling_metadata.max_num_logprobs`` is set.
        ``trace_req_ids`` labels rows for trace events (None: row not traced).
        """
        num_rows = len(sampling_metadata.output_token_ids)
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise ValueError(
                f"logits must have shape [num_requests={num_rows}, vocab_size], "
                f"got {tuple(logits.shape)}."
            )

        if self._trace.pending is not None: self.emit_pending_trace()  # noqa: E701
        if self.tracer.full: self._begin_stage_trace(trace_req_ids, logits)  # noqa: E701
        raw_logits = logits

        # 1. Logprobs of the raw model output, before anything below edits it.
        num_logprobs = sampling_metadata.max_num_logprobs
        raw_logprobs = self.compute_logprobs(logits) if num_logprobs is not None else None

        # 2. A float32 copy we are free to edit in place.
        logits = logits.to(torch.float32, copy=True)

        # 3. Masks, argmax-changing processors, penalties.
        logits = self.apply_logits_processors(logits, sampling_metadata)
        if self.tracer.full: self._trace_stage("processed", logits, unchanged=not self.edits_logits(sampling_metadata))  # noqa: E701

        # 4. Greedy and/or random sampling.
        sampled = self.sample(logits, sampling_metadata)  # int64 [N]

        # 5. Logprobs of the sampled token and the top-k.
        logprobs_tensors = None
        if num_logprobs is not None:
            assert raw_logprobs is not None
            logprobs_tensors = self.gather_logprobs(raw_logprobs, num_logprobs, sampled)

        if self.tracer.lifecycle and trace_req_ids is not None: self._record_sampled(trace_req_ids, raw_logits, raw_logprobs, sampled, sampling_metadata)  # noqa: E701

        return SamplerOutput(
            sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1),
            logprobs_tensors=logprobs_tensors,
        )

    @staticmethod
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(dim=-1, dtype=torch.float32)

    def apply_logits_processors(
        self, logits: torch.Tensor, sampling_metadata: SamplingMetadata
    ) -> torch.Tensor:
        """Everything that can change a greedy row's answer, in vLLM's order."""
        if not self.edits_logits(sampling_metadata):
            return logits
        if sampling_metadata.allowed_token_ids_mask is not None:
            logits.masked_fill_(sampling_metadata.allowed_token_ids_mask, float("-inf"))

        if sampling_metadata.bad_words_token_ids:
            apply_bad_words(
                logits,
                sampling_metadata.bad_words_token_ids,
                sampling_metadata.output_token_ids,
            )

        # Min-tokens, then logit bias.
        for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
            logits = processor.apply(logits)

        return self.apply_penalties(logits, sampling_metadata)

    @staticmethod
    def edits_logits(sampling_metadata: SamplingMetadata) -> bool:
        """Whether ``apply_logits_processors`` changes anything this step (it
        returns at once otherwise; the ``full`` trace then reuses the ``raw``
        snapshot for the ``processed`` stage). A new processor must be named
        here, or it is never applied."""
        return (
            sampling_metadata.allowed_token_ids_mask is not None
            or bool(sampling_metadata.bad_words_token_ids)
            or bool(sampling_metadata.logitsprocs.non_argmax_invariant)
            or not sampling_metadata.no_penalties
        )

    @staticmethod
    def apply_penalties(logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        if sampling_metadata.no_penalties:
            return logits
        assert sampling_metadata.prompt_token_ids is not None
        return apply_all_penalties(
            logits,
            sampling_metadata.prompt_token_ids,
            sampling_metadata.presence_penalties,
            sampling_metadata.frequency_penalties,
            sampling_metadata.repetition_penalties,
            sampling_metadata.output_token_ids,
        )

    @staticmethod
    def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
        # max(dim).indices == argmax (both return the first maximum on ties),
        # but on CPU it is ~3x faster over a 49k-wide float32 row.
        return logits.max(dim=-1).indices.view(-1)

    @staticmethod
    def apply_temperature(
        logits: torch.Tensor, temp: torch.Tensor, all_random: bool
    ) -> torch.Tensor:
        """Divide each row by its temperature, in place. Greedy rows (temp 0)
        divide by 1: their random token is thrown away anyway."""
        if not all_random:
            temp = torch.where(temp < _SAMPLING_EPS, torch.ones_like(temp), temp)
        return logits.div_(temp.unsqueeze(1))

    def sample(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        """Pick one token per row (int64 [N]). May edit ``logits`` in place."""
        greedy_sampled = None
        if not sampling_metadata.all_random:
            greedy_sampled = self.greedy_sample(logits)
            if sampling_metadata.all_greedy:
                return greedy_sampled

        logits = self.apply_temperature(
            logits, sampling_metadata.temperature, sampling_metadata.all_random
        )
        if self.tracer.full: self._trace_stage("temperature", logits)  # noqa: E701

        # Min-p (processors that cannot change the argmax).
        for processor in sampling_metadata.logitsprocs.argmax_invariant:
            logits = processor.apply(logits)
        if self.tracer.full and sampling_metadata.logitsprocs.argmax_invariant: self._trace_stage("min_p", logits)  # noqa: E701

        random_sampled, _ = self.topk_topp_sampler(
            logits,
            sampling_metadata.generators,
            sampling_metadata.top_k,
            sampling_metadata.top_p,
        )
        # The top-k / top-p filter masked ``logits`` in place: what the draw used.
        if self.tracer.full and (sampling_metadata.top_k is not None or sampling_metadata.top_p is not None): self._trace_stage("top_k_top_p", logits)  # noqa: E701
        if greedy_sampled is None:
            return random_sampled
        return torch.where(
            sampling_metadata.temperature < _SAMPLING_EPS, greedy_sampled, random_sampled
        )

    @staticmethod
    def gather_logprobs(
        logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
    ) -> LogprobsTensors:
        """Column 0: each row's ``token_ids`` entry; columns 1..k: the top-k.

        logprobs [N, V] float32; token_ids int64 [N]. The rank is the number
        of tokens whose logprob is >= the token's own (itself included), so
        1 = most likely, and a token tied with others gets the worst rank of
        its tie group.
        """
        topk_logprobs, topk_ids = torch.topk(logprobs, num_logprobs, dim=-1)
        token_ids = token_ids.to(torch.int64).unsqueeze(-1)  # [N, 1]
        token_logprobs = logprobs.gather(-1, token_ids)  # [N, 1]
        # Rank = how many tokens are at least as likely (itself included).
        ranks = (logprobs >= token_logprobs).sum(dim=-1)
        return LogprobsTensors(
            logprob_token_ids=torch.cat((token_ids, topk_ids), dim=1),
            logprobs=torch.cat((token_logprobs, topk_logprobs), dim=1),
            selected_token_ranks=ranks,
        )

    # ------------------------------------------------------------------
    # Tracing (reads the tensors, never changes them)
    # ------------------------------------------------------------------
    def _begin_stage_trace(
        self, trace_req_ids: Sequence[str | None] | None, logits: torch.Tensor
    ) -> None:
        self._trace.stages = None
        if trace_req_ids is None:
            return
        rows = [i for i, rid in enumerate(trace_req_ids) if rid is not None]
        if not rows:
            return
        # None: every row is traced (no index_select, no host-to-device copy).
        self._trace.rows = (
            None if len(rows) == len(trace_req_ids)
            else torch.tensor(rows, dtype=torch.long, device=logits.device)
        )
        self._trace.stages = []
        self._trace_stage("raw", logits)

    def _trace_stage(self, stage: str, logits: torch.Tensor, unchanged: bool = False) -> None:
        """Keep the top candidates of the traced rows as this stage left them
        (on the device: ``_emit_sampled`` copies them to the host once).
        ``unchanged``: the stage left the logits as the previous one did, so
        its candidates are the previous stage's (no softmax or top-k to run)."""
        if self._trace.stages is None:
            return
        if unchanged and self._trace.stages:
            _, top_probs, top_ids = self._trace.stages[-1]
            self._trace.stages.append((stage, top_probs, top_ids))
            return
        if self._trace.rows is not None:
            logits = logits.index_select(0, self._trace.rows)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        k = min(self.NUM_TRACE_CANDIDATES, probs.shape[-1])
        top_probs, top_ids = probs.topk(k, dim=-1)
        self._trace.stages.append((stage, top_probs, top_ids))

    def _record_sampled(
        self,
        trace_req_ids: Sequence[str | None],
        raw_logits: torch.Tensor,
        raw_logprobs: torch.Tensor | None,
        sampled: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> None:
        """Compute what the ``sampler.sampled`` events need, on the device, and
        queue its copy to the host without waiting (``HostListsCopy``):
        ``emit_pending_trace`` reads it after the model runner's own
        ``.tolist()`` of the sampled tokens has waited for the device (and
        takes the tokens from that list), so tracing adds no wait of its own.
        A blocking copy here would stall the host until the forward finished,
        before it had launched the rest of the step. At ``lifecycle`` the
        device work is two kernels (log-softmax, gather) and the greedy flags
        come from the host (``temperature_cpu``, or the batch being all greedy
        or all random); only metadata without host temperatures reads them
        from the device."""
        rows = [i for i, rid in enumerate(trace_req_ids) if rid is not None]
        if not rows:
            self._trace.stages = self._trace.rows = None
            return
        tokens = sampled
        row_logits = raw_logits if raw_logprobs is None else raw_logprobs
        index = None
        if len(rows) < len(trace_req_ids):
            index = torch.tensor(rows, dtype=torch.long, device=sampled.device)
            tokens, row_logits = tokens.index_select(0, index), row_logits.index_select(0, index)
        row_logprobs = self.compute_logprobs(row_logits) if raw_logprobs is None else row_logits
        chosen = row_logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        device_values = [chosen]
        stage_names: list[str] = []
        if self.tracer.full and self._trace.stages is not None:
            device_values.append((row_logprobs >= chosen.unsqueeze(-1)).sum(dim=-1))
            stage_names = [name for name, _, _ in self._trace.stages]
            # Two tensors [stages, R, C] instead of two per stage: fewer pieces to copy.
            device_values.append(torch.stack([probs for _, probs, _ in self._trace.stages]))
            device_values.append(torch.stack([ids for _, _, ids in self._trace.stages]))
        greedy: list[bool] | None = None
        if sampling_metadata.temperature_cpu is not None:
            greedy = (sampling_metadata.temperature_cpu[rows] < _SAMPLING_EPS).tolist()
        elif sampling_metadata.all_greedy or sampling_metadata.all_random:
            greedy = [sampling_metadata.all_greedy] * len(rows)
        else:
            temperature = sampling_metadata.temperature
            device_values.append(
                (temperature if index is None else temperature.index_select(0, index)) < _SAMPLING_EPS
            )
        self._trace.stages = self._trace.rows = None
        self._trace.pending = PendingSampledTrace(
            [trace_req_ids[r] for r in rows], rows, tokens, greedy,
            HostListsCopy(*device_values, staging=self._trace_staging), stage_names,
        )

    def emit_pending_trace(self, sampled_token_ids: Sequence[int] | None = None) -> None:
        """One ``sampler.sampled`` event per traced row of the last call
        (``Tracer.emit_rows``: the per-row dicts are built when written).

        ``sampled_token_ids``: the caller's host copy of the sampled tokens
        (one per batch row), made after the sampler call returned (so the
        stream has been waited for); without it they are copied from the
        device here. The other values were queued to the host by
        ``_record_sampled``."""
        pending, self._trace.pending = self._trace.pending, None
        if pending is None:
            return
        if sampled_token_ids is None:
            token_list = pending.tokens.tolist()  # waits for the device
        else:
            token_list = [sampled_token_ids[r] for r in pending.rows]
        # Either way the stream has been waited for since the copy was queued.
        host = pending.values.lists(synchronized=True)
        greedy_list = host.pop() if pending.greedy is None else pending.greedy
        columns = {
            "request_id": pending.req_ids,
            "row": pending.rows,
            "token_id": token_list,
            "logprob": host[0],
            "greedy": greedy_list,
        }
        if len(host) > 1:  # full: the rank and the top candidates of every stage
            columns["rank"] = host[1]
            stage_probs, stage_ids = host[2], host[3]  # [stages][R][C] twice
            columns["stages"] = [
                [
                    {"stage": name, "token_ids": stage_ids[i][j], "probs": stage_probs[i][j]}
                    for i, name in enumerate(pending.stage_names)
                ]
                for j in range(len(pending.rows))
            ]
        self.tracer.emit_rows("sampler.sampled", columns)

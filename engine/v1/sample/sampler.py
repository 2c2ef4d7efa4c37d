"""The Sampler: logits [N, V] in, one token per request row out.

vLLM twin: ``vllm/v1/sample/sampler.py`` (``Sampler``).
Read it for the fixed order of operations, which is what decides how the
sampling knobs interact:

1. If any row wants logprobs, take them from the *raw* logits (before any
   penalty, mask or temperature): ``log_softmax`` in float32 (the default
   ``logprobs_mode="raw_logprobs"``; ``raw_logits`` keeps the logits).
2. Work in float32 from here on.
3. Masks and edits that can change the argmax, so they apply to greedy rows
   too (``apply_logits_processors``): allowed_token_ids -> bad words ->
   the non-argmax-invariant logits processors (min-tokens, logit bias) ->
   repetition / frequency / presence penalties.
4. Sample (``sample``). Greedy rows take the argmax now (if every row is
   greedy, stop here). Then temperature (greedy rows divide by 1), the
   argmax-invariant processors (min-p), top-k / top-p and a random draw;
   each row keeps its greedy or its random token.
5. Gather logprobs: for each row the sampled token's logprob and rank,
   followed by the top ``max_num_logprobs`` logprobs. Every row gets the
   batch's largest count; the engine cuts each request's row to what it
   asked for.

``predict_bonus_token``: with speculative decoding the sampler also picks the
token after the accepted drafts; penalties and bad words must then see the
drafts as if generated (``spec_token_ids`` appended to ``output_token_ids``).

Tracing (not in vLLM): the sampler receives a ``SamplerTrace``
(``engine/tracing/worker_trace.py``) and shows it the logits after each
stage; the trace records the chosen token of every traced row and, at level
``full``, the top candidates after each stage. It never changes the logits.

Sessions: 05.

Simpler than vLLM: no ``logprob_token_ids`` scoring API, no thinking-budget
state; the sampled token's rank is counted with a plain comparison instead of
a ``torch.compile``-d helper.

Differs from vLLM on purpose: the caller's logits tensor is never modified --
the float32 copy made in step 2 is always a fresh tensor (vLLM edits fp32
logits in place); logprob token ids stay int64 (vLLM: int32).
"""

from __future__ import annotations

from typing import get_args

import torch
import torch.nn as nn

from engine.config.model import LogprobsMode
from engine.tracing.worker_trace import SamplerTrace
from engine.v1.outputs import LogprobsTensors, SamplerOutput
from engine.v1.sample.metadata import SamplingMetadata
from engine.v1.sample.ops.bad_words import apply_bad_words
from engine.v1.sample.ops.penalties import apply_all_penalties
from engine.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

# Rows with temperature below this are greedy (same constant as SamplingParams).
_SAMPLING_EPS = 1e-5
_LOGPROBS_MODES = get_args(LogprobsMode)


def _check_logprobs_mode(mode: str) -> None:
    if mode not in _LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {_LOGPROBS_MODES}, got {mode!r}.")


class Sampler(nn.Module):
    def __init__(
        self, logprobs_mode: LogprobsMode = "raw_logprobs", trace: SamplerTrace = SamplerTrace.NULL
    ) -> None:
        super().__init__()
        _check_logprobs_mode(logprobs_mode)
        self.logprobs_mode = logprobs_mode
        # A ``full`` trace reads the filtered logits back: the torch filter leaves them.
        self.topk_topp_sampler = TopKTopPSampler(
            logprobs_mode, keep_filtered_logits=trace.reads_filtered_logits
        )
        self.trace = trace

    def forward(
        self,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
        predict_bonus_token: bool = False,
        logprobs_mode_override: LogprobsMode | None = None,
    ) -> SamplerOutput:
        """logits [N, V] (any float dtype) -> SamplerOutput.

        ``sampled_token_ids`` is int32 [N, 1]; ``logprobs_tensors`` is None
        unless ``sampling_metadata.max_num_logprobs`` is set.
        """
        num_rows = len(sampling_metadata.output_token_ids)
        if logits.dim() != 2 or (num_rows and logits.shape[0] != num_rows):
            raise ValueError(
                f"logits must have shape [num_requests={num_rows}, vocab_size], "
                f"got {tuple(logits.shape)}."
            )
        logprobs_mode = logprobs_mode_override or self.logprobs_mode
        _check_logprobs_mode(logprobs_mode)

        # 1. Logprobs of the raw model output, before anything below edits it.
        num_logprobs = sampling_metadata.max_num_logprobs
        raw_logprobs = None
        if num_logprobs is not None:
            if logprobs_mode == "raw_logprobs":
                raw_logprobs = self.compute_logprobs(logits)
            elif logprobs_mode == "raw_logits":
                raw_logprobs = logits.to(torch.float32, copy=True)

        # 2. A float32 copy we are free to edit in place.
        logits = logits.to(torch.float32, copy=True)
        self.trace.raw(logits, raw_logprobs)

        # 3. Masks, argmax-changing processors, penalties.
        logits = self.apply_logits_processors(logits, sampling_metadata, predict_bonus_token)
        self.trace.processed(logits, sampling_metadata)

        # 4. Greedy and/or random sampling.
        sampled, processed_logprobs = self.sample(logits, sampling_metadata, logprobs_mode)
        if processed_logprobs is not None:
            raw_logprobs = processed_logprobs

        # 5. Logprobs of the sampled token and the top-k.
        logprobs_tensors = None
        if num_logprobs == -1:
            # The whole distribution, unsorted and unranked.
            assert raw_logprobs is not None
            logprobs_tensors = LogprobsTensors(torch.empty(0), raw_logprobs, torch.empty(0))
        elif num_logprobs is not None:
            assert raw_logprobs is not None
            logprobs_tensors = self.gather_logprobs(raw_logprobs, num_logprobs, sampled)

        self.trace.sampled(sampled, sampling_metadata)
        return SamplerOutput(
            sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1),
            logprobs_tensors=logprobs_tensors,
        )

    @staticmethod
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(dim=-1, dtype=torch.float32)

    @staticmethod
    def _combine_outputs_with_spec_tokens(
        output_token_ids: list[list[int]], spec_token_ids: list[list[int]] | None = None
    ) -> list[list[int]]:
        """Each row's output ids followed by its draft tokens (new lists)."""
        if spec_token_ids is None:
            return output_token_ids
        return [
            [*out, *spec] if spec else out for out, spec in zip(output_token_ids, spec_token_ids)
        ]

    def apply_logits_processors(
        self,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
        predict_bonus_token: bool,
    ) -> torch.Tensor:
        """Everything that can change a greedy row's answer, in vLLM's order."""
        bad_words_token_ids = sampling_metadata.bad_words_token_ids
        output_token_ids = sampling_metadata.output_token_ids
        if predict_bonus_token and (bad_words_token_ids or not sampling_metadata.no_penalties):
            output_token_ids = self._combine_outputs_with_spec_tokens(
                output_token_ids, sampling_metadata.spec_token_ids
            )

        if sampling_metadata.allowed_token_ids_mask is not None:
            logits.masked_fill_(sampling_metadata.allowed_token_ids_mask, float("-inf"))

        if bad_words_token_ids:
            apply_bad_words(logits, bad_words_token_ids, output_token_ids)

        # Min-tokens, then logit bias (then any custom processor that can move the argmax).
        for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
            logits = processor.apply(logits)

        return self.apply_penalties(logits, sampling_metadata, output_token_ids)

    @staticmethod
    def apply_penalties(
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
        output_token_ids: list[list[int]],
    ) -> torch.Tensor:
        if sampling_metadata.no_penalties:
            return logits
        assert sampling_metadata.prompt_token_ids is not None
        return apply_all_penalties(
            logits,
            sampling_metadata.prompt_token_ids,
            sampling_metadata.presence_penalties,
            sampling_metadata.frequency_penalties,
            sampling_metadata.repetition_penalties,
            output_token_ids,
        )

    @staticmethod
    def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
        # max(dim).indices == argmax (both return the first maximum on ties),
        # but on CPU it is the faster of the two over a vocabulary-wide float32 row.
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

    def sample(
        self,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
        logprobs_mode_override: LogprobsMode | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pick one token per row. May edit ``logits`` in place.

        Returns (int64 [N], the logits sampled from -- or their logprobs -- in a
        ``processed_*`` logprobs mode when logprobs are asked for, else None).
        """
        logprobs_mode = logprobs_mode_override or self.logprobs_mode
        greedy_sampled = None
        if not sampling_metadata.all_random:
            greedy_sampled = self.greedy_sample(logits)
            if sampling_metadata.all_greedy:
                processed_logprobs = None
                if sampling_metadata.max_num_logprobs is not None:
                    if logprobs_mode == "processed_logits":
                        processed_logprobs = logits
                    elif logprobs_mode == "processed_logprobs":
                        processed_logprobs = self.compute_logprobs(logits)
                return greedy_sampled, processed_logprobs

        assert sampling_metadata.temperature is not None
        logits = self.apply_temperature(
            logits, sampling_metadata.temperature, sampling_metadata.all_random
        )
        self.trace.temperature(logits)

        # Min-p (processors that cannot change the argmax).
        for processor in sampling_metadata.logitsprocs.argmax_invariant:
            logits = processor.apply(logits)
        self.trace.min_p(logits, sampling_metadata)

        topk_topp_sampler = self.topk_topp_sampler
        if logprobs_mode != topk_topp_sampler.logprobs_mode:
            topk_topp_sampler = TopKTopPSampler(logprobs_mode, keep_filtered_logits=True)
        random_sampled, processed_logprobs = topk_topp_sampler(
            logits,
            sampling_metadata.generators,
            sampling_metadata.top_k,
            sampling_metadata.top_p,
        )
        self.trace.top_k_top_p(logits, sampling_metadata)
        if greedy_sampled is None:
            return random_sampled, processed_logprobs
        sampled = torch.where(
            sampling_metadata.temperature < _SAMPLING_EPS, greedy_sampled, random_sampled
        )
        return sampled, processed_logprobs

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

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

Tracing (not in vLLM): the sampler receives a ``SamplerTrace``
(``engine/tracing/worker_trace.py``) and shows it the logits after each
stage; the trace records the chosen token of every traced row and, at level
``full``, the top candidates after each stage. It never changes the logits.

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

import torch
import torch.nn as nn

from engine.tracing.worker_trace import SamplerTrace
from engine.v1.sample.metadata import SamplingMetadata
from engine.v1.sample.ops.bad_words import apply_bad_words
from engine.v1.sample.ops.penalties import apply_all_penalties
from engine.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
from engine.v1.sample.outputs import LogprobsTensors, SamplerOutput

# Rows with temperature below this are greedy (same constant as SamplingParams).
_SAMPLING_EPS = 1e-5


class Sampler(nn.Module):
    def __init__(self, trace: SamplerTrace = SamplerTrace.NULL) -> None:
        super().__init__()
        # A ``full`` trace reads the filtered logits back: the torch filter leaves them.
        self.topk_topp_sampler = TopKTopPSampler(keep_filtered_logits=trace.reads_filtered_logits)
        self.trace = trace

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        """logits [N, V] (any float dtype) -> SamplerOutput.

        ``sampled_token_ids`` is int32 [N, 1]; ``logprobs_tensors`` is None
        unless ``sampling_metadata.max_num_logprobs`` is set.
        """
        num_rows = len(sampling_metadata.output_token_ids)
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise ValueError(
                f"logits must have shape [num_requests={num_rows}, vocab_size], "
                f"got {tuple(logits.shape)}."
            )

        # 1. Logprobs of the raw model output, before anything below edits it.
        num_logprobs = sampling_metadata.max_num_logprobs
        raw_logprobs = self.compute_logprobs(logits) if num_logprobs is not None else None

        # 2. A float32 copy we are free to edit in place.
        logits = logits.to(torch.float32, copy=True)
        self.trace.raw(logits, raw_logprobs)

        # 3. Masks, argmax-changing processors, penalties.
        logits = self.apply_logits_processors(logits, sampling_metadata)
        self.trace.processed(logits, sampling_metadata)

        # 4. Greedy and/or random sampling.
        sampled = self.sample(logits, sampling_metadata)  # int64 [N]

        # 5. Logprobs of the sampled token and the top-k.
        logprobs_tensors = None
        if num_logprobs is not None:
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

    def apply_logits_processors(
        self, logits: torch.Tensor, sampling_metadata: SamplingMetadata
    ) -> torch.Tensor:
        """Everything that can change a greedy row's answer, in vLLM's order."""
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
        self.trace.temperature(logits)

        # Min-p (processors that cannot change the argmax).
        for processor in sampling_metadata.logitsprocs.argmax_invariant:
            logits = processor.apply(logits)
        self.trace.min_p(logits, sampling_metadata)

        random_sampled, _ = self.topk_topp_sampler(
            logits,
            sampling_metadata.generators,
            sampling_metadata.top_k,
            sampling_metadata.top_p,
        )
        self.trace.top_k_top_p(logits, sampling_metadata)
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

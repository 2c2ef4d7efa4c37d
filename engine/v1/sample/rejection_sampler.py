"""RejectionSampler: verify a step's draft tokens against the target model.

vLLM twin: ``vllm/v1/sample/rejection_sampler.py`` (``RejectionSampler``,
``rejection_sample``, ``apply_sampling_constraints``,
``expand_batch_to_tokens``, ``generate_uniform_probs``,
``sample_recovered_tokens`` and the Triton kernels
``rejection_greedy_sample_kernel``, ``rejection_random_sample_kernel``,
``sample_recovered_tokens_kernel``, ``expand_kernel``).
Read it for how speculative decoding stays exact: the tokens it emits follow
the target model's distribution whatever the drafts were.

The step. Request i brings ``n_i`` drafts ``d_0 .. d_(n-1)``; the target
model has produced logits for "the token after each draft prefix" (the
*target* rows, ``p_j`` judges ``d_j``) and one more row (the *bonus* row,
after all drafts). ``SpecDecodeMetadata`` (``engine/v1/spec_decode/metadata.py``)
says where these rows are. Per request the output row, ``[max_spec_len + 1]``
wide, is: the drafts accepted in order until the first rejection, then one
token of the target's own (the *recovered* token at the rejected position, or
the *bonus* token when every draft was accepted), then
``PLACEHOLDER_TOKEN_ID`` (-1). So a request gains between 1 and ``n_i + 1``
tokens per step.

- Greedy rows (temperature 0): ``d_j`` is accepted iff it equals
  ``argmax p_j``; at the first mismatch the argmax is emitted instead. The
  output is exactly what step-by-step greedy decoding would give.
- Random rows: with ``q_j`` the draft's distribution, ``d_j`` is accepted with
  probability ``min(1, p_j(d_j) / q_j(d_j))`` (a uniform draw ``u``: accept
  iff ``p >= u * q``). On rejection the recovered token is drawn from the
  residual ``max(p_j - q_j, 0)`` normalised. Then for every token x
  ``P(emit x) = min(p(x), q(x)) + (1 - sum_y min(p(y), q(y))) * residual(x) = p(x)``
  (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192). A proposer that
  gives no probabilities (n-gram, and vLLM's draft model / EAGLE proposers,
  which propose greedily) passes ``draft_probs=None``: ``q`` is a point mass on
  the draft, so ``d`` is accepted with probability ``p(d)`` and the residual is
  ``p`` with ``d`` removed.
- Bonus tokens come from the ordinary ``Sampler`` on the bonus rows
  (``predict_bonus_token=True``), so every sampling option applies to them.

Which logits the drafts are judged by: each target row is processed as the
Sampler would process it if the drafts before it had already been generated
-- allowed_token_ids, bad words and penalties see ``output + d_0 .. d_(j-1)``,
min-tokens counts the drafts -- then temperature and top-k / top-p
(``apply_sampling_constraints``). Row j of a request uses that request's
settings; ``expand_batch_to_tokens`` repeats per-request values per draft.

Random draws are made in torch before either implementation runs:
``generate_uniform_probs`` (one float64 per draft) and, in
``sample_recovered_tokens``, one Exp(1) vector ``q`` per request for the
exponential race (``argmax(residual / q)`` is a draw from the normalised
residual; one vector serves all of a request's positions because only the
first rejection's token is used). A seeded request draws both from its own
generator, and draws nothing for a step in which it has no drafts.

Two implementations of the same arithmetic, chosen by device: plain torch
(``*_torch`` functions, the reference, what the CPU runs) and Triton kernels
with vLLM's names (what CUDA runs), both in ``ops/rejection_kernels.py``.
``RejectionSampler(use_triton=None)`` picks Triton for CUDA logits; every
function below takes the choice as an explicit ``use_triton`` argument.
Given the same draws the two produce the same tokens bit for bit: the
kernels only compare, subtract, multiply and take the first maximum, all
exact or identically rounded in IEEE arithmetic, and argmax / softmax /
temperature are torch ops shared by both.
Importing this module imports triton (as vLLM's does).

Sessions: 06 (speculative decoding).

Simpler than vLLM:
- no synthetic acceptance mode (``rejection_sample_method="synthetic"``) and
  no thinking-token budget.
- logits processors: as in vLLM, only min-tokens is applied to target rows;
  min-p, logit bias and custom processors are not supported with speculative
  decoding (vLLM rejects such requests up front and builds no such
  processors). Here an active one is a ``ValueError`` at ``forward``.
  Min-tokens with drafts is done here (vLLM: ``apply_with_spec_decode`` on
  the processor) and bad words with drafts by calling ``apply_bad_words`` on
  the target rows (vLLM: ``apply_bad_words_with_drafts``).
- the bonus sampler is asked for the whole-vocabulary logits only when some
  row wants logprobs (vLLM always asks).
- ``parse_output`` returns logprobs rows only for the tokens it returns
  (discarded rows dropped), as our runner's ``LogprobsLists`` carry no
  per-request offsets (vLLM keeps discarded rows' logprobs and passes
  ``cu_num_generated_tokens``).

Differs from vLLM on purpose:
- the accept test is ``p >= u * q`` in float64 rather than ``p / q >= u``:
  Triton's default float32 division is approximate on the GPU, a product is
  correctly rounded everywhere, so the kernel matches the torch path exactly.
- ``q`` is floored at the smallest normal float32 before its reciprocal (as
  our ``random_sample`` does): an Exp(1) draw of exactly 0 would otherwise
  give ``0 * inf = NaN`` scores.
- greedy rows are those with temperature < 1e-5 (our Sampler's rule; the
  metadata stores exactly 0 for them, vLLM's rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn as nn
import triton

from engine.config.speculative import MAX_NUM_SPECULATIVE_TOKENS
from engine.v1.outputs import LogprobsLists, LogprobsTensors, SamplerOutput
from engine.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
from engine.v1.sample.logits_processor.state import LogitsProcessors
from engine.v1.sample.metadata import SamplingMetadata
from engine.v1.sample.ops.bad_words import apply_bad_words
from engine.v1.sample.ops.penalties import apply_all_penalties
from engine.v1.sample.ops.rejection_kernels import (
    expand_kernel,
    expand_torch,
    rejection_greedy_sample_kernel,
    rejection_greedy_sample_torch,
    rejection_random_sample_kernel,
    rejection_random_sample_torch,
    sample_recovered_tokens_kernel,
    sample_recovered_tokens_torch,
)
from engine.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from engine.v1.sample.sampler import Sampler
from engine.v1.spec_decode.metadata import SpecDecodeMetadata

# Output slots after the first rejection (and after a row's last token).
PLACEHOLDER_TOKEN_ID = -1
# Greedy rows' temperature in SamplingMetadata; replaced by 1 before dividing.
GREEDY_TEMPERATURE = 0
# Most drafts one request may bring in a step (the expand kernel's tile size;
# SpeculativeConfig refuses a larger num_speculative_tokens).
MAX_SPEC_LEN = MAX_NUM_SPECULATIVE_TOKENS
# Rows with temperature below this are greedy (the Sampler's constant).
_SAMPLING_EPS = 1e-5
# Vocabulary tile of the recovered-token kernel.
_RECOVERED_BLOCK_SIZE = 8192


class ParsedOutput(NamedTuple):
    """``RejectionSampler.parse_output``'s answer (unpacks like vLLM's tuple)."""

    # Per request, the tokens it gained this step ([] for discarded rows).
    sampled_token_ids: list[list[int]]
    # One row per token in sampled_token_ids, in order; None without logprobs.
    logprobs: LogprobsLists | None


class RejectionSampler(nn.Module):
    """Accepted + recovered + bonus tokens for a batch of drafted requests.

    ``sampler`` is the engine's ``Sampler``: it samples the bonus tokens and
    its ``logprobs_mode`` decides which logits the logprobs come from.
    ``use_triton``: None picks the Triton kernels for CUDA logits and torch
    otherwise; True / False force one (True on CPU tensors needs
    ``TRITON_INTERPRET=1``).
    """

    def __init__(self, sampler: Sampler, use_triton: bool | None = None) -> None:
        super().__init__()
        self.sampler = sampler
        self.use_triton = use_triton
        logprobs_mode = sampler.logprobs_mode
        self.is_processed_logprobs_mode = logprobs_mode.startswith("processed")
        self.is_logits_logprobs_mode = logprobs_mode.endswith("logits")

    def forward(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        """Verify the drafts.

        draft_probs: [num_draft_tokens_total, V] float32, the proposer's
        distribution at each draft, or None (a point mass on each draft).
        logits: [num_draft_tokens_total + batch_size, V], the target's rows as
        ``metadata`` lays them out; not modified.
        ``sampling_metadata``: one row per request, with ``spec_token_ids``
        holding each request's drafts (penalties and bad words read them).

        Returns ``sampled_token_ids`` int32 [batch_size, max_spec_len + 1]
        (-1 after each row's last token) and, when some row wants logprobs,
        ``LogprobsTensors`` with one row per output slot
        ([batch_size * (max_spec_len + 1), k + 1]).
        """
        if metadata.max_spec_len > MAX_SPEC_LEN:
            raise ValueError(
                f"at most {MAX_SPEC_LEN} draft tokens per request, got {metadata.max_spec_len}."
            )
        use_triton = logits.is_cuda if self.use_triton is None else self.use_triton
        want_logprobs = sampling_metadata.max_num_logprobs is not None

        # Bonus tokens: the ordinary sampler on the bonus rows (a new tensor:
        # indexing with a tensor copies). With logprobs asked for, it also
        # hands back the whole rows it sampled from (raw or processed logits).
        bonus_logits = logits[metadata.bonus_logits_indices]
        if want_logprobs:
            bonus_output = self.sampler(
                bonus_logits,
                replace(sampling_metadata, max_num_logprobs=-1),
                predict_bonus_token=True,
                logprobs_mode_override=(
                    "processed_logits" if self.is_processed_logprobs_mode else "raw_logits"
                ),
            )
        else:
            bonus_output = self.sampler(bonus_logits, sampling_metadata, predict_bonus_token=True)
        bonus_token_ids = bonus_output.sampled_token_ids  # [batch_size, 1] int32

        # Target rows in float32 (a new tensor); keep the raw ones for raw logprobs.
        raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)
        target_logits = raw_target_logits
        if want_logprobs and not self.is_processed_logprobs_mode:
            target_logits = raw_target_logits.clone()
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata)
        target_logits = apply_sampling_constraints(
            target_logits, metadata.cu_num_draft_tokens, sampling_metadata, use_triton=use_triton
        )

        output_token_ids = rejection_sample(
            metadata.draft_token_ids,
            metadata.num_draft_tokens,
            metadata.max_spec_len,
            metadata.cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
            use_triton=use_triton,
        )

        logprobs_tensors = None
        if want_logprobs:
            assert sampling_metadata.max_num_logprobs is not None
            assert bonus_output.logprobs_tensors is not None
            logprobs_tensors = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs,
                metadata,
                logits,
                target_logits if self.is_processed_logprobs_mode else raw_target_logits,
                bonus_output.logprobs_tensors.logprobs,
                output_token_ids,
            )
        return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=logprobs_tensors)

    def _get_logprobs_tensors(
        self,
        max_num_logprobs: int,
        metadata: SpecDecodeMetadata,
        logits: torch.Tensor,
        target_logits: torch.Tensor,
        bonus_logits: torch.Tensor,
        sampled_token_ids: torch.Tensor,
    ) -> LogprobsTensors:
        """Logprobs for every output slot [batch_size * (max_spec_len + 1)].

        Slot (i, j) reads logits row ``start_i + j`` -- the target row that
        judged draft j, or the bonus row for j = n_i. Slots past a row's last
        token read some other row and score token 0; ``parse_output`` drops
        them (no host sync here to find which they are).
        """
        num_rows, vocab_size = logits.shape
        # Every logits row in the step, target and bonus, as the sampler saw it.
        final_logits = torch.zeros(
            (num_rows, vocab_size), dtype=torch.float32, device=logits.device
        )
        final_logits[metadata.target_logits_indices] = target_logits.to(torch.float32)
        final_logits[metadata.bonus_logits_indices] = bonus_logits.to(torch.float32)

        # First logits row of each request: cu_num_sampled_tokens shifted right.
        starts = torch.zeros_like(metadata.cu_num_sampled_tokens)
        starts[1:] = metadata.cu_num_sampled_tokens[:-1]
        offsets = torch.arange(sampled_token_ids.shape[1], device=starts.device, dtype=starts.dtype)
        slot_rows = (starts.unsqueeze(1) + offsets.unsqueeze(0)).flatten()
        slot_rows = slot_rows.clamp(max=num_rows - 1).to(torch.int64)
        slot_tokens = sampled_token_ids.flatten().to(torch.int64)
        slot_tokens = slot_tokens.masked_fill(slot_tokens == PLACEHOLDER_TOKEN_ID, 0)

        slot_logits = final_logits[slot_rows]
        slot_logprobs = (
            slot_logits
            if self.is_logits_logprobs_mode
            else self.sampler.compute_logprobs(slot_logits)
        )
        return self.sampler.gather_logprobs(slot_logprobs, max_num_logprobs, slot_tokens)

    @staticmethod
    def parse_output(
        output_token_ids: torch.Tensor,
        vocab_size: int,
        discard_req_indices: Sequence[int] = (),
        logprobs_tensors: LogprobsTensors | None = None,
    ) -> ParsedOutput:
        """Host lists from ``forward``'s output.

        output_token_ids: [batch_size, max_spec_len + 1]; -1 and ids >= vocab_size
        are dropped. Rows in ``discard_req_indices`` (requests still in the middle
        of their prompt) get []. ``logprobs_tensors`` (one row per output slot,
        as ``forward`` returns it) is cut to the kept tokens, in order.
        """
        token_ids = output_token_ids.cpu()
        valid = (token_ids != PLACEHOLDER_TOKEN_ID) & (token_ids < vocab_size)
        if len(discard_req_indices) > 0:
            valid[list(discard_req_indices)] = False
        outputs = [row[keep].tolist() for row, keep in zip(token_ids, valid)]

        logprobs = None
        if logprobs_tensors is not None:
            keep = valid.flatten()
            logprobs = LogprobsLists(
                logprob_token_ids=logprobs_tensors.logprob_token_ids.cpu()[keep].tolist(),
                logprobs=logprobs_tensors.logprobs.cpu()[keep].tolist(),
                sampled_token_ranks=logprobs_tensors.selected_token_ranks.cpu()[keep].tolist(),
            )
        return ParsedOutput(outputs, logprobs)

    def apply_logits_processors(
        self,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
        metadata: SpecDecodeMetadata,
    ) -> torch.Tensor:
        """Masks and penalties on the target rows [num_draft_tokens_total, V], in place.

        Row j of a request sees that request's output ids followed by its
        drafts 0 .. j-1, as if they had been generated.
        """
        _check_supported_logitsprocs(sampling_metadata.logitsprocs)
        has_penalties = not sampling_metadata.no_penalties
        bad_words_token_ids = sampling_metadata.bad_words_token_ids
        num_draft_tokens = metadata.num_draft_tokens

        output_token_ids = sampling_metadata.output_token_ids
        if bad_words_token_ids or has_penalties:
            output_token_ids = self._combine_outputs_with_spec_tokens(
                output_token_ids, sampling_metadata.spec_token_ids
            )
            if len(output_token_ids) != logits.shape[0]:
                raise ValueError(
                    "sampling_metadata.spec_token_ids must hold each request's drafts "
                    f"({sum(num_draft_tokens)} in all), got {sampling_metadata.spec_token_ids}."
                )

        # Target row -> its request's row in the batch (host-built, one copy).
        repeat_indices = None
        if sampling_metadata.allowed_token_ids_mask is not None or has_penalties:
            repeat_indices = torch.arange(len(num_draft_tokens)).repeat_interleave(
                torch.tensor(num_draft_tokens, dtype=torch.int64)
            )
            repeat_indices = repeat_indices.to(logits.device, non_blocking=True)

        if sampling_metadata.allowed_token_ids_mask is not None:
            assert repeat_indices is not None
            logits.masked_fill_(
                sampling_metadata.allowed_token_ids_mask[repeat_indices], float("-inf")
            )

        if bad_words_token_ids:
            starts = _draft_starts(num_draft_tokens)
            per_target_row = {
                starts[req] + j: words
                for req, words in bad_words_token_ids.items()
                for j in range(num_draft_tokens[req])
            }
            apply_bad_words(logits, per_target_row, output_token_ids)

        for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
            if isinstance(processor, MinTokensLogitsProcessor):
                _apply_min_tokens_with_drafts(processor, logits, num_draft_tokens)

        if has_penalties:
            assert repeat_indices is not None
            logits = self.apply_penalties(
                logits, sampling_metadata, metadata, repeat_indices, output_token_ids
            )
        return logits

    @staticmethod
    def apply_penalties(
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
        metadata: SpecDecodeMetadata,
        repeat_indices: torch.Tensor,
        output_token_ids: list[list[int]],
    ) -> torch.Tensor:
        """The Sampler's penalties with each request's values repeated per target row."""
        if sampling_metadata.no_penalties:
            return logits
        assert sampling_metadata.prompt_token_ids is not None
        return apply_all_penalties(
            logits,
            sampling_metadata.prompt_token_ids[repeat_indices],
            sampling_metadata.presence_penalties[repeat_indices],
            sampling_metadata.frequency_penalties[repeat_indices],
            sampling_metadata.repetition_penalties[repeat_indices],
            output_token_ids,
        )

    @staticmethod
    def _combine_outputs_with_spec_tokens(
        output_token_ids: list[list[int]], spec_token_ids: list[list[int]] | None = None
    ) -> list[list[int]]:
        """One list per target row: request i's output ids, then its drafts before that row.

        Requests without drafts own no target row and contribute nothing.
        """
        if spec_token_ids is None:
            return output_token_ids
        combined: list[list[int]] = []
        for out, spec in zip(output_token_ids, spec_token_ids):
            combined.extend([*out, *spec[:j]] for j in range(len(spec)))
        return combined


def _check_supported_logitsprocs(logitsprocs: LogitsProcessors) -> None:
    """Only min-tokens may be active while speculating (vLLM's rule)."""
    for processor in logitsprocs.all:
        if not isinstance(processor, MinTokensLogitsProcessor) and processor.is_active():
            raise ValueError(
                f"{type(processor).__name__} is active, but min_p, logit_bias and custom "
                "logits processors are not supported with speculative decoding."
            )


def _draft_starts(num_draft_tokens: list[int]) -> list[int]:
    """Index of each request's first draft in the flattened drafts (host ints)."""
    starts, total = [], 0
    for n in num_draft_tokens:
        starts.append(total)
        total += n
    return starts


def _apply_min_tokens_with_drafts(
    processor: MinTokensLogitsProcessor, logits: torch.Tensor, num_draft_tokens: list[int]
) -> None:
    """Mask stop tokens on the target rows of requests still short of min_tokens.

    Draft row j of a request comes after ``len(output) + j`` generated tokens,
    so the stop ids are masked on its first ``min_tokens - len(output)`` rows.
    Reads the processor's per-row state ``min_toks`` (row -> (min_tokens,
    output ids, stop ids)).
    """
    starts = _draft_starts(num_draft_tokens)
    rows: list[int] = []
    token_ids: list[int] = []
    for req, (min_tokens, out, stop_ids) in processor.min_toks.items():
        num_masked = min(max(min_tokens - len(out), 0), num_draft_tokens[req])
        for j in range(num_masked):
            rows.extend([starts[req] + j] * len(stop_ids))
            token_ids.extend(sorted(stop_ids))
    if rows:
        index = torch.tensor([rows, token_ids], dtype=torch.int64).to(logits.device)
        logits[index[0], index[1]] = float("-inf")


# ----------------------------------------------------------------------------
# Rejection sampling
# ----------------------------------------------------------------------------
def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_tokens] int32
    num_draft_tokens: list[int],  # [batch_size]
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,  # [batch_size] int32
    draft_probs: torch.Tensor | None,  # [num_tokens, V] float32 or None
    target_logits: torch.Tensor,  # [num_tokens, V] float32, processed
    bonus_token_ids: torch.Tensor,  # [batch_size, 1] int32
    sampling_metadata: SamplingMetadata,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Output tokens int32 [batch_size, max_spec_len + 1], -1 after each row's last.

    ``use_triton``: None = Triton kernels iff ``target_logits`` is on CUDA.
    """
    assert draft_token_ids.ndim == 1 and cu_num_draft_tokens.ndim == 1
    assert target_logits.ndim == 2 and (draft_probs is None or draft_probs.ndim == 2)
    use_triton = target_logits.is_cuda if use_triton is None else use_triton
    batch_size = len(num_draft_tokens)
    num_tokens, vocab_size = target_logits.shape
    device = target_logits.device
    assert draft_token_ids.shape[0] == num_tokens
    assert draft_probs is None or draft_probs.shape == (num_tokens, vocab_size)

    output_token_ids = torch.full(
        (batch_size, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=device
    )
    if batch_size == 0:
        return output_token_ids
    draft_token_ids = draft_token_ids.contiguous()
    bonus_token_ids = bonus_token_ids.contiguous()

    is_greedy = None  # None: every row is greedy
    if not sampling_metadata.all_greedy:
        assert sampling_metadata.temperature is not None
        is_greedy = sampling_metadata.temperature < _SAMPLING_EPS

    # Drawn before anything else consumes a generator, whichever path runs.
    uniform_probs = None
    if not sampling_metadata.all_greedy:
        uniform_probs = generate_uniform_probs(
            num_tokens, num_draft_tokens, sampling_metadata.generators, device
        )

    if not sampling_metadata.all_random:
        target_argmax = target_logits.argmax(dim=-1)  # [num_tokens] int64
        if use_triton:
            rejection_greedy_sample_kernel[(batch_size,)](
                output_token_ids,
                cu_num_draft_tokens,
                draft_token_ids,
                target_argmax,
                bonus_token_ids,
                is_greedy,
                max_spec_len,
            )
        else:
            rejection_greedy_sample_torch(
                output_token_ids,
                cu_num_draft_tokens,
                draft_token_ids,
                target_argmax,
                bonus_token_ids,
                is_greedy,
                max_spec_len,
            )
        if sampling_metadata.all_greedy:
            return output_token_ids

    assert is_greedy is not None and uniform_probs is not None
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32).contiguous()
    draft_probs = None if draft_probs is None else draft_probs.to(torch.float32).contiguous()
    recovered_token_ids = sample_recovered_tokens(
        max_spec_len,
        num_draft_tokens,
        cu_num_draft_tokens,
        draft_token_ids,
        draft_probs,
        target_probs,
        sampling_metadata,
        device,
        use_triton=use_triton,
    )
    if use_triton:
        rejection_random_sample_kernel[(batch_size,)](
            output_token_ids,
            cu_num_draft_tokens,
            draft_token_ids,
            draft_probs,
            target_probs,
            bonus_token_ids,
            recovered_token_ids,
            uniform_probs,
            is_greedy,
            max_spec_len,
            vocab_size,
            NO_DRAFT_PROBS=draft_probs is None,
        )
    else:
        rejection_random_sample_torch(
            output_token_ids,
            cu_num_draft_tokens,
            draft_token_ids,
            draft_probs,
            target_probs,
            bonus_token_ids,
            recovered_token_ids,
            uniform_probs,
            is_greedy,
            max_spec_len,
        )
    return output_token_ids


def apply_sampling_constraints(
    logits: torch.Tensor,  # [num_tokens, V] float32
    cu_num_draft_tokens: torch.Tensor,  # [batch_size]
    sampling_metadata: SamplingMetadata,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Temperature, then top-k / top-p, per target row with its request's values.

    Edits ``logits`` in place. An all-greedy batch is returned untouched
    (greedy rows only need the argmax); greedy rows of a mixed batch divide
    by 1.
    """
    assert logits.ndim == 2 and cu_num_draft_tokens.ndim == 1
    if sampling_metadata.all_greedy:
        return logits
    assert sampling_metadata.temperature is not None
    num_tokens = logits.shape[0]
    temperature = expand_batch_to_tokens(
        sampling_metadata.temperature,
        cu_num_draft_tokens,
        num_tokens,
        replace_from=GREEDY_TEMPERATURE,
        replace_to=1,
        use_triton=use_triton,
    )
    logits.div_(temperature.unsqueeze(-1))

    top_k = None
    if sampling_metadata.top_k is not None:
        top_k = expand_batch_to_tokens(
            sampling_metadata.top_k, cu_num_draft_tokens, num_tokens, use_triton=use_triton
        )
    top_p = None
    if sampling_metadata.top_p is not None:
        top_p = expand_batch_to_tokens(
            sampling_metadata.top_p, cu_num_draft_tokens, num_tokens, use_triton=use_triton
        )
    return apply_top_k_top_p(logits, top_k, top_p)


def expand_batch_to_tokens(
    x: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size]
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Repeat request i's value once per token it owns: [batch_size] -> [num_tokens].

    x = [a, b, c] with cu_num_tokens = [2, 5, 6] gives [a, a, b, b, b, c].
    Values equal to ``replace_from`` become ``replace_to`` (temperature 0 -> 1).
    """
    batch_size = x.shape[0]
    assert cu_num_tokens.shape[0] == batch_size
    use_triton = x.is_cuda if use_triton is None else use_triton
    if not use_triton:
        return expand_torch(x, cu_num_tokens, num_tokens, replace_from, replace_to)
    expanded_x = x.new_empty(num_tokens)
    if batch_size > 0 and num_tokens > 0:
        expand_kernel[(batch_size,)](
            expanded_x, x, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=MAX_SPEC_LEN
        )
    return expanded_x


def generate_uniform_probs(
    num_tokens: int,
    num_draft_tokens: list[int],
    generators: dict[int, torch.Generator],
    device: torch.device,
) -> torch.Tensor:
    """One U[0, 1) draw per draft token, float64 [num_tokens].

    Float64 because float32 ``rand`` returns exactly 0 often enough to matter
    (0 would accept any draft). A seeded request's draws come from its own
    generator; a request with no drafts draws nothing from it.
    """
    uniform_probs = torch.rand((num_tokens,), dtype=torch.float64, device=device)
    start = 0
    for req, n in enumerate(num_draft_tokens):
        if n == 0:
            continue
        generator = generators.get(req)
        if generator is not None:
            uniform_probs[start : start + n].uniform_(generator=generator)
        start += n
    return uniform_probs


def sample_recovered_tokens(
    max_spec_len: int,
    num_draft_tokens: list[int],
    cu_num_draft_tokens: torch.Tensor,  # [batch_size]
    draft_token_ids: torch.Tensor,  # [num_tokens]
    draft_probs: torch.Tensor | None,  # [num_tokens, V] or None
    target_probs: torch.Tensor,  # [num_tokens, V]
    sampling_metadata: SamplingMetadata,
    device: torch.device,
    use_triton: bool | None = None,
    block_size: int = _RECOVERED_BLOCK_SIZE,
) -> torch.Tensor:
    """For every draft position, a token from normalize(max(p - q, 0)), int32 [num_tokens].

    The exponential race: with one Exp(1) vector per request, ``argmax(residual
    / q)`` is a draw from the normalised residual (no normalising needed).
    ``block_size``: the kernel's vocabulary tile (a power of two).
    """
    batch_size = len(num_draft_tokens)
    vocab_size = target_probs.shape[-1]
    q = torch.empty((batch_size, vocab_size), dtype=torch.float32, device=device)
    q.exponential_()
    for req, generator in sampling_metadata.generators.items():
        if num_draft_tokens[req] > 0:
            q[req].exponential_(generator=generator)
    inv_q = q.clamp_min_(torch.finfo(torch.float32).tiny).reciprocal()

    use_triton = target_probs.is_cuda if use_triton is None else use_triton
    if not use_triton:
        return sample_recovered_tokens_torch(
            cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, inv_q
        )
    recovered_token_ids = torch.empty_like(draft_token_ids)
    if batch_size > 0 and max_spec_len > 0:
        sample_recovered_tokens_kernel[(batch_size, max_spec_len)](
            recovered_token_ids,
            cu_num_draft_tokens,
            draft_token_ids,
            draft_probs,
            target_probs,
            inv_q,
            vocab_size,
            BLOCK_SIZE=min(block_size, triton.next_power_of_2(vocab_size)),
            NO_DRAFT_PROBS=draft_probs is None,
        )
    return recovered_token_ids

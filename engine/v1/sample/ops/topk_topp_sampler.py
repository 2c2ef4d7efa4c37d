"""Top-k / top-p filtering followed by a random draw, per request row.

vLLM twin: ``vllm/v1/sample/ops/topk_topp_sampler.py`` (``TopKTopPSampler``,
``apply_top_k_top_p_pytorch``, ``random_sample``).
Read it for:

- top-k: keep the k highest logits of the row (k = vocab size means "off").
- top-p (nucleus): of what top-k kept, keep the most likely tokens until
  their probability mass reaches p (the token that crosses p is kept; the
  most likely token is always kept; p = 1 means "off").
- the draw without ``torch.multinomial``: with q_i ~ Exp(1) independent,
  ``argmax_i(p_i / q_i)`` is token i with probability exactly p_i (the
  "exponential race": token i arrives at time q_i / p_i; the first arrival
  wins). It needs no CPU-GPU sync and makes per-request seeds easy: a row
  with its own ``torch.Generator`` draws its q from that generator, so its
  tokens depend only on its seed and its own logits, never on which other
  requests share the batch. Rows without a generator use the global RNG.

Sessions: 05.

On CUDA (``forward_cuda``), when a batch asks for top-k or top-p and no row
has its own generator, the draw goes to FlashInfer's rejection samplers
(``top_k_top_p_sampling_from_logits``, ``top_k_sampling_from_probs``,
``top_p_sampling_from_probs``) when ``flashinfer`` imports: they sample
from the filtered distribution without sorting the vocabulary. The tokens
follow the same distribution as the torch path, not the same draws. Seeded
rows keep the torch path (FlashInfer's RNG has no per-row generators, and a
seeded request must give the same tokens whatever shares its batch), and so
do batches with neither filter (the exponential race needs no sort anyway).
``GLASSBOX_USE_FLASHINFER_SAMPLER=0`` turns the FlashInfer path off (vLLM:
``VLLM_USE_FLASHINFER_SAMPLER``); ``keep_filtered_logits=True`` does too, for
the ``full`` trace, which reads the filtered logits back (FlashInfer filters
inside its kernel and leaves ``logits`` untouched).

``logprobs_mode``: in ``processed_logits`` / ``processed_logprobs`` the
sampler returns the logits it sampled from (after top-k / top-p), so those
modes always take the torch path (FlashInfer does not hand them back).

Simpler than vLLM: torch everywhere else. vLLM also has a Triton
top-k/top-p kernel for larger batches (``apply_top_k_top_p`` picks it),
aiter on ROCm, an XPU kernel and a ``torch.compile``-d draw on CPU; all
compute the same distribution. Here ``apply_top_k_top_p`` always calls
``apply_top_k_top_p_pytorch``, which never needs a host sync (vLLM's takes
``allow_cpu_sync`` for a faster top-k-only path on the CPU).

Ties: both filters here are thresholds on the logit value, so tokens tied
with the last kept token are kept too. vLLM's top-k does the same; its top-p
masks positions of a sorted row, so at a tie on the top-p boundary it may keep
any subset of the tied tokens depending on sort order. Glassbox keeps them all
so that the kept set does not depend on how ``sort`` orders equal values.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from engine.config.model import LogprobsMode


class TopKTopPSampler(nn.Module):
    """Filter logits with top-k and/or top-p, then draw one token per row.

    On the torch path, when k or p is given, ``logits`` is filtered in place
    (the ``full`` trace reads the filtered distribution from it afterwards).
    """

    def __init__(
        self, logprobs_mode: LogprobsMode = "raw_logprobs", keep_filtered_logits: bool = False
    ) -> None:
        super().__init__()
        self.logprobs_mode = logprobs_mode
        # Processed modes return the filtered logits: only the torch path has them.
        keep_filtered_logits |= logprobs_mode in ("processed_logits", "processed_logprobs")
        self.use_flashinfer = (
            not keep_filtered_logits and os.environ.get(USE_FLASHINFER_SAMPLER_ENV, "1") != "0"
        )

    def forward(
        self,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        k: torch.Tensor | None,
        p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [N, V] float32 (already temperature-scaled); k int [N] or
        None; p float32 [N] or None; generators maps row -> its generator.

        Returns (sampled ids int64 [N], the filtered logits or their logprobs
        in a ``processed_*`` logprobs mode, else None).
        """
        if logits.is_cuda and self.use_flashinfer:
            return self.forward_cuda(logits, generators, k, p)
        return self.forward_native(logits, generators, k, p)

    def forward_native(
        self,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        k: torch.Tensor | None,
        p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Plain torch, any device: threshold filter, softmax, exponential race."""
        logits = apply_top_k_top_p(logits, k, p)
        processed = None
        if self.logprobs_mode == "processed_logits":
            processed = logits
        elif self.logprobs_mode == "processed_logprobs":
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        return random_sample(probs, generators), processed

    def forward_cuda(
        self,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        k: torch.Tensor | None,
        p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FlashInfer's samplers when they apply (see the module docstring),
        else the torch path."""
        if (k is None and p is None) or generators or not flashinfer_sampling_available():
            return self.forward_native(logits, generators, k, p)
        return flashinfer_sample(logits.contiguous(), k, p), None


USE_FLASHINFER_SAMPLER_ENV = "GLASSBOX_USE_FLASHINFER_SAMPLER"


@functools.cache
def flashinfer_sampling_available() -> bool:
    try:
        import flashinfer.sampling  # noqa: F401
    except ImportError:
        return False
    return True


def flashinfer_sample(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """One token per row of ``logits`` [N, V] (float32, CUDA) from the top-k /
    top-p filtered distribution, by FlashInfer's rejection sampling. Draws
    from torch's global CUDA RNG. Returns int64 [N]."""
    import flashinfer.sampling

    if k is None and p is None:
        raise ValueError("flashinfer_sample needs top-k or top-p (k and p are both None)")
    if k is None:
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        sampled = flashinfer.sampling.top_p_sampling_from_probs(probs, p, deterministic=True)
    elif p is None:
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        sampled = flashinfer.sampling.top_k_sampling_from_probs(probs, k, deterministic=True)
    else:
        # Top-k first, then top-p over what top-k kept: the order apply_top_k_top_p uses.
        sampled = flashinfer.sampling.top_k_top_p_sampling_from_logits(
            logits, k, p, deterministic=True
        )
    return sampled.view(-1).to(torch.int64)


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """The filter the sampler calls (vLLM picks a Triton kernel here for
    large GPU batches; Glassbox always uses the torch one)."""
    return apply_top_k_top_p_pytorch(logits, k, p)


def apply_top_k_top_p_pytorch(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """Set filtered-out logits to -inf, in place. logits [N, V]; k in [1, V]
    ([N], any int dtype); p in (0, 1] ([N] or [1])."""
    if k is None and p is None:
        return logits
    vocab_size = logits.shape[-1]
    # Ascending sort: position V-1 holds the row's largest logit.
    sorted_logits = logits.sort(dim=-1).values  # [N, V]
    threshold: torch.Tensor | None = None  # [N, 1]: keep logits >= threshold

    if k is not None:
        # The k-th largest logit sits at ascending position V - k.
        kth_position = (vocab_size - k.to(torch.int64)).clamp(0, vocab_size - 1)
        threshold = sorted_logits.gather(1, kth_position.unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))

    if p is not None:
        # Probabilities of what top-k kept, smallest first; mass_up_to[j] is the
        # mass of sorted positions 0..j. A prefix whose mass is <= 1 - p can be
        # dropped: what is left still has mass >= p.
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_up_to = sorted_probs.cumsum(dim=-1)
        num_dropped = (mass_up_to <= 1 - p.unsqueeze(1)).sum(dim=-1)
        # Never drop the largest logit, whatever rounding did to the sums.
        num_dropped = num_dropped.clamp(max=vocab_size - 1)
        p_threshold = sorted_logits.gather(1, num_dropped.unsqueeze(1))
        threshold = p_threshold if threshold is None else torch.maximum(threshold, p_threshold)

    assert threshold is not None
    return logits.masked_fill_(logits < threshold, float("-inf"))


def random_sample(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """Draw one token per row of ``probs`` [N, V] via the exponential race.

    Rows listed in ``generators`` draw their noise from their own generator;
    all other rows from the global RNG. Returns int64 [N].
    """
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        # Fill every row from the global RNG, then overwrite the seeded rows.
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # Exp(1) can return exactly 0; 0/0 would be NaN and NaN wins argmax. With a
    # floor, a zero-probability token scores 0 and can never be drawn.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1).view(-1)

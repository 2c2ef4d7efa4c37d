"""Synthetic requests for the benchmarks: nano-vllm's random workload.

vLLM twin: ``vllm/benchmarks/datasets/datasets.py`` (``SampleRequest``,
``RandomDataset``). Read it for what a benchmark request is -- prompt token
ids plus the number of output tokens it must produce (``ignore_eos`` makes
that exact) -- and for the workload every throughput figure in this project
uses, nano-vllm's ``bench.py``: Python's ``random`` seeded with 0, then for
each of 256 sequences a prompt of ``randint(100, 1024)`` tokens, each
``randint(0, 10000)``, then the output lengths ``randint(100, 1024)``, in that
order (all prompts first, then all output lengths). With the defaults it gives
133,966 output tokens and 142,827 prompt tokens, as nano-vllm's README says.
Sessions: 06 (performance).

Simpler than vLLM: one synthetic dataset. vLLM's module also reads ShareGPT,
Sonnet, HF datasets, multimodal and prefix-repetition workloads, and samples
random lengths with a range ratio rather than nano-vllm's inclusive ranges.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class SampleRequest:
    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def parse_len_range(value: str | int | tuple[int, int], name: str) -> tuple[int, int]:
    """``"100-1024"`` -> (100, 1024); ``"512"`` or 512 -> (512, 512). Inclusive."""
    if isinstance(value, tuple):
        lo, hi = value
    elif isinstance(value, int):
        lo = hi = value
    else:
        text = str(value).strip()
        parts = text.split("-") if "-" in text else [text, text]
        try:
            lo, hi = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"{name} must be N or MIN-MAX with integers, got {value!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must satisfy 1 <= MIN <= MAX, got {lo}-{hi}")
    return lo, hi


def sample_random_requests(
    num_requests: int = 256,
    input_len: tuple[int, int] = (100, 1024),
    output_len: tuple[int, int] = (100, 1024),
    seed: int = 0,
    max_token_id: int = 10000,
) -> list[SampleRequest]:
    """nano-vllm's workload (the defaults reproduce ``bench.py`` exactly).

    ``max_token_id`` is inclusive, as ``randint``'s upper bound; lower it for
    a model whose vocabulary is smaller than 10,001 tokens.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if max_token_id < 0:
        raise ValueError(f"max_token_id must be >= 0, got {max_token_id}")
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, max_token_id) for _ in range(rng.randint(*input_len))]
        for _ in range(num_requests)
    ]
    out_lens = [rng.randint(*output_len) for _ in range(num_requests)]
    return [SampleRequest(p, n) for p, n in zip(prompts, out_lens)]

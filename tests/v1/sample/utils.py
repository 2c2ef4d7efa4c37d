"""Factories shared by the sampler and persistent-batch tests.

Import with ``from tests.v1.sample.utils import ...`` (vLLM keeps its own
helpers for these tests in a module of the same name).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import GlassboxConfig, ModelConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    build_logitsprocs,
    process_dict_updates,
)
from engine.v1.worker.gpu_input_batch import CachedRequestState, InputBatch


def make_glassbox_config(max_num_seqs: int = 8) -> GlassboxConfig:
    """An engine config that reads no checkpoint; only ``max_num_seqs`` matters
    to the logits processors (their per-row buffers)."""
    return GlassboxConfig(
        model_config=ModelConfig(model="glassbox-test-model", hf_config={"vocab_size": 32}),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs),
    )


def fresh_logitsproc(
    cls: type[LogitsProcessor],
    params: Sequence[SamplingParams],
    outputs: Sequence[list[int]] | None = None,
    prompts: Sequence[list[int]] | None = None,
) -> LogitsProcessor:
    """A new ``cls`` on the CPU, told that request i was just added in row i."""
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = prompts if prompts is not None else [[0] for _ in range(n)]
    proc = cls(make_glassbox_config(max(n, 1)), torch.device("cpu"), False)
    added = [(row, sp, prompts[row], outputs[row]) for row, sp in enumerate(params)]
    proc.update_state(BatchUpdate(batch_size=n, removed=[], added=added, moved=[]))
    return proc


def make_input_batch(
    max_num_reqs: int = 8, vocab_size: int = 32, max_model_len: int = 64, block_size: int = 4
) -> InputBatch:
    """A CPU persistent batch with the built-in logits processors, as the runner builds it."""
    device = torch.device("cpu")
    return InputBatch(
        max_num_reqs=max_num_reqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len,
        device=device,
        pin_memory=False,
        vocab_size=vocab_size,
        block_sizes=[block_size],
        kernel_block_sizes=[block_size],
        logitsprocs=build_logitsprocs(make_glassbox_config(max_num_reqs), device, False),
    )


def make_request_state(
    req_id: str,
    params: SamplingParams,
    prompt: list[int],
    output: list[int] | None = None,
    block_ids: list[int] | None = None,
) -> CachedRequestState:
    """A request as the runner caches it; seeded params get their own generator."""
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        mm_features=[],
        sampling_params=params,
        generator=generator,
        block_ids=(list(block_ids) if block_ids is not None else [1],),
        num_computed_tokens=0,
        output_token_ids=list(output) if output is not None else [],
    )


class BanTokenLogitsProcessor(LogitsProcessor):
    """A custom processor for the tests: a request with
    ``extra_args={"ban_token": t}`` never samples token ``t``."""

    def __init__(self, glassbox_config: GlassboxConfig, device: torch.device, is_pin_memory: bool):
        self.banned: dict[int, int] = {}  # row -> token

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        token = (sampling_params.extra_args or {}).get("ban_token")
        if token is not None and not isinstance(token, int):
            raise ValueError(f"ban_token must be an int, got {token!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def is_active(self) -> bool:
        return bool(self.banned)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.banned,
            batch_update,
            lambda params, _, __: (params.extra_args or {}).get("ban_token"),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, token in self.banned.items():
            logits[row, token] = float("-inf")
        return logits

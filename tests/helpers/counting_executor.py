"""A stand-in model for engine-loop tests: it "predicts" last token + 1.

It implements the real ``Executor`` interface and consumes ``SchedulerOutput``
exactly as a worker must -- full data for new requests, deltas for cached
ones, a fresh block table for resumed ones -- and checks on every step that
the block table it has rebuilt from those deltas is the scheduler's own table
and has a slot for every scheduled token. So the tests exercise the
scheduler/worker protocol, not just the scheduler.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.v1.core.sched.output import SchedulerOutput
from engine.v1.executor.abstract import Executor, done_future
from engine.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from engine.v1.outputs import LogprobsLists, ModelRunnerOutput


@dataclass
class _ReqState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    logprobs: int | None = None
    history: list[int] = field(default_factory=list)


def non_blocking(method: Callable[..., Any]) -> Callable[..., Any]:
    """An executor method that also takes ``non_block``, as an in-process
    executor's does: with ``non_block=True`` it runs now and returns a done
    ``Future`` holding its result or its exception."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, non_block: bool = False) -> Any:
        if non_block:
            return done_future(method, self, *args)
        return method(self, *args)

    return wrapper


class CountingExecutor(Executor):
    # Test knobs (class attributes so tests can subclass cheaply).
    available_memory: int = 64 * 2 * 16 * 1 * 8 * 4 * 2  # 64 blocks for 2 layers
    num_layers: int = 2
    all_executors: list[CountingExecutor] = []

    def _init_executor(self) -> None:
        self.requests: dict[str, _ReqState] = {}
        self.kv_cache_config: KVCacheConfig | None = None
        self.vocab_size = self.glassbox_config.model_config.vocab_size or 1000
        self.steps: list[SchedulerOutput] = []
        self.is_shutdown = False
        self.updated_max_model_len: int | None = None
        CountingExecutor.all_executors.append(self)

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        block_size = self.glassbox_config.cache_config.block_size
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=8, dtype="float32"
        )
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(self.num_layers)}

    def determine_available_memory(self) -> int:
        return self.available_memory

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config

    def update_max_model_len(self, max_model_len: int) -> None:
        self.updated_max_model_len = max_model_len  # no workers: only recorded

    @non_blocking
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(scheduler_output)
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = _ReqState(
                token_ids=list(new.prompt_token_ids),
                block_ids=list(new.block_ids[0]),
                num_computed_tokens=new.num_computed_tokens,
                logprobs=new.sampling_params.logprobs,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state = self.requests[req_id] = _ReqState(
                    token_ids=list(cached.all_token_ids[req_id]),
                    block_ids=list(new_blocks[0]) if new_blocks else [],
                    num_computed_tokens=cached.num_computed_tokens[i],
                )
            else:
                state = self.requests[req_id]
                if req_id in cached.all_token_ids:
                    state.token_ids = list(cached.all_token_ids[req_id])
                if new_blocks:
                    state.block_ids.extend(new_blocks[0])
                state.num_computed_tokens = cached.num_computed_tokens[i]

        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        rows_ids: list[list[int]] = []
        rows_lp: list[list[float]] = []
        ranks: list[int] = []
        block_size = self.glassbox_config.cache_config.block_size
        for req_id in req_ids:
            state = self.requests[req_id]
            n = scheduler_output.num_scheduled_tokens[req_id]
            end = state.num_computed_tokens + n
            assert end <= len(state.token_ids), (req_id, end, len(state.token_ids))
            assert len(state.block_ids) * block_size >= end, "no KV slot for a scheduled token"
            state.num_computed_tokens = end
            if end < len(state.token_ids):
                sampled.append([])  # a prefill chunk short of the prompt's end
                continue
            token = (state.token_ids[-1] + 1) % self.vocab_size
            state.token_ids.append(token)
            sampled.append([token])
            if state.logprobs is not None:
                # Pretend the sampled token is the most likely one (rank 1)
                # and the runners-up are the next ids with falling logprobs.
                top = [(token + k) % self.vocab_size for k in range(state.logprobs)]
                rows_ids.append([token, *top])
                rows_lp.append([-0.5] + [-0.5 - k for k in range(state.logprobs)])
                ranks.append(1)
            else:
                rows_ids.append([token])
                rows_lp.append([-0.5])
                ranks.append(1)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=LogprobsLists(rows_ids, rows_lp, ranks),
        )

    def shutdown(self) -> None:
        self.is_shutdown = True

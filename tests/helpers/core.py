"""Factories shared by the tests of ``engine/v1/core`` (KV cache and scheduler).

vLLM keeps the equivalent helpers inside each test file (``make_request``,
``make_kv_cache_config``); Glassbox gathers them here so the KV-cache tests and
the scheduler tests build requests and pools the same way.

Import from a test file with::

    from tests.helpers.core import make_kv_cache_manager, make_request

Conventions:
  * Every request built here hashes its full blocks with the real
    ``get_request_block_hasher(block_size, sha256)``, exactly as EngineCore
    does, so prefix-cache hits in tests are genuine hash matches.
  * Pools are built through ``get_kv_cache_configs`` with
    ``num_gpu_blocks_override``, so ``num_blocks`` *includes* the null block:
    a pool of ``N`` blocks has ``N - 1`` usable ones (ids ``1 .. N-1``).
  * Nothing here mutates global state.

Keep functions general and backwards compatible: other test files rely on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.config import CacheConfig, GlassboxConfig, ModelConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.utils.hashing import sha256
from engine.v1.core.block_pool import BlockPool
from engine.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from engine.v1.core.kv_cache_utils import get_kv_cache_configs, get_request_block_hasher
from engine.v1.core.sched.async_scheduler import AsyncScheduler
from engine.v1.core.sched.output import SchedulerOutput
from engine.v1.core.sched.scheduler import Scheduler
from engine.v1.engine import EngineCoreOutput, EngineCoreOutputs
from engine.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from engine.v1.metrics.stats import SchedulerStats
from engine.v1.outputs import LogprobsLists, ModelRunnerOutput
from engine.v1.request import Request

# Default geometry of the test KV cache: 16 tokens per block (vLLM's default),
# one KV head of size 8, float32 -> 2 * 16 * 1 * 8 * 4 = 1024 bytes per block
# per layer.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_NUM_KV_HEADS = 1
DEFAULT_HEAD_SIZE = 8


def make_sampling_params(
    max_tokens: int = 16,
    *,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
    min_tokens: int = 0,
    eos_token_id: int | None = None,
    **kwargs,
) -> SamplingParams:
    """A validated ``SamplingParams`` with ``max_tokens`` resolved.

    ``eos_token_id`` (optional) is applied the way the input processor does,
    through ``update_from_generation_config({}, eos_token_id)``; leave it None
    for requests that can only stop on ``max_tokens`` / ``stop_token_ids``.
    Extra keyword arguments go straight to ``SamplingParams`` (e.g.
    ``temperature=0.0``, ``prompt_logprobs=1``).
    """
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids,
        min_tokens=min_tokens,
        **kwargs,
    )
    if eos_token_id is not None:
        params.update_from_generation_config({}, eos_token_id=eos_token_id)
    return params


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int = 16,
    block_size: int = DEFAULT_BLOCK_SIZE,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
    min_tokens: int = 0,
    *,
    eos_token_id: int | None = None,
    sampling_params: SamplingParams | None = None,
    hash_blocks: bool = True,
    **sampling_kwargs,
) -> Request:
    """A WAITING ``Request`` whose full blocks are already hashed.

    Args:
        request_id: the request's id (also its final tie-break in priority order).
        prompt_token_ids: the prompt; must be non-empty.
        max_tokens / ignore_eos / stop_token_ids / min_tokens / eos_token_id /
            **sampling_kwargs: forwarded to ``make_sampling_params``; ignored
            when ``sampling_params`` is given.
        block_size: block size the hasher uses; must match the KV cache the
            request is scheduled on, or prefix hits will never happen.
        priority, arrival_time, cache_salt: as in ``Request``. ``arrival_time``
            defaults to ``time.time()``; pass explicit values when a test
            depends on FCFS/priority order.
        hash_blocks: False builds the request without a block hasher
            (``block_hashes`` stays empty), like a request of an engine whose
            prefix caching is off.
    """
    if sampling_params is None:
        sampling_params = make_sampling_params(
            max_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=stop_token_ids,
            min_tokens=min_tokens,
            eos_token_id=eos_token_id,
            **sampling_kwargs,
        )
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling_params,
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(block_size, sha256) if hash_blocks else None,
    )


def make_kv_cache_spec(
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_kv_heads: int = DEFAULT_NUM_KV_HEADS,
    head_size: int = DEFAULT_HEAD_SIZE,
    dtype: str = "float32",
) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )


def make_kv_cache_config(
    num_blocks: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int | None = None,
    num_layers: int = 1,
) -> KVCacheConfig:
    """A one-group ``KVCacheConfig`` of exactly ``num_blocks`` blocks (null block included).

    ``max_model_len`` defaults to the longest sequence the pool can hold,
    ``(num_blocks - 1) * block_size``. A larger value raises ValueError from
    ``get_kv_cache_configs``, just as EngineCore would at start-up.
    """
    if max_model_len is None:
        max_model_len = max(num_blocks - 1, 1) * block_size
    spec = make_kv_cache_spec(block_size)
    glassbox_config = GlassboxConfig(
        model_config=make_model_config(max_model_len),
        cache_config=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks),
    )
    (kv_cache_config,) = get_kv_cache_configs(
        glassbox_config,
        [{f"model.layers.{i}.self_attn.attn": spec for i in range(num_layers)}],
        [0],
    )
    return kv_cache_config


def make_kv_cache_manager(
    num_blocks: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int | None = None,
    enable_caching: bool = True,
    log_stats: bool = False,
) -> KVCacheManager:
    """A ``KVCacheManager`` over a fresh pool of ``num_blocks`` blocks.

    ``max_model_len`` defaults as in ``make_kv_cache_config``; the manager caps
    slot allocation at it. ``log_stats=True`` turns on ``PrefixCacheStats``.
    """
    config = make_kv_cache_config(num_blocks, block_size, max_model_len)
    if max_model_len is None:
        max_model_len = (num_blocks - 1) * block_size
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        hash_block_size=block_size,
        enable_caching=enable_caching,
        log_stats=log_stats,
    )


def block_token_ids(fill_values: Iterable[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """One full block per value, each block filled with that value.

    ``block_token_ids([0, 1, 2])`` is 48 tokens: sixteen 0s, sixteen 1s, sixteen 2s.
    """
    return [value for value in fill_values for _ in range(block_size)]


def free_block_ids(block_pool: BlockPool) -> list[int]:
    """Ids in the free queue, head (evicted first) to tail."""
    return [block.block_id for block in block_pool.free_block_queue.get_all_free_blocks()]


def get_request_block_ids(manager: KVCacheManager, request_id: str) -> list[int]:
    """The request's block table (group 0), or [] when it holds no blocks."""
    return [block.block_id for block in manager.get_blocks(request_id).blocks[0]]


def allocate_prompt(
    manager: KVCacheManager, request: Request, advance: bool = True
) -> tuple[KVCacheBlocks | None, int]:
    """Schedule a waiting request's whole prompt the way the scheduler does.

    Looks up the prefix cache, then allocates slots for every prompt token
    not covered by the hit (the hit blocks are adopted by ``allocate_slots``).
    Returns ``(new_blocks, num_hit_tokens)``; ``new_blocks`` is None when the
    pool is too small (and then nothing changed). With ``advance`` and a
    successful allocation, ``request.num_computed_tokens`` moves to
    ``request.num_tokens``, as after the step that computes the prompt.
    """
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    num_new_tokens = request.num_tokens - request.num_computed_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(
        request,
        num_new_tokens,
        num_new_computed_tokens=num_hit_tokens,
        new_computed_blocks=hit_blocks,
    )
    if new_blocks is not None and advance:
        request.num_computed_tokens = request.num_tokens
    return new_blocks, num_hit_tokens


def assert_block_pool_consistent(block_pool: BlockPool) -> None:
    """Check the pool's invariants; raise AssertionError naming the first broken one.

    * The free queue's forward and backward walks agree, and both match
      ``num_free_blocks``.
    * A block is in the free queue iff its ``ref_cnt`` is 0; the null block
      is never in it.
    * Every block with a hash is registered under exactly that hash in the
      prefix-cache map, and every map entry points back at a block with that
      hash (reads the map's private ``_cache`` dict).
    """
    queue = block_pool.free_block_queue
    forward = []
    block = queue.fake_free_list_head.next_free_block
    while block is not None and block is not queue.fake_free_list_tail:
        forward.append(block)
        block = block.next_free_block
    assert block is queue.fake_free_list_tail, "forward walk did not reach the tail sentinel"
    backward = []
    block = queue.fake_free_list_tail.prev_free_block
    while block is not None and block is not queue.fake_free_list_head:
        backward.append(block)
        block = block.prev_free_block
    assert block is queue.fake_free_list_head, "backward walk did not reach the head sentinel"
    assert forward == backward[::-1], "forward and backward walks disagree"
    assert len(forward) == queue.num_free_blocks, (
        f"num_free_blocks={queue.num_free_blocks} but {len(forward)} blocks are linked"
    )

    in_queue = {b.block_id for b in forward}
    assert len(in_queue) == len(forward), "a block is linked into the free queue twice"
    assert block_pool.null_block.block_id not in in_queue, "the null block is in the free queue"
    for b in block_pool.blocks:
        if b.is_null:
            continue
        if b.block_id in in_queue:
            assert b.ref_cnt == 0, f"block {b.block_id} is free but has ref_cnt {b.ref_cnt}"
        else:
            assert b.ref_cnt > 0, f"block {b.block_id} has ref_cnt 0 but is not in the free queue"
            assert b.prev_free_block is None and b.next_free_block is None, (
                f"block {b.block_id} is in use but still has free-queue links"
            )

    cache = block_pool.cached_block_hash_to_block._cache
    registered: dict[int, bytes] = {}
    for key, entry in cache.items():
        blocks = [entry] if not isinstance(entry, dict) else list(entry.values())
        assert blocks, f"empty entry left in the prefix-cache map under {key.hex()[:8]}"
        for b in blocks:
            assert b.block_hash == key, (
                f"block {b.block_id} is mapped under a hash it does not carry"
            )
            registered[b.block_id] = key
    for b in block_pool.blocks:
        if b.block_hash is not None:
            assert registered.get(b.block_id) == b.block_hash, (
                f"block {b.block_id} carries a hash but is not in the prefix-cache map"
            )


# ---------------------------------------------------------------------------
# Scheduler factories (tests/v1/core/test_scheduler*.py)
# ---------------------------------------------------------------------------
# The token every request "samples" in run_step unless the test says otherwise.
# Kept away from the small ids tests use for EOS / stop tokens.
DEFAULT_SAMPLED_TOKEN_ID = 100


def make_model_config(max_model_len: int = 1024) -> ModelConfig:
    """A ``ModelConfig`` that reads no checkpoint: its HF config is a dict
    whose context length is ``max_model_len``."""
    return ModelConfig(
        model="glassbox-test-model",
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        hf_config={"max_position_embeddings": max_model_len},
    )


def make_scheduler(
    *,
    num_blocks: int = 1000,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int = 1024,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 16,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    scheduler_reserve_full_isl: bool = True,
    log_stats: bool = True,
    include_finished_set: bool = False,
    structured_output_manager: object | None = None,
    async_scheduling: bool = False,
) -> Scheduler:
    """A ``Scheduler`` over a pool of exactly ``num_blocks`` blocks (null block included).

    Built the way EngineCore builds it: a ``GlassboxConfig`` (model config
    from ``make_model_config``, ``SchedulerConfig``, ``CacheConfig`` with
    ``num_gpu_blocks_override``) + a ``KVCacheConfig`` from
    ``get_kv_cache_configs``. ``max_model_len`` must fit in the pool
    (``(num_blocks - 1) * block_size`` tokens) and, with chunked prefill off,
    in ``max_num_batched_tokens`` -- the configs raise ValueError otherwise.
    ``async_scheduling=True`` builds an ``AsyncScheduler`` (placeholders, the
    scheduler of ``EngineCore.step_with_batch_queue``) with
    ``scheduler_config.async_scheduling`` set, as ``get_scheduler_cls`` would.
    """
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,  # type: ignore[arg-type]
        scheduler_reserve_full_isl=scheduler_reserve_full_isl,
        # None unless asked: GlassboxConfig resolves it as for any other config.
        async_scheduling=True if async_scheduling else None,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_gpu_blocks_override=num_blocks,
    )
    glassbox_config = GlassboxConfig(
        model_config=make_model_config(max_model_len),
        cache_config=cache_config,
        scheduler_config=scheduler_config,
    )
    kv_cache_config = make_kv_cache_config(num_blocks, block_size, max_model_len)
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    return scheduler_cls(
        glassbox_config,
        kv_cache_config,
        structured_output_manager,
        block_size,
        include_finished_set=include_finished_set,
        log_stats=log_stats,
    )


def make_model_runner_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    sampled: dict[str, list[int]] | None = None,
    *,
    default_token_id: int = DEFAULT_SAMPLED_TOKEN_ID,
    req_order: Sequence[str] | None = None,
    logprobs: LogprobsLists | None = None,
) -> ModelRunnerOutput:
    """What a worker would return for ``scheduler_output``, built by hand.

    Every scheduled request gets a row. ``sampled[req_id]`` (when given) is
    used verbatim; otherwise a request whose scheduled tokens stop short of
    its sequence (``is_prefill_chunk``) samples ``[]`` and any other request
    samples ``[default_token_id]``. Requests the scheduler no longer knows
    (aborted mid-step) still get a row, as the model did run them.
    ``req_order`` overrides the row order (default: the order of
    ``scheduler_output.num_scheduled_tokens``).
    """
    sampled = sampled or {}
    req_ids = (
        list(req_order) if req_order is not None else list(scheduler_output.num_scheduled_tokens)
    )
    if sorted(req_ids) != sorted(scheduler_output.num_scheduled_tokens):
        raise ValueError(f"req_order {req_ids} must be a permutation of the scheduled requests")
    sampled_token_ids: list[list[int]] = []
    for req_id in req_ids:
        if req_id in sampled:
            sampled_token_ids.append(list(sampled[req_id]))
            continue
        request = scheduler.requests.get(req_id)
        if request is not None and request.is_prefill_chunk:
            sampled_token_ids.append([])
        else:
            sampled_token_ids.append([default_token_id])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled_token_ids,
        logprobs=logprobs,
    )


@dataclass
class StepResult:
    """One engine step driven by hand: schedule -> fake model -> update."""

    scheduler_output: SchedulerOutput
    model_runner_output: ModelRunnerOutput
    engine_core_outputs: dict[int, EngineCoreOutputs]

    @property
    def outputs(self) -> dict[str, EngineCoreOutput]:
        """Every client's per-request outputs, by request id."""
        return {
            out.request_id: out for eco in self.engine_core_outputs.values() for out in eco.outputs
        }

    @property
    def stats(self) -> SchedulerStats | None:
        eco = self.engine_core_outputs.get(0)
        return eco.scheduler_stats if eco is not None else None


def run_step(
    scheduler: Scheduler,
    sampled: dict[str, list[int]] | None = None,
    *,
    default_token_id: int = DEFAULT_SAMPLED_TOKEN_ID,
) -> StepResult:
    """``schedule()``, a hand-made ``ModelRunnerOutput`` (see
    ``make_model_runner_output``), then ``update_from_output``."""
    scheduler_output = scheduler.schedule()
    model_runner_output = make_model_runner_output(
        scheduler, scheduler_output, sampled, default_token_id=default_token_id
    )
    engine_core_outputs = scheduler.update_from_output(scheduler_output, model_runner_output)
    return StepResult(scheduler_output, model_runner_output, engine_core_outputs)


# ---------------------------------------------------------------------------
# Async scheduling: steps launched before the previous one is read back
# ---------------------------------------------------------------------------
@dataclass
class InFlightStep:
    """A step that ``EngineCore.step_with_batch_queue`` launched and has not
    read back yet: its ``SchedulerOutput`` and what the fake worker samples."""

    scheduler_output: SchedulerOutput
    sampled: dict[str, list[int]]


def launch_step(
    scheduler: Scheduler,
    tokens: dict[str, int] | None = None,
    *,
    default_token_id: int = DEFAULT_SAMPLED_TOKEN_ID,
) -> InFlightStep:
    """``schedule()``, and fix now what the worker will sample for each request.

    The runner decides at launch: a request whose scheduled tokens stop short
    of its sequence (``is_prefill_chunk`` right after ``schedule()``, which
    counts placeholders) samples ``[]``; any other samples ``tokens[req_id]``
    (default ``default_token_id``). Deciding later would be wrong: the next
    ``schedule()`` changes ``is_prefill_chunk``.
    """
    tokens = tokens or {}
    scheduler_output = scheduler.schedule()
    sampled = {
        req_id: (
            []
            if scheduler.requests[req_id].is_prefill_chunk
            else [tokens.get(req_id, default_token_id)]
        )
        for req_id in scheduler_output.num_scheduled_tokens
    }
    return InFlightStep(scheduler_output, sampled)


def finish_step(scheduler: Scheduler, step: InFlightStep) -> StepResult:
    """Read back a launched step: ``update_from_output`` with its sampled tokens
    (every request gets its row, even one finished or aborted since launch)."""
    model_runner_output = make_model_runner_output(scheduler, step.scheduler_output, step.sampled)
    engine_core_outputs = scheduler.update_from_output(step.scheduler_output, model_runner_output)
    return StepResult(step.scheduler_output, model_runner_output, engine_core_outputs)


class AnyTokenGrammar:
    """A compiled grammar that allows every token: what a parked request's
    ``structured_output_request.grammar`` becomes once "compiled" in the
    scheduler tests (the scheduler advances it over each request's tokens)."""

    num_processed_tokens = 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        self.num_processed_tokens += len(tokens)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens

    def is_terminated(self) -> bool:
        return False

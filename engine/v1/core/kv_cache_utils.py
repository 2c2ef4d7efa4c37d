"""Blocks, the free queue, block hashing and KV pool sizing.

vLLM twin: ``vllm/v1/core/kv_cache_utils.py``.
Read it for:
  * ``KVCacheBlock`` -- the scheduler-side record of one physical block: id,
    reference count, and (once full and cached) its hash.
  * ``FreeKVCacheBlockQueue`` -- an intrusive doubly linked list of blocks with
    ``ref_cnt == 0``. The head is evicted first. A cached block that gets a
    prefix hit is unlinked from the middle in O(1), which is why this is not a
    ``collections.deque``.
  * ``hash_block_tokens`` / ``get_request_block_hasher`` -- block *i*'s hash
    covers block *i*'s tokens **and** block *i-1*'s hash, so equal hashes mean
    equal prefixes, not just equal blocks.
  * ``get_kv_cache_configs`` -- how many blocks fit in the memory left over,
    and the check that one ``max_model_len`` sequence fits at all (with
    ``max_model_len=-1``, first the longest one that does: the auto-fit). A block
    costs one page in every layer: with a draft model whose pages differ in
    size (``UniformTypeKVCacheSpecs``), the sum of the layers' page sizes.
Sessions: 03 (KV cache).

Simpler than vLLM: extra hash keys are only the cache salt (no multimodal,
LoRA or prompt-embedding keys; ``start_mm_idx`` is passed through untouched);
one KV cache group of full-attention layers with one block size -- equal
specs, or, with a draft model, one ``UniformTypeKVCacheSpecs`` of pages of
different sizes (no hybrid grouping, page-size unification, hidden-state
layers or DeepSeek-V4 layouts); no context parallelism, no integer block
hashes for KV events.

Differs from vLLM on purpose:
  * ``NONE_HASH`` is seeded from the fixed string ``"glassbox"`` when
    PYTHONHASHSEED is unset (vLLM: random bytes), so two runs a learner
    compares, and two processes, agree on every hash.
  * The memory check also counts the null block: the pool must hold one
    ``max_model_len`` sequence *plus* block 0. vLLM's check ignores block 0, so
    a pool that passes it exactly can never finish such a sequence.
  * ``KVCacheBlock`` compares by identity (vLLM's dataclass compares fields,
    which walks the free-list neighbours).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType, overload

from engine.utils.hashing import sha256
from engine.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    UniformTypeKVCacheSpecs,
)
from engine.v1.utils import cdiv

if TYPE_CHECKING:
    from engine.config.glassbox import GlassboxConfig
    from engine.v1.request import Request

logger = logging.getLogger(__name__)

# The hash of one full block (and, through chaining, of its whole prefix).
BlockHash = NewType("BlockHash", bytes)
# The same hash with the KV cache group id appended (4 bytes, big endian): the
# key of the prefix-cache map, so one token prefix can be cached per group.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


# The "parent hash" of a request's first block, set by init_none_hash.
NONE_HASH: BlockHash = BlockHash(b"")


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """Seed ``NONE_HASH`` with ``hash_fn(PYTHONHASHSEED)``, or of "glassbox"
    when it is unset (vLLM: random bytes; see the module docstring)."""
    global NONE_HASH
    seed = os.getenv("PYTHONHASHSEED") or "glassbox"
    NONE_HASH = BlockHash(hash_fn(seed))


# EngineCore calls it again with the configured hash; this covers code (tests,
# notebooks) that hashes requests without an engine.
init_none_hash(sha256)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical KV block (the data lives on the worker)."""

    block_id: int
    # How many requests currently hold this block in their block table.
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache.
    _block_hash: BlockHashWithGroupId | None = None
    # Links of the free queue; only FreeKVCacheBlockQueue touches them.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # Block 0: a placeholder id that is never allocated, cached or freed.
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        if self._block_hash is not None:
            raise RuntimeError(f"block {self.block_id} already has a hash (cached twice?)")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        h = self._block_hash.hex()[:8] if self._block_hash else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hash={h}, prev={prev_id}, next={next_id})"
        )


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order, as an O(1) doubly linked list.

    Two sentinel blocks (id -1) bracket the list so that every real block in
    it always has both neighbours; no Python objects are allocated per
    operation. Order: at start-up, by block id. Afterwards the scheduler appends
    a finished request's blocks tail-first, so the head holds the least
    recently used blocks and, among one request's blocks, the deepest ones
    (which are the least likely to be shared) go first.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for left, right in zip(chain, chain[1:]):
            left.next_free_block = right
            right.prev_free_block = left

    def popleft(self) -> KVCacheBlock:
        block = self.fake_free_list_head.next_free_block
        if block is None or block is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue (a prefix-cache hit)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        last = self.fake_free_list_tail.prev_free_block
        if last is None:
            raise AssertionError("prev_free_block of fake_free_list_tail should always exist")
        # Glassbox's own guard against a double free (vLLM links blindly):
        # check everything before linking anything, so a bad call leaves the
        # queue untouched.
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise RuntimeError(f"block {block.block_id} is already in the free queue")
        if len({id(b) for b in blocks}) != len(blocks):
            raise RuntimeError("the same block appears twice in one append_n call")
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head-to-tail walk; O(n), for tests, traces and the TUI."""
        out = []
        block = self.fake_free_list_head.next_free_block
        while block is not None and block is not self.fake_free_list_tail:
            out.append(block)
            block = block.next_free_block
        return out

    def _unlink(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is not None and block.next_free_block is not None
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1


# ---------------------------------------------------------------------------
# Block hashing
# ---------------------------------------------------------------------------
def generate_block_hash_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """Keys besides the token ids that make a block distinct, and the index of
    the first multimodal input the next block should look at.

    The LoRA adapter's name (on every block: the same tokens under another
    adapter have other keys and values) and the cache salt (on the first
    block, which then changes every later hash through the chain); with no
    multimodal inputs, ``start_mm_idx`` comes back unchanged. vLLM also mixes
    in multimodal and prompt-embedding hashes.
    """
    keys: list[Any] = []
    if request.lora_request is not None:
        keys.append(request.lora_request.lora_name)
    if start_token_idx == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    return (tuple(keys) if keys else None), start_mm_idx


def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """hash(parent hash, this block's token ids, extra keys)."""
    parent = parent_block_hash if parent_block_hash else NONE_HASH
    return BlockHash(hash_function((parent, tuple(curr_block_token_ids), extra_keys)))


def get_request_block_hasher(
    block_size: int, caching_hash_fn: Callable[[Any], bytes]
) -> Callable[[Request], list[BlockHash]]:
    """Build the function ``Request.update_block_hashes`` calls.

    It returns hashes only for the full blocks not hashed yet, so calling it
    after every appended token costs nothing until a block fills up.
    ``block_size`` here is the *hash* block size (``hash_block_size``), which
    is the KV block size in Glassbox.
    """

    def request_block_hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes) * block_size
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes: list[BlockHash] = []
        tokens = request.all_token_ids
        mm_idx = 0
        while start + block_size <= request.num_tokens:
            end = start + block_size
            extra, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            parent = hash_block_tokens(caching_hash_fn, parent, tokens[start:end], extra)
            new_hashes.append(parent)
            start = end
        return new_hashes

    return request_block_hasher


class BlockHashListWithBlockSize:
    """A request's block hashes seen at a coarser block size.

    ``block_hashes`` were computed every ``hash_block_size`` tokens; a group
    whose blocks hold ``target_block_size`` tokens (a multiple) sees one hash
    per block: the concatenation of the ``target_block_size //
    hash_block_size`` fine hashes it covers. Built on access, never stored.
    With fine hashes A B C D (16 tokens each) and 32-token blocks: AB, CD.
    """

    def __init__(
        self, block_hashes: list[BlockHash], hash_block_size: int, target_block_size: int
    ) -> None:
        if target_block_size % hash_block_size != 0:
            raise ValueError(
                f"block_size {target_block_size} must be a multiple of "
                f"hash_block_size {hash_block_size}"
            )
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    @overload
    def __getitem__(self, idx: int) -> BlockHash: ...

    @overload
    def __getitem__(self, idx: slice) -> list[BlockHash]: ...

    def __getitem__(self, idx: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(idx, slice):
            return [self._get_value_at(i) for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"block index {idx} out of range for {len(self)} blocks")
        return self._get_value_at(idx)

    def __iter__(self) -> Iterator[BlockHash]:
        for i in range(len(self)):
            yield self._get_value_at(i)

    def _get_value_at(self, idx: int) -> BlockHash:
        start = idx * self.scale_factor
        return BlockHash(b"".join(self.block_hashes[start : start + self.scale_factor]))


# What the block pool and the managers accept as "a request's block hashes".
BlockHashList = list[BlockHash] | BlockHashListWithBlockSize


def resolve_kv_cache_block_sizes(
    kv_cache_config: KVCacheConfig, glassbox_config: GlassboxConfig
) -> tuple[int, int]:
    """``(scheduler block size, hash block size)``.

    vLLM hashes at a finer granularity than the block size only when hybrid
    KV cache groups have different block sizes. Glassbox has one group, so
    both are ``cache_config.block_size``.
    """
    if len(kv_cache_config.kv_cache_groups) > 1:
        raise ValueError(
            f"Glassbox supports exactly one KV cache group, got "
            f"{len(kv_cache_config.kv_cache_groups)} (hybrid attention is not implemented)"
        )
    block_size = glassbox_config.cache_config.block_size
    return block_size, block_size


# ---------------------------------------------------------------------------
# Sizing the pool
# ---------------------------------------------------------------------------
def max_memory_usage_bytes(
    glassbox_config: GlassboxConfig, kv_cache_specs: Iterable[KVCacheSpec]
) -> int:
    """Bytes the given layers need for one ``max_model_len`` sequence."""
    return sum(spec.max_memory_usage_bytes(glassbox_config) for spec in kv_cache_specs)


def estimate_max_model_len(
    glassbox_config: GlassboxConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    available_memory: int,
) -> int:
    """The longest ``max_model_len`` (at most the configured one) whose sequence
    fits in ``available_memory``; 0 if not even one token fits.

    Binary search: it sets ``model_config.max_model_len`` for each probe and
    puts the original value back before returning.
    """
    model_config = glassbox_config.model_config
    original = model_config.max_model_len

    def fits(model_len: int) -> bool:
        model_config.max_model_len = model_len
        return max_memory_usage_bytes(glassbox_config, kv_cache_spec.values()) <= available_memory

    try:
        lo, hi, best = 1, original, 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if fits(mid):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best
    finally:
        model_config.max_model_len = original


def _null_block_bytes(kv_cache_spec: dict[str, KVCacheSpec]) -> int:
    """Block 0 costs one page in every layer; the pool must hold it besides a sequence."""
    return sum(spec.page_size_bytes for spec in kv_cache_spec.values())


def _auto_fit_max_model_len(
    glassbox_config: GlassboxConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
) -> None:
    """``max_model_len=-1``: the longest context (at most the model's own) whose
    sequence, plus the null block, fits every worker's memory. Sets it on the
    model and scheduler configs; EngineCore tells the workers and the front end."""
    model_config = glassbox_config.model_config
    derived = model_config.max_model_len
    fitted = derived
    for worker_spec, memory in zip(kv_cache_specs, available_memory):
        if not worker_spec:
            continue
        fitted = min(
            fitted,
            estimate_max_model_len(
                glassbox_config, worker_spec, memory - _null_block_bytes(worker_spec)
            ),
        )
    if fitted <= 0:
        raise ValueError(
            "Cannot auto-fit max_model_len: the KV cache memory does not hold even one "
            "token. Try increasing `gpu_memory_utilization` (or `kv_cache_memory_bytes`)."
        )
    if fitted >= derived:
        logger.info("Auto-fit max_model_len: the model's whole context (%d) fits", derived)
        return
    model_config.max_model_len = fitted
    glassbox_config.scheduler_config.max_model_len = fitted
    logger.info(
        "Auto-fit max_model_len: reduced from %d to %d to fit the KV cache memory (%.2f GiB)",
        derived,
        fitted,
        min(available_memory) / 2**30,
    )


def check_enough_kv_cache_memory(
    glassbox_config: GlassboxConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    available_memory: int,
) -> None:
    """Raise unless ``available_memory`` holds one ``max_model_len`` sequence
    plus the null block (see the module docstring), in every layer."""
    if not kv_cache_spec:
        return
    if available_memory <= 0:
        raise ValueError(
            "No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine (or set "
            "`num_gpu_blocks_override` / `kv_cache_memory_bytes`)."
        )
    null_block_bytes = _null_block_bytes(kv_cache_spec)
    needed = max_memory_usage_bytes(glassbox_config, kv_cache_spec.values()) + null_block_bytes
    if needed <= available_memory:
        return
    max_model_len = glassbox_config.model_config.max_model_len
    estimated = estimate_max_model_len(
        glassbox_config, kv_cache_spec, available_memory - null_block_bytes
    )
    estimated_msg = (
        f"Based on the available memory, the estimated maximum model length is {estimated}. "
        if estimated > 0
        else ""
    )
    if glassbox_config.cache_config.num_gpu_blocks_override is not None:
        advice = "Try increasing `num_gpu_blocks_override`"
    else:
        advice = "Try increasing `gpu_memory_utilization`"
    raise ValueError(
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"{needed} bytes of KV cache are needed (one sequence plus the null block), which "
        f"is larger than the available KV cache memory ({available_memory} bytes). "
        f"{estimated_msg}{advice} or decreasing `max_model_len` when initializing the engine."
    )


def create_kv_cache_group_specs(
    kv_cache_spec: dict[str, KVCacheSpec], grouped_layer_names: list[list[str]]
) -> list[KVCacheGroupSpec]:
    """One ``KVCacheGroupSpec`` per list of layer names; the layers of a group
    must share one spec (``KVCacheSpec.merge`` checks it)."""
    groups = []
    for layer_names in grouped_layer_names:
        specs = [kv_cache_spec[name] for name in layer_names]
        groups.append(KVCacheGroupSpec(layer_names, specs[0].merge(specs)))
    return groups


def is_kv_cache_spec_uniform(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    """True when every layer has the same spec (no layers counts as uniform)."""
    if not kv_cache_spec:
        return True
    specs = list(kv_cache_spec.values())
    try:
        specs[0].merge(specs)
    except ValueError:
        return False
    return True


def get_kv_cache_groups(
    glassbox_config: GlassboxConfig, kv_cache_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """Split the layers into groups that share a block table: one group here.
    Equal specs make a plain group; full-attention layers whose pages differ
    (a target and its draft model) one group of ``UniformTypeKVCacheSpecs``."""
    if not kv_cache_spec:
        raise ValueError("the model reported no attention layers to build a KV cache for")
    if is_kv_cache_spec_uniform(kv_cache_spec):
        return create_kv_cache_group_specs(kv_cache_spec, [list(kv_cache_spec)])
    if uniform_spec := UniformTypeKVCacheSpecs.from_specs(kv_cache_spec):
        return [KVCacheGroupSpec(list(kv_cache_spec), uniform_spec)]
    block_sizes = sorted({spec.block_size for spec in kv_cache_spec.values()})
    raise ValueError(
        "all layers must be full attention with one block size, got block sizes "
        f"{block_sizes} and types {sorted({type(s).__name__ for s in kv_cache_spec.values()})} "
        "(hybrid models are not supported)"
    )


def _num_page_columns(group: KVCacheGroupSpec) -> int:
    """Pages a block id names in this group, counted in units of the group's
    ``page_size_bytes``: one per layer, or one in all for uniform-type specs
    (whose page size already sums its layers')."""
    if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs):
        return 1
    return len(group.layer_names)


def may_override_num_blocks(glassbox_config: GlassboxConfig, num_blocks: int) -> int:
    override = glassbox_config.cache_config.num_gpu_blocks_override
    return num_blocks if override is None else override


def get_num_blocks(
    glassbox_config: GlassboxConfig, num_layers: int, available_memory: int, page_size: int
) -> int:
    """Blocks that fit when each of ``num_layers`` layers needs one page of
    ``page_size`` bytes per block (``num_gpu_blocks_override`` wins when set).
    Uniform-type specs pass ``num_layers=1`` and their summed page size."""
    num_blocks = max(int(available_memory // page_size // num_layers), 0)
    return may_override_num_blocks(glassbox_config, num_blocks)


def get_uniform_page_size(kv_cache_specs: Iterable[KVCacheSpec]) -> int:
    page_sizes = {spec.page_size_bytes for spec in kv_cache_specs}
    if len(page_sizes) != 1:
        raise ValueError(f"KV cache groups must share one page size, got {sorted(page_sizes)}")
    return page_sizes.pop()


def get_kv_cache_config_from_groups(
    glassbox_config: GlassboxConfig,
    kv_cache_groups: list[KVCacheGroupSpec],
    available_memory: int,
) -> KVCacheConfig:
    """Blocks and backing tensors for one worker.

    Tensor *i* is shared by layer *i* of every group (with one group: one
    tensor per layer), each ``num_blocks * page_size`` bytes. A group of
    ``UniformTypeKVCacheSpecs``: one tensor per layer of that layer's pages.
    """
    if any(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in kv_cache_groups):
        # get_kv_cache_groups only builds this spec as the single group.
        assert len(kv_cache_groups) == 1, "uniform-type specs must make the only group"
        group = kv_cache_groups[0]
        spec = group.kv_cache_spec
        assert isinstance(spec, UniformTypeKVCacheSpecs)
        num_blocks = get_num_blocks(glassbox_config, 1, available_memory, spec.page_size_bytes)
        return KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=spec.kv_cache_specs[name].page_size_bytes * num_blocks, shared_by=[name]
                )
                for name in group.layer_names
            ],
            kv_cache_groups=kv_cache_groups,
        )
    group_size = max(len(group.layer_names) for group in kv_cache_groups)
    page_size = get_uniform_page_size(group.kv_cache_spec for group in kv_cache_groups)
    num_blocks = get_num_blocks(glassbox_config, group_size, available_memory, page_size)
    kv_cache_tensors = [
        KVCacheTensor(
            size=page_size * num_blocks,
            shared_by=[g.layer_names[i] for g in kv_cache_groups if i < len(g.layer_names)],
        )
        for i in range(group_size)
    ]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=kv_cache_tensors, kv_cache_groups=kv_cache_groups
    )


def get_max_concurrency_for_kv_cache_config(
    glassbox_config: GlassboxConfig, kv_cache_config: KVCacheConfig
) -> float:
    """How many ``max_model_len`` sequences the pool holds at once."""
    groups = kv_cache_config.kv_cache_groups
    num_layers = max(_num_page_columns(group) for group in groups)
    bytes_per_request = num_layers * max_memory_usage_bytes(
        glassbox_config, (group.kv_cache_spec for group in groups)
    )
    bytes_per_block = groups[0].kv_cache_spec.page_size_bytes * num_layers
    return kv_cache_config.num_blocks / cdiv(bytes_per_request, bytes_per_block)


def get_kv_cache_configs(
    glassbox_config: GlassboxConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
) -> list[KVCacheConfig]:
    """One ``KVCacheConfig`` per worker (Glassbox runs one).

    1. Merge the workers' layer specs and group the layers (one group).
    2. With ``num_gpu_blocks_override``, replace each worker's memory by what
       that many blocks take, so the check below sees the real pool.
    3. Check that one ``max_model_len`` sequence (plus the null block) fits.
    4. Size each worker's pool, then cut every worker to the smallest
       ``num_blocks``: the scheduler hands out one set of block ids for all.
    """
    merged: dict[str, KVCacheSpec] = {}
    for worker_spec in kv_cache_specs:
        for name, spec in worker_spec.items():
            if merged.setdefault(name, spec) != spec:
                raise ValueError(
                    f"The KV cache specs for layer {name!r} are different across workers."
                )
    groups = get_kv_cache_groups(glassbox_config, merged)
    per_worker_groups = [
        [_group_for_worker(g, worker_spec) for g in groups] for worker_spec in kv_cache_specs
    ]

    override = glassbox_config.cache_config.num_gpu_blocks_override
    if override is not None:
        available_memory = [
            override
            * max(_num_page_columns(g) for g in worker_groups)
            * get_uniform_page_size(g.kv_cache_spec for g in worker_groups)
            for worker_groups in per_worker_groups
        ]

    if glassbox_config.model_config.original_max_model_len == -1:
        _auto_fit_max_model_len(glassbox_config, kv_cache_specs, available_memory)
    for worker_spec, memory in zip(kv_cache_specs, available_memory):
        check_enough_kv_cache_memory(glassbox_config, worker_spec, memory)

    configs = [
        get_kv_cache_config_from_groups(glassbox_config, worker_groups, memory)
        for worker_groups, memory in zip(per_worker_groups, available_memory)
    ]
    min_num_blocks = min(config.num_blocks for config in configs)
    for config in configs:
        for tensor in config.kv_cache_tensors:
            tensor.size = tensor.size // config.num_blocks * min_num_blocks
        config.num_blocks = min_num_blocks
    max_model_len = glassbox_config.model_config.max_model_len
    concurrency = get_max_concurrency_for_kv_cache_config(glassbox_config, configs[0])
    logger.info("GPU KV cache size: %d tokens", int(concurrency * max_model_len))
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_model_len, concurrency)
    return configs


def _group_for_worker(
    group: KVCacheGroupSpec, worker_spec: dict[str, KVCacheSpec]
) -> KVCacheGroupSpec:
    """The part of ``group`` whose layers live on this worker."""
    names = [n for n in group.layer_names if n in worker_spec]
    spec = group.kv_cache_spec
    # A worker with none of the group's layers keeps the whole spec, so its
    # page size never sums to 0.
    if names and isinstance(spec, UniformTypeKVCacheSpecs):
        spec = UniformTypeKVCacheSpecs(
            block_size=spec.block_size,
            kv_cache_specs={n: spec.kv_cache_specs[n] for n in names},
        )
    return KVCacheGroupSpec(names, spec)


def generate_scheduler_kv_cache_config(kv_cache_configs: list[KVCacheConfig]) -> KVCacheConfig:
    """The scheduler's copy: every worker has the same blocks, so take the first.
    The scheduler counts blocks, not bytes: a uniform-type group shows it one
    of its layers' specs (they differ only in page size), as vLLM does."""
    if any(config.num_blocks != kv_cache_configs[0].num_blocks for config in kv_cache_configs):
        raise ValueError("all workers must have the same num_blocks")
    config = copy.deepcopy(kv_cache_configs[0])
    for group in config.kv_cache_groups:
        if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs):
            group.kv_cache_spec = next(iter(group.kv_cache_spec.kv_cache_specs.values()))
    return config

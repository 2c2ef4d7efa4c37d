"""Paged attention in plain torch: the reference backend.

vLLM twin: ``vllm/v1/attention/backends/cpu_attn.py`` (``CPUAttentionBackend``,
``CPUAttentionBackendImpl``, ``CPUAttentionMetadataBuilder``).
Read it for what every paged-attention kernel computes, with nothing hidden:

  1. scatter this step's K and V into the cache at ``slot_mapping``
     (``cache.view(-1, H_kv, D)[slot] = k``);
  2. for each request, gather its context K/V from the blocks listed in its
     block-table row, and attend with a causal mask shifted by the number of
     tokens already cached -- query row j sits at absolute position
     ``seq_len - query_len + j``.

Prefills with a cached prefix, chunked prefills, decodes and mixed batches are
all the same loop. Three shortcuts, none changing the maths:
  * decode-only requests (query length 1) are batched into one padded call:
    the metadata builder turns their block-table rows into one flat list of
    block ids and a padding mask once per step, and each layer gathers its K
    and V blocks with one ``index_select`` into a reused buffer, then makes
    one ``scaled_dot_product_attention`` call in which the query heads that
    share a KV head are stacked as query rows (grouped-query attention without
    repeating K/V);
  * a prefill with nothing cached before it attends over the K/V rows it has
    just written instead of gathering them back from the blocks;
  * on a CPU in float32, when ``engine/_cpu_ops.py`` could build
    ``csrc/cpu/cpu_attn.cpp``, the decodes skip the gather altogether: one C++
    call per layer reads each request's K/V blocks where they lie (the gather
    plus SDPA read the context three times; on one core a decode step is bound
    by that memory traffic). ``GLASSBOX_CPU_KERNELS=0`` keeps the torch path.

Batch order (``reorder_batch_threshold``): as in vLLM, the builder asks the
runner to put decodes first only on CPU architectures outside x86, Arm,
PowerPC, s390x and RISC-V; on those five vLLM's C++ kernel takes a mixed
batch as it comes, and the threshold stays None. Elsewhere vLLM splits the
batch (SDPA for the prefills); here the same loops run either way, and with
decodes first their query rows are one slice instead of an index list.
Sessions: 05 (attention backends).

Simpler than vLLM: vLLM's CPU backend calls C++ kernels for everything (and
uses its own cache layout); this one uses the flash-attention cache layout
``[2, num_blocks, block_size, H_kv, D]`` and ``torch`` ops for all but the
decode rows, so it runs on any device and is the oracle the faster backends
are tested against.
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine._cpu_ops import cpu_kernels
from engine.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

# CPU families whose attention kernel in vLLM prefers mixed batches
# (vLLM: ``_CPU_ARCH_PREFER_MIXED_BATCH``): no reordering there.
_CPU_ARCH_PREFER_MIXED_BATCH = ("x86", "arm", "powerpc", "s390x", "riscv")


def get_cpu_architecture() -> str:
    """This machine's CPU family, named as in ``_CPU_ARCH_PREFER_MIXED_BATCH``,
    or "other" / "unknown". Glassbox's own here: vLLM asks its platform
    (``Platform.get_cpu_architecture``, an enum); Glassbox has no platform layer."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        return "x86"
    if machine.startswith(("arm", "aarch")):
        return "arm"
    if machine.startswith("ppc"):
        return "powerpc"
    if machine == "s390x":
        return "s390x"
    if machine.startswith("riscv"):
        return "riscv"
    return "other" if machine else "unknown"


class GatherBuffer:
    """A growable scratch tensor for gathered K/V blocks.

    Every layer of a step gathers the same number of blocks, so one buffer
    serves them all (and later steps): no per-layer allocation, and the
    memory stays warm in the CPU caches.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self.buffer
        if (
            buf is None
            or buf.numel() < numel
            or buf.dtype != dtype
            or buf.device != device
            # made under inference_mode, it may not be written outside it
            or (buf.is_inference() and not torch.is_inference_mode_enabled())
        ):
            # A quarter of headroom: contexts grow by a block every few steps.
            buf = self.buffer = torch.empty(numel + numel // 4, dtype=dtype, device=device)
        return buf[:numel].view(shape)


@dataclass
class CPUDecodeBatch:
    """The step's pure decodes as one padded batch; built once per step, read by every layer.

    Decode b attends over blocks ``block_table[req_ids[b], :max_blocks]``
    (``padded_len = max_blocks * block_size`` positions); positions past its
    ``seq_len`` are padding and masked out.
    """

    num_decodes: int
    max_blocks: int
    padded_len: int
    # Query/output rows of the decodes: a slice when they are consecutive rows.
    query_rows: slice | torch.Tensor
    block_ids: torch.Tensor  # [num_decodes * max_blocks] int64, device
    valid: torch.Tensor  # [num_decodes, 1, 1, padded_len] bool: inside the context
    gather_buffer: GatherBuffer
    # ``valid`` as an additive mask (0 / -inf) in the query dtype, made by the
    # first layer of the step; SDPA would otherwise convert the bool mask per call.
    attn_bias: torch.Tensor | None = None
    # For the C++ decode kernel (None: no kernel, the gather + SDPA path):
    # int32 block-table rows [num_decodes, max_blocks] and contexts [num_decodes].
    kernel_block_table: torch.Tensor | None = None
    kernel_seq_lens: torch.Tensor | None = None

    def get_attn_bias(self, dtype: torch.dtype) -> torch.Tensor:
        if self.attn_bias is None or self.attn_bias.dtype != dtype:
            bias = torch.zeros(self.valid.shape, dtype=dtype, device=self.valid.device)
            self.attn_bias = bias.masked_fill_(~self.valid, float("-inf"))
        return self.attn_bias


@dataclass
class CPUAttentionMetadata:
    num_actual_tokens: int
    block_size: int
    # Python copies of the per-request layout: the loop below runs on the host.
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64, device
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, device
    # Requests with query length 1 (pure decodes) and those with more.
    decode_req_ids: list[int]
    prefill_req_ids: list[int]
    decode: CPUDecodeBatch | None = None


class CPUAttentionMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, block_size: int, device: torch.device, use_cpu_kernels: bool = True) -> None:
        super().__init__(block_size, device)
        threshold = None if get_cpu_architecture() in _CPU_ARCH_PREFER_MIXED_BATCH else 1
        self._init_reorder_batch_threshold(threshold)
        self.gather_buffer = GatherBuffer()
        # False: decodes always take the gather + SDPA torch path (the plain-torch
        # reference the tests hold the other backends to).
        self.use_cpu_kernels = use_cpu_kernels

    def build(self, common: CommonAttentionMetadata) -> CPUAttentionMetadata:
        qsl = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        query_lens = [qsl[i + 1] - qsl[i] for i in range(common.num_reqs)]
        block_table = common.block_table_tensor[: common.num_reqs].long()
        decode_req_ids = [i for i, n in enumerate(query_lens) if n == 1]
        return CPUAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            block_size=self.block_size,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens].long(),
            decode_req_ids=decode_req_ids,
            prefill_req_ids=[i for i, n in enumerate(query_lens) if n > 1],
            decode=self._build_decode(decode_req_ids, qsl, seq_lens, block_table),
        )

    def _build_decode(
        self, ids: list[int], qsl: list[int], seq_lens: list[int], block_table: torch.Tensor
    ) -> CPUDecodeBatch | None:
        if not ids:
            return None
        device = block_table.device
        rows = [qsl[i] for i in ids]
        n = len(ids)
        if rows == list(range(rows[0], rows[0] + n)):
            query_rows: slice | torch.Tensor = slice(rows[0], rows[0] + n)
        else:
            query_rows = torch.tensor(rows, device=device)
        lens = [seq_lens[i] for i in ids]
        max_blocks = -(-max(lens) // self.block_size)
        padded_len = max_blocks * self.block_size
        if ids == list(range(n)):
            block_ids = block_table[:n, :max_blocks]
        else:
            block_ids = block_table[torch.tensor(ids, device=device), :max_blocks]
        lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
        valid = torch.arange(padded_len, device=device)[None, :] < lens_t[:, None]
        kernel_block_table = kernel_seq_lens = None
        # Whether the kernel exists is asked in forward, where the dtype is known:
        # a bfloat16 model never needs it, so never waits for its build.
        if self.use_cpu_kernels and device.type == "cpu":
            kernel_block_table = block_ids.to(torch.int32).contiguous()
            kernel_seq_lens = lens_t
        return CPUDecodeBatch(
            num_decodes=n,
            max_blocks=max_blocks,
            padded_len=padded_len,
            query_rows=query_rows,
            block_ids=block_ids.reshape(-1),
            valid=valid[:, None, None, :],
            gather_buffer=self.gather_buffer,
            kernel_block_table=kernel_block_table,
            kernel_seq_lens=kernel_seq_lens,
        )


class CPUAttentionBackendImpl(AttentionImpl):
    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if attn_metadata is None:
            # Profiling / dummy run: no KV cache to read or write.
            return output.zero_()
        md = attn_metadata
        n = md.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)  # each [num_blocks, bs, H_kv, D]
        h_kv, d = key_cache.shape[-2:]

        # 1. Write this step's K/V into their slots.
        key_cache.view(-1, h_kv, d)[md.slot_mapping] = key[:n]
        value_cache.view(-1, h_kv, d)[md.slot_mapping] = value[:n]

        # 2a. Requests with more than one query token: one causal call each.
        for i in md.prefill_req_ids:
            q_start, q_end = md.query_start_loc[i], md.query_start_loc[i + 1]
            if md.seq_lens[i] == q_end - q_start:
                # Nothing cached before this chunk: the context is exactly the
                # K/V rows just written, so read them without the block gather.
                k, v = key[q_start:q_end], value[q_start:q_end]
            else:
                k, v = self._gather_context(key_cache, value_cache, md, i)
            output[q_start:q_end] = self._attend(query[q_start:q_end], k, v, causal=True)

        # 2b. Decodes: pad every context to the longest and attend in one call.
        if md.decode is not None:
            self._batched_decode(query, kv_cache, md.decode, output)
        return output

    def _gather_context(self, key_cache, value_cache, md: CPUAttentionMetadata, i: int):
        """K, V of request i's whole context, [seq_len, H_kv, D]."""
        seq_len = md.seq_lens[i]
        num_blocks = -(-seq_len // md.block_size)
        blocks = md.block_table[i, :num_blocks]
        k = key_cache[blocks].flatten(0, 1)[:seq_len]
        v = value_cache[blocks].flatten(0, 1)[:seq_len]
        return k, v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> torch.Tensor:
        """q [Lq, H, D] over k, v [Lk, H_kv, D]; the Lq queries are the last
        Lq positions of the context."""
        lq, lk = q.shape[0], k.shape[0]
        mask = None
        if causal and 1 < lq < lk:
            q_pos = torch.arange(lk - lq, lk, device=q.device)[:, None]
            mask = torch.arange(lk, device=q.device)[None, :] <= q_pos  # [Lq, Lk]
        # A batch dim of 1: torch's CPU flash kernel takes 4-D inputs only
        # (3-D ones fall back to the slower unfused "math" path).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, H, Lq, D]
            k.transpose(0, 1)[None],  # [1, H_kv, Lk, D]
            v.transpose(0, 1)[None],
            attn_mask=mask,
            # Lq == Lk: the shifted mask is the ordinary lower triangle.
            is_causal=causal and 1 < lq == lk,
            scale=self.scale,
            enable_gqa=self.num_queries_per_kv > 1,
        )
        return out[0].transpose(0, 1)  # [Lq, H, D]

    def _batched_decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, dec: CPUDecodeBatch, output: torch.Tensor
    ) -> None:
        if (
            dec.kernel_block_table is not None
            and query.dtype == kv_cache.dtype == torch.float32
            and cpu_kernels() is not None
        ):
            self._kernel_decode(query, kv_cache, dec, output)
            return
        n, h_kv, d = dec.num_decodes, self.num_kv_heads, self.head_size
        # One gather for K and V of every decode: [2, n * max_blocks, bs * H_kv * D].
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        kv = dec.gather_buffer.take(
            (2, n * dec.max_blocks, block_size * h_kv * d), kv_cache.dtype, kv_cache.device
        )
        torch.index_select(kv_cache.view(2, num_blocks, -1), 1, dec.block_ids, out=kv)
        # -> [2, n, padded_len, H_kv, D] -> k, v: [n, H_kv, padded_len, D] (strided views).
        k, v = kv.view(2, n, dec.padded_len, h_kv, d).transpose(2, 3).unbind(0)
        # The G = H / H_kv query heads that share KV head j are heads j*G .. j*G+G-1:
        # stacked as G query rows of head j, [n, H_kv, G, D], they read K/V once.
        q = query[dec.query_rows].reshape(n, h_kv, self.num_queries_per_kv, d)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=dec.get_attn_bias(q.dtype), scale=self.scale
        )  # padding beyond each context is masked
        output[dec.query_rows] = out.reshape(n, self.num_heads, d)

    def _kernel_decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, dec: CPUDecodeBatch, output: torch.Tensor
    ) -> None:
        """The same decodes through ``csrc/cpu/cpu_attn.cpp``: no gather, no padding."""
        kernels = cpu_kernels()
        assert kernels is not None and dec.kernel_seq_lens is not None
        key_cache, value_cache = kv_cache.unbind(0)  # each [num_blocks, bs, H_kv, D], contiguous
        q = query[dec.query_rows]  # [n, H, D]
        if isinstance(dec.query_rows, slice):  # consecutive rows: write the output in place
            kernels.paged_decode_attention(
                output[dec.query_rows],
                q,
                key_cache,
                value_cache,
                dec.kernel_block_table,
                dec.kernel_seq_lens,
                self.scale,
            )
        else:
            out = torch.empty_like(q)
            kernels.paged_decode_attention(
                out,
                q,
                key_cache,
                value_cache,
                dec.kernel_block_table,
                dec.kernel_seq_lens,
                self.scale,
            )
            output[dec.query_rows] = out


class CPUAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return CPUAttentionMetadataBuilder

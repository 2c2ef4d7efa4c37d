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
all the same loop. Decode-only requests (query length 1) are batched into one
padded call, the single optimisation here.
Sessions: 05 (attention backends).

Simpler than vLLM: vLLM's CPU backend calls C++ kernels (and uses its own
cache layout); this one uses the flash-attention cache layout
``[2, num_blocks, block_size, H_kv, D]`` and ``torch`` ops only, so it runs
on any device and is the oracle the faster backends are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


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


class CPUAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> CPUAttentionMetadata:
        qsl = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        query_lens = [qsl[i + 1] - qsl[i] for i in range(common.num_reqs)]
        return CPUAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            block_size=self.block_size,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=common.block_table_tensor[: common.num_reqs].long(),
            slot_mapping=common.slot_mapping[: common.num_actual_tokens].long(),
            decode_req_ids=[i for i, n in enumerate(query_lens) if n == 1],
            prefill_req_ids=[i for i, n in enumerate(query_lens) if n > 1],
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
            k, v = self._gather_context(key_cache, value_cache, md, i)
            output[q_start:q_end] = self._attend(query[q_start:q_end], k, v, causal=True)

        # 2b. Decodes: pad every context to the longest and attend in one call.
        if md.decode_req_ids:
            self._batched_decode(query, key_cache, value_cache, md, output)
        return output

    def _gather_context(self, key_cache, value_cache, md: CPUAttentionMetadata, i: int):
        """K, V of request i's whole context, [seq_len, H_kv, D]."""
        seq_len = md.seq_lens[i]
        num_blocks = -(-seq_len // md.block_size)
        blocks = md.block_table[i, :num_blocks]
        k = key_cache[blocks].flatten(0, 1)[:seq_len]
        v = value_cache[blocks].flatten(0, 1)[:seq_len]
        return k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        """q [Lq, H, D] over k, v [Lk, H_kv, D]; the Lq queries are the last
        Lq positions of the context."""
        lq, lk = q.shape[0], k.shape[0]
        mask = None
        if causal and lq > 1:
            q_pos = torch.arange(lk - lq, lk, device=q.device)[:, None]
            mask = torch.arange(lk, device=q.device)[None, :] <= q_pos  # [Lq, Lk]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [H, Lq, D]
            k.transpose(0, 1),  # [H_kv, Lk, D]
            v.transpose(0, 1),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_queries_per_kv > 1,
        )
        return out.transpose(0, 1)  # [Lq, H, D]

    def _batched_decode(self, query, key_cache, value_cache, md: CPUAttentionMetadata, output):
        ids = md.decode_req_ids
        rows = torch.tensor([md.query_start_loc[i] for i in ids], device=query.device)
        seq_lens = torch.tensor([md.seq_lens[i] for i in ids], device=query.device)
        max_len = int(seq_lens.max())
        max_blocks = -(-max_len // md.block_size)
        blocks = md.block_table[ids, :max_blocks]  # [B, max_blocks]
        # [B, max_blocks, bs, H_kv, D] -> [B, H_kv, max_len, D]
        k = key_cache[blocks].flatten(1, 2)[:, :max_len].transpose(1, 2)
        v = value_cache[blocks].flatten(1, 2)[:, :max_len].transpose(1, 2)
        valid = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]
        q = query[rows].unsqueeze(2)  # [B, H, 1, D]
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=valid[:, None, None, :],  # padding beyond each context is masked
            scale=self.scale,
            enable_gqa=self.num_queries_per_kv > 1,
        )
        output[rows] = out.squeeze(2)


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

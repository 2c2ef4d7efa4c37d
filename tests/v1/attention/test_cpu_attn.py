"""The plain-torch paged attention backend against dense causal attention.

Each case scatters a batch of requests over random, non-contiguous KV blocks
(some context already cached from "earlier steps", some written now through
the slot mapping) and checks the output equals attention computed densely over
each request's full token sequence.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.v1.attention.backend import CommonAttentionMetadata
from engine.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

H, H_KV, D, BS = 4, 2, 8, 4


def dense_causal(q, k, v, scale):
    """q [L, H, D], k/v [L, H_KV, D] for one whole sequence."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    L = q.shape[0]
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(contexts: list[tuple[int, int]], seed: int = 0):
    """contexts: per request (num_cached_tokens, num_new_tokens)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = 64
    kv_cache = torch.zeros(CPUAttentionBackend.get_kv_cache_shape(num_blocks, BS, H_KV, D))
    free = list(range(1, num_blocks))  # block 0 is the null block
    rng.shuffle(free)
    scale = 1 / math.sqrt(D)

    full_q, full_k, full_v, tables = [], [], [], []
    new_q, new_k, new_v, slots = [], [], [], []
    for cached, new in contexts:
        total = cached + new
        q = torch.randn(total, H, D, generator=g)
        k = torch.randn(total, H_KV, D, generator=g)
        v = torch.randn(total, H_KV, D, generator=g)
        blocks = [free.pop() for _ in range(-(-total // BS))]
        tables.append(blocks)
        # Cached context was written by earlier steps: put it in place directly.
        for pos in range(cached):
            b, o = blocks[pos // BS], pos % BS
            kv_cache[0, b, o], kv_cache[1, b, o] = k[pos], v[pos]
        for pos in range(cached, total):
            slots.append(blocks[pos // BS] * BS + pos % BS)
        new_q.append(q[cached:]), new_k.append(k[cached:]), new_v.append(v[cached:])
        full_q.append(q), full_k.append(k), full_v.append(v)

    max_blocks = max(len(t) for t in tables)
    block_table = torch.zeros(len(contexts), max_blocks, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_table[i, : len(t)] = torch.tensor(t)
    qlens = [n for _, n in contexts]
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in contexts], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens,
        num_reqs=len(contexts),
        num_actual_tokens=sum(qlens),
        max_query_len=max(qlens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    md = CPUAttentionMetadataBuilder(BS, torch.device("cpu")).build(common)
    impl = CPUAttentionBackendImpl(H, D, scale, H_KV)
    q, k, v = torch.cat(new_q), torch.cat(new_k), torch.cat(new_v)
    out = torch.empty_like(q)
    impl.forward(None, q, k, v, kv_cache, md, out)

    start = 0
    for i, (cached, new) in enumerate(contexts):
        expected = dense_causal(full_q[i], full_k[i], full_v[i], scale)[cached:]
        torch.testing.assert_close(out[start : start + new], expected, atol=1e-5, rtol=1e-5)
        start += new
    # The new K/V landed in the cache at their slots.
    flat_k = kv_cache[0].view(-1, H_KV, D)
    torch.testing.assert_close(flat_k[torch.tensor(slots)], k)


@pytest.mark.parametrize(
    "contexts",
    [
        [(0, 7)],  # one prefill
        [(0, 1)],  # a one-token prompt
        [(9, 1), (3, 1), (15, 1)],  # decodes only (batched path)
        [(8, 5)],  # prefill after a prefix-cache hit of two blocks
        [(6, 4)],  # a chunked prefill resuming mid-block
        [(0, 10), (12, 1), (4, 6), (2, 1)],  # mixed batch
    ],
)
def test_paged_attention_matches_dense(contexts):
    run_case(contexts)


def test_profile_run_returns_zeros_without_metadata():
    impl = CPUAttentionBackendImpl(H, D, 0.5, H_KV)
    out = torch.ones(3, H, D)
    impl.forward(
        None,
        torch.randn(3, H, D),
        torch.randn(3, H_KV, D),
        torch.randn(3, H_KV, D),
        None,
        None,
        out,
    )
    assert torch.count_nonzero(out) == 0


def test_heads_must_divide():
    with pytest.raises(ValueError, match="num_kv_heads"):
        CPUAttentionBackendImpl(6, D, 0.5, 4)

"""The plain-torch paged attention backend against dense causal attention.

Each case scatters a batch of requests over random, non-contiguous KV blocks
(some context already cached from "earlier steps", some written now through
the slot mapping) and checks the output equals attention computed densely over
each request's full token sequence.

The builder's batch-order wish (``reorder_batch_threshold``) follows vLLM's
choice by CPU architecture, and with decodes first their query rows are one
slice.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.v1.attention.backend import CommonAttentionMetadata
from engine.v1.attention.backends import cpu_attn
from engine.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
    get_cpu_architecture,
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
        _seq_lens_cpu=seq_lens,
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


@pytest.mark.parametrize(
    "machine, family, threshold",
    [
        ("x86_64", "x86", None),
        ("AMD64", "x86", None),
        ("aarch64", "arm", None),
        ("armv7l", "arm", None),
        ("ppc64le", "powerpc", None),
        ("s390x", "s390x", None),
        ("riscv64", "riscv", None),
        ("sparc64", "other", 1),
        ("", "unknown", 1),
    ],
)
def test_reorder_threshold_follows_the_cpu_architecture(monkeypatch, machine, family, threshold):
    """As vLLM's CPU backend: mixed batches as they come on the five common
    families, decodes first (threshold 1) anywhere else."""
    monkeypatch.setattr(cpu_attn.platform, "machine", lambda: machine)
    assert get_cpu_architecture() == family
    assert CPUAttentionMetadataBuilder(BS, torch.device("cpu")).reorder_batch_threshold == threshold


def test_reorder_threshold_must_be_positive():
    builder = CPUAttentionMetadataBuilder(BS, torch.device("cpu"))
    with pytest.raises(ValueError, match="reorder_batch_threshold must be None or >= 1, got 0"):
        builder._init_reorder_batch_threshold(0)
    builder._init_reorder_batch_threshold(3, supports_spec_as_decode=True)
    assert builder.reorder_batch_threshold == 3


def _metadata(query_lens: list[int]) -> cpu_attn.CPUAttentionMetadata:
    """Build metadata for requests with these query lengths (8 tokens cached each)."""
    n = len(query_lens)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([8 + q for q in query_lens], dtype=torch.int32)
    total = int(qsl[-1])
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        _seq_lens_cpu=seq_lens,
        num_reqs=n,
        num_actual_tokens=total,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.arange(n * 8, dtype=torch.int32).view(n, 8),
        slot_mapping=torch.zeros(total, dtype=torch.int64),
    )
    return CPUAttentionMetadataBuilder(BS, torch.device("cpu")).build(common)


def test_decodes_first_make_one_slice_of_query_rows():
    ordered = _metadata([1, 1, 6])
    assert ordered.decode is not None and ordered.decode.query_rows == slice(0, 2)
    scattered = _metadata([1, 6, 1])
    assert scattered.decode is not None
    assert scattered.decode.query_rows.tolist() == [0, 7]

"""The CPU backend's batched decode path against its per-request path and dense attention.

``CPUAttentionMetadataBuilder`` turns the step's pure decodes into one
``CPUDecodeBatch`` (flat block ids, padding mask, query rows) that every
layer reuses; each layer gathers K/V with one ``index_select`` into a shared
``GatherBuffer`` and makes one grouped-query SDPA call. Here the result of
that path is compared, request by request, with the backend's own unbatched
path (``_gather_context`` + ``_attend``, what prefills use) and with dense
attention over the full sequence, across several layers sharing one metadata
object, consecutive steps whose contexts grow, decodes mixed with prefills,
and plain multi-head as well as grouped-query attention. Every such test runs
twice (``decode_path``): through the C++ decode kernel (``csrc/cpu/cpu_attn.cpp``,
built by ``make setup``) and through the gather + SDPA torch path.
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
    GatherBuffer,
)

BS, D, NUM_BLOCKS = 4, 8, 96


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request):
    from engine._cpu_ops import cpu_kernels, kernels_disabled

    if request.param == "torch":
        with kernels_disabled():
            yield request.param
    else:
        assert cpu_kernels() is not None, (
            "the CPU kernels did not build here: run `python -m engine._cpu_ops -v` to see why"
        )
        yield request.param


def dense(q_last: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last position's query [H, D] over k, v [L, H_kv, D]."""
    rep = q_last.shape[0] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("hd,lhd->hl", q_last, k) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


class Step:
    """One step's batch: per request (cached tokens, new tokens), over L layers."""

    def __init__(
        self, contexts, num_layers, h, h_kv, seed, tables=None, kv_caches=None, history=None
    ):
        g = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.contexts, self.h, self.h_kv = contexts, h, h_kv
        self.kv_caches = kv_caches or [
            torch.zeros(CPUAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BS, h_kv, D))
            for _ in range(num_layers)
        ]
        free = list(range(1, NUM_BLOCKS))
        rng.shuffle(free)
        self.tables = tables if tables is not None else [[] for _ in contexts]
        used = {b for t in self.tables for b in t}
        free = [b for b in free if b not in used]
        # Per layer and request: full K/V history (cached + new), and the queries.
        self.history = history or [[None] * len(contexts) for _ in range(num_layers)]
        self.q, self.k, self.v, slots = [], [], [], []
        for layer in range(num_layers):
            qs, ks, vs = [], [], []
            for i, (cached, new) in enumerate(contexts):
                total = cached + new
                while len(self.tables[i]) * BS < total:
                    self.tables[i].append(free.pop())
                prev = self.history[layer][i]
                assert prev is None or prev[0].shape[0] == cached
                k_new = torch.randn(new, h_kv, D, generator=g)
                v_new = torch.randn(new, h_kv, D, generator=g)
                if prev is None:
                    # Context "from earlier steps" written straight into the cache.
                    k_old = torch.randn(cached, h_kv, D, generator=g)
                    v_old = torch.randn(cached, h_kv, D, generator=g)
                    for pos in range(cached):
                        b, o = self.tables[i][pos // BS], pos % BS
                        self.kv_caches[layer][0, b, o] = k_old[pos]
                        self.kv_caches[layer][1, b, o] = v_old[pos]
                    prev = (k_old, v_old)
                self.history[layer][i] = (torch.cat([prev[0], k_new]), torch.cat([prev[1], v_new]))
                qs.append(torch.randn(new, h, D, generator=g))
                ks.append(k_new)
                vs.append(v_new)
                if layer == 0:
                    slots += [self.tables[i][p // BS] * BS + p % BS for p in range(cached, total)]
            self.q.append(torch.cat(qs))
            self.k.append(torch.cat(ks))
            self.v.append(torch.cat(vs))
        max_blocks = max(len(t) for t in self.tables)
        block_table = torch.zeros(len(contexts), max_blocks, dtype=torch.int32)
        for i, t in enumerate(self.tables):
            block_table[i, : len(t)] = torch.tensor(t)
        qlens = [n for _, n in contexts]
        qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor([c + n for c, n in contexts], dtype=torch.int32)
        self.common = CommonAttentionMetadata(
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

    def next(self, num_layers, seed):
        """The following step: every request decodes one more token."""
        contexts = [(c + n, 1) for c, n in self.contexts]
        return Step(
            contexts, num_layers, self.h, self.h_kv, seed, self.tables, self.kv_caches, self.history
        )


def run_and_check(step: Step, builder: CPUAttentionMetadataBuilder, impl: CPUAttentionBackendImpl):
    md = builder.build(step.common)
    qsl = md.query_start_loc
    for layer, kv_cache in enumerate(step.kv_caches):
        out = torch.empty_like(step.q[layer])
        impl.forward(None, step.q[layer], step.k[layer], step.v[layer], kv_cache, md, out)
        key_cache, value_cache = kv_cache.unbind(0)
        for i, (_cached, new) in enumerate(step.contexts):
            if new != 1:
                continue
            row = qsl[i]
            # The backend's own unbatched path (what a prefill request runs).
            k, v = impl._gather_context(key_cache, value_cache, md, i)
            per_request = impl._attend(step.q[layer][row : row + 1], k, v, causal=True)[0]
            torch.testing.assert_close(out[row], per_request, atol=1e-6, rtol=1e-5)
            k_full, v_full = step.history[layer][i]
            torch.testing.assert_close(
                out[row],
                dense(step.q[layer][row], k_full, v_full, impl.scale),
                atol=1e-5,
                rtol=1e-5,
            )
    return md


@pytest.mark.parametrize("h, h_kv", [(6, 2), (3, 3)], ids=["gqa", "mha"])
def test_decodes_over_layers_and_steps_match_per_request_path(h, h_kv, decode_path):
    # Contexts on both sides of block boundaries; two layers share each step's metadata.
    contexts = [(3, 1), (0, 1), (15, 1), (4, 1), (7, 1), (8, 1), (22, 1)]
    builder = CPUAttentionMetadataBuilder(BS, torch.device("cpu"))
    impl = CPUAttentionBackendImpl(h, D, 1 / math.sqrt(D), h_kv)
    step = Step(contexts, num_layers=2, h=h, h_kv=h_kv, seed=0)
    md = run_and_check(step, builder, impl)
    assert isinstance(md.decode.query_rows, slice)  # all rows are decodes
    # Prepared on every CPU step; forward decides whether the kernel runs.
    assert md.decode.kernel_block_table is not None
    first_buffer = builder.gather_buffer.buffer
    # The kernel reads the blocks in place: it never fills the gather buffer.
    assert (first_buffer is None) == (decode_path == "kernel")
    for s in range(1, 6):  # contexts grow; the buffer is reused or grown
        step = step.next(num_layers=2, seed=s)
        run_and_check(step, builder, impl)
    if decode_path == "torch":
        assert builder.gather_buffer.buffer.numel() >= first_buffer.numel()


def test_decodes_mixed_with_prefills(decode_path):
    # Decode rows are not consecutive and their request ids do not start at 0.
    contexts = [(0, 5), (9, 1), (4, 3), (2, 1), (13, 1), (6, 6)]
    builder = CPUAttentionMetadataBuilder(BS, torch.device("cpu"))
    impl = CPUAttentionBackendImpl(4, D, 1 / math.sqrt(D), 2)
    step = Step(contexts, num_layers=2, h=4, h_kv=2, seed=3)
    md = run_and_check(step, builder, impl)
    assert md.decode_req_ids == [1, 3, 4]
    assert torch.is_tensor(md.decode.query_rows)
    assert md.decode.query_rows.tolist() == [5, 9, 10]


def test_decode_rows_after_a_prefill_use_a_slice(decode_path):
    contexts = [(0, 5), (7, 1), (9, 1)]
    builder = CPUAttentionMetadataBuilder(BS, torch.device("cpu"))
    impl = CPUAttentionBackendImpl(4, D, 1 / math.sqrt(D), 2)
    md = run_and_check(Step(contexts, 1, 4, 2, seed=4), builder, impl)
    assert md.decode.query_rows == slice(5, 7)


def test_no_decodes_builds_no_decode_batch():
    md = CPUAttentionMetadataBuilder(BS, torch.device("cpu")).build(
        Step([(0, 5), (2, 3)], 1, 4, 2, seed=5).common
    )
    assert md.decode is None


def test_gather_buffer_grows_and_reuses():
    buf = GatherBuffer()
    a = buf.take((2, 3, 4), torch.float32, torch.device("cpu"))
    assert a.shape == (2, 3, 4)
    storage = buf.buffer
    b = buf.take((2, 3), torch.float32, torch.device("cpu"))  # smaller: same storage
    assert buf.buffer is storage and b.data_ptr() == a.data_ptr()
    buf.take((5, 10), torch.float32, torch.device("cpu"))  # larger: a new one
    assert buf.buffer is not storage and buf.buffer.numel() >= 50
    buf.take((5, 10), torch.float64, torch.device("cpu"))  # another dtype: a new one
    assert buf.buffer.dtype == torch.float64


def test_gather_buffer_made_in_inference_mode_is_replaced_outside_it():
    buf = GatherBuffer()
    with torch.inference_mode():
        buf.take((4, 4), torch.float32, torch.device("cpu"))
    assert buf.buffer.is_inference()
    t = buf.take((4, 4), torch.float32, torch.device("cpu"))
    t.fill_(1.0)  # would raise on an inference tensor
    assert not buf.buffer.is_inference()


def test_kernel_rejects_bad_input():
    from engine._cpu_ops import cpu_kernels

    kernels = cpu_kernels()
    assert kernels is not None
    q = torch.randn(2, 4, D)
    cache = torch.randn(NUM_BLOCKS, BS, 2, D)
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    kernels.paged_decode_attention(torch.empty_like(q), q, cache, cache, table, lens, 0.5)
    with pytest.raises(RuntimeError, match="float32 only"):
        kernels.paged_decode_attention(
            torch.empty_like(q).double(),
            q.double(),
            cache.double(),
            cache.double(),
            table,
            lens,
            0.5,
        )
    with pytest.raises(RuntimeError, match="int32"):
        kernels.paged_decode_attention(
            torch.empty_like(q), q, cache, cache, table.long(), lens, 0.5
        )
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\]=9 is outside \[1, 8\]"):
        kernels.paged_decode_attention(
            torch.empty_like(q),
            q,
            cache,
            cache,
            table,
            torch.tensor([5, 9], dtype=torch.int32),
            0.5,
        )


def test_builder_can_be_held_to_the_torch_path():
    # The reference for the other backends' tests (tests/helpers/attention_batches.py).
    common = Step([(3, 1), (9, 1)], 1, 4, 2, seed=6).common
    md = CPUAttentionMetadataBuilder(BS, torch.device("cpu"), use_cpu_kernels=False).build(common)
    assert md.decode is not None and md.decode.kernel_block_table is None


def test_a_bfloat16_model_never_asks_for_the_cpu_kernels(monkeypatch):
    # The kernel is float32-only: a bf16 model must not trigger (or wait for) its build.
    import engine.v1.attention.backends.cpu_attn as cpu_attn

    def no_kernels():
        raise AssertionError("cpu_kernels() was called for a bfloat16 model")

    monkeypatch.setattr(cpu_attn, "cpu_kernels", no_kernels)
    h, h_kv = 4, 2
    step = Step([(3, 1), (9, 1), (5, 1)], 1, h, h_kv, seed=7)
    md = CPUAttentionMetadataBuilder(BS, torch.device("cpu")).build(step.common)
    impl = CPUAttentionBackendImpl(h, D, 1 / math.sqrt(D), h_kv)
    kv_cache = step.kv_caches[0].to(torch.bfloat16)
    query = step.q[0].to(torch.bfloat16)
    out = torch.empty_like(query)
    impl._batched_decode(query, kv_cache, md.decode, out)
    assert torch.isfinite(out.float()).all()

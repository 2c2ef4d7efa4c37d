"""CudagraphDispatcher: which graph a batch replays, with and without drafts.

Host logic only (no CUDA): the keys capture_model() captures and the key a
step's batch dispatches to. With speculation (k drafts) a verification batch
of 1 + k tokens per request has graphs of its own, sized in multiples of
1 + k; FlashInfer-like builders (one-token decodes only) drop them.
"""

from __future__ import annotations

import pytest

from engine.config.compilation import CompilationConfig, CUDAGraphMode
from engine.v1.cudagraph_dispatcher import BatchDescriptor, CudagraphDispatcher


def _dispatcher(q: int = 1, sizes=(1, 2, 4, 8)) -> CudagraphDispatcher:
    config = CompilationConfig(
        cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY, cudagraph_capture_sizes=list(sizes)
    )
    d = CudagraphDispatcher(config, uniform_decode_query_len=q)
    d.captured.update(d.decode_keys())
    return d


def test_plain_decode_keys_and_dispatch():
    d = _dispatcher()
    assert d.decode_keys() == [BatchDescriptor(s, s, True) for s in (1, 2, 4, 8)]
    assert d.dispatch(3, uniform_decode=True) == (CUDAGraphMode.FULL, BatchDescriptor(4, 4, True))
    assert d.dispatch(9, uniform_decode=True)[0] == CUDAGraphMode.NONE  # too big
    assert d.dispatch(3, uniform_decode=False)[0] == CUDAGraphMode.NONE


def test_verification_batches_get_graphs_in_multiples_of_one_plus_k():
    d = _dispatcher(q=4)
    # Capture sizes 1, 2, 4, 8 rounded up to multiples of 4: 4 and 8 tokens.
    assert d.spec_capture_sizes == [4, 8]
    assert BatchDescriptor(8, 2, True) in d.decode_keys()
    # 2 requests x (1 + 3 drafts) = 8 tokens: the 2-request graph.
    mode, key = d.dispatch(8, uniform_decode=True, query_len=4)
    assert (mode, key) == (CUDAGraphMode.FULL, BatchDescriptor(8, 2, True))
    # 1 request: padded to the 1-request graph of 4 tokens.
    assert d.dispatch(4, uniform_decode=True, query_len=4)[1] == BatchDescriptor(4, 1, True)
    # One-token decodes keep their own graphs.
    assert d.dispatch(2, uniform_decode=True)[1] == BatchDescriptor(2, 2, True)
    # Another query length (fewer drafts) runs eagerly; so does a 3-request batch (12 > 8).
    assert d.dispatch(6, uniform_decode=True, query_len=3)[0] == CUDAGraphMode.NONE
    assert d.dispatch(12, uniform_decode=True, query_len=4)[0] == CUDAGraphMode.NONE


def test_verification_graphs_fit_the_runners_token_buffers():
    config = CompilationConfig(
        cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY, cudagraph_capture_sizes=[1, 2, 4, 8, 16]
    )
    # 1 + k = 3: 3, 6, 9, 18 tokens; a 16-token budget leaves out 18.
    d = CudagraphDispatcher(config, uniform_decode_query_len=3, max_num_tokens=16)
    assert d.spec_capture_sizes == [3, 6, 9]


def test_builders_without_uniform_batch_support_drop_the_verification_graphs():
    d = _dispatcher(q=4)
    d.disable_spec_graphs()
    assert d.decode_keys() == [BatchDescriptor(s, s, True) for s in (1, 2, 4, 8)]
    assert d.dispatch(8, uniform_decode=True, query_len=4)[0] == CUDAGraphMode.NONE


def test_no_graph_mode_means_no_keys():
    config = CompilationConfig(cudagraph_mode=CUDAGraphMode.NONE)
    d = CudagraphDispatcher(config, uniform_decode_query_len=4)
    assert d.decode_keys() == []
    assert d.dispatch(4, uniform_decode=True, query_len=4)[0] == CUDAGraphMode.NONE


def test_capture_sizes_reach_a_full_verification_batch():
    # max_num_seqs 8, k = 3: a verification batch holds up to 8 x 4 = 32 tokens;
    # the list goes to twice that (vLLM's bound, whatever the mode).
    config = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY)
    config.finalize(8, enforce_eager=False, uniform_decode_query_len=4, max_num_batched_tokens=2048)
    assert config.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    d = CudagraphDispatcher(config, uniform_decode_query_len=4, max_num_tokens=2048, max_num_reqs=8)
    # One-token decodes never exceed 8 requests; verification graphs go to 32 tokens.
    assert d.capture_sizes == [1, 2, 4, 8]
    assert d.spec_capture_sizes == [4, 8, 16, 24, 32]
    d.captured.update(d.decode_keys())
    mode, key = d.dispatch(32, uniform_decode=True, query_len=4)
    assert (mode, key) == (CUDAGraphMode.FULL, BatchDescriptor(32, 8, True))
    # Without drafts the sizes stop at twice max_num_seqs; the token budget caps them too.
    plain = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY)
    plain.finalize(8, enforce_eager=False)
    assert plain.cudagraph_capture_sizes == [1, 2, 4, 8, 16]
    tight = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY)
    tight.finalize(8, enforce_eager=False, uniform_decode_query_len=4, max_num_batched_tokens=20)
    assert tight.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize(
    "mode", [CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL]
)
def test_capture_sizes_follow_vllm_in_every_mode(mode):
    """vLLM's _set_cudagraph_sizes: min(2 x max_num_seqs x (1 + k), 512), capped by
    the budget, which is itself captured when it fits."""
    big = CompilationConfig(mode=3, cudagraph_mode=mode)
    big.finalize(1024, enforce_eager=False, max_num_batched_tokens=16384)
    sizes = big.cudagraph_capture_sizes
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-3:] == [480, 496, 512]
    assert len(sizes) == 3 + 31 + 17 and big.max_cudagraph_capture_size == 512
    budget = CompilationConfig(mode=3, cudagraph_mode=mode)
    budget.finalize(64, enforce_eager=False, max_num_batched_tokens=100)
    assert budget.cudagraph_capture_sizes[-2:] == [96, 100]


def test_capture_sizes_the_user_gives(caplog):
    asked = CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=[4, 1, 64])
    asked.finalize(8, enforce_eager=False, max_num_batched_tokens=32)
    assert asked.cudagraph_capture_sizes == [1, 4] and asked.max_cudagraph_capture_size == 4
    assert "cut to [1, 4]" in caplog.text
    both = CompilationConfig(
        cudagraph_mode="FULL_DECODE_ONLY",
        cudagraph_capture_sizes=[1, 2],
        max_cudagraph_capture_size=8,
    )
    with pytest.raises(ValueError, match=r"max_cudagraph_capture_size \(8\) must equal .* \(2\)"):
        both.finalize(8, enforce_eager=False)
    assert CompilationConfig(cudagraph_mode="NONE").cudagraph_capture_sizes == []

"""What the FLASHINFER builder hands to FlashInfer's ``plan()``, checked on the CPU.

FlashInfer is replaced by a stand-in module whose wrappers record their
constructor arguments and ``plan()`` calls, so the page table (``indptr``,
``indices``, ``last_page_len``), the wrapper choice (prefill / decode /
fixed-size CUDA-graph decode), the padding and the plan options are checked
without flashinfer or a GPU. tests/gpu/test_flashinfer.py runs the real
kernels against cpu_attn on the H200.
"""

from __future__ import annotations

import importlib
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from engine.v1.attention.backend import CommonAttentionMetadata

MODULE = "engine.v1.attention.backends.flashinfer"


class _FakeWrapper:
    def __init__(
        self,
        workspace,
        layout,
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
    ):
        self.layout = layout
        self.use_cuda_graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        self.buffers = (
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        )
        self.plans: list[tuple[tuple, dict]] = []

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))


def _install_fake_flashinfer(monkeypatch, jit_cache: bool = True):
    fake = types.ModuleType("flashinfer")
    fake.__version__ = "0.0-fake"
    fake.BatchDecodeWithPagedKVCacheWrapper = type(
        "BatchDecodeWithPagedKVCacheWrapper", (_FakeWrapper,), {}
    )
    fake.BatchPrefillWithPagedKVCacheWrapper = type(
        "BatchPrefillWithPagedKVCacheWrapper", (_FakeWrapper,), {}
    )
    jit = types.ModuleType("flashinfer.jit")
    env = types.ModuleType("flashinfer.jit.env")
    env.has_flashinfer_jit_cache = lambda: jit_cache
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(sys.modules, "flashinfer.jit", jit)
    monkeypatch.setitem(sys.modules, "flashinfer.jit.env", env)


def _import_fresh():
    """Import the backend module anew (over the stand-in); returns a function
    that puts back whatever was there before (the real module, or nothing)."""
    import engine.v1.attention.backends as package

    original = sys.modules.pop(MODULE, None)
    original_attr = getattr(package, "flashinfer", None)

    def restore():
        sys.modules.pop(MODULE, None)
        if original is not None:
            sys.modules[MODULE] = original
        if original_attr is not None:
            package.flashinfer = original_attr
        elif hasattr(package, "flashinfer"):
            del package.flashinfer

    return restore


@pytest.fixture
def fi(monkeypatch):
    _install_fake_flashinfer(monkeypatch)
    restore = _import_fresh()
    try:
        module = importlib.import_module(MODULE)
        monkeypatch.setattr(module, "WORKSPACE_BUFFER_SIZE", 1024)  # no 256 MiB on the CPU
        yield module
    finally:
        restore()


BS = 4
LAYER = SimpleNamespace(num_heads=4, num_kv_heads=2, head_size=64, scale=0.125)


def _common(contexts, tables, width=8, pad_reqs=0):
    """contexts: (cached, new) per request; tables: its block ids."""
    query_lens = [n for _, n in contexts]
    seq_lens = [c + n for c, n in contexts]
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    rows = len(contexts) + pad_reqs
    block_table = torch.zeros(rows, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_table[i, : len(t)] = torch.tensor(t)
    slots = []
    for (c, n), t in zip(contexts, tables):
        slots += [t[p // BS] * BS + p % BS for p in range(c, c + n)]
    slots += [-1] * pad_reqs
    qsl_dev = torch.cat([qsl, qsl[-1:].repeat(pad_reqs)])
    seq_dev = torch.tensor(seq_lens + [0] * pad_reqs, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl_dev,
        query_start_loc_cpu=qsl,
        seq_lens=seq_dev,
        _seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=rows,
        num_actual_tokens=len(slots),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )


def _builder(fi, graph_sizes=()):
    builder = fi.FlashInferMetadataBuilder(BS, torch.device("cpu"))
    builder.bind_layers([LAYER, LAYER], torch.bfloat16, graph_sizes)
    return builder


def _plan_tensors(wrapper):
    ((args, kwargs),) = wrapper.plans
    return args, kwargs


def test_mixed_batch_plans_the_prefill_wrapper(fi):
    # A prefill from scratch, a decode at a block edge, a chunk after a prefix hit.
    contexts = [(0, 5), (7, 1), (9, 3)]
    tables = [[3, 9], [5, 1], [2, 7, 6]]
    md = _builder(fi).build(_common(contexts, tables))
    assert md.decode_wrapper is None and md.num_prefills == 2 and md.num_decodes == 1
    args, kwargs = _plan_tensors(md.prefill_wrapper)
    qo_indptr, indptr, indices, last_page_len, h, h_kv, d, page = args
    assert qo_indptr.tolist() == [0, 5, 6, 9]
    assert indptr.tolist() == [0, 2, 4, 7]  # pages: ceil(5/4), ceil(8/4), ceil(12/4)
    assert indices.tolist() == [3, 9, 5, 1, 2, 7, 6]
    assert last_page_len.tolist() == [1, 4, 4]  # a full last block counts block_size, not 0
    assert indices.dtype == indptr.dtype == last_page_len.dtype == torch.int32
    assert (h, h_kv, d, page) == (4, 2, 64, BS)
    assert kwargs == {
        "causal": True,
        "sm_scale": 0.125,
        "q_data_type": torch.bfloat16,
        "kv_data_type": torch.bfloat16,
    }
    assert md.prefill_wrapper.layout == "NHD"
    assert md.slot_mapping.tolist() == [12, 13, 14, 15, 36, 7, 25, 26, 27]


def test_decodes_come_first_but_the_mixed_batch_is_planned_whole(fi):
    """The builder asks for decodes first (threshold 1, as vLLM's); the runner's
    reordered batch still goes to the prefill wrapper in one plan."""
    builder = _builder(fi)
    assert builder.reorder_batch_threshold == 1
    contexts = [(6, 1), (3, 1), (0, 5)]  # two decodes, then a prefill
    md = builder.build(_common(contexts, [[4, 2], [7], [1, 3]]))
    assert md.decode_wrapper is None and (md.num_decodes, md.num_prefills) == (2, 1)
    args, _ = _plan_tensors(md.prefill_wrapper)
    assert args[0].tolist() == [0, 1, 2, 7]  # qo_indptr: every request in one plan


def test_pure_decode_plans_the_decode_wrapper(fi):
    contexts = [(4, 1), (0, 1), (10, 1)]
    tables = [[8, 2], [5], [1, 3, 4]]
    builder = _builder(fi)
    md = builder.build(_common(contexts, tables))
    assert md.prefill_wrapper is None and not md.uses_cudagraph_wrapper
    wrapper = md.decode_wrapper
    assert wrapper.use_tensor_cores and not wrapper.use_cuda_graph
    args, kwargs = _plan_tensors(wrapper)
    indptr, indices, last_page_len = args[:3]
    assert indptr.tolist() == [0, 2, 3, 6]
    assert indices.tolist() == [8, 2, 5, 1, 3, 4]
    assert last_page_len.tolist() == [1, 1, 3]
    assert kwargs == {
        "q_data_type": torch.bfloat16,
        "kv_data_type": torch.bfloat16,
        "sm_scale": 0.125,
    }
    # The next step reuses the same wrapper (one plan per step, all layers).
    assert builder.build(_common(contexts, tables)).decode_wrapper is wrapper


def test_padded_decode_uses_a_fixed_size_graph_wrapper(fi):
    """3 decodes padded to the captured size 4: the padding request reads one
    page, the null block 0, with one slot used."""
    contexts = [(4, 1), (0, 1), (10, 1)]
    tables = [[8, 2], [5], [1, 3, 4]]
    builder = _builder(fi, graph_sizes=(2, 4))
    md = builder.build(_common(contexts, tables, pad_reqs=1))
    assert md.uses_cudagraph_wrapper and md.num_reqs == 4 and md.num_actual_tokens == 4
    wrapper = md.decode_wrapper
    assert wrapper.use_cuda_graph
    indptr_buf, indices_buf, last_buf = wrapper.buffers
    assert indptr_buf.shape == (5,) and last_buf.shape == (4,)
    assert indices_buf.shape == (4 * 8,)  # largest size x block-table width: any batch fits
    args, _ = _plan_tensors(wrapper)
    indptr, indices, last_page_len = args[:3]
    assert indptr.tolist() == [0, 2, 3, 6, 7]
    assert indices.tolist() == [8, 2, 5, 1, 3, 4, 0]
    assert last_page_len.tolist() == [1, 1, 3, 1]
    # Size 2 gets its own wrapper over prefixes of the same buffers (fixed addresses).
    md2 = builder.build(_common(contexts[:2], tables[:2]))
    assert md2.decode_wrapper is not wrapper and md2.uses_cudagraph_wrapper
    assert md2.decode_wrapper.buffers[1] is indices_buf
    assert md2.decode_wrapper.buffers[0].data_ptr() == indptr_buf.data_ptr()
    # A decode batch that is not a captured size plans the ordinary wrapper.
    md3 = builder.build(_common(contexts, tables))
    assert not md3.uses_cudagraph_wrapper and not md3.decode_wrapper.use_cuda_graph


def test_padding_outside_a_decode_batch_is_rejected(fi):
    common = _common([(0, 3), (2, 1)], [[1], [2]])
    common.num_reqs = 3  # a padding row on a batch with a prefill
    with pytest.raises(ValueError, match="padding"):
        _builder(fi).build(common)


def test_bind_layers_checks(fi):
    builder = fi.FlashInferMetadataBuilder(BS, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="bind_layers"):
        builder.build(_common([(0, 2)], [[1]]))
    with pytest.raises(ValueError, match="float32"):
        builder.bind_layers([LAYER], torch.float32)
    with pytest.raises(ValueError, match="head sizes"):
        builder.bind_layers(
            [SimpleNamespace(num_heads=4, num_kv_heads=2, head_size=32, scale=0.1)], torch.float16
        )
    with pytest.raises(ValueError, match="same"):
        builder.bind_layers(
            [LAYER, SimpleNamespace(num_heads=4, num_kv_heads=2, head_size=64, scale=0.5)],
            torch.float16,
        )
    with pytest.raises(ValueError, match="no attention layers"):
        builder.bind_layers([], torch.float16)
    with pytest.raises(ValueError, match="head sizes"):
        fi.FlashInferImpl(4, 32, 0.1, 2)
    assert (
        fi.FlashInferBackend.get_name() == "FLASHINFER" and fi.FlashInferBackend.supports_cudagraph
    )
    assert fi.FlashInferBackend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)


def test_module_refuses_to_load_without_a_way_to_get_kernels(monkeypatch):
    _install_fake_flashinfer(monkeypatch, jit_cache=False)
    monkeypatch.setattr("shutil.which", lambda name: None)  # no nvcc, no ninja on PATH
    for var in ("CUDA_HOME", "CUDA_PATH", "FLASHINFER_NVCC"):
        monkeypatch.delenv(var, raising=False)
    restore = _import_fresh()
    try:
        with pytest.raises(ImportError, match="cannot run here: no (nvcc|ninja)"):
            importlib.import_module(MODULE)
    finally:
        restore()

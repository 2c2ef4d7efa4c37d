"""The contract between the model runner and an attention kernel.

vLLM twin: ``vllm/v1/attention/backend.py`` (``AttentionBackend``,
``CommonAttentionMetadata``, ``AttentionMetadataBuilder``, ``AttentionImpl``).
Read it for the three roles:
  * ``AttentionBackend`` -- a namespace class: its name, the KV cache tensor
    shape it wants, and which builder / impl classes go with it;
  * ``AttentionMetadataBuilder.build`` -- once per step, turns the runner's
    backend-neutral ``CommonAttentionMetadata`` into whatever the kernel needs;
    its ``reorder_batch_threshold`` (None: any order) asks the runner to put
    requests with at most that many query tokens (decodes) first
    (``engine/v1/attention/backends/utils.py``);
  * ``AttentionImpl.forward`` -- per layer: write this step's K/V into the
    paged cache through ``slot_mapping``, then attend over each request's
    blocks through its row of ``block_table_tensor``.
Sessions: 05 (attention backends).

Simpler than vLLM: builders are made from the block size and the device
(vLLM's take the KV cache spec, the layer names and the whole config);
``_init_reorder_batch_threshold`` takes vLLM's arguments, but its two flags
change nothing here: the threshold is the one given. So a speculative
verification row (query length 1 + k) counts as a prefill: it is ordered after
the decodes and runs on the prefill path, never on a decode CUDA graph (vLLM
can treat it as a decode when the backend supports that).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass
class CommonAttentionMetadata:
    """What every backend gets for one step (tokens of all requests flattened).

    Request i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; its
    context after this step is ``seq_lens[i]`` tokens (cached + new), whose KV
    lives in blocks ``block_table_tensor[i, :ceil(seq_lens[i] / block_size)]``.
    Token t's new K/V goes to flat slot ``slot_mapping[t]`` =
    ``block_id * block_size + offset``.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    query_start_loc_cpu: torch.Tensor  # same, on the CPU
    seq_lens: torch.Tensor  # [num_reqs] int32, device
    num_reqs: int
    num_actual_tokens: int  # tokens in the batch before any padding
    max_query_len: int
    max_seq_len: int  # with _seq_lens_cpu unset, an upper bound
    block_table_tensor: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    causal: bool = True
    # seq_lens on the CPU; None when only the device knows them (a drafter's
    # lookahead pass under async scheduling), and then a backend that reads
    # them waits for the copy (``seq_lens_cpu``).
    _seq_lens_cpu: torch.Tensor | None = None

    @property
    def seq_lens_cpu(self) -> torch.Tensor:
        if self._seq_lens_cpu is None:
            self._seq_lens_cpu = self.seq_lens.to("cpu")  # a host sync on CUDA
        return self._seq_lens_cpu


class AttentionImpl(ABC):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads

    @abstractmethod
    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,  # [T, num_heads, head_size]
        key: torch.Tensor,  # [T, num_kv_heads, head_size]
        value: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # backend-specific shape, see get_kv_cache_shape
        attn_metadata: Any,
        output: torch.Tensor,  # [T, num_heads, head_size], written in place
    ) -> torch.Tensor: ...


class AttentionCGSupport(enum.Enum):
    """Which batches a builder's metadata stays valid for under a CUDA graph
    (vLLM's enum, same members): the runner captures only those."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # every request one query token
    UNIFORM_BATCH = 2  # every request the same query length (decode, or 1 + k drafts)
    ALWAYS = 3


class AttentionMetadataBuilder(ABC):
    # The longest query (in tokens) the runner moves to the front of the
    # batch as a decode; None: the builder takes requests in any order.
    reorder_batch_threshold: int | None = None
    # Which batches may be replayed from a CUDA graph (the backend must also
    # set ``supports_cudagraph``).
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

    def _init_reorder_batch_threshold(
        self,
        reorder_batch_threshold: int | None = 1,
        supports_spec_as_decode: bool = False,
        supports_dcp_with_varlen: bool = False,
    ) -> None:
        """Set ``reorder_batch_threshold``. In vLLM the flags raise it to cover
        a speculative-decoding step's drafts or lower it to 1 under decode
        context parallelism; Glassbox has neither, so they are accepted unused."""
        if reorder_batch_threshold is not None and reorder_batch_threshold < 1:
            raise ValueError(
                f"reorder_batch_threshold must be None or >= 1, got {reorder_batch_threshold}"
            )
        self.reorder_batch_threshold = reorder_batch_threshold

    @abstractmethod
    def build(self, common_attn_metadata: CommonAttentionMetadata) -> Any: ...


class AttentionBackend(ABC):
    # Whether the runner may capture this backend's decode steps in CUDA graphs.
    supports_cudagraph: ClassVar[bool] = False

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        # K and V stacked on dim 0; one block = block_size consecutive slots.
        return (2, num_blocks, block_size, num_kv_heads, head_size)

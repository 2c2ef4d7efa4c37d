"""The contract between the model runner and an attention kernel.

vLLM twin: ``vllm/v1/attention/backend.py`` (``AttentionBackend``,
``CommonAttentionMetadata``, ``AttentionMetadataBuilder``, ``AttentionImpl``).
Read it for the three roles:
  * ``AttentionBackend`` -- a namespace class: its name, the KV cache tensor
    shape it wants, and which builder / impl classes go with it;
  * ``AttentionMetadataBuilder.build`` -- once per step, turns the runner's
    backend-neutral ``CommonAttentionMetadata`` into whatever the kernel needs;
  * ``AttentionImpl.forward`` -- per layer: write this step's K/V into the
    paged cache through ``slot_mapping``, then attend over each request's
    blocks through its row of ``block_table_tensor``.
Sessions: 05 (attention backends).
"""

from __future__ import annotations

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
    seq_lens_cpu: torch.Tensor  # same, on the CPU
    num_reqs: int
    num_actual_tokens: int  # tokens in the batch before any padding
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    causal: bool = True


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


class AttentionMetadataBuilder(ABC):
    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

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

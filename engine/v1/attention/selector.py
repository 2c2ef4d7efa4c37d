"""Which attention backend a layer gets (vLLM twin: ``vllm/v1/attention/selector.py``).

Sessions: 05. Today: the plain-torch CPU backend on every device; the GPU
backends (Triton, FlashInfer) register here when they land.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.v1.attention.backend import AttentionBackend

if TYPE_CHECKING:
    from engine.config import GlassboxConfig


def get_attn_backend(glassbox_config: GlassboxConfig | None = None) -> type[AttentionBackend]:
    from engine.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend

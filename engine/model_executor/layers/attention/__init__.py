"""Attention layers (vLLM twin: ``vllm/model_executor/layers/attention/__init__.py``).

Sessions: 05. Glassbox has the decoder ``Attention`` only (no cross, encoder-only
or MLA variants).
"""

from engine.model_executor.layers.attention.attention import Attention

__all__ = ["Attention"]

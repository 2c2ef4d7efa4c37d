"""Model implementations and their registry.

vLLM twin: ``vllm/model_executor/models/__init__.py``.
Sessions: 04. Model files are imported lazily through ``ModelRegistry``.
"""

from engine.model_executor.models.registry import ModelRegistry

__all__ = ["ModelRegistry"]

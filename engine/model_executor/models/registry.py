"""Which class implements which ``architectures`` entry of config.json.

vLLM twin: ``vllm/model_executor/models/registry.py`` (``ModelRegistry``).
Read it for the lookup ``"LlamaForCausalLM" -> (module "llama", class
"LlamaForCausalLM")`` and for lazy registration: a model file is imported only
when a config asks for it. ``register_model`` adds out-of-tree models.
Sessions: 04.

Simpler than vLLM: a handful of decoder-only text models, no model-info
inspection cache, no transformers fallback; ``resolve_model_cls`` returns
the class only (vLLM returns ``(class, architecture)``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from torch import nn

# architecture in config.json -> (module under engine.model_executor.models, class)
_TEXT_GENERATION_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    # decapoda-research/llama-* spelled it this way
    "LLaMAForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    # EAGLE-1 heads (speculative decoding); vLLM's EAGLEConfig renames the
    # checkpoint's architecture to this one.
    "EagleLlamaForCausalLM": ("llama_eagle", "EagleLlamaForCausalLM"),
}


class _ModelRegistry:
    def __init__(self, models: dict[str, tuple[str, str] | type[nn.Module]]) -> None:
        self.models: dict[str, tuple[str, str] | type[nn.Module]] = dict(models)

    def get_supported_archs(self) -> list[str]:
        return sorted(self.models)

    def register_model(self, model_arch: str, model_cls: type[nn.Module] | str) -> None:
        """Add an architecture: a class, or ``"package.module:ClassName"`` (imported lazily)."""
        if isinstance(model_cls, str):
            module, sep, cls_name = model_cls.partition(":")
            if not sep or not module or not cls_name:
                raise ValueError(
                    f"model_cls must look like 'package.module:ClassName', got {model_cls!r}"
                )
            self.models[model_arch] = (module, cls_name)
        elif isinstance(model_cls, type) and issubclass(model_cls, nn.Module):
            self.models[model_arch] = model_cls
        else:
            raise ValueError(
                "model_cls must be an nn.Module subclass or a 'module:Class' string, "
                f"got {model_cls!r}"
            )

    def _load_model_cls(self, model_arch: str) -> type[nn.Module]:
        entry = self.models[model_arch]
        if isinstance(entry, type):
            return entry
        module_name, cls_name = entry
        if "." not in module_name:
            module_name = f"engine.model_executor.models.{module_name}"
        return getattr(importlib.import_module(module_name), cls_name)

    def resolve_model_cls(self, architectures: str | Iterable[str]) -> type[nn.Module]:
        """The class for the first supported name in ``architectures``."""
        if isinstance(architectures, str):
            architectures = [architectures]
        architectures = list(architectures)
        if not architectures:
            raise ValueError(
                "config.json lists no 'architectures'; supported architectures: "
                f"{self.get_supported_archs()}"
            )
        for arch in architectures:
            if arch in self.models:
                return self._load_model_cls(arch)
        raise ValueError(
            f"model architectures {architectures} are not supported by Glassbox; "
            f"supported architectures: {self.get_supported_archs()}"
        )


ModelRegistry = _ModelRegistry(_TEXT_GENERATION_MODELS)

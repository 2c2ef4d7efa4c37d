"""``@support_torch_compile``: the class decorator that makes a model compile.

vLLM twin: ``vllm/compilation/decorators.py`` (``support_torch_compile``).
Read it for where compilation enters a model: the decorator sits on the
inner model class (``LlamaModel``, ``Qwen2Model``), whose ``forward`` takes
``input_ids`` / ``positions`` of ``T`` tokens and returns hidden states;
the LM head stays outside (it runs on a few rows per step). At the first
call the decorator marks dim 0 of every tensor argument dynamic (``T``
varies every step; nothing else does) and hands ``forward`` to
``torch.compile`` with the backend the ``CompilationMode`` asks for:

  NONE                 no compilation: ``forward`` runs as written;
  STOCK_TORCH_COMPILE  plain torch.compile + Inductor, guards kept;
  DYNAMO_TRACE_ONCE    one Dynamo trace, guards dropped, whole graph to
                       ``CompilationConfig.backend`` (inductor or eager);
  VLLM_COMPILE         one trace, guards dropped, ``GlassboxBackend``: split
                       at attention, pieces compiled and (on CUDA) wrapped
                       for piecewise CUDA graphs.

The first call happens in the runner's profiling run, at the largest token
count, so the trace sees a general ``T``.
Sessions: 06 (compilation).

Simpler than vLLM: dynamic dims come from the annotations (``torch.Tensor``
arguments, dim 0) unless given; no ``enable_if``, no marking of unbacked
dims, no shape-invariant checks, no per-model compile tags.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from engine.compilation.backends import GlassboxBackend
from engine.compilation.counter import compilation_counter
from engine.compilation.cuda_graph import get_global_graph_pool
from engine.compilation.wrapper import TorchCompileWithNoGuardsWrapper
from engine.config.compilation import CompilationMode
from engine.model_executor.custom_op import CustomOp

logger = logging.getLogger(__name__)

_T = TypeVar("_T", bound=type[nn.Module])
# Engine code whose change must invalidate compiled artefacts.
_ENGINE_ROOT = Path(__file__).resolve().parents[1]
_HASHED_DIRS = ("compilation", "model_executor")


def support_torch_compile(
    cls: _T | None = None, *, dynamic_arg_dims: dict[str, int] | None = None
) -> Any:
    """Decorate ``cls`` (its ``__init__`` must take ``glassbox_config``)."""

    def decorate(cls: _T) -> _T:
        dims = dynamic_arg_dims
        if dims is None:
            dims = _infer_dynamic_arg_dims(cls.forward)
        return _decorate_model(cls, dims)

    return decorate(cls) if cls is not None else decorate


def _infer_dynamic_arg_dims(forward: Callable[..., Any]) -> dict[str, int]:
    dims = {}
    for name, param in inspect.signature(forward).parameters.items():
        if "Tensor" in str(param.annotation):
            dims[name] = 0
    if not dims:
        raise ValueError(f"{forward.__qualname__} has no torch.Tensor arguments to mark dynamic")
    return dims


def _decorate_model(cls: _T, dynamic_arg_dims: dict[str, int]) -> _T:
    original_init = cls.__init__
    signature = inspect.signature(cls.forward)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        glassbox_config = kwargs["glassbox_config"]
        self.glassbox_config = glassbox_config
        mode = glassbox_config.compilation_config.mode
        self.do_not_compile = mode in (None, CompilationMode.NONE)
        self.compiled: TorchCompileWithNoGuardsWrapper | None = None
        self.compile_backend: GlassboxBackend | None = None
        if not self.do_not_compile:
            compilation_counter.num_models_seen += 1
            compilation_config = glassbox_config.compilation_config
            for module in self.modules():
                if isinstance(module, CustomOp):
                    enabled = compilation_config.is_custom_op_enabled(module.name)
                    module.set_enabled_by_config(enabled)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.do_not_compile or torch.compiler.is_compiling():
            return nn.Module.__call__(self, *args, **kwargs)
        if self.compiled is None:
            bound = signature.bind(self, *args, **kwargs)
            for name, dim in dynamic_arg_dims.items():
                arg = bound.arguments.get(name)
                if isinstance(arg, torch.Tensor):
                    torch._dynamo.mark_dynamic(arg, dim)
            self.compiled = _compile(self)
        return self.compiled(*args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    cls.__call__ = __call__  # type: ignore[method-assign]
    return cls


def _compile(model: Any) -> TorchCompileWithNoGuardsWrapper:
    config = model.glassbox_config
    compilation_config = config.compilation_config
    mode = compilation_config.mode
    device_type = next(model.parameters()).device.type
    backend: Any = compilation_config.backend or "inductor"
    if mode == CompilationMode.VLLM_COMPILE:
        pool = get_global_graph_pool() if device_type == "cuda" else None
        model.compile_backend = backend = GlassboxBackend(
            compilation_config, compute_cache_key(config), device_type, pool
        )
    logger.info("compiling %s (mode %s)", type(model).__name__, mode.name)
    return TorchCompileWithNoGuardsWrapper(
        model, mode, backend, compilation_config.inductor_compile_config
    )


def release_compiled_model(model: nn.Module) -> None:
    """Let a shut-down engine's compiled code, pieces and CUDA graphs go.
    Dynamo holds on to every backend (and, through it, the KV cache) and to
    every compiled graph for the life of the process, which matters when
    engines come and go in one process (notebooks, tests)."""
    for module in model.modules():
        compiled = getattr(module, "compiled", None)
        if isinstance(compiled, TorchCompileWithNoGuardsWrapper):
            compiled.release()
            module.compiled = None
        backend = getattr(module, "compile_backend", None)
        if isinstance(backend, GlassboxBackend):
            backend.release()
            module.compile_backend = None


def compute_cache_key(glassbox_config: Any) -> str:
    """The cache folder of one model, the settings that change its graph and
    the engine's code (Inductor keys each piece and size inside it)."""
    model_config = glassbox_config.model_config
    compilation_config = glassbox_config.compilation_config
    digest = hashlib.sha256()
    settings = {
        "model": str(model_config.model),
        "dtype": str(model_config.dtype),
        "hf_config": model_config.hf_config,
        "mode": int(compilation_config.mode),
        "backend": compilation_config.backend,
        "splitting_ops": compilation_config.splitting_ops,
        "inductor_compile_config": compilation_config.inductor_compile_config,
        "torch": torch.__version__,
    }
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for folder in _HASHED_DIRS:
        for path in sorted((_ENGINE_ROOT / folder).rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:10]

"""CustomOp: a layer with a reference torch implementation and fused kernels.

vLLM twin: ``vllm/model_executor/custom_op.py`` (``CustomOp``,
``CustomOp.register``, ``forward_native`` / ``forward_cuda`` /
``forward_cpu``, ``enabled()``).
Read it for how one layer class carries several implementations of the same
maths: ``forward_native`` is plain torch (the readable reference, and what the
CPU runs), ``forward_cuda`` calls fused kernels (``engine/_custom_ops.py``).
``forward`` never chooses per call: the implementation is picked once and
kept as a bound method in ``_forward_method``, so a step pays no dispatch
cost -- and a CUDA graph captures exactly the kernels that were chosen.
Sessions: 04 (worker: why the decode step is ~5 launches per layer and not
~35), 06 (kernel fusion).

Simpler than vLLM:
- vLLM picks by platform (``current_platform``) in ``__init__``; we pick on the
  first call from the device of the first tensor argument, and pick again
  after ``.to()`` / ``.cuda()`` moves the module. Models are built on their
  device, so in practice this is once per module.
- Enabling is an environment variable, not ``CompilationConfig.custom_ops``:
  ``GLASSBOX_DISABLE_CUSTOM_OPS=1`` (or ``all``) makes every CustomOp run
  ``forward_native``; a comma-separated list of registered names
  (``rms_norm,rotary_embedding``) disables only those. vLLM spells the same
  thing ``custom_ops=["none"]`` / ``["-rms_norm"]``. The variable is read when
  a module dispatches, so set it before the first forward.
- No ROCm/TPU/XPU/out-of-tree paths, no out-of-tree class replacement
  (``register_oot``), no ``torch.compile`` of the native path.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

DISABLE_CUSTOM_OPS_ENV = "GLASSBOX_DISABLE_CUSTOM_OPS"

# Registered name -> CustomOp subclass (``CustomOp.register``).
op_registry: dict[str, type[CustomOp]] = {}


def _disabled_op_names() -> set[str]:
    """The op names ``GLASSBOX_DISABLE_CUSTOM_OPS`` turns off; ``{"all"}`` for every op."""
    value = os.environ.get(DISABLE_CUSTOM_OPS_ENV, "").strip()
    if value in ("", "0"):
        return set()
    if value in ("1", "all"):
        return {"all"}
    names = {name.strip() for name in value.split(",") if name.strip()}
    unknown = names - set(op_registry)
    if unknown:
        raise ValueError(
            f"{DISABLE_CUSTOM_OPS_ENV} must be 1, all, or a comma-separated list of "
            f"registered custom ops {sorted(op_registry)}; got unknown {sorted(unknown)}"
        )
    return names


class CustomOp(nn.Module, ABC):
    """Base class: subclasses must implement ``forward_native`` and ``forward_cuda``
    (an op with no kernel of its own says so by returning ``forward_native``)."""

    # Set by ``CustomOp.register``.
    name: str

    def __init__(self) -> None:
        super().__init__()
        # Until the first call, forward goes through _dispatch_and_call.
        self._forward_method: Callable[..., Any] = self._dispatch_and_call
        # CompilationConfig.custom_ops, applied to a compiled model's layers
        # (support_torch_compile): False runs forward_native, for Inductor to fuse.
        self.enabled_by_config = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    @abstractmethod
    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """Plain torch: the reference every other implementation is tested against."""

    @abstractmethod
    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        """Fused kernels (``engine/_custom_ops.py``), same maths as ``forward_native``."""

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        # No CPU kernels of our own: the torch ops already run vectorised there.
        return self.forward_native(*args, **kwargs)

    @classmethod
    def enabled(cls) -> bool:
        """False when ``GLASSBOX_DISABLE_CUSTOM_OPS`` turns this op (or all ops) off."""
        disabled = _disabled_op_names()
        return "all" not in disabled and getattr(cls, "name", None) not in disabled

    def is_enabled(self) -> bool:
        """Whether this layer runs its own kernels: the environment's switch
        and the compilation config's (``set_enabled_by_config``) both allow it."""
        return self.enabled() and self.enabled_by_config

    def set_enabled_by_config(self, enabled: bool) -> None:
        """Apply ``CompilationConfig.custom_ops``; the next call chooses again."""
        self.enabled_by_config = enabled
        self._forward_method = self._dispatch_and_call

    def dispatch_forward(self, device: torch.device) -> Callable[..., Any]:
        """The bound method ``forward`` will call for inputs on ``device``."""
        if not self.is_enabled():
            return self.forward_native
        if device.type == "cuda":
            return self.forward_cuda
        if device.type == "cpu":
            return self.forward_cpu
        return self.forward_native  # meta, mps, ...: the torch reference

    def _dispatch_and_call(self, *args: Any, **kwargs: Any) -> Any:
        first_tensor = next(
            (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None
        )
        if first_tensor is None:
            raise ValueError(f"{type(self).__name__}.forward needs at least one tensor argument")
        self._forward_method = self.dispatch_forward(first_tensor.device)
        return self._forward_method(*args, **kwargs)

    def _apply(self, fn, recurse: bool = True):
        # .to() / .cuda() / .half() land here: choose again on the next call.
        self._forward_method = self._dispatch_and_call
        return super()._apply(fn, recurse)

    @classmethod
    def register(cls, name: str) -> Callable[[type[CustomOp]], type[CustomOp]]:
        """Class decorator: ``@CustomOp.register("rms_norm")`` names the op."""

        def decorator(op_cls: type[CustomOp]) -> type[CustomOp]:
            if name in op_registry:
                raise ValueError(f"custom op name {name!r} is already registered")
            op_cls.name = name
            op_registry[name] = op_cls
            return op_cls

        return decorator

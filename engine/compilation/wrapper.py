"""``torch.compile`` of a model's ``forward``, traced once, without guards.

vLLM twin: ``vllm/compilation/wrapper.py`` (``TorchCompileWithNoGuardsWrapper``).
Read it for why vLLM's compiled model costs nothing per call on the host:
Dynamo normally re-checks guards (input shapes, module attributes, globals)
before every call and recompiles when one fails. The engine knows its model
never changes shape except in the token count, which is marked dynamic, so
every guard is dropped (``torch.compiler.skip_all_guards_unsafe``): one trace
at start-up, then the compiled code runs directly.
``STOCK_TORCH_COMPILE`` keeps the guards (plain ``torch.compile``).
Sessions: 06 (compilation).

Simpler than vLLM: no bytecode hook, no AOT compile, no NVTX ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.config.compilation import CompilationMode


class TorchCompileWithNoGuardsWrapper:
    def __init__(self, forward: Callable[..., Any], mode: CompilationMode, backend: Any) -> None:
        options: dict[str, Any] = {}
        if mode != CompilationMode.STOCK_TORCH_COMPILE:
            options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
        stock = mode == CompilationMode.STOCK_TORCH_COMPILE
        self._compiled_callable = torch.compile(
            forward,
            fullgraph=not stock,
            # Only the dims marked dynamic are symbolic; plain torch.compile
            # (None) also turns a dim dynamic once a guard on its size fails.
            dynamic=None if stock else False,
            backend=backend,
            options=options,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled_callable(*args, **kwargs)

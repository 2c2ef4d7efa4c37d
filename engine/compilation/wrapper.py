"""``torch.compile`` of a model's ``forward``, traced once, without guards.

vLLM twin: ``vllm/compilation/wrapper.py`` (``TorchCompileWithNoGuardsWrapper``).
Read it for why vLLM's compiled model costs nothing per call on the host:
Dynamo normally re-checks guards (input shapes, module attributes, globals)
before every call and recompiles when one fails. The engine knows its model
never changes shape except in the token count, which is marked dynamic, so
every guard is dropped (``torch.compiler.skip_all_guards_unsafe``): one trace
at start-up, then the compiled code runs directly.

"Directly" is meant literally (vLLM's default, ``VLLM_USE_BYTECODE_HOOK=1``).
Dynamo keeps its compiled code per *code object*, and every instance of a
model class shares ``forward.__code__``: with the guards gone, whichever
engine of the process compiled last would serve every model of that class,
its pieces and CUDA graphs included. So the wrapper catches, through
Dynamo's bytecode hook, the transformed bytecode of its own model's first
call, and from then on runs ``forward`` with that code swapped in (vLLM's
``_dispatch_to_compiled_code``): each model calls its own compiled graph
and never consults Dynamo's cache again.
``STOCK_TORCH_COMPILE`` keeps the guards (plain ``torch.compile``).
Sessions: 06 (compilation).

Simpler than vLLM: no AOT compile, no NVTX ranges, no dump of the
decompiled code; the hook is removed once it has fired (vLLM's stays
registered, keeping the model reachable).
"""

from __future__ import annotations

from types import CodeType
from typing import Any

import torch
from torch import nn

from engine.config.compilation import CompilationMode


class TorchCompileWithNoGuardsWrapper:
    def __init__(
        self,
        model: nn.Module,
        mode: CompilationMode,
        backend: Any,
        inductor_options: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        # The function every instance of the class runs (maybe a base class's).
        self.forward_fn = type(model).forward
        self.original_code: CodeType = self.forward_fn.__code__
        self.use_bytecode = mode != CompilationMode.STOCK_TORCH_COMPILE
        # Plain Inductor takes the options itself; our backend hands them to each piece.
        options: dict[str, Any] = dict(inductor_options or {}) if backend == "inductor" else {}
        if self.use_bytecode:
            options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
        self._compiled_callable = torch.compile(
            model.forward,
            fullgraph=self.use_bytecode,
            # Only the dims marked dynamic are symbolic; plain torch.compile
            # (None) also turns a dim dynamic once a guard on its size fails.
            dynamic=False if self.use_bytecode else None,
            backend=backend,
            options=options,
        )
        self._compiled_bytecode: CodeType | None = None
        self._compiling = False
        self._hook_handle = (
            torch._dynamo.convert_frame.register_bytecode_hook(self.bytecode_hook)
            if self.use_bytecode
            else None
        )

    def bytecode_hook(self, old_code: CodeType, new_code: CodeType) -> None:
        """Dynamo's hook: keep the code it made for this model's first call."""
        if self._compiling and old_code is self.original_code:
            self._compiled_bytecode = new_code

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.use_bytecode:
            return self._compiled_callable(*args, **kwargs)
        if self._compiled_bytecode is None:
            return self._compile_and_call(*args, **kwargs)
        # vLLM's _dispatch_to_compiled_code, inline (this runs every step): Dynamo's
        # bytecode takes the same arguments, cells and free variables as the
        # original, so it can stand in for it for one call.
        self.forward_fn.__code__ = self._compiled_bytecode
        try:
            return self.model.forward(*args, **kwargs)
        finally:
            self.forward_fn.__code__ = self.original_code

    def _compile_and_call(self, *args: Any, **kwargs: Any) -> Any:
        # An earlier model of this class may have left code on ``forward``:
        # drop it, so this call traces this model.
        torch._dynamo.eval_frame.remove_from_cache(self.original_code)
        self._compiling = True
        try:
            output = self._compiled_callable(*args, **kwargs)
        finally:
            self._compiling = False
        if self._compiled_bytecode is None:
            raise RuntimeError(
                f"torch.compile produced no bytecode for {self.forward_fn.__qualname__}"
            )
        self._remove_hook()
        return output

    def release(self) -> None:
        """Forget the compiled code (the engine is shutting down). Dynamo keeps
        the compiled graph in a global of the model's module (``__compiled_fn_N``)
        until the bytecode that calls it is collected: drop the bytecode, ours
        and the copy in Dynamo's cache (no model runs from that cache: each
        traces afresh and then calls its own bytecode)."""
        torch._dynamo.eval_frame.remove_from_cache(self.original_code)
        self._remove_hook()
        self._compiled_bytecode = None
        self._compiled_callable = None

    def _remove_hook(self) -> None:
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None

"""dtype and device helpers (vLLM twin: ``vllm/utils/torch_utils.py``).

``resolve_dtype`` fixes what ``dtype="auto"`` means in Glassbox: on CUDA, as
vLLM's ``_resolve_auto_dtype``, the checkpoint's own dtype when it is float16
or bfloat16, and bfloat16 for a float32 (or unstated) one; float32 on the CPU
(Glassbox's choice: exact parity with transformers in tests, and CPUs are slow
at bf16 matmuls without AMX). Sessions: 04.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch

_STR_TO_DTYPE = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

DTYPE_TO_STR = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def release_device_memory() -> None:
    """Free what dead tensors still hold and give the CUDA caching allocator's
    reserved blocks back to the driver: otherwise an engine that ran earlier in
    this process counts against the next one (in its profiling peak, or as
    memory "used by others" seen from another process). Nothing on the CPU."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def resolve_dtype(
    dtype: str, device: str | torch.device, config_dtype: str | None = None
) -> torch.dtype:
    """``dtype`` as a torch dtype; ``config_dtype`` is the checkpoint's (config.json's
    ``dtype`` / ``torch_dtype``), read only for "auto" on CUDA."""
    device_type = torch.device(device).type
    if dtype == "auto":
        if device_type != "cuda":
            return torch.float32
        if config_dtype in ("float16", "bfloat16"):
            return _STR_TO_DTYPE[config_dtype]
        return torch.bfloat16
    if dtype not in _STR_TO_DTYPE:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_STR_TO_DTYPE)}, got {dtype!r}")
    return _STR_TO_DTYPE[dtype]


@contextlib.contextmanager
def set_default_torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules with parameters of ``dtype`` (restores the old default)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory that does not keep it allocated (vLLM's
    ``weak_ref_tensors``). A captured CUDA graph's outputs live in the graph
    pool; holding them weakly lets later captures reuse that memory, and a
    replay writes the same addresses again. Valid only until the next replay."""
    if tensor.device.type != "cuda":
        return tensor
    # A storage built from a raw pointer does not own (or free) its memory.
    storage = torch._C._construct_storage_from_data_pointer(
        tensor.untyped_storage().data_ptr(), tensor.device, tensor.untyped_storage().nbytes()
    )
    view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    view.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())
    return view


def weak_ref_tensors(value: Any) -> Any:
    """``weak_ref_tensor`` over a tensor, or a tuple / list of them."""
    if isinstance(value, torch.Tensor):
        return weak_ref_tensor(value)
    if isinstance(value, tuple | list):
        return type(value)(weak_ref_tensors(v) for v in value)
    return value


# The library our custom ops live in: ``torch.ops.glassbox.<name>``.
glassbox_lib = torch.library.Library("glassbox", "FRAGMENT")


def direct_register_custom_op(
    op_name: str,
    op_func: Callable[..., Any],
    mutates_args: list[str],
    fake_impl: Callable[..., Any],
) -> None:
    """Register ``op_func`` as ``torch.ops.glassbox.<op_name>`` (vLLM's helper of
    the same name). Dynamo records a call to it as one opaque node instead of
    tracing into it, which is what lets the compiler split the graph there;
    ``fake_impl`` tells the compiler the op's effect on shapes (none: it
    writes its ``mutates_args`` in place and returns nothing)."""
    schema = torch.library.infer_schema(op_func, mutates_args=mutates_args)
    glassbox_lib.define(op_name + schema)
    for dispatch_key in ("CPU", "CUDA"):
        glassbox_lib.impl(op_name, op_func, dispatch_key)
    glassbox_lib._register_fake(op_name, fake_impl)

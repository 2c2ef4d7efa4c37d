"""dtype and device helpers (vLLM twin: ``vllm/utils/torch_utils.py``).

``resolve_dtype`` fixes what ``dtype="auto"`` means in Glassbox: float32 on the
CPU (exact parity with transformers in tests; CPUs are slow at bf16 matmuls
without AMX) and bfloat16 on CUDA. Sessions: 04.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


def resolve_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    device_type = torch.device(device).type
    if dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
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

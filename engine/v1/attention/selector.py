"""Which attention backend a layer gets (vLLM twin: ``vllm/v1/attention/selector.py``).

Read it for the selection order:

  * CPU  -> ``CPU_ATTN`` (plain torch, ``backends/cpu_attn.py``);
  * CUDA -> ``FLASHINFER`` when ``engine.v1.attention.backends.flashinfer``
    imports (it needs the ``flashinfer`` package), else ``TRITON_ATTN``
    (our Triton kernels, ``backends/triton_attn.py``). vLLM's CUDA platform
    walks a longer priority list (``_get_backend_priorities`` in
    ``vllm/platforms/cuda.py``: FLASH_ATTN, FLASHINFER, TRITON_ATTN, ... on
    Hopper); we have no FlashAttention backend, so ours starts at FlashInfer;
  * the environment variable ``GLASSBOX_ATTENTION_BACKEND`` overrides the
    choice with one of ``CPU_ATTN``, ``TRITON_ATTN``, ``FLASHINFER`` (vLLM:
    ``--attention-backend`` / ``AttentionConfig.backend``).

FlashInfer has no float32 kernels and supports head sizes 64, 128 and 256,
so a CUDA model outside those (an fp32 run, a tiny test model with 32-wide
heads) gets TRITON_ATTN automatically; asking for FLASHINFER by name then is
an error that says why.

Backends are imported only when chosen, so a CPU run never imports triton.
Sessions: 05 (attention backends).

Simpler than vLLM: the name -> class table sits here (vLLM's is
``AttentionBackendEnum`` in ``backends/registry.py``) and the choice looks at
the device, the model dtype and the head size only -- not the KV-cache dtype,
sinks, MLA or the compute capability.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING

from engine.v1.attention.backend import AttentionBackend

if TYPE_CHECKING:
    from engine.config import GlassboxConfig

logger = logging.getLogger(__name__)

ATTENTION_BACKEND_ENV = "GLASSBOX_ATTENTION_BACKEND"

# Backend name -> "module:class" (imported lazily).
BACKENDS: dict[str, str] = {
    "CPU_ATTN": "engine.v1.attention.backends.cpu_attn:CPUAttentionBackend",
    "TRITON_ATTN": "engine.v1.attention.backends.triton_attn:TritonAttentionBackend",
    "FLASHINFER": "engine.v1.attention.backends.flashinfer:FlashInferBackend",
}


def _load(name: str) -> type[AttentionBackend]:
    module_name, class_name = BACKENDS[name].split(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ImportError(f"{module_name} defines no {class_name} (backend {name})") from None


# What FLASHINFER can run (kept here so the check needs no flashinfer import;
# backends/flashinfer.py enforces the same sets).
FLASHINFER_DTYPES = ("float16", "bfloat16")
FLASHINFER_HEAD_SIZES = (64, 128, 256)


def _try_load_flashinfer() -> type[AttentionBackend] | None:
    """The FlashInfer backend, or None when it cannot be imported here."""
    try:
        return _load("FLASHINFER")
    except ImportError as e:
        logger.debug("FLASHINFER attention backend unavailable (%s); using TRITON_ATTN", e)
        return None


def is_flashinfer_available() -> bool:
    return _try_load_flashinfer() is not None


def _model_dtype_and_head_size(
    glassbox_config: GlassboxConfig | None, device: str
) -> tuple[str | None, int | None]:
    """("bfloat16", 128)-style facts about the model, None where unknown."""
    model_config = getattr(glassbox_config, "model_config", None)
    if model_config is None:
        return None, None
    from engine.utils.torch_utils import resolve_dtype

    dtype = resolve_dtype(model_config.dtype, device, model_config.config_dtype)
    dtype = str(dtype).removeprefix("torch.")
    return dtype, model_config.get_head_size()


def _flashinfer_unsupported_reason(
    glassbox_config: GlassboxConfig | None, device: str
) -> str | None:
    dtype, head_size = _model_dtype_and_head_size(glassbox_config, device)
    if dtype is not None and dtype not in FLASHINFER_DTYPES:
        return f"dtype {dtype} (FLASHINFER supports {list(FLASHINFER_DTYPES)})"
    if head_size is not None and head_size not in FLASHINFER_HEAD_SIZES:
        return f"head size {head_size} (FLASHINFER supports {list(FLASHINFER_HEAD_SIZES)})"
    return None


def _check_triton_on_device(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "TRITON_ATTN on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1 before "
            "starting (slow; for study and tests), or use CPU_ATTN"
        )


def get_attn_backend(glassbox_config: GlassboxConfig | None = None) -> type[AttentionBackend]:
    device = "cpu" if glassbox_config is None else glassbox_config.device_config.resolve()
    requested = os.environ.get(ATTENTION_BACKEND_ENV)
    if requested:
        name = requested.strip()
        if name not in BACKENDS:
            raise ValueError(
                f"{ATTENTION_BACKEND_ENV}={requested!r} is not a backend; "
                f"valid values: {sorted(BACKENDS)}"
            )
        if name == "FLASHINFER":
            if device != "cuda":
                raise ValueError(
                    f"{ATTENTION_BACKEND_ENV}=FLASHINFER needs a CUDA device, got device {device!r}"
                )
            reason = _flashinfer_unsupported_reason(glassbox_config, device)
            if reason is not None:
                raise ValueError(
                    f"{ATTENTION_BACKEND_ENV}=FLASHINFER cannot run this model: {reason}"
                )
        if name == "TRITON_ATTN":
            _check_triton_on_device(device)
        # An explicit request fails loudly if the backend cannot be imported.
        return _load(name)

    if device == "cuda":
        reason = _flashinfer_unsupported_reason(glassbox_config, device)
        if reason is None:
            backend = _try_load_flashinfer()
            if backend is not None:
                return backend
        else:
            logger.debug("not using FLASHINFER: %s; using TRITON_ATTN", reason)
        return _load("TRITON_ATTN")
    return _load("CPU_ATTN")

"""get_punica_wrapper: the wrapper for this device.

vLLM twin: ``vllm/lora/punica_wrapper/punica_selector.py`` (``get_punica_wrapper``).
Read it for where the platform picks the LoRA kernels: on CUDA the Triton
shrink/expand kernels (``PunicaWrapperGPU``, ``punica_gpu.py``), anywhere
else the per-token torch ops (``PunicaWrapperCPU``). Sessions: 06.
Simpler than vLLM: the choice is made here from the device type (vLLM asks
the platform for a class name); if Triton cannot be imported, CUDA falls back
to the torch ops.
"""

from __future__ import annotations

import torch

from engine.lora.punica_wrapper.punica_base import PunicaWrapperBase
from engine.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU


def get_punica_wrapper(
    max_num_batched_tokens: int, device: torch.device | str, max_loras: int
) -> PunicaWrapperBase:
    if torch.device(device).type == "cuda":
        try:
            from engine.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU
        except ImportError:  # no Triton in this install: the torch ops serve CUDA too
            pass
        else:
            return PunicaWrapperGPU(max_num_batched_tokens, device, max_loras)
    return PunicaWrapperCPU(max_num_batched_tokens, device)

"""get_punica_wrapper: the wrapper for this device.

vLLM twin: ``vllm/lora/punica_wrapper/punica_selector.py`` (``get_punica_wrapper``).
Read it for where the platform picks the LoRA kernels. Sessions: 06.
Simpler than vLLM: one wrapper, the torch ops (vLLM's GPU wrapper runs Triton
shrink/expand kernels, ``punica_gpu.py``; Glassbox has none yet).
"""

from __future__ import annotations

import torch

from engine.lora.punica_wrapper.punica_base import PunicaWrapperBase
from engine.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU


def get_punica_wrapper(
    max_num_batched_tokens: int, device: torch.device | str
) -> PunicaWrapperBase:
    return PunicaWrapperCPU(max_num_batched_tokens, device)

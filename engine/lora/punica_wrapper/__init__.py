"""Punica wrappers: the per-token LoRA computation (vLLM twin:
``vllm/lora/punica_wrapper/``). Sessions: 06."""

from engine.lora.punica_wrapper.punica_base import PunicaWrapperBase
from engine.lora.punica_wrapper.punica_selector import get_punica_wrapper

__all__ = ["PunicaWrapperBase", "get_punica_wrapper"]

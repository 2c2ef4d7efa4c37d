"""PEFTHelper: an adapter's ``adapter_config.json``, read and checked.

vLLM twin: ``vllm/lora/peft_helper.py`` (``PEFTHelper``).
Read it for the one number the engine derives from PEFT's settings: the
scaling applied to ``x A^T B^T``, ``lora_alpha / r`` -- or, with rsLoRA,
``lora_alpha / sqrt(r)`` (``vllm_lora_scaling_factor``) -- and for what makes
an adapter unusable: a rank above ``max_lora_rank``, trained biases, DoRA.
Sessions: 06.

Simpler than vLLM: no per-module rank or alpha patterns, no LoftQ, no
long-context scaling.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

# The PEFT target modules Glassbox serves: a Llama-family layer's projections
# (their fused homes are qkv_proj, o_proj, gate_up_proj and down_proj).
SUPPORTED_LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def check_lora_adapter(lora_path: str, max_lora_rank: int) -> PEFTHelper:
    """The adapter folder's config, checked for what this engine can serve:
    rank, no bias, no DoRA, supported target modules (ValueError otherwise)."""
    helper = PEFTHelper.from_local_dir(lora_path)
    helper.validate_legal(max_lora_rank)
    targets = helper.target_modules
    targets = [targets] if isinstance(targets, str) else list(targets)
    unsupported = sorted(set(targets) - set(SUPPORTED_LORA_TARGETS))
    if unsupported:
        raise ValueError(
            f"target modules {unsupported} are not supported "
            f"(supported: {list(SUPPORTED_LORA_TARGETS)})"
        )
    return helper


@dataclass
class PEFTHelper:
    r: int
    lora_alpha: int | float
    target_modules: list[str] | str
    bias: str = "none"
    use_rslora: bool = False
    use_dora: bool = False
    vllm_lora_scaling_factor: float = field(init=False)

    def __post_init__(self) -> None:
        denominator = math.sqrt(self.r) if self.use_rslora else self.r
        self.vllm_lora_scaling_factor = self.lora_alpha / denominator

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> PEFTHelper:
        try:
            return cls(
                r=int(config["r"]),
                lora_alpha=config.get("lora_alpha", 8),
                target_modules=config.get("target_modules") or [],
                bias=config.get("bias", "none"),
                use_rslora=bool(config.get("use_rslora", False)),
                use_dora=bool(config.get("use_dora", False)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"adapter_config.json: not a PEFT LoRA config ({e})") from e

    @classmethod
    def from_local_dir(cls, lora_path: str) -> PEFTHelper:
        path = os.path.join(lora_path, "adapter_config.json")
        if not os.path.isfile(path):
            raise ValueError(f"lora_path={lora_path!r}: no adapter_config.json there")
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def validate_legal(self, max_lora_rank: int) -> None:
        if self.r > max_lora_rank:
            raise ValueError(
                f"the adapter's rank r={self.r} is larger than max_lora_rank={max_lora_rank}"
            )
        if self.bias != "none":
            raise ValueError(f"adapters with trained biases (bias={self.bias!r}) are not supported")
        if self.use_dora:
            raise ValueError("DoRA adapters (use_dora=true) are not supported")

"""LoRAModel: an adapter folder, loaded into per-module ``A`` / ``B`` pairs.

vLLM twin: ``vllm/lora/lora_model.py`` (``LoRAModel.from_local_checkpoint``).
Read it for how PEFT names its tensors --
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -- and how
they become ``{"model.layers.0.self_attn.q_proj": LoRALayerWeights}`` with
the scaling folded into ``B``. Sessions: 06.

Simpler than vLLM: safetensors files only (``adapter_model.safetensors``), no
extra vocabulary or embedding adapters, no tensorizer.
"""

from __future__ import annotations

import os

import torch

from engine.lora.lora_weights import LoRALayerWeights
from engine.lora.peft_helper import PEFTHelper

_PEFT_PREFIX = "base_model.model."


def parse_fine_tuned_lora_name(name: str) -> tuple[str, bool]:
    """``base_model.model.X.lora_A.weight`` -> (``X``, is_lora_a)."""
    module = name.removeprefix(_PEFT_PREFIX)
    for suffix, is_a in ((".lora_A.weight", True), (".lora_B.weight", False)):
        if module.endswith(suffix):
            return module[: -len(suffix)], is_a
    raise ValueError(f"{name!r} is not a LoRA A or B weight")


class LoRAModel:
    def __init__(self, lora_model_id: int, rank: int, loras: dict[str, LoRALayerWeights]):
        self.id = lora_model_id
        self.rank = rank
        self.loras = loras

    def get_lora(self, module_name: str) -> LoRALayerWeights | None:
        return self.loras.get(module_name)

    @classmethod
    def from_local_checkpoint(
        cls,
        lora_dir: str,
        expected_lora_modules: set[str],
        peft_helper: PEFTHelper,
        lora_model_id: int,
        dtype: torch.dtype,
    ) -> LoRAModel:
        from safetensors.torch import load_file

        path = os.path.join(lora_dir, "adapter_model.safetensors")
        if not os.path.isfile(path):
            raise ValueError(f"lora_path={lora_dir!r}: no adapter_model.safetensors there")
        pairs: dict[str, dict[bool, torch.Tensor]] = {}
        for name, tensor in load_file(path).items():
            module, is_a = parse_fine_tuned_lora_name(name)
            leaf = module.rpartition(".")[2]
            if leaf not in expected_lora_modules:
                raise ValueError(
                    f"lora_path={lora_dir!r}: target module {leaf!r} ({module}) is not supported; "
                    f"supported: {sorted(expected_lora_modules)}"
                )
            pairs.setdefault(module, {})[is_a] = tensor.to(dtype)
        loras = {}
        for module, ab in pairs.items():
            if set(ab) != {True, False}:
                raise ValueError(f"lora_path={lora_dir!r}: {module} lacks lora_A or lora_B")
            loras[module] = LoRALayerWeights(
                module, peft_helper.r, ab[True], ab[False], peft_helper.vllm_lora_scaling_factor
            ).optimize()
        return cls(lora_model_id, peft_helper.r, loras)

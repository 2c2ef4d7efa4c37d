"""PEFT LoRA adapters for the LoRA tests, made by ``peft`` itself.

``save_peft_adapter`` wraps an HF checkpoint in a ``peft`` LoRA of the given
rank over the seven projections, with random non-zero ``A`` and ``B``
(``init_lora_weights=False``: PEFT's default B is zero, which would make every
adapter a no-op), saves the adapter folder and returns the peft model -- the
oracle the engine's outputs are compared with.
"""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_peft_adapter(
    base_dir: str | Path,
    out: Path,
    *,
    seed: int,
    r: int = 8,
    alpha: int = 16,
    use_rslora: bool = False,
    targets: list[str] | None = None,
    scale_b: float = 1.0,
) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        use_rslora=use_rslora,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config)
    if scale_b != 1.0:  # a large model needs small adapters to stay on its rails
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale_b)
    peft_model.save_pretrained(str(out))
    return peft_model.eval()

"""LoRAConfig: how many adapters, of what rank, may be served at once.

vLLM twin: ``vllm/config/lora.py`` (``LoRAConfig``). Sessions: 06.
``max_loras`` adapters live on the device at once (slots; a step never mixes
more), ``max_cpu_loras`` stay loaded in host memory (an LRU cache; at least
``max_loras``), and no adapter may have a rank above ``max_lora_rank`` (the
slots are allocated at that rank).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRAConfig:
    max_lora_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_lora_rank", "max_loras"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras!r}) must be an integer >= max_loras "
                f"({self.max_loras})"
            )

"""LoRARequest: which adapter a request runs with.

vLLM twin: ``vllm/lora/request.py`` (``LoRARequest``).
Read it for the three things the engine needs to know about an adapter: a
name (what the user calls it, and what the prefix-cache hash mixes in, so two
adapters never share KV blocks), an integer id (>= 1; what the worker keys its
slots by) and the folder holding the PEFT files. Sessions: 06.

Simpler than vLLM: no tensorizer config, in-place reload or 3-D weights.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

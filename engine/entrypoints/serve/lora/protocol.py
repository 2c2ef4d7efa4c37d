"""Bodies of ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

vLLM twin: ``vllm/entrypoints/serve/lora/protocol.py`` (``LoadLoRAAdapterRequest``,
``UnloadLoRAAdapterRequest``). Sessions: 06.
Simpler than vLLM: no ``load_inplace`` or ``is_3d_lora_weight``.
"""

from __future__ import annotations

from pydantic import BaseModel


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None

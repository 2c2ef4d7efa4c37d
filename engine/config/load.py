"""LoadConfig: how weights get into the model.

vLLM twin: ``vllm/config/load.py`` (``LoadConfig``). Sessions: 04.
"""

from __future__ import annotations

from dataclasses import dataclass

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class LoadConfig:
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")

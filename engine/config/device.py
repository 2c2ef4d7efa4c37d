"""DeviceConfig: where the model runs.

vLLM twin: ``vllm/config/device.py`` (``DeviceConfig``). Sessions: 04.
``"auto"`` picks CUDA when torch sees a GPU, else the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class DeviceConfig:
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")

    def resolve(self) -> str:
        """The concrete device type; imports torch only when asked to guess."""
        if self.device != "auto":
            return self.device
        import torch

        # device_count() asks NVML; is_available() asks the CUDA runtime, which
        # initialises the driver in this process, and a child forked after that
        # cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess").
        return "cuda" if torch.cuda.device_count() > 0 else "cpu"

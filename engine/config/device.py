"""DeviceConfig: where the model runs.

vLLM twin: ``vllm/config/device.py`` (``DeviceConfig``). Sessions: 04.
``"auto"`` picks CUDA when torch sees a GPU, else the CPU.

``get_device_total_memory`` and ``get_device_name`` play vLLM's
``current_platform`` methods of the same names (``vllm/platforms/cuda.py``,
``NvmlCudaPlatform``): they ask NVML, which leaves the process without a CUDA
context, so the engine-core and worker processes can still be forked.
Simpler than vLLM: no platform classes; the CPU and CUDA are the only devices.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

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

    def get_device_memory_and_name(self) -> tuple[int, str]:
        """(bytes, name) of the first visible GPU in one NVML query; (0, "") on
        the CPU or when neither NVML nor an initialised CUDA can tell."""
        info = _nvml_device_info() if self.resolve() == "cuda" else None
        return info if info is not None else (0, "")

    def get_device_total_memory(self) -> int:
        """Bytes of memory on the first visible GPU (0: CPU or unknown)."""
        return self.get_device_memory_and_name()[0]

    def get_device_name(self) -> str:
        """Name of the first visible GPU ("NVIDIA H200"; "": CPU or unknown)."""
        return self.get_device_memory_and_name()[1]


def _nvml_device_info() -> tuple[int, str] | None:
    """(total bytes, name) of the GPU that is cuda:0 in this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            if visible.startswith(("GPU-", "MIG-")):
                handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible else 0)
            name = pynvml.nvmlDeviceGetName(handle)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        finally:
            pynvml.nvmlShutdown()
        return int(total), name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:  # no NVML here: fall back to CUDA only if it is already up
        import torch

        if torch.cuda.is_initialized():
            props = torch.cuda.get_device_properties(0)
            return int(props.total_memory), props.name
        logger.debug("GPU memory and name unknown (%s); using small-GPU defaults", exc)
        return None

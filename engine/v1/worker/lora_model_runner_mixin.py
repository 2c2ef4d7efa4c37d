"""LoRAModelRunnerMixin: the model runner's LoRA hooks.

vLLM twin: ``vllm/v1/worker/lora_model_runner_mixin.py``
(``LoRAModelRunnerMixin``: ``load_lora_model``, ``set_active_loras``).
Read it for the two places LoRA touches the runner: after loading, the
model's projections are wrapped (``load_lora_model``); before every
forward, each scheduled token is told its request's adapter
(``set_active_loras``: ``num_scheduled_tokens [2, 5, 3]`` with adapters
``[7, 0, 9]`` -> token ids ``[7 7 0 0 0 0 0 9 9 9]``). ``add_lora`` and its
siblings are the worker's side of the engine's adapter calls. Sessions: 06.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from engine.config.lora import LoRAConfig
from engine.lora.worker_manager import LRUCacheWorkerLoRAManager


class LoRAModelRunnerMixin:
    lora_manager: LRUCacheWorkerLoRAManager | None = None
    trace: Any
    input_batch: Any

    def load_lora_model(
        self,
        model: nn.Module,
        lora_config: LoRAConfig,
        max_num_batched_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> nn.Module:
        self.lora_manager = LRUCacheWorkerLoRAManager(
            max_num_batched_tokens, lora_config, device, dtype
        )
        return self.lora_manager.create_lora_manager(model)

    def set_active_loras(self, lora_requests: list[Any], num_scheduled_tokens: np.ndarray) -> None:
        """``lora_requests``: per batch row, its LoRARequest or None."""
        assert self.lora_manager is not None
        row_ids = np.array([r.lora_int_id if r else 0 for r in lora_requests], dtype=np.int64)
        token_ids = np.repeat(row_ids, num_scheduled_tokens)
        self.lora_manager.set_active_adapters({r for r in lora_requests if r}, token_ids)
        self.trace.lora_slots(self.lora_manager, self.input_batch.req_ids, row_ids)

    # -- the engine's add_lora / remove_lora / pin_lora / list_loras ----------------
    def _lora_manager(self) -> LRUCacheWorkerLoRAManager:
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled (start the engine with enable_lora=True)")
        return self.lora_manager

    def add_lora(self, lora_request: Any) -> bool:
        added = self._lora_manager().add_adapter(lora_request)
        self.trace.lora_slots(self._lora_manager(), [], np.zeros(0, dtype=np.int64))
        return added

    def check_lora(self, lora_request: Any) -> None:
        self._lora_manager().check_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_manager().remove_adapter(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora_manager().pin_adapter(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora_manager().list_adapters()

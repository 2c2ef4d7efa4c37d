"""LRUCacheWorkerLoRAManager: the worker's side of LoRA -- load adapters from
disk on demand and make each step's adapters active.

vLLM twin: ``vllm/lora/worker_manager.py`` (``WorkerLoRAManager``,
``LRUCacheWorkerLoRAManager``).
Read it for what happens when a request names an adapter the worker has not
seen: ``_load_adapter`` reads its folder (``PEFTHelper`` for the config,
``LoRAModel.from_local_checkpoint`` for the tensors) into host memory, and
``set_active_adapters`` puts the step's adapters into device slots (evicting
the least recently used) and maps every token to its slot. ``add_adapter``,
``remove_adapter`` and ``pin_adapter`` are the engine's ``add_lora`` /
``remove_lora`` / ``pin_lora``: load an adapter before any request names it
(so a broken one fails that call, not a step), drop it, keep it loaded;
``check_adapter`` reads one without keeping it (the engine's ``check_lora``).
Sessions: 06.

Simpler than vLLM: ``add_adapter`` loads into host memory only; the step
that first uses the adapter puts it into a slot (vLLM's also activates it).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engine.config.lora import LoRAConfig
from engine.lora.lora_model import LoRAModel
from engine.lora.model_manager import LRUCacheLoRAModelManager
from engine.lora.peft_helper import PEFTHelper
from engine.lora.request import LoRARequest


class LRUCacheWorkerLoRAManager:
    def __init__(
        self,
        max_num_batched_tokens: int,
        lora_config: LoRAConfig,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lora_config = lora_config
        self.device = device
        self.dtype = dtype
        self._adapter_manager: LRUCacheLoRAModelManager | None = None
        # Adapter ids read from disk by the last set_active_adapters().
        self.loaded: list[int] = []

    def create_lora_manager(self, model: nn.Module) -> nn.Module:
        self._adapter_manager = LRUCacheLoRAModelManager(
            model, self.max_num_batched_tokens, self.lora_config, self.device
        )
        return self._adapter_manager.model

    @property
    def adapter_manager(self) -> LRUCacheLoRAModelManager:
        assert self._adapter_manager is not None, "create_lora_manager() first"
        return self._adapter_manager

    def _load_adapter(self, lora_request: LoRARequest) -> LoRAModel:
        try:
            peft_helper = PEFTHelper.from_local_dir(lora_request.lora_path)
            peft_helper.validate_legal(self.lora_config.max_lora_rank)
            lora = LoRAModel.from_local_checkpoint(
                lora_request.lora_path,
                self.adapter_manager.supported_lora_modules,
                peft_helper,
                lora_request.lora_int_id,
                self.dtype,
            )
            self.adapter_manager.check_adapter(lora)
        except Exception as e:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} ({lora_request.lora_path}) "
                f"could not be loaded: {e}"
            ) from e
        for weights in lora.loras.values():
            weights.lora_a = weights.lora_a.to(self.device)
            weights.lora_b = weights.lora_b.to(self.device)
        return lora

    def set_active_adapters(self, requests: set[LoRARequest], token_lora_ids: np.ndarray) -> None:
        """Make ``requests``' adapters active; ``token_lora_ids``: each token's id (0: none)."""
        manager = self.adapter_manager
        self.loaded = []
        manager.evicted_from_slots, manager.evicted_from_cpu = [], []
        if len(requests) > manager.lora_slots:
            raise RuntimeError(
                f"{len(requests)} adapters in one step, more than max_loras={manager.lora_slots}"
            )
        for request in requests:  # mark them recently used before anything is evicted
            for cache in (manager._active_adapters, manager._registered_adapters):
                if request.lora_int_id in cache:
                    cache.move_to_end(request.lora_int_id)
        for request in sorted(requests, key=lambda r: r.lora_int_id):
            if not manager.has_adapter(request.lora_int_id):
                manager.add_adapter(self._load_adapter(request))
                self.loaded.append(request.lora_int_id)
            manager.activate_adapter(request.lora_int_id)
        manager.set_adapter_mapping(token_lora_ids)

    def add_adapter(self, lora_request: LoRARequest) -> bool:
        """Load into host memory now (False: it already was; now most recently used)."""
        manager = self.adapter_manager
        self.loaded = []
        manager.evicted_from_slots, manager.evicted_from_cpu = [], []
        if (known := manager.get_adapter(lora_request.lora_int_id)) is not None:
            return manager.add_adapter(known)  # False; now the most recently used
        # Read (and check) it before anything is evicted for it.
        added = manager.add_adapter(self._load_adapter(lora_request))
        self.loaded.append(lora_request.lora_int_id)
        return added

    def check_adapter(self, lora_request: LoRARequest) -> None:
        """Read an adapter and check it fits, keeping nothing (Glassbox's own:
        the front end asks before the first request naming it is scheduled)."""
        self._load_adapter(lora_request)

    def remove_adapter(self, adapter_id: int) -> bool:
        return self.adapter_manager.remove_adapter(adapter_id)

    def pin_adapter(self, adapter_id: int) -> bool:
        return self.adapter_manager.pin_adapter(adapter_id)

    def list_adapters(self) -> set[int]:
        return set(self.adapter_manager.list_adapters())

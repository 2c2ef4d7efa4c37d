"""LoRAModelManager: which adapter sits in which device slot, and the model's
linear layers swapped for their LoRA wrappers.

vLLM twin: ``vllm/lora/model_manager.py`` (``LoRAModelManager``,
``LRUCacheLoRAModelManager``).
Read it for the adapter life cycle: ``add_adapter`` registers a loaded
``LoRAModel`` in host memory; ``activate_adapter`` copies its ``A``/``B`` into
a free slot of every wrapped layer (``lora_index_to_id`` says which id holds
which slot); ``set_adapter_mapping`` turns each token's adapter id into its
slot for the punica wrapper. The LRU variant evicts the least recently used
active adapter when the slots are full, and the least recently used
registered one beyond ``max_cpu_loras``, passing over the pinned ones
(``pin_adapter``). Sessions: 06.

Simpler than vLLM: linear layers only (q/k/v/o and gate/up/down), no
embedding or LM-head adapters, no packed-module padding rules beyond the
model's ``packed_modules_mapping``. A pinned adapter stays in host memory but
not in a device slot (vLLM pins both): the scheduler plans each step's
adapters against all ``max_loras`` slots, so a slot held by a pinned adapter
no request runs with would be one the step could not have.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from engine.config.lora import LoRAConfig
from engine.lora.layers import BaseLinearLayerWithLoRA, from_layer
from engine.lora.lora_model import LoRAModel
from engine.lora.punica_wrapper import get_punica_wrapper

# The model's projection modules that get LoRA wrappers.
LORA_TARGET_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def replace_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


class LoRAModelManager:
    def __init__(
        self,
        model: nn.Module,
        max_num_batched_tokens: int,
        lora_config: LoRAConfig,
        device: torch.device | str,
    ) -> None:
        self.model = model
        self.lora_config = lora_config
        self.lora_slots = lora_config.max_loras
        self.lora_index_to_id: list[int | None] = [None] * self.lora_slots
        self.packed_modules_mapping: dict[str, list[str]] = dict(
            getattr(model, "packed_modules_mapping", {})
        )
        self.punica_wrapper = get_punica_wrapper(
            max_num_batched_tokens, device, lora_config.max_loras
        )
        self.modules: dict[str, BaseLinearLayerWithLoRA] = {}
        self._registered_adapters: dict[int, LoRAModel] = {}
        self._active_adapters: dict[int, None] = {}
        self._pinned: set[int] = set()  # never evicted from host memory
        self._create_lora_modules()

    @property
    def supported_lora_modules(self) -> set[str]:
        """Leaf names an adapter may target (the fused ones by their parts)."""
        names: set[str] = set()
        for target in LORA_TARGET_MODULES:
            names.update(self.packed_modules_mapping.get(target, [target]))
        return names

    def _create_lora_modules(self) -> None:
        for name, module in list(self.model.named_modules()):
            if name.rpartition(".")[2] in LORA_TARGET_MODULES:
                wrapped = from_layer(
                    module, self.lora_config.max_loras, self.lora_config.max_lora_rank
                )
                wrapped.set_mapping(self.punica_wrapper)
                replace_submodule(self.model, name, wrapped)
                self.modules[name] = wrapped

    # -- adapters -------------------------------------------------------------
    def check_adapter(self, lora: LoRAModel) -> None:
        """Every pair of ``lora`` fits its layer's slots (an adapter trained for
        another base model does not): ValueError naming the first that does not."""
        known = set()
        for name, module in self.modules.items():
            prefix, _, leaf = name.rpartition(".")
            parts = self.packed_modules_mapping.get(leaf, [leaf])
            for part, out_size in zip(parts, module.output_slices, strict=True):
                known.add(f"{prefix}.{part}")
                weights = lora.get_lora(f"{prefix}.{part}")
                if weights is None:
                    continue
                want_a = (weights.rank, module.input_size)
                want_b = (out_size, weights.rank)
                got_a, got_b = tuple(weights.lora_a.shape), tuple(weights.lora_b.shape)
                if got_a != want_a or got_b != want_b:
                    raise ValueError(
                        f"{prefix}.{part}: lora_A {list(got_a)} / lora_B {list(got_b)} do not fit "
                        f"this model's layer (lora_A {list(want_a)}, lora_B {list(want_b)})"
                    )
        if unknown := sorted(set(lora.loras) - known):
            raise ValueError(f"{unknown[0]}: no such layer in this model")

    def add_adapter(self, lora: LoRAModel) -> bool:
        if lora.id in self._registered_adapters:
            return False
        self._registered_adapters[lora.id] = lora
        return True

    def remove_adapter(self, adapter_id: int) -> bool:
        self.deactivate_adapter(adapter_id)
        self._pinned.discard(adapter_id)
        return self._registered_adapters.pop(adapter_id, None) is not None

    def list_adapters(self) -> dict[int, LoRAModel]:
        return dict(self._registered_adapters)

    def get_adapter(self, adapter_id: int) -> LoRAModel | None:
        return self._registered_adapters.get(adapter_id)

    def activate_adapter(self, lora_id: int) -> bool:
        """Copy a registered adapter into a free slot (False: already active)."""
        if lora_id in self._active_adapters:
            return False
        free = [i for i, held in enumerate(self.lora_index_to_id) if held is None]
        if not free:
            raise RuntimeError(f"no free LoRA slot ({self.lora_slots} in use)")
        index = free[0]
        lora = self._registered_adapters[lora_id]
        for name, module in self.modules.items():
            prefix, _, leaf = name.rpartition(".")
            parts = self.packed_modules_mapping.get(leaf, [leaf])
            weights = [lora.get_lora(f"{prefix}.{part}") for part in parts]
            module.set_lora(
                index,
                [w.lora_a if w else None for w in weights],
                [w.lora_b if w else None for w in weights],
            )
        self.lora_index_to_id[index] = lora_id
        self._active_adapters[lora_id] = None
        return True

    def deactivate_adapter(self, adapter_id: int) -> bool:
        if adapter_id not in self._active_adapters:
            return False
        index = self.lora_index_to_id.index(adapter_id)
        self.lora_index_to_id[index] = None
        for module in self.modules.values():
            module.reset_lora(index)
        del self._active_adapters[adapter_id]
        return True

    def has_adapter(self, adapter_id: int) -> bool:
        """Whether ``adapter_id`` is loaded in host memory (active or not)."""
        return adapter_id in self._registered_adapters

    def set_adapter_mapping(self, token_lora_ids: np.ndarray) -> None:
        """Each token's adapter id (0: none) -> its slot (-1: none)."""
        # A handful of distinct ids per step: map those, then index (no per-token Python).
        ids, inverse = np.unique(token_lora_ids, return_inverse=True)
        slot_of = {lora_id: i for i, lora_id in enumerate(self.lora_index_to_id) if lora_id}
        id_slots = np.array([slot_of.get(int(i), -1) for i in ids], dtype=np.int64)
        self.punica_wrapper.update_metadata(torch.from_numpy(id_slots[inverse]))


class LRUCacheLoRAModelManager(LoRAModelManager):
    """Slots and host cache both evict the least recently used adapter."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._registered_adapters = OrderedDict()
        self._active_adapters = OrderedDict()
        # Adapter ids evicted since the worker's last set_active_adapters().
        self.evicted_from_slots: list[int] = []
        self.evicted_from_cpu: list[int] = []

    def add_adapter(self, lora: LoRAModel) -> bool:
        if lora.id in self._registered_adapters:
            self._registered_adapters.move_to_end(lora.id)
            return False
        while len(self._registered_adapters) >= (self.lora_config.max_cpu_loras or 1):
            # pin_adapter leaves room for a step's max_loras adapters: one is unpinned.
            oldest = next(i for i in self._registered_adapters if i not in self._pinned)
            if oldest in self._active_adapters:  # it leaves its slot too
                self.evicted_from_slots.append(oldest)
            self.remove_adapter(oldest)
            self.evicted_from_cpu.append(oldest)
        self._registered_adapters[lora.id] = lora
        return True

    def activate_adapter(self, lora_id: int) -> bool:
        if lora_id in self._active_adapters:
            self._active_adapters.move_to_end(lora_id)
            return False
        if len(self._active_adapters) >= self.lora_slots:
            oldest = next(iter(self._active_adapters))
            self.deactivate_adapter(oldest)
            self.evicted_from_slots.append(oldest)
        self._registered_adapters.move_to_end(lora_id)
        return super().activate_adapter(lora_id)

    def pin_adapter(self, lora_id: int) -> bool:
        """Keep a loaded adapter in host memory for good (no more disk reads).
        At most ``max_cpu_loras - max_loras`` may be pinned, so that a step's
        adapters always find room."""
        if lora_id not in self._registered_adapters:
            raise ValueError(f"LoRA {lora_id} is not loaded: add_lora it first")
        room = (self.lora_config.max_cpu_loras or 1) - self.lora_slots
        if lora_id not in self._pinned and len(self._pinned) >= room:
            raise ValueError(
                f"cannot pin LoRA {lora_id}: at most max_cpu_loras - max_loras = {room} "
                "adapters may be pinned (a step needs max_loras unpinned places); "
                "raise max_cpu_loras"
            )
        self._pinned.add(lora_id)
        return True

"""Helpers shared by the model files: naming, layer stacks, weight routing.

vLLM twin: ``vllm/model_executor/models/utils.py`` (``AutoWeightsLoader``,
``make_layers``, ``maybe_prefix``, ``extract_layer_index``) and, for
``get_rope_parameters``, ``vllm/transformers_utils/config.py`` (which turns
old-style ``rope_theta`` / ``rope_scaling`` keys into ``rope_parameters``).
Read it for how checkpoint names reach parameters: ``AutoWeightsLoader``
walks the module tree by the dotted name (``model.layers.0...``), hands each
sub-tree to the first module on the way that has its own ``load_weights``
(the ``*Model`` class, which knows the q/k/v and gate/up packing), and raises
on a name that matches nothing.
Sessions: 04.

Simpler than vLLM: no pipeline parallelism (``make_layers`` builds every
layer, no ``PPMissingLayer``), no weight-name mappers; unknown checkpoint
tensors are errors everywhere (vLLM skips some of them silently).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.model_loader.weight_utils import default_weight_loader


def maybe_prefix(prefix: str, name: str) -> str:
    """``"model" + "layers" -> "model.layers"``; an empty part adds nothing."""
    if not prefix or not name:
        return prefix or name
    return f"{prefix}.{name}"


def extract_layer_index(layer_name: str) -> int:
    """The single integer in a dotted name: ``"model.layers.3.self_attn" -> 3``."""
    ints = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(ints) != 1:
        raise ValueError(f"expected exactly one layer index in {layer_name!r}, found {ints}")
    return ints[0]


def make_layers(
    num_hidden_layers: int, layer_fn: Callable[[str], nn.Module], prefix: str
) -> nn.ModuleList:
    """``num_hidden_layers`` decoder layers named ``{prefix}.{i}``."""
    return nn.ModuleList(layer_fn(f"{prefix}.{i}") for i in range(num_hidden_layers))


def get_rope_parameters(
    hf_config: dict[str, Any], default_theta: float = 10000.0
) -> dict[str, Any]:
    """The RoPE settings of a config.json, in the ``rope_parameters`` form.

    transformers >= 5 writes ``rope_parameters = {"rope_type", "rope_theta", ...}``;
    older checkpoints have a top-level ``rope_theta`` and an optional
    ``rope_scaling`` dict (whose type key may be ``"type"``).
    """
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = hf_config.get("rope_theta") or default_theta
    if "partial_rotary_factor" in hf_config and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = hf_config["partial_rotary_factor"]
    return params


# Checkpoint tensors that are derived buffers, not parameters: skipped.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_stacked_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: list[tuple[str, str, str | int]],
    prefix: str = "",
) -> set[str]:
    """The body of a ``*Model.load_weights``: route HF tensors into fused params.

    ``stacked_params_mapping`` rows are ``(param_name, shard_name, shard_id)``:
    a checkpoint name containing ``shard_name`` (``.q_proj``) is loaded into
    ``param_name`` (``.qkv_proj``) through that parameter's
    ``weight_loader(param, tensor, shard_id)``. Everything else must match a
    parameter name exactly. Returns the names of the parameters filled; a
    fused parameter missing one of its shards is left out, so the loader
    reports it as missing. ``prefix`` (the module's own name) only makes error
    messages show full checkpoint names.
    """
    params_dict = dict(module.named_parameters())
    loaded_params: set[str] = set()
    # A fused parameter counts as loaded only once all its shards were seen.
    expected_shards: dict[str, set[str | int]] = {}
    for param_name, _, shard_id in stacked_params_mapping:
        expected_shards.setdefault(param_name, set()).add(shard_id)
    seen_shards: dict[str, tuple[str, set[str | int]]] = {}  # fused name -> (param_name, shard ids)
    for name, loaded_weight in weights:
        if name.endswith(_SKIPPED_SUFFIXES):
            continue
        for param_name, shard_name, shard_id in stacked_params_mapping:
            if shard_name not in name:
                continue
            fused_name = name.replace(shard_name, param_name)
            param = _lookup_param(params_dict, fused_name, name, module, prefix)
            param.weight_loader(param, loaded_weight, shard_id)
            seen_shards.setdefault(fused_name, (param_name, set()))[1].add(shard_id)
            break
        else:
            param = _lookup_param(params_dict, name, name, module, prefix)
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, loaded_weight)
            loaded_params.add(name)
    for fused_name, (param_name, shard_ids) in seen_shards.items():
        if shard_ids == expected_shards[param_name]:
            loaded_params.add(fused_name)
    return loaded_params


def _lookup_param(
    params_dict: dict[str, nn.Parameter],
    name: str,
    checkpoint_name: str,
    module: nn.Module,
    prefix: str,
) -> nn.Parameter:
    if name not in params_dict:
        raise ValueError(
            f"unexpected checkpoint tensor {maybe_prefix(prefix, checkpoint_name)!r}: "
            f"{type(module).__name__} has no parameter {name!r}"
        )
    return params_dict[name]


class AutoWeightsLoader:
    """Route ``(name, tensor)`` pairs down the module tree by their dotted names.

    A child module with its own ``load_weights`` receives its sub-tree with the
    child's prefix stripped and returns the names it loaded; a direct parameter
    is filled by its ``weight_loader``. Names under ``skip_prefixes`` (e.g.
    ``lm_head.`` when the head is tied to the embedding) are dropped.
    """

    def __init__(self, module: nn.Module, *, skip_prefixes: list[str] | None = None) -> None:
        self.module = module
        self.skip_prefixes = list(skip_prefixes or [])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        weights = (
            (n, t) for n, t in weights if not any(n.startswith(p) for p in self.skip_prefixes)
        )
        return set(self._load_module("", self.module, weights))

    def _load_module(
        self, base_prefix: str, module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[str]:
        if module is not self.module and callable(getattr(module, "load_weights", None)):
            for name in module.load_weights(weights):
                yield maybe_prefix(base_prefix, name)
            return
        children = dict(module.named_children())
        params = dict(module.named_parameters(recurse=False))
        # Consecutive names with the same first component form one group (a
        # sharded checkpoint may visit the same child more than once).
        for child_prefix, group in itertools.groupby(
            weights, key=lambda item: item[0].split(".", 1)[0]
        ):
            qualname = maybe_prefix(base_prefix, child_prefix)
            if child_prefix in children:
                rest = ((name.split(".", 1)[1] if "." in name else "", t) for name, t in group)
                yield from self._load_module(qualname, children[child_prefix], rest)
            elif child_prefix in params:
                param = params[child_prefix]
                for name, tensor in group:
                    if name != child_prefix:  # e.g. "weight.extra"
                        raise ValueError(
                            f"unexpected checkpoint tensor {maybe_prefix(base_prefix, name)!r}"
                        )
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                yield qualname
            else:
                name, _ = next(group)
                raise ValueError(
                    f"unexpected checkpoint tensor {maybe_prefix(base_prefix, name)!r}: "
                    f"there is no module or parameter named {qualname!r} in "
                    f"{type(self.module).__name__}"
                )

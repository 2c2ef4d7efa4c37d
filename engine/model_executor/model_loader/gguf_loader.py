"""Load a Llama from a GGUF file, its quantized tensors kept as they are.

vLLM twin: ``vllm/model_executor/model_loader/gguf_loader.py``
(``GGUFModelLoader``) and ``weight_utils.py`` (``gguf_quant_weights_iterator``).
Read it for how a llama.cpp file meets a model written for HF names:

* GGUF names (``blk.3.attn_q.weight``) map to HF names
  (``model.layers.3.self_attn.q_proj.weight``); the model's own
  ``load_weights`` then routes q/k/v and gate/up into its fused layers as for
  any checkpoint;
* a quantized tensor arrives as two entries: ``...q_proj.qweight_type`` (its
  GGML format, all of them first, as vLLM does) and ``...q_proj.qweight``
  (its raw blocks, ``uint8 [rows, bytes per row]``); float tensors (the norms)
  keep their ``.weight`` names;
* before the model is built, modules whose matrix is stored as plain floats
  are listed in ``GGUFConfig.unquantized_modules`` so they get ordinary
  weights.

Sessions: 06 (quantization).
Simpler than vLLM: Llama architecture only (vLLM maps any architecture
through the ``gguf`` package's tensor-name tables); one file, no shards;
config.json comes from ``hf_config_path``, not from the GGUF metadata.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from engine.model_executor.layers.quantization.gguf_kernels import UNQUANTIZED_TYPES
from engine.model_executor.model_loader.base_loader import BaseModelLoader

if TYPE_CHECKING:
    from engine.config import GlassboxConfig, ModelConfig

# GGUF tensor name (without .weight / .bias) -> HF module name, Llama layout.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors llama.cpp stores that an HF Llama computes itself.
_SKIPPED = ("rope_freqs",)
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)$")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.q_proj.weight``;
    None for a tensor the model does not take."""
    module, _, suffix = gguf_name.rpartition(".")
    if module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{suffix}"
    if (m := _LAYER_RE.match(module)) and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    if module in _SKIPPED:
        return None
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama model")


def gguf_quant_weights_iterator(
    gguf_file: str,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """(HF name, tensor) pairs: every quantized tensor's ``qweight_type`` first,
    then the data (``qweight`` for quantized tensors, ``weight`` for floats)."""
    import gguf

    reader = gguf.GGUFReader(gguf_file)
    tensors = [(t, name) for t in reader.tensors if (name := gguf_to_hf_name(t.name))]
    for tensor, name in tensors:
        if int(tensor.tensor_type) not in UNQUANTIZED_TYPES:
            yield name.replace(".weight", ".qweight_type"), torch.tensor(int(tensor.tensor_type))
    for tensor, name in tensors:
        data = np.asarray(tensor.data)
        if int(tensor.tensor_type) not in UNQUANTIZED_TYPES:
            yield name.replace(".weight", ".qweight"), torch.from_numpy(data.copy())
        elif data.dtype == np.uint8:  # BF16 is read as raw bytes
            yield name, torch.from_numpy(data.copy()).view(torch.bfloat16)
        else:
            yield name, torch.from_numpy(data.copy())


def unquantized_modules(gguf_file: str) -> list[str]:
    """HF module names whose matrix the file stores as floats."""
    import gguf

    reader = gguf.GGUFReader(gguf_file)
    return [
        name.rpartition(".")[0]
        for t in reader.tensors
        if int(t.tensor_type) in UNQUANTIZED_TYPES
        and len(t.shape) == 2
        and (name := gguf_to_hf_name(t.name))
    ]


class GGUFModelLoader(BaseModelLoader):
    def download_model(self, model_config: ModelConfig) -> None:
        pass  # a local file (ModelConfig checked it exists)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        loaded = model.load_weights(gguf_quant_weights_iterator(model_config.model))
        self.track_weights_loading(model, loaded, model_config.model)

    def load_model(
        self,
        glassbox_config: GlassboxConfig,
        device: torch.device | str,
        dtype: torch.dtype,
        prefix: str = "",
    ) -> nn.Module:
        model_config = glassbox_config.model_config
        quant_config = glassbox_config.quant_config
        if quant_config is None or quant_config.get_name() != "gguf":
            raise ValueError(
                f"load_format='gguf' needs a .gguf model (quantization gguf), "
                f"got model={model_config.model!r}"
            )
        if not set(model_config.architectures) & set(SUPPORTED_ARCHITECTURES):
            raise ValueError(
                f"GGUF models: Glassbox loads {list(SUPPORTED_ARCHITECTURES)}, "
                f"{model_config.model!r} is {model_config.architectures}"
            )
        quant_config.unquantized_modules = unquantized_modules(model_config.model)
        return super().load_model(glassbox_config, device, dtype, prefix)

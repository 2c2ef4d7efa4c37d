"""Tiny GGUF files written from tiny HF Llama checkpoints, for the GGUF tests.

``save_tiny_gguf`` quantizes every matrix of an HF folder the way llama.cpp's
converter does (the ``gguf`` package's quantizers; q and k rows permuted into
llama.cpp's rotary layout) and writes ``model.gguf``. ``save_dequantized``
writes the HF folder the GGUF file stands for: the same matrices quantized
and dequantized again (``gguf.quants``), in HF's row order -- the float model
the quantized engine must reproduce. ``random_blocks`` makes raw GGUF data
of any bytes, for the dequantization kernels.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from engine.model_executor.model_loader.gguf_loader import _GLOBAL_NAMES, _LAYER_NAMES

# HF module -> GGUF tensor name: the loader's own tables, read backwards.
_GLOBAL = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()}
_LAYER = {hf: gguf for gguf, hf in _LAYER_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{_LAYER[rest]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, the two rotary halves interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _round_trip(w: np.ndarray, qtype) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


def _matrices(hf_dir: Path) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}


def save_tiny_gguf(hf_dir: Path, out: Path, qtype_of: Callable[[str], object]) -> Path:
    """``qtype_of(hf_name)`` -> a ``gguf.GGMLQuantizationType`` for each matrix."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch="llama")
    for name, w in sorted(_matrices(hf_dir).items()):
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, kv_heads)
        qtype = qtype_of(name) if w.ndim == 2 else gguf.GGMLQuantizationType.F32
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), w.astype(np.float32))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def save_dequantized(hf_dir: Path, out_dir: Path, qtype_of: Callable[[str], object]) -> Path:
    """The float HF folder equal to what ``save_tiny_gguf`` stores."""
    import gguf

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out_dir / f.name)
    tensors = {}
    for name, w in _matrices(hf_dir).items():
        qtype = qtype_of(name) if w.ndim == 2 else gguf.GGMLQuantizationType.F32
        if qtype != gguf.GGMLQuantizationType.F32:
            w = _round_trip(w, qtype)  # row-wise blocks: the row order does not matter
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def random_blocks(qtype: int, m: int, n: int, seed: int = 0) -> torch.Tensor:
    """Raw GGUF data ``uint8 [m, n / 32 * bytes_per_block]`` of random bytes:
    every quant bit pattern, scales of either sign, zero and subnormal. The
    fp16 scales' top exponent bit is cleared (|scale| < 2), so none is inf
    or NaN (NaN payloads would make equal results compare unequal)."""
    from engine.model_executor.layers.quantization.gguf_kernels import (
        BLOCK_SIZE,
        BYTES_PER_BLOCK,
        GGML_Q4_1,
    )

    nbytes = BYTES_PER_BLOCK[qtype]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (m, n // BLOCK_SIZE, nbytes), generator=g, dtype=torch.uint8)
    blocks[..., 1] &= 0xBF  # d (little-endian): bit 6 of its high byte is the exponent top bit
    if qtype == GGML_Q4_1:
        blocks[..., 3] &= 0xBF  # m
    return blocks.reshape(m, n // BLOCK_SIZE * nbytes)

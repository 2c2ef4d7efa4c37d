"""Finding, reading and writing weights: the loaders' toolbox.

vLLM twin: ``vllm/model_executor/model_loader/weight_utils.py``.
Read it for: ``safetensors_weights_iterator`` (stream ``(name, tensor)``
pairs file by file, so a loader never holds two copies of the model),
``filter_duplicate_safetensors_files`` (trust ``model.safetensors.index.json``
when a folder has it), ``default_weight_loader`` (a shape-checked copy, the
fallback for parameters without their own ``weight_loader``) and
``initialize_dummy_weights`` (reproducible random weights for benchmarking
without a checkpoint).
Sessions: 04.

The tensors the iterator yields are views of the file mapped into memory
(``mmap``): nothing is read until a weight loader copies from them, and a
tensor-parallel rank that copies only its slice (``weight_loader``'s
``narrow``) reads only those bytes -- so each rank's resident memory grows by
its shard, not by the whole checkpoint (vLLM's safetensors reads map the file
too).

Simpler than vLLM: safetensors only (no .bin/.pt/npcache/GGUF), no prefetch
or multithreaded reading, no quantization configs; every failure is a
``ValueError`` that names the file, tensor or parameter involved.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Generator

import torch
from torch import nn

SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def _natural_sort_key(path: str) -> list:
    """``model-2-of-10`` before ``model-10-of-10``."""
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", path)]


def download_weights_from_hf(
    model_name_or_path: str, allow_patterns: list[str], revision: str | None = None
) -> str:
    """Local folder holding a Hub repo's weight files: cache first, then network.

    Raises ``ValueError`` when the repo is not cached and the machine is
    offline (``HF_HUB_OFFLINE=1``) or the download fails.
    """
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub ships with transformers
        raise ValueError(
            f"model={model_name_or_path!r} is not a local folder and huggingface_hub "
            "is not installed to download it"
        ) from e
    patterns = [*allow_patterns, "*.json"]
    try:
        return snapshot_download(
            model_name_or_path, allow_patterns=patterns, revision=revision, local_files_only=True
        )
    except Exception:
        pass  # not (fully) cached: download below, if we may
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            f"model={model_name_or_path!r} is not a local folder and is not in the Hugging Face "
            "cache, and this machine is offline (HF_HUB_OFFLINE is set). Pass the path of a "
            "local checkpoint folder instead."
        )
    try:
        return snapshot_download(model_name_or_path, allow_patterns=patterns, revision=revision)
    except Exception as e:
        raise ValueError(
            f"model={model_name_or_path!r} is not a local folder and could not be downloaded "
            f"from the Hugging Face Hub ({type(e).__name__}: {e}). If this machine is offline, "
            "pass the path of a local checkpoint folder instead."
        ) from e


def filter_duplicate_safetensors_files(
    hf_weights_files: list[str], hf_folder: str, index_file: str = SAFE_WEIGHTS_INDEX_NAME
) -> list[str]:
    """Keep only the files the index lists (a folder may also hold a
    consolidated copy); check that every listed file exists."""
    index_path = os.path.join(hf_folder, index_file)
    if not os.path.isfile(index_path):
        return hf_weights_files
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"could not read the weight map of {index_path}: {e}") from e
    listed = {os.path.join(hf_folder, name) for name in weight_map.values()}
    missing = sorted(p for p in listed if not os.path.isfile(p))
    if missing:
        raise ValueError(f"{index_path} lists weight files that do not exist: {missing}")
    return [f for f in hf_weights_files if f in listed]


def find_safetensors_files(hf_folder: str) -> list[str]:
    files = glob.glob(os.path.join(hf_folder, "*.safetensors"))
    files = filter_duplicate_safetensors_files(files, hf_folder)
    if not files:
        raise ValueError(f"no *.safetensors weight files found in {hf_folder!r}")
    return sorted(files, key=_natural_sort_key)


# safetensors dtype names -> torch dtypes (those a checkpoint may hold).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_header(path: str) -> tuple[int, dict]:
    """(bytes before the data, the JSON header) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("the file is shorter than a safetensors header")
        size = int.from_bytes(raw, "little")
        if size > os.path.getsize(path) - 8:
            raise ValueError(f"header length {size} runs past the end of the file")
        header = json.loads(f.read(size))
    return 8 + size, header


def _mapped_tensors(path: str) -> Generator[tuple[str, torch.Tensor], None, None]:
    """The file's tensors as views of its private memory map (read on first touch)."""
    data_start, header = _read_header(path)
    file_size = os.path.getsize(path)
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=file_size)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
        start, end = info["data_offsets"]
        shape = list(info["shape"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} has an unsupported dtype {info.get('dtype')!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = end - start
        if numel != itemsize * torch.Size(shape).numel() or data_start + end > file_size:
            raise ValueError(f"tensor {name!r}: its offsets do not match its shape {shape}")
        if (data_start + start) % itemsize:
            raise ValueError(f"tensor {name!r} is not aligned in the file")
        offset = (data_start + start) // itemsize
        yield name, torch.empty(0, dtype=dtype).set_(storage, offset, shape)


def safetensors_weights_iterator(
    hf_weights_files: list[str],
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Yield every ``(name, tensor)`` of the files, on the CPU, file by file:
    mapped from the file (see the module docstring), or read whole by the
    ``safetensors`` library when a file cannot be mapped so (an unaligned or
    unusual tensor)."""
    from safetensors import safe_open

    for path in sorted(hf_weights_files, key=_natural_sort_key):
        try:
            mapped = list(_mapped_tensors(path))
        except (ValueError, KeyError, TypeError, OSError, RuntimeError):
            mapped = None  # the library below reads it, or names what is wrong
        if mapped is not None:
            yield from mapped
            continue
        try:
            f = safe_open(path, framework="pt")  # reads and checks the header only
            names = list(f.keys())
        except Exception as e:  # SafetensorError, OSError: truncated, garbage, unreadable
            raise ValueError(f"could not read safetensors file {path!r}: {e}") from e
        for name in names:
            try:
                tensor = f.get_tensor(name)
            except Exception as e:
                raise ValueError(
                    f"could not read tensor {name!r} from safetensors file {path!r}: {e}"
                ) from e
            yield name, tensor


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape (any dtype)."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        # Scalars may be stored as shape [] or [1].
        param.data.copy_(loaded_weight.view(param.shape))
        return
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"cannot load a checkpoint tensor of shape {tuple(loaded_weight.shape)} "
            f"into a parameter of shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


@torch.no_grad()
def initialize_dummy_weights(
    model: nn.Module, low: float = -1e-3, high: float = 1e-3, seed: int = 1234
) -> None:
    """Fill every floating-point parameter uniformly in ``[low, high)``.

    Each parameter gets its own generator seeded with ``seed``, so its values
    depend only on ``seed``, its shape, dtype and device -- not on the order of
    parameters or on which other layers exist. The small range keeps
    activations finite in any depth of model.
    """
    for param in model.parameters():
        if not torch.is_floating_point(param):
            continue
        generator = torch.Generator(device=param.device)
        generator.manual_seed(seed)
        param.data.uniform_(low, high, generator=generator)

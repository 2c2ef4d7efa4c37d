"""ModelConfig: which checkpoint, which dtype, how long a sequence may be.

vLLM twin: ``vllm/config/model.py`` (``ModelConfig``).
Read it for: how ``max_model_len`` is derived from the HF config and checked,
which HF config fields the rest of the engine reads (layers, KV heads,
head size, EOS), and where default sampling parameters come from
(``generation_config``: the model's file, "vllm" for none, or a folder;
``get_diff_sampling_param``).
Sessions: 01, 04.

``quantization`` names a scheme of layers/quantization/ (``"gguf"``). A
``.gguf`` file as the model means GGUF: its weights are read from the file,
its config.json from ``hf_config_path`` (vLLM's field; Glassbox does not
rebuild the architecture from GGUF metadata) and its tokenizer from there too
unless ``tokenizer`` says otherwise.

Simpler than vLLM: the HF ``config.json`` is read as a plain dict (no
transformers import on the scheduler path); only decoder-only text models.

Differs from vLLM on purpose: a Hub name (``org/model``) as the model or the
tokenizer is used only when it is already in the Hugging Face cache
(``resolve_model_path``); Glassbox never downloads. It must run without a
network, and a mistyped name should fail at once with one line rather than
after the hub client's retries. ``hf download NAME`` fetches a model into that
cache.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

# HF config keys that bound the context length, in vLLM's order of preference.
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "model_max_length",
)

# Which logprobs the sampler returns: of the model's raw output, or of the
# distribution actually sampled from (after penalties, temperature, top-k/p);
# as logprobs or as logits.
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json keys that set default sampling parameters -> their
# SamplingParams names (vLLM's get_diff_sampling_param).
GENERATION_DEFAULT_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# (source, values) of the sampling defaults already logged (vLLM warns once).
_LOGGED_SAMPLING_DEFAULTS: set[tuple[str, str]] = set()
_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "fp32", "fp16", "bf16")


def model_not_found_message(model: str, field: str = "model") -> str:
    """The one line every entry point (``LLM``, ``glassbox serve/trace/bench``) prints."""
    if not _looks_like_hub_name(model):
        return f"{field}={model!r} is not a local folder"
    return (
        f"{field}={model!r} is not a local folder and is not in the Hugging Face cache; "
        f"Glassbox does not download models (fetch it first with: hf download {model})"
    )


def _looks_like_hub_name(model: str) -> bool:
    """``org/name`` or ``name``: no path syntax (``/x``, ``./x``, ``~``, ``a/b/c``)."""
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", model)) and not model.startswith(".")


def _hub_cache_snapshot(model: str) -> str | None:
    """The cached snapshot folder of Hub repo ``model`` (its ``main``), or None.

    Reads the local cache only (``HF_HUB_CACHE``): no network, whatever
    ``HF_HUB_OFFLINE`` says."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub ships with transformers
        return None
    # A tokenizer-only repo has no config.json.
    for name in ("config.json", "tokenizer_config.json"):
        try:
            cached = try_to_load_from_cache(model, name)
        except Exception:  # not a valid repo id
            return None
        if isinstance(cached, str):
            return os.path.dirname(cached)
    return None


def resolve_model_path(model: str, field: str = "model") -> str:
    """The checkpoint folder for ``model``: a local folder as given, or the
    cached snapshot of a Hub name. Anything else fails at once with
    ``model_not_found_message`` (naming ``field``: model or tokenizer)."""
    if os.path.isdir(model):
        return model
    if _looks_like_hub_name(model) and (snapshot := _hub_cache_snapshot(model)):
        return snapshot
    raise ValueError(model_not_found_message(model, field))


def load_hf_config_dict(model: str, hf_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read ``config.json`` from a local checkpoint folder and apply overrides."""
    path = os.path.join(model, "config.json")
    if not os.path.isdir(model):
        raise ValueError(model_not_found_message(model))
    if not os.path.isfile(path):
        raise ValueError(f"model={model!r}: no config.json in that folder")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"model={model!r}: config.json is not valid JSON ({e})") from e
    if hf_overrides:
        cfg.update(hf_overrides)
    return cfg


@dataclass
class ModelConfig:
    model: str
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    """None: the model's own limit; -1 ("auto"): that limit, cut at start-up to
    what the KV cache can hold (vLLM's auto-fit, ``get_kv_cache_configs``)."""
    hf_overrides: dict[str, Any] | None = None
    enforce_eager: bool = False
    hf_config: dict[str, Any] = field(default_factory=dict)
    logprobs_mode: LogprobsMode = "raw_logprobs"
    max_logprobs: int = 20
    """Most logprobs a request may ask for per token (20, the OpenAI API's
    limit, as in vLLM); -1: no limit (the whole vocabulary)."""
    logits_processors: list[str | type] | None = None
    """Custom logits processors (classes, or ``"module:Class"`` / dotted
    names), built once with the built-in ones when the worker starts."""
    served_model_name: str | None = None
    """The name the model goes by in the API and the metrics' model_name label;
    None: ``model`` as given (before it is resolved to a folder), as in vLLM."""
    quantization: str | None = None
    """How the weights are stored: None (as the checkpoint says), "fp8" or "gguf"."""
    hf_config_path: str | None = None
    """Folder whose config.json describes the model; None: the model folder."""
    generation_config: str = "auto"
    """Where default sampling parameters come from: "auto" (the model's
    generation_config.json), "vllm" (none: SamplingParams' own defaults), or a
    folder with a generation_config.json."""
    override_generation_config: dict[str, Any] | None = None
    """generation_config.json keys that replace the file's (vLLM's names:
    temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)."""
    # max_model_len as the user gave it (vLLM's name): -1 asks for the auto-fit.
    original_max_model_len: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        # A pathlib.Path works as a model or tokenizer; the rest of the engine
        # (the trace, the served name) keeps strings.
        self.model = os.fspath(self.model)
        if self.tokenizer is not None:
            self.tokenizer = os.fspath(self.tokenizer)
        if self.served_model_name is None:
            self.served_model_name = self.model
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.logprobs_mode not in get_args(LogprobsMode):
            raise ValueError(
                f"logprobs_mode must be one of {get_args(LogprobsMode)}, got {self.logprobs_mode!r}"
            )
        if (
            not isinstance(self.max_logprobs, int)
            or isinstance(self.max_logprobs, bool)
            or self.max_logprobs < -1
        ):
            raise ValueError(
                "max_logprobs must be an integer >= 0, or -1 for no limit, "
                f"got {self.max_logprobs!r}"
            )
        self._check_generation_config()
        self._check_quantization()
        config_folder = self.hf_config_path or self.model
        if not self.hf_config:
            config_folder = resolve_model_path(config_folder)
            if not self.is_gguf:
                self.model = config_folder
            self.hf_config = load_hf_config_dict(config_folder, self.hf_overrides)
        elif self.hf_overrides:
            self.hf_config = {**self.hf_config, **self.hf_overrides}
        self._check_checkpoint_quantization()
        if self.tokenizer is None:
            self.tokenizer = config_folder
        elif not self.skip_tokenizer_init:
            self.tokenizer = resolve_model_path(self.tokenizer, field="tokenizer")
        derived = self.get_derived_max_model_len()
        self.original_max_model_len = self.max_model_len
        if self.max_model_len is None or self.max_model_len == -1:
            self.max_model_len = derived
        elif not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            raise ValueError(
                f"max_model_len must be a positive integer or -1 (auto-fit), "
                f"got {self.max_model_len!r}"
            )
        elif self.max_model_len > derived:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's maximum "
                f"context length {derived} (from its config.json)"
            )

    def _check_generation_config(self) -> None:
        source = self.generation_config
        if not isinstance(source, str) or not source:
            raise ValueError(
                f'generation_config must be "auto", "vllm" or a folder, got {source!r}'
            )
        if source not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(source, GENERATION_CONFIG_FILE)
        ):
            raise ValueError(
                f"generation_config: {source!r} is not a folder with a {GENERATION_CONFIG_FILE} "
                '(or use "auto" or "vllm")'
            )
        override = self.override_generation_config
        if override is not None and not isinstance(override, dict):
            raise ValueError(
                "override_generation_config must be a JSON object (a dict), "
                f"got {type(override).__name__}"
            )

    def try_get_generation_config(self) -> dict[str, Any]:
        """The generation_config.json in effect ({} when there is none): the
        model's for "auto" and "vllm" (its EOS ids still count), else the
        folder's. vLLM's ``ModelConfig.try_get_generation_config``."""
        folder = self.generation_config
        if folder in ("auto", "vllm"):
            folder = self.hf_config_path or self.model
        path = os.path.join(folder, GENERATION_CONFIG_FILE)
        if not os.path.isfile(path):
            return {}
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The default sampling parameters that differ from SamplingParams' own,
        under SamplingParams' names (max_new_tokens -> max_tokens): from the
        generation config in effect ({} for "vllm"), then the overrides."""
        source = self.generation_config
        config = {} if source == "vllm" else self.try_get_generation_config()
        config = {**config, **(self.override_generation_config or {})}
        diff = {
            ours: config[theirs]
            for theirs, ours in GENERATION_DEFAULT_KEYS.items()
            if config.get(theirs) is not None
        }
        if diff and source != "vllm" and (source, str(diff)) not in _LOGGED_SAMPLING_DEFAULTS:
            _LOGGED_SAMPLING_DEFAULTS.add((source, str(diff)))
            logger.warning(
                "Default sampling parameters come from %s: %s (--generation-config vllm "
                "keeps SamplingParams' own)",
                "the model's generation_config.json" if source == "auto" else source,
                diff,
            )
        return diff

    @property
    def config_dtype(self) -> str | None:
        """The checkpoint's dtype as config.json states it ("bfloat16", ...):
        ``dtype`` in transformers 5, ``torch_dtype`` before; None if unstated."""
        value = self.hf_config.get("dtype") or self.hf_config.get("torch_dtype")
        return value if isinstance(value, str) else None

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")

    def _check_quantization(self) -> None:
        from engine.model_executor.layers.quantization import QUANTIZATION_METHODS

        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}"
            )
        if not self.is_gguf:
            if self.quantization == "gguf":
                raise ValueError(
                    f"quantization='gguf' needs a .gguf file as the model, got {self.model!r}"
                )
            return
        if not os.path.isfile(self.model):
            raise ValueError(f"model={self.model!r}: no such GGUF file")
        if self.quantization not in (None, "gguf"):
            raise ValueError(
                f"model={self.model!r} is a GGUF file: quantization must be 'gguf' or unset, "
                f"got {self.quantization!r}"
            )
        self.quantization = "gguf"
        if self.hf_config_path is None and not self.hf_config:
            raise ValueError(
                f"model={self.model!r}: a GGUF model needs hf_config_path, a folder with "
                "its config.json (Glassbox does not read the architecture from GGUF metadata)"
            )

    def _check_checkpoint_quantization(self) -> None:
        """A checkpoint saved quantized says so in config.json (``quantization_config``)."""
        from engine.model_executor.layers.quantization import QUANTIZATION_METHODS

        method = (self.hf_config.get("quantization_config") or {}).get("quant_method")
        if method is None:
            return
        if method not in QUANTIZATION_METHODS:
            raise ValueError(
                f"model={self.model!r} is quantized with {method!r} (its config.json's "
                f"quantization_config); Glassbox loads {QUANTIZATION_METHODS}"
            )
        if self.quantization not in (None, method):
            raise ValueError(
                f"quantization={self.quantization!r} does not match the checkpoint, "
                f"whose config.json says quant_method {method!r}"
            )
        self.quantization = method

    # -- fields the rest of the engine reads -------------------------------
    def get_derived_max_model_len(self) -> int:
        for key in _MAX_LEN_KEYS:
            value = self.hf_config.get(key)
            if isinstance(value, int) and value > 0:
                return value
        return 2048

    @property
    def architectures(self) -> list[str]:
        return list(self.hf_config.get("architectures") or [])

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.get("vocab_size", 0))

    def get_num_layers(self) -> int:
        return int(self.hf_config.get("num_hidden_layers", 1))

    def get_num_kv_heads(self) -> int:
        heads = self.hf_config.get("num_attention_heads", 1)
        return int(self.hf_config.get("num_key_value_heads", heads))

    def get_head_size(self) -> int:
        if self.hf_config.get("head_dim"):
            return int(self.hf_config["head_dim"])
        hidden = int(self.hf_config.get("hidden_size", 64))
        return hidden // int(self.hf_config.get("num_attention_heads", 1))

    @property
    def eos_token_id(self) -> int | None:
        eos = self.hf_config.get("eos_token_id")
        if isinstance(eos, list):
            return eos[0] if eos else None
        return eos

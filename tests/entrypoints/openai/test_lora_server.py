"""LoRA adapters on the OpenAI server: chosen by ``model``, listed in
``/v1/models``, loaded and unloaded at run time when allowed.

The base model is a tiny random Llama with the tiny word tokenizer; its
adapter's greedy text must equal the offline engine's with the same
``LoRARequest`` (itself checked against HF peft in tests/lora/).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.entrypoints.serve.lora.api_router import ALLOW_RUNTIME_LORA_UPDATING_ENV
from engine.lora.request import LoRARequest
from tests.entrypoints.openai.utils import RemoteOpenAIServer
from tests.helpers.hf_checkpoints import save_tiny_checkpoint
from tests.helpers.lora_adapters import save_peft_adapter
from tests.helpers.tiny_model import make_tiny_model_dir

REPO_ROOT = Path(__file__).resolve().parents[3]
PROMPT = "w1 w2 w3 w4 w5"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_server")
    save_tiny_checkpoint("llama", root / "base", seed=1)
    words = make_tiny_model_dir(root / "words")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (words / name).exists():
            shutil.copy(words / name, root / "base" / name)
    for name, seed in (("a", 1), ("b", 2), ("broken", 3)):
        save_peft_adapter(root / "base", root / name, seed=seed, r=8)
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"truncated")
    return {name: str(root / name) for name in ("base", "a", "b", "broken")}


def _offline_text(model: dict, adapter: str | None) -> str:
    os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(model["base"], enable_lora=True, max_lora_rank=8, max_model_len=64)
        lora = LoRARequest(adapter, 1, model[adapter]) if adapter else None
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        (out,) = llm.generate([PROMPT], params, lora_request=lora, use_tqdm=False)
        llm.shutdown()
    finally:
        del os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"]
    return out.outputs[0].text


def _model_ids(server: RemoteOpenAIServer) -> set[str]:
    return {m.id for m in server.get_client().models.list().data}


def _complete(server: RemoteOpenAIServer, model: str):
    return server.get_client().completions.create(
        model=model, prompt=PROMPT, max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True}
    )


def test_adapters_are_models_of_their_own(model, monkeypatch) -> None:
    monkeypatch.setenv(ALLOW_RUNTIME_LORA_UPDATING_ENV, "1")
    want = {name: _offline_text(model, name) for name in ("a", "b", None)}
    args = ["--enable-lora", "--max-lora-rank", "8", "--max-model-len", "64"]
    with RemoteOpenAIServer(model["base"], [*args, "--lora-modules", f"a={model['a']}"]) as server:
        listed = {m.id: m for m in server.get_client().models.list().data}
        assert set(listed) == {model["base"], "a"}
        assert listed["a"].parent == model["base"] and listed["a"].root == model["a"]
        answer = _complete(server, "a")
        assert answer.model == "a" and answer.choices[0].text == want["a"]
        assert _complete(server, model["base"]).choices[0].text == want[None]
        # At run time: load b, use it, refuse a second load, unload it.
        load = httpx.post(
            server.url_for("v1", "load_lora_adapter"),
            json={"lora_name": "b", "lora_path": model["b"]},
        )
        assert load.status_code == 200, load.text
        assert _complete(server, "b").choices[0].text == want["b"]
        again = httpx.post(
            server.url_for("v1", "load_lora_adapter"),
            json={"lora_name": "b", "lora_path": model["b"]},
        )
        assert again.status_code == 400 and "already been loaded" in again.text
        bad = httpx.post(
            server.url_for("v1", "load_lora_adapter"),
            json={"lora_name": "c", "lora_path": "/nowhere"},
        )
        assert bad.status_code == 400 and "no adapter_config.json" in bad.text
        # The engine reads the weights at load time: a broken file is a 400, not a dead engine.
        broken = httpx.post(
            server.url_for("v1", "load_lora_adapter"),
            json={"lora_name": "broken", "lora_path": model["broken"]},
        )
        assert broken.status_code == 400, broken.text
        assert "LoRA adapter 'broken' (" in broken.text and "could not be loaded" in broken.text
        assert "broken" not in _model_ids(server)
        assert _complete(server, "b").choices[0].text == want["b"]
        gone = httpx.post(server.url_for("v1", "unload_lora_adapter"), json={"lora_name": "b"})
        assert gone.status_code == 200
        missing = httpx.post(server.url_for("v1", "unload_lora_adapter"), json={"lora_name": "b"})
        assert missing.status_code == 404 and "cannot be found" in missing.text
        unknown = httpx.post(
            server.url_for("v1", "completions"), json={"model": "b", "prompt": PROMPT}
        )
        assert unknown.status_code == 404 and "does not exist" in unknown.text


def test_runtime_updates_are_off_by_default(model, monkeypatch) -> None:
    monkeypatch.delenv(ALLOW_RUNTIME_LORA_UPDATING_ENV, raising=False)
    args = ["--enable-lora", "--max-lora-rank", "8", "--max-model-len", "64"]
    with RemoteOpenAIServer(model["base"], args) as server:
        response = httpx.post(
            server.url_for("v1", "load_lora_adapter"),
            json={"lora_name": "a", "lora_path": model["a"]},
        )
        assert response.status_code == 404


def test_lora_modules_need_enable_lora(model) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.entrypoints.cli.main",
            "serve",
            model["base"],
            "--lora-modules",
            f"a={model['a']}",
        ],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert b"--lora-modules needs --enable-lora" in result.stderr
    assert b"Traceback" not in result.stderr


def test_a_broken_startup_adapter_stops_the_server(model) -> None:
    args = ["--enable-lora", "--max-lora-rank", "8", "--max-model-len", "64"]
    with pytest.raises(RuntimeError, match="the API server failed to start") as failed:
        RemoteOpenAIServer(model["base"], [*args, "--lora-modules", f"broken={model['broken']}"])
    assert "LoRA adapter 'broken'" in str(failed.value.__cause__)

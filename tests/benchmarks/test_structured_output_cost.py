"""benchmarks/structured_output_cost.py on the CPU (a tiny random Llama with a
byte-level BPE tokenizer trained here, so that JSON can be spelled and the
run takes seconds): every mode at every batch size, ratios against the free
mode of the same loop, and compile times."""

from __future__ import annotations

import json

import pytest

from benchmarks import results_store, structured_output_cost
from tests.helpers.hf_checkpoints import save_tiny_checkpoint


@pytest.fixture
def bpe_model(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "bpe_llama"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],  # ids 0, 1, 2: TINY_CONFIG's bos 1, eos 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(['{"text": "hello world"}'] * 8, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(path))
    save_tiny_checkpoint("llama", path, vocab_size=320, max_position_embeddings=2048)
    return path


def test_structured_output_cost_runs_on_cpu(tmp_path, bpe_model):
    argv = ["--device", "cpu", "--model", str(bpe_model), "--batch-sizes", "1,3"]
    assert structured_output_cost.main([*argv, "--steps", "3", "--out", f"{tmp_path}/"]) == 0
    (path,) = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    assert path.name == "structured_output_cost_cpu.json"
    assert path.name == results_store.current_name(result) + ".json"
    rows = {(r["mode"], r["batch"]): r for r in result["results"]}
    modes = ["free_async", "json_async", "free_serial", "json_serial"]
    assert sorted(rows) == sorted((m, b) for m in modes for b in (1, 3))
    for (mode, _), r in rows.items():
        assert r["ms_per_step"] > 0 and r["steps"] >= 3
        if mode.startswith("free"):
            assert r["ratio_to_free"] == 1.0
    for times in result["compile"].values():
        assert times["cold_s"] > 0 and times["cached_s"] > 0

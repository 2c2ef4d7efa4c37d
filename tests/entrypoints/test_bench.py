"""``glassbox bench throughput|latency`` on the CPU with a tiny random model.

Each command runs end to end through the CLI parser (``glassbox bench ...``)
with a handful of short requests and ``--load-format dummy``; the tests check
the JSON it writes: the fields, that the token counts add up to the requested
lengths, and that the figures are positive. The workload generator is held to
nano-vllm's published totals, and the roofline arithmetic to the figures of
the first H200 run (benchmarks/results/gpu_throughput_2026-12-02_h200.json).
"""

from __future__ import annotations

import json

import pytest

from engine.benchmarks.datasets import parse_len_range, sample_random_requests
from engine.entrypoints.cli.main import build_parser

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "hidden_act": "silu",
    "eos_token_id": 151645,
}


@pytest.fixture
def tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")  # quicker start, same results
    path = tmp_path / "tiny"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(path)


def _bench(*argv: str) -> int:
    args = build_parser().parse_args(["bench", *argv])
    return args.dispatch_function(args)


def test_workload_is_nano_vllms():
    requests = sample_random_requests()
    assert len(requests) == 256
    assert sum(r.expected_output_len for r in requests) == 133_966  # nano-vllm README
    assert sum(r.prompt_len for r in requests) == 142_827
    assert all(
        100 <= r.prompt_len <= 1024 and 100 <= r.expected_output_len <= 1024 for r in requests
    )
    assert max(t for r in requests for t in r.prompt_token_ids) <= 10_000


def test_len_ranges():
    assert parse_len_range("100-1024", "--input-len") == (100, 1024)
    assert parse_len_range("512", "--input-len") == (512, 512)
    with pytest.raises(ValueError, match="--output-len"):
        parse_len_range("20-10", "--output-len")
    with pytest.raises(ValueError, match="--input-len"):
        parse_len_range("a-b", "--input-len")


def test_roofline_matches_the_first_h200_run(tmp_path):
    import torch

    from engine.benchmarks.roofline import (
        count_model_bytes,
        decode_step_floor_seconds,
        throughput_bound_seconds,
    )
    from engine.config.model import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B))
    model = count_model_bytes(
        ModelConfig(model=str(tmp_path), skip_tokenizer_init=True), torch.bfloat16
    )
    assert model.num_params == 596_049_920  # perf.md section 6
    assert (
        model.weight_bytes_per_step == 2 * 596_049_920
    )  # tied embeddings: the LM head reads them all
    assert model.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2
    bandwidth = 4246.719466794773e9  # measured in that run
    seconds = throughput_bound_seconds(sample_random_requests(), model, bandwidth)
    assert seconds == pytest.approx(3.5573886611978724, rel=1e-12)
    assert decode_step_floor_seconds(1, 512, model, 4.3e12) * 1e3 == pytest.approx(
        0.29088839441860465
    )


def test_bench_throughput_glassbox(tiny_model, tmp_path):
    out = tmp_path / "throughput.json"
    assert (
        _bench(
            "throughput",
            "--model",
            tiny_model,
            "--load-format",
            "dummy",
            "--num-prompts",
            "5",
            "--input-len",
            "8-24",
            "--output-len",
            "3-9",
            "--output-json",
            str(out),
        )
        == 0
    )
    result = json.loads(out.read_text())
    expected = sample_random_requests(
        5, (8, 24), (3, 9), seed=0, max_token_id=TINY_CONFIG["vocab_size"] - 1
    )
    assert result["benchmark"] == "throughput" and result["backend"] == "glassbox"
    assert (
        result["engine"]["attention_backend"] == "CPU_ATTN" and result["engine"]["device"] == "cpu"
    )
    assert result["workload"]["max_token_id"] == 299  # capped at the vocabulary
    assert result["num_requests"] == 5
    assert result["total_output_tokens"] == sum(r.expected_output_len for r in expected)
    assert result["total_prompt_tokens"] == sum(r.prompt_len for r in expected)
    assert result["all_lengths_as_requested"] is True
    assert result["elapsed_time"] > 0
    assert result["output_tokens_per_second"] == pytest.approx(
        result["total_output_tokens"] / result["elapsed_time"]
    )
    assert "roofline" not in result  # CPU: no bandwidth measurement
    for key in ("date", "commit", "torch", "transformers"):
        assert key in result


def test_bench_throughput_hf_continuous_batching(tiny_model, tmp_path):
    pytest.importorskip("transformers.generation", reason="needs transformers' continuous batching")
    out = tmp_path / "hf.json"
    assert (
        _bench(
            "throughput",
            "--backend",
            "hf",
            "--model",
            tiny_model,
            "--load-format",
            "dummy",
            "--num-prompts",
            "4",
            "--input-len",
            "8-24",
            "--output-len",
            "3-9",
            "--output-json",
            str(out),
        )
        == 0
    )
    result = json.loads(out.read_text())
    expected = sample_random_requests(4, (8, 24), (3, 9), seed=0, max_token_id=299)
    assert result["backend"] == "hf" and result["completed"] is True
    assert result["num_requests_finished"] == 4
    assert result["total_output_tokens"] == sum(
        r.expected_output_len for r in expected
    )  # EOS was off
    assert result["all_lengths_as_requested"] is True
    assert result["generation_config"]["per_request_max_new_tokens"] is True
    cb = result["continuous_batching_config"]
    assert cb["max_batch_tokens"] == 16384 and cb["max_requests_per_batch"] == 256
    assert result["output_tokens_per_second"] > 0


def test_bench_latency(tiny_model, tmp_path):
    out = tmp_path / "latency.json"
    assert (
        _bench(
            "latency",
            "--model",
            tiny_model,
            "--load-format",
            "dummy",
            "--batch-size",
            "1,3",
            "--input-len",
            "20",
            "--num-iters",
            "4",
            "--num-iters-warmup",
            "1",
            "--output-json",
            str(out),
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["benchmark"] == "latency" and result["input_len"] == 20
    assert result["engine"]["max_num_seqs"] == 3  # the largest batch, when not given
    assert result["engine"]["enable_prefix_caching"] is False
    assert sorted(result["decode_latency"]) == ["1", "3"]
    for b, entry in result["decode_latency"].items():
        assert entry["batch_size"] == int(b) and entry["context_len"] == 20
        assert len(entry["step_ms"]) == 4 and all(t > 0 for t in entry["step_ms"])
        assert entry["min_ms"] <= entry["median_ms"] <= entry["max_ms"]
        assert "floor_ms" not in entry  # CPU


def test_bench_latency_rejects_bad_batch_sizes(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "latency", "--batch-size", "0,4"])
    assert "--batch-size" in capsys.readouterr().err

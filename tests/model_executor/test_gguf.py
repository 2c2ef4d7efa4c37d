"""GGUF weights kept quantized: Config -> Method -> Kernel on the CPU.

* The dequantization kernels equal the ``gguf`` package's numpy reference bit
  for bit (Q4_0, Q4_1, Q8_0), so a GGUF model computes with exactly the
  weights of its float conversion.
* Tiny Llamas written as GGUF files (each format; q in Q8_0 beside Q4_1, so a
  fused layer mixes formats; a float embedding; tied embeddings) generate the
  same greedy tokens as their dequantized float folders, logprobs within 1e-4
  (fp32: only the GEMM path differs -- F.linear over the dequantized weight
  against the float model's oneDNN-packed weight).
* The embedded SmolLM2 from its Q4_1 file: the same tokens as its float32
  conversion, with under 30% of its weight memory.
* Bad input fails with one line naming the field.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_executor.layers.quantization.gguf_kernels import ggml_dequantize
from tests.helpers.gguf_checkpoints import save_dequantized, save_tiny_gguf
from tests.helpers.hf_checkpoints import TINY_CONFIG, save_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("in_process_engine")

Q = gguf.GGMLQuantizationType
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
PROMPTS = [
    {"prompt_token_ids": [(5 * i + 3 * j) % TINY_CONFIG["vocab_size"] for j in range(n)]}
    for i, n in enumerate((3, 17, 40))
]
ENGINE = {"skip_tokenizer_init": True, "max_model_len": 128, "num_gpu_blocks_override": 32}


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequantize_is_bit_exact(qtype) -> None:
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    ours = ggml_dequantize(torch.from_numpy(raw), int(qtype), 48, 96)
    assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(raw, qtype)))


def test_dequantize_checks_its_input() -> None:
    with pytest.raises(
        ValueError, match=r"Q4_1 data for a \[4, 64\] weight must be uint8 \[4, 40\]"
    ):
        ggml_dequantize(torch.zeros(4, 39, dtype=torch.uint8), int(Q.Q4_1), 4, 64)
    with pytest.raises(ValueError, match="cannot dequantize Q5_0"):
        ggml_dequantize(torch.zeros(4, 44, dtype=torch.uint8), int(Q.Q5_0), 4, 64)


def _generate(model: str, **kwargs) -> tuple[list, int]:
    llm = LLM(model, **ENGINE, **kwargs)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
        nbytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        return outs, nbytes
    finally:
        llm.shutdown()


def _assert_same(got: list, want: list, atol: float = 1e-4) -> None:
    for a, b in zip(got, want, strict=True):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) <= atol for t in la)


VARIANTS = {
    "q8_0": lambda name: Q.Q8_0,
    "q4_0": lambda name: Q.Q4_0,
    "q4_1": lambda name: Q.Q4_1,
    # llama.cpp mixes formats: q in Q8_0 inside a Q4_1 qkv_proj, a float table.
    "mixed": lambda name: (
        Q.Q8_0 if "q_proj" in name else Q.F32 if "embed_tokens" in name else Q.Q4_1
    ),
}


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_gguf_equals_its_float_model(variant: str, tied: bool, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    save_tiny_checkpoint("llama", hf, seed=3, tie_word_embeddings=tied)
    qtype_of = VARIANTS[variant]
    path = save_tiny_gguf(hf, tmp_path / "model.gguf", qtype_of)
    floats = save_dequantized(hf, tmp_path / "dequantized", qtype_of)
    want, float_bytes = _generate(str(floats))
    got, gguf_bytes = _generate(str(path), hf_config_path=str(hf))
    _assert_same(got, want)
    assert gguf_bytes < float_bytes


def test_default_model_from_its_gguf_file() -> None:
    """The Q4_1 file as it ships: the float32 conversion's tokens, <30% of its bytes."""
    prompts = [{"prompt_token_ids": [1, 504, 3575, 282, 4649, 314]}, {"prompt_token_ids": [42] * 9}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = {}
    for name, kwargs in (("f32", {}), ("gguf", {"quantization": "gguf"})):
        llm = LLM("default", max_model_len=128, num_gpu_blocks_override=32, **kwargs)
        try:
            outs[name] = llm.generate(prompts, params, use_tqdm=False)
            runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
            model = runner.model_runner.model
            outs[name + "_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        finally:
            llm.shutdown()
    _assert_same(outs["gguf"], outs["f32"])
    assert outs["gguf_bytes"] < 0.3 * outs["f32_bytes"]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"quantization": "fp9"}, "quantization must be one of"),
        ({"quantization": "gguf"}, "quantization='gguf' needs a .gguf file"),
        ({"model": "/nowhere/x.gguf"}, "no such GGUF file"),
        ({"model": "GGUF"}, "a GGUF model needs hf_config_path"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict, message: str, tmp_path: Path) -> None:
    from engine.engine.arg_utils import EngineArgs

    hf = tmp_path / "hf"
    save_tiny_checkpoint("llama", hf, seed=0)
    if kwargs.get("model") == "GGUF":
        kwargs = {"model": str(save_tiny_gguf(hf, tmp_path / "m.gguf", lambda n: Q.Q8_0))}
    args = {"model": str(hf), "skip_tokenizer_init": True, **kwargs}
    with pytest.raises(ValueError, match=message):
        EngineArgs(**args).create_engine_config()


def test_unsupported_format_names_the_layer(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    save_tiny_checkpoint("llama", hf, seed=0)
    path = save_tiny_gguf(hf, tmp_path / "m.gguf", lambda n: Q.Q5_0 if "o_proj" in n else Q.Q8_0)
    with pytest.raises(ValueError, match=r"o_proj: GGUF format Q5_0 is not supported"):
        LLM(str(path), hf_config_path=str(hf), **ENGINE)


def test_runner_init_traces_the_quant_methods(tmp_path: Path) -> None:
    from engine.tracing import RunnerInit, load_trace

    hf = tmp_path / "hf"
    save_tiny_checkpoint("llama", hf, seed=0, tie_word_embeddings=True)
    qtype_of = VARIANTS["mixed"]  # a float embedding: an unquantized module among GGUF ones
    path = save_tiny_gguf(hf, tmp_path / "m.gguf", qtype_of)
    trace = tmp_path / "trace.jsonl"
    _, nbytes = _generate(str(path), hf_config_path=str(hf), trace_path=str(trace))
    (init,) = [e for e in load_trace(str(trace)) if isinstance(e, RunnerInit)]
    assert init.quantization == "gguf" and init.weight_bytes == nbytes
    assert init.quant_methods == {
        "VocabParallelEmbedding": "UnquantizedEmbeddingMethod",
        "QKVParallelLinear": "GGUFLinearMethod",
        "RowParallelLinear": "GGUFLinearMethod",
        "MergedColumnParallelLinear": "GGUFLinearMethod",
    }

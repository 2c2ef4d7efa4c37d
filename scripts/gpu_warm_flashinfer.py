"""Build FlashInfer's kernels for the default model's attention shape, ahead of need.

    python scripts/gpu_warm_flashinfer.py      (on a CUDA machine; gpu_run.sh WARM_FLASHINFER=1)

FlashInfer compiles its prefill, decode and sampling modules on first use, per
dtype and head size: on a fresh H200 about two minutes (docs/gpu.md). The
session notebooks run SmolLM2-135M-Instruct (bf16 on CUDA: 9 query heads, 3 KV
heads of 64), so this runs a two-layer model of that attention shape with dummy
weights -- no checkpoint needed -- through the default engine once, with
sampling on. It takes 6% of the GPU's memory, so it can run beside other work;
the kernels land in ~/.cache/flashinfer for every later process on the machine.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.tiny_model import make_tiny_model_dir  # noqa: E402

# SmolLM2-135M's attention: hidden 576 = 9 heads of 64, 3 KV heads.
SHAPE = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}


def main() -> int:
    start = time.perf_counter()
    path = make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="fi-warm-")) / "model")
    config = json.loads((path / "config.json").read_text())
    config.update(SHAPE, intermediate_size=128, torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(config))

    from engine import LLM, SamplingParams

    llm = LLM(str(path), load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.06)
    prompts = ["w1 w2 w3 " * 20, "w5"] * 4  # a prefill of 60 tokens and short ones
    params = SamplingParams(temperature=0.6, top_p=0.9, top_k=20, max_tokens=24)
    outputs = llm.generate(prompts, params)
    print(f"warmed: {len(outputs)} requests in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

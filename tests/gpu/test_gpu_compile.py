"""torch.compile on the H200: compiled models give the eager model's tokens.

The random bf16 Llama (head size 64, 2 layers) runs eagerly and compiled
(``VLLM_COMPILE``: pieces between attentions through Inductor's Triton
backend) with each attention backend, with the decode CUDA graphs the mode
allows. Inductor fuses and reorders bf16 arithmetic, so tokens are compared
with ``assert_same_greedy`` (equal except after a near tie both runs saw).
"""

from __future__ import annotations

import pytest

from engine.compilation.counter import compilation_counter
from tests.gpu.test_flashinfer import _generate, assert_same_greedy, tiny_llama_head64

pytestmark = pytest.mark.gpu
__all__ = ["tiny_llama_head64"]  # the fixture, shared with test_flashinfer


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "FLASHINFER"])
def test_compiled_matches_eager(backend, tiny_llama_head64, tmp_path):
    if backend == "FLASHINFER":
        pytest.importorskip("flashinfer")
    _, eager = _generate(tiny_llama_head64, backend, enforce_eager=True)
    before = compilation_counter.clone()
    compilation = {"mode": 3, "cache_dir": str(tmp_path)}
    used, compiled = _generate(tiny_llama_head64, backend, compilation_config=compilation)
    assert used == backend
    assert compilation_counter.num_graphs_seen - before.num_graphs_seen == 1
    assert (
        compilation_counter.num_piecewise_capturable_graphs_seen
        - (before.num_piecewise_capturable_graphs_seen)
        == 5
    )  # 4 layers + 1
    assert_same_greedy(eager, compiled)

"""Model building blocks shared by every architecture.

vLLM twin: ``vllm/model_executor/layers/``.
Read it for the layer types a decoder is assembled from and, in ``linear.py``,
how fused parameters (qkv, gate_up) are filled from separate checkpoint tensors.
Sessions: 04 (worker), 05 (``attention/``).

Simpler than vLLM: no ``CustomOp`` dispatch (each layer has one plain-torch
``forward``), no quantization methods beyond the unquantized one, tensor
parallel size 1.
"""

"""Model building blocks shared by every architecture.

vLLM twin: ``vllm/model_executor/layers/``.
Read it for the layer types a decoder is assembled from and, in ``linear.py``,
how fused parameters (qkv, gate_up) are filled from separate checkpoint tensors.
Sessions: 04 (worker), 05 (``attention/``).

``RMSNorm``, ``SiluAndMul`` and ``RotaryEmbedding`` are ``CustomOp``s
(``engine/model_executor/custom_op.py``): plain torch on the CPU, one fused
Triton kernel each on CUDA (``engine/_custom_ops.py``).

Simpler than vLLM: no quantization methods beyond the unquantized one, tensor
parallel size 1.
"""

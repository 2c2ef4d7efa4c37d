"""The punica ops (vLLM twin: ``vllm/lora/ops/``): ``torch_ops`` (per-token, any
device) and ``triton_ops`` (grouped by adapter, CUDA). Sessions: 06."""

"""LoRA adapters served beside the base model (vLLM twin: ``vllm/lora/``). Sessions: 06."""

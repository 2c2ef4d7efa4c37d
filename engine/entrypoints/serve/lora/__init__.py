"""LoRA adapters loaded and unloaded while the server runs (vLLM twin:
``vllm/entrypoints/serve/lora/``). Sessions: 06."""

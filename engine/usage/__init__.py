"""Who built the engine (vLLM twin: ``vllm/usage/``)."""

"""Small shared helpers (vLLM twin: ``vllm/utils/``)."""

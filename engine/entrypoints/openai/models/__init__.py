"""``GET /v1/models`` (vLLM twin: ``vllm/entrypoints/openai/models/``)."""

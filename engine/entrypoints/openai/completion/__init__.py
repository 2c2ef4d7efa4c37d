"""``POST /v1/completions`` (vLLM twin: ``vllm/entrypoints/openai/completion/``)."""

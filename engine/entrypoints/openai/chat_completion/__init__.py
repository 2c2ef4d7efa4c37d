"""``POST /v1/chat/completions`` (vLLM twin: ``vllm/entrypoints/openai/chat_completion/``)."""

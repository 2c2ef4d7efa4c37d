"""``POST /reset_prefix_cache`` (vLLM twin: ``vllm/entrypoints/serve/cache/``)."""

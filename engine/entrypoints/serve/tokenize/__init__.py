"""``POST /tokenize`` and ``POST /detokenize`` (vLLM twin: ``vllm/entrypoints/serve/tokenize/``)."""

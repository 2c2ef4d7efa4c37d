"""Server endpoints that are not part of the OpenAI API (vLLM twin: ``vllm/entrypoints/serve/``)."""

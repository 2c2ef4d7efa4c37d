"""``POST /pause``, ``POST /resume``, ``GET /is_paused``
(vLLM twin: ``vllm/entrypoints/serve/rlhf/``)."""

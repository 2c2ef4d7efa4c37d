"""``POST /start_profile`` and ``/stop_profile``
(vLLM twin: ``vllm/entrypoints/serve/profile/``)."""

"""Profiling windows of the workers (vLLM twin: ``vllm/profiler/``)."""

"""Offline benchmarks behind ``glassbox bench throughput|latency``.

vLLM twin: ``vllm/benchmarks/`` (``throughput.py``, ``latency.py``,
``datasets/``). Read it for how the engine's speed is measured: output tokens
over wall time on nano-vllm's workload (``throughput``), and the wall time of
one decode step at a fixed batch size and context (``latency``), each beside
the bound that memory bandwidth sets (``roofline``).
Sessions: 06 (performance).
"""

"""``glassbox bench`` sub-commands (vLLM twin: ``vllm/entrypoints/cli/benchmark/``).

Sessions: 06.
"""

"""vLLM twin: ``vllm/distributed/device_communicators/`` (here only ``shm_broadcast.py``).

Sessions: 07 (executor).
"""

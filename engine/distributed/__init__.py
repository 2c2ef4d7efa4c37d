"""vLLM twin: ``vllm/distributed/`` (the processes of one model talking to each other)."""

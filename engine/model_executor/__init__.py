"""Everything that turns a checkpoint into a runnable ``nn.Module``.

vLLM twin: ``vllm/model_executor/``.
Read it for the three parts the worker touches: ``layers/`` (linear, norm,
rotary, attention building blocks with vLLM's weight-loading seams),
``models/`` (Llama / Qwen2 / Qwen3 written with those blocks, plus the
architecture registry) and ``model_loader/`` (``get_model``: build the module,
then fill it from safetensors or with dummy weights).
Sessions: 04 (worker), 05 (attention layer).
"""

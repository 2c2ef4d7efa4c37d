"""Compilation: torch.compile of the model, split at attention, and CUDA graphs.

vLLM twin: ``vllm/compilation/``. Read the modules in this order:
``decorators.py`` (which models compile, and when), ``backends.py`` (the
Dynamo backend that splits the graph at the attention ops),
``piecewise_backend.py`` (Inductor per piece, per shape),
``cuda_graph.py`` (capture and replay keyed by the batch descriptor) and
``counter.py`` (what happened, counted). Sessions: 06 (compilation).
"""

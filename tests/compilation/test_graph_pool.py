"""Each engine's CUDA graphs get a memory pool of their own (engine/compilation/cuda_graph.py).

PyTorch retires a graph pool once the last graph captured into it is freed and asserts
on a later capture into it, so a process that runs engines one after another (notebooks,
tests) must not hand a new engine the pool of one that is gone. The capture itself needs
a GPU (tests/gpu/test_gpu_engine.py::test_engines_one_after_another_capture_graphs);
here the pool handles are counted with torch's handle factory replaced.
"""

from __future__ import annotations

import itertools

import torch

from engine.compilation import cuda_graph


def test_each_new_pool_is_fresh_and_becomes_the_global_one(monkeypatch):
    handles = itertools.count(1)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (next(handles), 0))
    monkeypatch.setattr(cuda_graph, "_global_graph_pool", None)
    first = cuda_graph.new_global_graph_pool()
    assert cuda_graph.get_global_graph_pool() == first  # what the compile backend reads
    second = cuda_graph.new_global_graph_pool()
    assert second != first
    assert cuda_graph.get_global_graph_pool() == second

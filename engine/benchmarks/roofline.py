"""Lower bounds on benchmark times from bytes moved over measured bandwidth.

vLLM twin: none (vLLM's benchmarks report what they measure, not a bound).
Read it for the arithmetic behind "our fraction of the roofline"
(../shared/reference/perf.md section 6): a decode step must at least read
every weight the step uses once and every cached K/V it attends over, so at a
copy bandwidth of B bytes/s

  * one decode step of ``batch`` requests at context ``ctx`` takes at least
    ``(weight_bytes + batch * ctx * kv_bytes_per_token) / B``;
  * a whole offline run takes at least ``(weight_bytes * decode_steps +
    kv_bytes_per_token * (KV reads of every decode token + one write per
    prompt token)) / B``, where ``decode_steps`` is the longest output (every
    request can share each step) and a request with prompt length P and output
    length O reads ``P*O + O*(O-1)/2`` cached tokens over its decode steps.

Weight bytes per step are the parameters a step reads: all of them, except
that the input embedding is a lookup of a few rows (unless it is tied to the
LM head, which reads all of it). They are counted on a ``meta``-device copy
of the transformers model built from the checkpoint's config (no memory, no
weights). The bandwidth is a device-to-device copy measured in the same run.
Compute is ignored: at these sizes a step is memory-bound (perf.md section 6).
Sessions: 06 (performance).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.benchmarks.datasets import SampleRequest


@dataclass
class ModelBytes:
    num_params: int
    weight_bytes_per_step: int  # parameters read by one forward, in bytes
    kv_bytes_per_token: int  # K and V of one token over all layers, in bytes


def count_model_bytes(model_config: Any, dtype: torch.dtype) -> ModelBytes:
    """Bytes a forward reads for ``model_config`` (our ``ModelConfig``) in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**model_config.hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    num_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    read = num_params if tied else num_params - embedding.numel()
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv = (
        2
        * model_config.get_num_layers()
        * model_config.get_num_kv_heads()
        * model_config.get_head_size()
    )
    return ModelBytes(num_params, read * itemsize, kv * itemsize)


def measure_copy_bandwidth(
    device: torch.device | str = "cuda", nbytes: int = 2 * 1024**3, iters: int = 10
) -> float:
    """Bytes per second (read + write) of a device-to-device tensor copy."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_copy_bandwidth needs a CUDA device, got {device}")
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        y.copy_(x)
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / iters
    del x, y
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def throughput_bound_seconds(
    requests: Sequence[SampleRequest], model: ModelBytes, bandwidth: float
) -> float:
    decode_steps = max(r.expected_output_len for r in requests)
    kv_reads = sum(
        r.prompt_len * r.expected_output_len
        + r.expected_output_len * (r.expected_output_len - 1) // 2
        for r in requests
    )
    prompt_writes = sum(r.prompt_len for r in requests)
    total = (
        model.weight_bytes_per_step * decode_steps
        + (kv_reads + prompt_writes) * model.kv_bytes_per_token
    )
    return total / bandwidth


def decode_step_floor_seconds(
    batch_size: int, context_len: int, model: ModelBytes, bandwidth: float
) -> float:
    return (
        model.weight_bytes_per_step + batch_size * context_len * model.kv_bytes_per_token
    ) / bandwidth

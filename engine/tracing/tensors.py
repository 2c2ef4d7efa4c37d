"""Tensor values for trace events, brought to the host with one wait per step.

vLLM twin: none (vLLM's tracing records no tensor values). Read it for why a
hook that reads several small device tensors should not call ``.tolist()`` or
``.item()`` on each: on a GPU every such call is a device-to-host copy that
waits for the device, and a ``full`` trace of a step would make dozens of
them (the sampler's top candidates per stage). ``HostListsCopy`` concatenates
the pieces of each dtype on the device, queues one non-blocking copy per
dtype and splits them again on the host once the device has been waited
for; on the CPU it is plain ``tolist``. The values are exactly what
``tolist`` would give. ``array_summaries`` describes host arrays (the
runner's inputs, read from the arrays the device buffers were filled from,
so no device work at all).

Used by the worker's trace objects (``worker_trace.py``); imported only
through them, so the rest of ``engine.tracing`` (which ``engine/v1/core``
uses) never imports torch.
Sessions: 04 worker, 05 attention and sampling.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.tracing.events import TensorSummary

# Values kept of a long tensor in a summary: the first and the last this many.
SUMMARY_VALUES = 32


class HostListsCopy:
    """``[t.tolist() for t in tensors]`` in two halves: the copy to the host is
    queued now and read later.

    The constructor concatenates the CUDA tensors of each dtype on the device
    (nothing is cast) and queues one non-blocking copy per dtype into pinned
    host memory, then returns at once. Queued on the current stream before
    the caller's own synchronising copy (the model runner's ``.tolist()`` of
    the sampled tokens), the copies are complete when that returns:
    ``lists(synchronized=True)`` reads them with no second wait for the
    device; ``lists()`` waits for the stream once first. CPU tensors are read
    as they are.

    ``gather=True`` groups and copies CPU tensors too (into ordinary memory):
    the tests check the grouping and the split on the CPU.

    ``staging``: a dict the caller keeps between calls, dtype -> a pinned
    buffer, grown when too small and otherwise reused: a fresh pinned
    allocation costs more host time than the rest of a small copy. Only for
    a caller that has read the previous copy (``lists``) before it makes the
    next, as the sampler does every step."""

    def __init__(
        self,
        *tensors: torch.Tensor,
        gather: bool = False,
        staging: dict[torch.dtype, torch.Tensor] | None = None,
    ) -> None:
        self.tensors = tensors
        cuda = [t.device for t in tensors if t.device.type == "cuda"]
        self.device: torch.device | None = cuda[0] if cuda else None  # waited for by lists()
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            if gather or t.device.type == "cuda":
                by_dtype.setdefault(t.dtype, []).append(i)
        # dtype -> (indices of its tensors, their values end to end in host memory)
        self.groups: dict[torch.dtype, tuple[list[int], torch.Tensor]] = {}
        for dtype, indices in by_dtype.items():
            pieces = [tensors[i].detach().reshape(-1) for i in indices]
            flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            on_cuda = flat.device.type == "cuda"
            if staging is None:
                host = torch.empty(flat.shape, dtype=dtype, pin_memory=on_cuda)
            else:
                buffer = staging.get(dtype)
                if buffer is None or buffer.numel() < flat.numel():
                    size = max(flat.numel(), 2 * buffer.numel() if buffer is not None else 0)
                    buffer = staging[dtype] = torch.empty(size, dtype=dtype, pin_memory=on_cuda)
                host = buffer[: flat.numel()]
            host.copy_(flat, non_blocking=on_cuda)
            self.groups[dtype] = (indices, host)

    def lists(self, synchronized: bool = False) -> list[Any]:
        """``[t.tolist() for t in tensors]``. ``synchronized``: the caller has
        waited for the stream the copies were queued on since they were."""
        if self.device is not None and not synchronized:
            torch.cuda.current_stream(self.device).synchronize()
        out: list[Any] = [None] * len(self.tensors)
        for indices, host in self.groups.values():
            start = 0
            for i in indices:
                t = self.tensors[i]
                n = t.numel()
                values = host[start : start + n]
                out[i] = (values if t.dim() == 1 else values.reshape(t.shape)).tolist()
                start += n
        for i, t in enumerate(self.tensors):
            if out[i] is None:
                out[i] = t.tolist()
        return out


def array_summaries(**arrays: np.ndarray) -> dict[str, TensorSummary]:
    """Per host array: its shape, dtype, min and max and all its values -- or
    the first and last ``SUMMARY_VALUES`` (``head``, ``tail``) when it is
    long; a small 2-D array keeps its rows; no min / max when empty.

    Numpy, not torch: the model runner describes the host arrays its device
    buffers were filled from, and on these small arrays a numpy reduction
    costs a fraction of a torch CPU op's dispatch (the ``full`` trace makes
    many of them per step)."""
    out: dict[str, TensorSummary] = {}
    for name, a in arrays.items():
        dtype = _DTYPE_NAMES.get(a.dtype) or a.dtype.name  # .name runs Python code in numpy
        summary = TensorSummary(shape=list(a.shape), dtype=dtype)
        if a.size <= 2 * SUMMARY_VALUES or (a.ndim == 2 and a.size <= 4 * SUMMARY_VALUES):
            values = a.tolist()
            flat = values if a.ndim == 1 else a.reshape(-1).tolist()
            if flat:  # builtin min/max of a short list beat two numpy reductions
                summary.min, summary.max = min(flat), max(flat)
            summary.values = values if a.ndim == 2 else flat
        else:
            flat_array = a.reshape(-1)
            summary.min, summary.max = flat_array.min().item(), flat_array.max().item()
            summary.head = flat_array[:SUMMARY_VALUES].tolist()
            summary.tail = flat_array[-SUMMARY_VALUES:].tolist()
        out[name] = summary
    return out


_DTYPE_NAMES = {np.dtype(t): np.dtype(t).name for t in (np.int32, np.int64, np.float32, np.bool_)}


__all__ = ["SUMMARY_VALUES", "HostListsCopy", "array_summaries"]

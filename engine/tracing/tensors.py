"""Tensor values for trace events, brought to the host in one copy per step.

vLLM twin: none (vLLM's tracing records no tensor values). Read it for why a
hook that reads several small device tensors should not call ``.tolist()`` or
``.item()`` on each: on a GPU every such call is a device-to-host copy that
waits for the device, a few to tens of microseconds each, and a ``full``
trace of a step would make dozens of them (the sampler's top candidates per
stage, the runner's input summaries). ``host_lists`` gathers the pieces on
the device, copies them once, and splits them again on the host; on the CPU
it is plain ``tolist``. The values are exactly what ``tolist`` would give.
``HostListsCopy`` does the same with the copy queued without waiting and
read later, after the caller's own wait for the device.

Used by the sampler (``engine/v1/sample/sampler.py``) and the model runner
(``engine/v1/worker/gpu_model_runner.py``) at trace level ``full`` (the
sampled token and its logprob at every level). Imported only by them, so
the tracer itself (which ``engine/v1/core`` uses) never imports torch.
Sessions: 04 worker, 05 attention and sampling.
"""

from __future__ import annotations

from typing import Any

import torch

# Values kept of a long tensor in a summary: the first and the last this many.
SUMMARY_VALUES = 32


def _flat(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces (1-D) end to end, in a dtype that holds all their values."""
    if len(pieces) == 1:
        return pieces[0]
    if all(not p.is_floating_point() for p in pieces):
        # Integers and bools: one integer dtype for all.
        return torch.cat([p.to(torch.int64) if p.dtype == torch.bool else p for p in pieces])
    # Mixed: float64 holds every float32/bf16 value and every integer below
    # 2**53 exactly, so the split gives back the very same numbers.
    # (Pieces of one dtype let ``cat`` copy them all in one kernel.)
    return torch.cat([p.to(torch.float64) for p in pieces])


def _split(tensors: tuple[torch.Tensor, ...], gathered: list[int], host: torch.Tensor | None) -> list[Any]:
    """``tolist`` of every tensor; those at ``gathered`` read from ``host``."""
    out: list[Any] = [None] * len(tensors)
    start = 0
    for i in gathered:
        assert host is not None
        n = tensors[i].numel()
        out[i] = host[start : start + n].to(tensors[i].dtype).reshape(tensors[i].shape).tolist()
        start += n
    for i, t in enumerate(tensors):
        if out[i] is None:
            out[i] = t.tolist()
    return out


def host_lists(*tensors: torch.Tensor, gather: bool | None = None) -> list[Any]:
    """``[t.tolist() for t in tensors]``, with one device-to-host copy for all
    the tensors that live on a device (instead of one per tensor).

    ``gather``: None (default) gathers the device tensors only; True gathers
    CPU tensors too (the tests check the gathered path on the CPU)."""
    if gather is None:
        on_device = [i for i, t in enumerate(tensors) if t.device.type != "cpu"]
    else:
        on_device = list(range(len(tensors))) if gather else []
    if len(on_device) <= 1:
        return [t.tolist() for t in tensors]
    host = _flat([tensors[i].detach().reshape(-1) for i in on_device]).cpu()  # waits for the device
    return _split(tensors, on_device, host)


class HostListsCopy:
    """``host_lists`` in two halves: the copy is queued now and read later.

    On CUDA the constructor queues non-blocking copies of the device tensors
    into pinned host memory (one per dtype among them: pieces of one dtype
    are concatenated on the device, nothing is cast) and returns at once.
    Queued on the current stream before the caller's own synchronising copy
    (the model runner's ``.tolist()`` of the sampled tokens), they are
    complete when that returns: ``lists(synchronized=True)`` then reads them
    with no second wait for the device. ``lists()`` without that promise
    waits for the stream first. Elsewhere ``lists()`` is ``host_lists``.

    ``gather=True`` groups and copies CPU tensors too (into ordinary memory):
    the tests check the grouping and the split on the CPU."""

    def __init__(self, *tensors: torch.Tensor, gather: bool = False) -> None:
        self.tensors = tensors
        # dtype -> (indices of its tensors, their values end to end in host memory)
        self.groups: dict[torch.dtype, tuple[list[int], torch.Tensor]] = {}
        self.device: torch.device | None = None  # the CUDA device, if any tensor is on one
        for i, t in enumerate(tensors):
            if t.device.type == "cuda":
                self.device = t.device
            elif not gather:
                continue
            self.groups.setdefault(t.dtype, ([], t))[0].append(i)
        for dtype, (indices, _) in list(self.groups.items()):
            pieces = [tensors[i].detach().reshape(-1) for i in indices]
            flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            on_cuda = flat.device.type == "cuda"
            host = torch.empty(flat.shape, dtype=dtype, pin_memory=on_cuda)
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


def tensor_summaries(
    gather: bool | None = None, /, **tensors: torch.Tensor
) -> dict[str, dict[str, Any]]:
    """Per tensor: ``{shape, dtype, min, max, values}`` -- or ``head`` and
    ``tail`` (``SUMMARY_VALUES`` each) instead of ``values`` when it is long;
    a small 2-D tensor keeps its rows. One device-to-host copy for all."""
    pieces: list[torch.Tensor] = []
    layout: list[tuple[str, torch.Tensor, list[str]]] = []
    for name, t in tensors.items():
        flat = t.detach().reshape(-1)
        keys: list[str] = []
        if flat.numel():
            lo, hi = torch.aminmax(flat)
            pieces += [lo, hi]
            keys += ["min", "max"]
        if t.dim() == 2 and t.shape[0] * t.shape[1] <= 4 * SUMMARY_VALUES:
            pieces.append(t.detach())
            keys.append("values")
        elif flat.numel() <= 2 * SUMMARY_VALUES:
            pieces.append(flat)
            keys.append("values")
        else:
            pieces += [flat[:SUMMARY_VALUES], flat[-SUMMARY_VALUES:]]
            keys += ["head", "tail"]
        layout.append((name, t, keys))
    values = iter(host_lists(*pieces, gather=gather))
    out: dict[str, dict[str, Any]] = {}
    for name, t, keys in layout:
        summary: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        for key in keys:
            summary[key] = next(values)
        out[name] = summary
    return out


__all__ = ["SUMMARY_VALUES", "HostListsCopy", "host_lists", "tensor_summaries"]

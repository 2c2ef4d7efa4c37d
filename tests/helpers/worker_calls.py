"""Top-level functions for ``collective_rpc`` / ``apply_model`` tests: the
workers (other processes) import them by name, so they cannot be lambdas."""

from __future__ import annotations

from typing import Any


def num_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def first_weight_row(model: Any) -> list[float]:
    """The embedding's first row, on the CPU (tensors come back moved off the device)."""
    return model.model.embed_tokens.weight[0, :4].float().cpu().tolist()


def rank_and_sum(worker: Any, x: int, y: int = 0) -> tuple[int, int]:
    return worker.rank, x + y


def fail(worker: Any) -> None:
    raise RuntimeError(f"rank {worker.rank} refuses")

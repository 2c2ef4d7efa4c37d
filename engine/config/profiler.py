"""ProfilerConfig: whether ``start_profile`` / ``stop_profile`` may record, and how.

vLLM twin: ``vllm/config/profiler.py`` (``ProfilerConfig``). Read it for the
switches of a profiling window: which profiler (torch's, writing a trace per
worker and one for the front end, or CUDA's, which only marks the range for an
outside tool such as ``nsys``), where the traces go, and how many engine steps
to skip or keep. Sessions: 04 (worker), 07 (one trace per rank).

Simpler than vLLM: a plain dataclass checked in ``__post_init__`` (vLLM's is a
pydantic config); the directory must be a local folder (vLLM also takes
``gs://``-style URIs); the CLI takes one JSON object, ``--profiler-config
'{"profiler": "torch", "torch_profiler_dir": "./traces"}'`` (vLLM also takes
``--profiler-config.profiler torch``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

ProfilerKind = Literal["torch", "cuda"]
_KINDS = ("torch", "cuda")


@dataclass
class ProfilerConfig:
    profiler: ProfilerKind | None = None
    """Which profiler start_profile drives: torch (torch.profiler, traces in
    torch_profiler_dir), cuda (cudaProfilerStart/Stop, for nsys
    --capture-range=cudaProfilerApi), or None: profiling is off."""
    torch_profiler_dir: str = ""
    """Folder for the torch profiler's traces (one per worker, one for the
    front end); required with profiler=torch."""
    torch_profiler_with_stack: bool = True
    """Record the Python stack of each op (slower, but shows who called it)."""
    torch_profiler_with_flops: bool = False
    """Estimate the FLOPs of matmuls and convolutions."""
    torch_profiler_use_gzip: bool = True
    """Write the traces gzipped (*.pt.trace.json.gz)."""
    torch_profiler_dump_cuda_time_total: bool = True
    """On stop, write (and print on rank 0) the op table sorted by device time."""
    torch_profiler_record_shapes: bool = False
    """Record the input shapes of each op."""
    torch_profiler_with_memory: bool = False
    """Record tensor allocations and frees."""
    ignore_frontend: bool = False
    """Do not profile the front end (AsyncLLM's process), only the workers."""
    delay_iterations: int = 0
    """Engine steps to let pass after start_profile before recording."""
    max_iterations: int = 0
    """Stop recording by itself after this many steps (0: only stop_profile stops it)."""
    warmup_iterations: int = 0
    """Steps the torch profiler runs but discards before its active steps
    (with wait_iterations: torch.profiler.schedule; 0 and 0: no schedule)."""
    active_iterations: int = 5
    """With a schedule: how many steps are recorded."""
    wait_iterations: int = 0
    """With a schedule: steps with the profiler off before the warm-up."""

    def __post_init__(self) -> None:
        if self.profiler is not None and self.profiler not in _KINDS:
            raise ValueError(
                f"profiler_config.profiler must be 'torch', 'cuda' or None, got {self.profiler!r}"
            )
        for name in ("delay_iterations", "max_iterations", "warmup_iterations", "wait_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"profiler_config.{name} must be an int >= 0, got {value!r}")
        active = self.active_iterations
        if isinstance(active, bool) or not isinstance(active, int) or active < 1:
            raise ValueError(
                f"profiler_config.active_iterations must be an int >= 1, got {active!r}"
            )
        if self.torch_profiler_dir and self.profiler != "torch":
            raise ValueError(
                "profiler_config.torch_profiler_dir is only used with profiler='torch', "
                f"got profiler={self.profiler!r}"
            )
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ValueError("profiler_config.torch_profiler_dir is required with profiler='torch'")
        if "://" in self.torch_profiler_dir:
            raise ValueError(
                "profiler_config.torch_profiler_dir must be a local folder, got "
                f"{self.torch_profiler_dir!r} (vLLM also writes to URIs; Glassbox does not)"
            )
        if self.profiler == "torch" and (self.delay_iterations or self.max_iterations):
            if not self.ignore_frontend:
                logger.warning(
                    "profiler_config: delay_iterations/max_iterations count engine steps, but "
                    "the front end's trace spans the whole start..stop window; set "
                    "ignore_frontend=true to profile only the workers"
                )
        if self.torch_profiler_dir:
            # Workers may run in another working directory: fix the folder now.
            self.torch_profiler_dir = os.path.abspath(os.path.expanduser(self.torch_profiler_dir))

    @classmethod
    def from_dict(cls, values: dict) -> ProfilerConfig:
        """Glassbox's own: the CLI's JSON object, with unknown keys named."""
        if not isinstance(values, dict):
            raise ValueError(
                f"profiler_config must be a JSON object (a dict), got {type(values).__name__}"
            )
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"profiler_config: unknown field(s) {unknown}")
        return cls(**values)

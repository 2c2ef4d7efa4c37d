"""The worker's profiler: a window opened by ``start_profile`` and closed by
``stop_profile`` (or by itself after ``max_iterations`` steps).

vLLM twin: ``vllm/profiler/wrapper.py`` (``WorkerProfiler``,
``TorchProfilerWrapper``, ``CudaProfilerWrapper``). Read it for the small
state machine every kind shares: ``start`` arms the window, ``step`` (called
at the top of each ``execute_model``) counts engine steps to honour
``delay_iterations`` and ``max_iterations``, ``stop`` closes it. The torch
kind writes one trace per worker into ``torch_profiler_dir`` (open it in
Perfetto or ``chrome://tracing``) plus an op table, ``profiler_out_<rank>.txt``;
the CUDA kind only brackets the window with ``cudaProfilerStart/Stop`` so an
outside tool (``nsys profile --capture-range=cudaProfilerApi``) records it.
Each step is labelled ``execute_context_<reqs>(<tokens>)_generation_<reqs>(<tokens>)``,
vLLM's label, so the trace shows prefill and decode work per step.
Sessions: 04 (worker), 07 (one trace per rank).

Simpler than vLLM: no URI folders. Differences on purpose, so the fields
mean what vLLM's field documentation says: with ``delay_iterations=D``
exactly D engine steps run unrecorded (vLLM's code records the D-th step);
with a schedule, ``wait + warmup`` steps pass before the first recorded one
(vLLM's wrapper counts ``start_profile`` as one of them); and each window gets
a fresh torch profiler, so a second window runs its schedule again (a reused
one would have finished its single cycle and record nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch

from engine.config.profiler import ProfilerConfig

logger = logging.getLogger(__name__)

TorchProfilerActivity = Literal["CPU", "CUDA"]
_ACTIVITIES = {
    "CPU": torch.profiler.ProfilerActivity.CPU,
    "CUDA": torch.profiler.ProfilerActivity.CUDA,
}


class WorkerProfiler(ABC):
    """The window's state: ``_active`` from start to stop (what the user
    asked), ``_running`` while the profiler really records."""

    def __init__(self, profiler_config: ProfilerConfig) -> None:
        self._delay_iters = profiler_config.delay_iterations
        self._max_iters = profiler_config.max_iterations
        self._active = False
        self._running = False
        self._active_iteration_count = 0  # steps seen since start
        self._profiling_for_iters = 0  # steps recorded (warm-up steps excluded)

    @abstractmethod
    def _start(self) -> None: ...

    @abstractmethod
    def _stop(self) -> None: ...

    def _profiler_step(self) -> bool:
        """One step while recording; False for a step a schedule discards."""
        return True

    def _call_start(self) -> None:
        # A profiler that cannot start (another one is on) must not fail the step.
        try:
            self._start()
            self._running = True
        except Exception as e:
            logger.warning("The profiler did not start: %s", e)

    def _call_stop(self) -> None:
        try:
            self._stop()
        except Exception as e:
            logger.warning("The profiler did not stop cleanly: %s", e)
        self._running = False

    @property
    def is_running(self) -> bool:
        return self._running

    def start(self) -> None:
        if self._active:
            logger.debug("start_profile while the profiler is on: ignored")
            return
        self._active = True
        if self._delay_iters == 0:
            self._call_start()

    def step(self) -> None:
        """At the top of each engine step (``Worker.execute_model``)."""
        if not self._active:
            return
        self._active_iteration_count += 1
        delayed = self._delay_iters and self._active_iteration_count == self._delay_iters + 1
        if delayed and not self._running:
            self._call_start()
        if self._running and self._profiler_step():
            self._profiling_for_iters += 1
        if self._max_iters and self._running and self._profiling_for_iters > self._max_iters:
            # Recorded max_iters steps; the window stays active until stop_profile.
            logger.info("The profiler stops after %d steps (max_iterations)", self._max_iters)
            self._call_stop()

    def stop(self) -> None:
        if not self._active:
            logger.debug("stop_profile while the profiler is off: ignored")
            return
        self._active = False
        self._active_iteration_count = 0
        self._profiling_for_iters = 0
        if self._running:
            self._call_stop()

    def shutdown(self) -> None:
        """The worker is going away: write what was recorded."""
        if self._running:
            self.stop()

    def annotate_context_manager(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class TorchProfilerWrapper(WorkerProfiler):
    def __init__(
        self,
        profiler_config: ProfilerConfig,
        worker_name: str,
        local_rank: int,
        activities: list[TorchProfilerActivity],
        on_trace_ready: Callable[[torch.profiler.profile], None] | None = None,
    ) -> None:
        super().__init__(profiler_config)
        self.profiler_config = config = profiler_config
        self.local_rank = local_rank
        self.activities = activities
        if local_rank == 0:
            logger.info("Torch profiler traces go to %s", config.torch_profiler_dir)
        self._uses_schedule = bool(config.warmup_iterations or config.wait_iterations)
        self._on_trace_ready = on_trace_ready or torch.profiler.tensorboard_trace_handler(
            config.torch_profiler_dir,
            worker_name=worker_name,
            use_gzip=config.torch_profiler_use_gzip,
        )
        self.profiler: torch.profiler.profile | None = None
        self._unrecorded_steps_left = 0
        self._schedule_entered = False

    def _make_profiler(self) -> torch.profiler.profile:
        config = self.profiler_config
        schedule = None
        if self._uses_schedule:
            schedule = torch.profiler.schedule(
                wait=config.wait_iterations,
                warmup=config.warmup_iterations,
                active=config.active_iterations,
                repeat=1,
            )
        return torch.profiler.profile(
            activities=[_ACTIVITIES[a] for a in self.activities],
            schedule=schedule,
            record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory,
            with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
            on_trace_ready=self._on_trace_ready,
        )

    def _start(self) -> None:
        # A fresh profiler per window: each window runs its schedule from the start.
        self.profiler = self._make_profiler()
        self._unrecorded_steps_left = self.profiler_config.wait_iterations
        self._unrecorded_steps_left += self.profiler_config.warmup_iterations
        self._schedule_entered = False
        self.profiler.start()

    def _stop(self) -> None:
        assert self.profiler is not None
        self.profiler.stop()  # on_trace_ready writes the trace
        try:
            table = self._op_table(self.profiler)
        except UnicodeDecodeError as e:
            # torch sometimes records a Python-stack event (with_stack) under a
            # name it cannot decode again; only the summary is lost.
            logger.warning("No op table: torch could not read an event's name (%s)", e)
            return
        if table is None:
            return
        out_dir = self.profiler_config.torch_profiler_dir
        with open(os.path.join(out_dir, f"profiler_out_{self.local_rank}.txt"), "w") as f:
            print(table, file=f)
        if self.local_rank == 0:
            print(table)

    def _op_table(self, profiler: torch.profiler.profile) -> str | None:
        """The ops by device time (CUDA) or host time (CPU only), as vLLM prints them."""
        if "CUDA" in self.activities and self.profiler_config.torch_profiler_dump_cuda_time_total:
            return profiler.key_averages().table(sort_by="self_cuda_time_total")
        if self.activities == ["CPU"]:
            return profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
        return None

    def _profiler_step(self) -> bool:
        if not self._uses_schedule:
            return True
        assert self.profiler is not None
        # start() put the schedule in its first step: the first engine step runs
        # there; each later engine step moves the schedule on one.
        if self._schedule_entered:
            self.profiler.step()
        self._schedule_entered = True
        if self._unrecorded_steps_left > 0:
            self._unrecorded_steps_left -= 1
            return False
        return True

    def annotate_context_manager(self, name: str) -> contextlib.AbstractContextManager:
        return torch.profiler.record_function(name)


class CudaProfilerWrapper(WorkerProfiler):
    """Marks the window for an outside CUDA profiler; records nothing itself."""

    def _start(self) -> None:
        torch.cuda.profiler.start()

    def _stop(self) -> None:
        torch.cuda.profiler.stop()

    def annotate_context_manager(self, name: str) -> contextlib.AbstractContextManager:
        return torch.cuda.nvtx.range(name)


def make_worker_profiler(
    profiler_config: ProfilerConfig, trace_name: str, local_rank: int, device: torch.device
) -> WorkerProfiler:
    """The worker's profiler for ``profiler_config.profiler`` (Glassbox's own
    helper; vLLM's ``Worker.profile`` picks inline)."""
    if profiler_config.profiler == "torch":
        activities: list[Any] = ["CPU", "CUDA"] if device.type == "cuda" else ["CPU"]
        return TorchProfilerWrapper(profiler_config, trace_name, local_rank, activities)
    if profiler_config.profiler == "cuda":
        return CudaProfilerWrapper(profiler_config)
    raise ValueError(f"profiler_config.profiler={profiler_config.profiler!r} records nothing")


class FrontendProfiler:
    """The front end's CPU trace (``AsyncLLM``'s process: detokenizing, the
    HTTP handlers), one file per window named ``<host>_<pid>.async_llm``. It
    covers the whole window: it does not count engine steps.

    torch's profiler must stop on the thread that started it (stopped from
    another, it finds no session and the process may crash), and the event
    loop must not block while a trace is written: so both run on one thread
    of its own (vLLM uses ``asyncio.to_thread`` for each, any pool thread)."""

    def __init__(self, profiler_config: ProfilerConfig) -> None:
        logger.info("Front-end profiler traces go to %s", profiler_config.torch_profiler_dir)
        self.profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            with_stack=profiler_config.torch_profiler_with_stack,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                profiler_config.torch_profiler_dir,
                worker_name=f"{socket.gethostname()}_{os.getpid()}.async_llm",
                use_gzip=profiler_config.torch_profiler_use_gzip,
            ),
        )
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glassbox-profiler")
        self._running = False

    @classmethod
    def create(cls, profiler_config: ProfilerConfig) -> FrontendProfiler | None:
        """None unless the torch profiler is on for the front end too."""
        if profiler_config.profiler != "torch" or profiler_config.ignore_frontend:
            return None
        return cls(profiler_config)

    def _start(self) -> None:
        if not self._running:
            self.profiler.start()
            self._running = True

    def _stop(self) -> None:
        if self._running:
            self._running = False
            self.profiler.stop()

    async def start(self) -> None:
        await asyncio.wrap_future(self._thread.submit(self._start))

    async def stop(self) -> None:
        await asyncio.wrap_future(self._thread.submit(self._stop))

    def shutdown(self) -> None:
        """Write a window still open, then end the thread."""
        self._thread.submit(self._stop).result()
        self._thread.shutdown()

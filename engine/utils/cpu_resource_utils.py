"""How many torch threads each process uses on the CPU.

vLLM twins: ``vllm/utils/cpu_resource_utils.py`` (``get_allowed_cpu_list``,
``parse_id_list``) and ``vllm/utils/ompmultiprocessing.py``
(``OMPProcessManager``: one OpenMP thread per physical core the worker may use,
minus cores reserved for the other processes). Read it for why a 135M model on
a 2-core machine ran 2-10x slower with torch's default thread count: torch
starts one thread per logical CPU, the front end and other jobs take a core
away, and the threads spin at every barrier waiting for the one that was
descheduled.

Two processes, two rules:

  * the process that runs the model on the CPU (EngineCore: its own process by
    default, or the caller's process when EngineCore runs in-process, as in
    ``glassbox trace``) calls ``init_cpu_threads_env()`` from
    ``Worker.init_device``: it sizes torch's intra-op threads by
    ``plan_cpu_threads()`` and logs the choice once;
  * the CLI's front ends (``glassbox serve``, ``bench``, ``trace``) call
    ``limit_frontend_threads()`` before any torch work: they tokenize, serve
    HTTP and detokenize, and need no compute threads. A user's own process
    (``LLM(...)`` in a notebook) is left alone unless EngineCore runs in it.

Settings (the subset of vLLM's CPU-backend variables Glassbox supports, under
its own prefix):

  * ``GLASSBOX_CPU_OMP_THREADS_BIND`` (vLLM: ``VLLM_CPU_OMP_THREADS_BIND``):
    ``auto`` (default) -- one thread per physical core in the process's CPU
    affinity (``os.sched_getaffinity``), minus the reserved ones; ``nobind`` --
    touch nothing, in EngineCore or in the front end (torch's own default: the
    behaviour before this module); or a CPU list such as ``0-3,6`` -- EngineCore
    is confined to those CPUs and runs one thread per CPU listed.
  * ``GLASSBOX_CPU_NUM_OF_RESERVED_CPU`` (vLLM: ``VLLM_CPU_NUM_OF_RESERVED_CPU``):
    cores ``auto`` leaves to the other processes (default 1, vLLM's x86
    default; none are reserved when that would leave no core).

Simpler than vLLM: one engine, so one CPU list (vLLM's ``|``-separated lists
per rank, NUMA-node selection and ``VLLM_CPU_SIM_MULTI_NUMA`` are not
supported), and no ``LD_PRELOAD`` checks for tcmalloc / Intel OpenMP.

Differs from vLLM on purpose:
  * ``auto`` sizes the thread pool but does not pin each thread to a core
    (vLLM sets ``OMP_PLACES``/``KMP_AFFINITY`` before its worker starts): on a
    shared machine a pinned thread waits for its one core while another core is
    idle, and EngineCore's OpenMP runtime is already loaded when the worker is
    built, so per-thread placement could not be set from there.
  * Under ``auto``, an ``OMP_NUM_THREADS`` the user set is taken as the thread
    count (vLLM's CPU backend overwrites it): it is the knob users already
    know, and the benchmarks sweep thread counts with it. The front end
    therefore limits itself with ``torch.set_num_threads(1)`` and does not
    export ``OMP_NUM_THREADS=1``, which the spawned EngineCore would inherit
    and read as the user's choice.
Sessions: 04 (worker).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

OMP_THREADS_BIND_ENV = "GLASSBOX_CPU_OMP_THREADS_BIND"
RESERVED_CPU_ENV = "GLASSBOX_CPU_NUM_OF_RESERVED_CPU"
OMP_NUM_THREADS_ENV = "OMP_NUM_THREADS"
DEFAULT_RESERVED_CPUS = 1


@dataclass(frozen=True)
class CpuThreadPlan:
    """What EngineCore does with its threads: ``num_threads`` None leaves
    torch's default; ``cpus`` not None confines the process to those CPUs."""

    num_threads: int | None
    cpus: tuple[int, ...] | None
    reason: str


# The plan this process last logged: the choice is logged once, not per engine.
_logged_plan: CpuThreadPlan | None = None


def parse_id_list(raw: str, name: str) -> list[int]:
    """``"0-2,4"`` -> ``[0, 1, 2, 4]``; ``name`` is the setting the error names."""
    ids: set[int] = set()
    try:
        for part in raw.split(","):
            part = part.strip()
            if "-" in part:
                start, end = (int(x) for x in part.split("-"))
                if start > end:
                    raise ValueError
                ids.update(range(start, end + 1))
            else:
                ids.add(int(part))
    except ValueError:
        raise ValueError(
            f"{name} must be 'auto', 'nobind' or a CPU list such as '0-3,6', got {raw!r}"
        ) from None
    if any(i < 0 for i in ids):
        raise ValueError(f"{name} must list CPU ids >= 0, got {raw!r}")
    return sorted(ids)


def get_allowed_cpu_list() -> list[int]:
    """The CPUs this process may run on (``taskset``, cgroup cpusets)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_core_of(cpu: int) -> tuple[int, int]:
    """(package, core) of a logical CPU, from sysfs; the CPU itself where sysfs
    has no topology, so every CPU counts as a core of its own."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{base}/physical_package_id") as f:
            package = int(f.read())
        with open(f"{base}/core_id") as f:
            core = int(f.read())
    except (OSError, ValueError):
        return (-1, cpu)
    return (package, core)


def one_cpu_per_core(
    cpus: list[int], core_of: Callable[[int], tuple[int, int]] = physical_core_of
) -> list[int]:
    """The first logical CPU of each physical core among ``cpus``: SMT siblings
    share a core's arithmetic units, so a second thread there mostly waits (vLLM's
    auto binding on x86 keeps one logical CPU per core too)."""
    seen: set[tuple[int, int]] = set()
    chosen = []
    for cpu in sorted(cpus):
        core = core_of(cpu)
        if core not in seen:
            seen.add(core)
            chosen.append(cpu)
    return chosen


def _int_setting(environ: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}")
    return value


def bind_setting(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return (environ.get(OMP_THREADS_BIND_ENV) or "auto").strip()


def plan_cpu_threads(
    environ: Mapping[str, str] | None = None,
    allowed: list[int] | None = None,
    core_of: Callable[[int], tuple[int, int]] = physical_core_of,
    local_world_size: int = 1,
) -> CpuThreadPlan:
    """EngineCore's thread count and CPU set from the settings above (pure:
    the environment, the allowed CPUs and the topology are arguments).
    ``local_world_size``: how many tensor-parallel ranks of this machine share
    the cores; under ``auto`` each gets an equal share (at least one)."""
    environ = os.environ if environ is None else environ
    allowed = get_allowed_cpu_list() if allowed is None else sorted(allowed)
    bind = bind_setting(environ)
    # Validate both settings whatever the mode, so a typo never goes unnoticed.
    reserved = _int_setting(environ, RESERVED_CPU_ENV, 0)
    if bind == "nobind":
        return CpuThreadPlan(None, None, f"{OMP_THREADS_BIND_ENV}=nobind: torch's default")
    if bind != "auto":
        cpus = parse_id_list(bind, OMP_THREADS_BIND_ENV)
        outside = [c for c in cpus if c not in allowed]
        if outside:
            raise ValueError(
                f"{OMP_THREADS_BIND_ENV}={bind!r} names CPUs {outside} outside this "
                f"process's affinity {allowed}"
            )
        return CpuThreadPlan(len(cpus), tuple(cpus), f"{OMP_THREADS_BIND_ENV}={bind}")
    # OpenMP reads "4,2" as 4 threads at the outer level: keep the first entry.
    omp_first = {OMP_NUM_THREADS_ENV: environ.get(OMP_NUM_THREADS_ENV, "").split(",")[0]}
    omp = _int_setting(omp_first, OMP_NUM_THREADS_ENV, 1)
    if omp is not None:
        return CpuThreadPlan(omp, None, f"{OMP_NUM_THREADS_ENV}={omp}")
    cores = one_cpu_per_core(allowed, core_of)
    reserve = DEFAULT_RESERVED_CPUS if reserved is None else reserved
    if reserve >= len(cores):
        reserve = 0  # nothing would be left: use every core (vLLM does the same)
    share = f", shared by {local_world_size} ranks" if local_world_size > 1 else ""
    return CpuThreadPlan(
        max(1, (len(cores) - reserve) // local_world_size),
        None,
        f"auto: {len(cores)} physical core(s) among allowed CPUs {_spans(allowed)}, "
        f"{reserve} reserved ({RESERVED_CPU_ENV}){share}",
    )


def init_cpu_threads_env(plan: CpuThreadPlan | None = None) -> CpuThreadPlan:
    """Apply ``plan`` (default: ``plan_cpu_threads()``) to this process: the
    EngineCore side, called by the worker when the model runs on the CPU.
    vLLM's twin is the worker process's OpenMP set-up (``OMPProcessManager``)."""
    import torch

    global _logged_plan
    plan = plan_cpu_threads() if plan is None else plan
    if plan.cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, plan.cpus)
    if plan.num_threads is not None:
        torch.set_num_threads(plan.num_threads)
    if plan != _logged_plan:
        _logged_plan = plan
        logger.info(
            "CPU threads: torch uses %d thread(s) (%s)", torch.get_num_threads(), plan.reason
        )
    return plan


def limit_frontend_threads(environ: Mapping[str, str] | None = None) -> bool:
    """One torch thread in a CLI front end (``nobind`` leaves it alone). Call it
    before the first torch op: the OpenMP pool is made at the first parallel
    region. Also checks EngineCore's settings here, so a bad value fails at
    once with one line rather than from the EngineCore process. Returns
    whether the count was changed."""
    environ = os.environ if environ is None else environ
    plan_cpu_threads(environ)
    if bind_setting(environ) == "nobind":
        return False
    import torch

    torch.set_num_threads(1)
    return True


def _spans(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the form taskset and the setting use)."""
    spans: list[str] = []
    start = prev = None
    for cpu in cpus:
        if start is None:
            start = prev = cpu
        elif cpu == prev + 1:  # type: ignore[operator]
            prev = cpu
        else:
            spans.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = cpu
    if start is not None:
        spans.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(spans)

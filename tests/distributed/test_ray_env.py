"""What the Ray executor hands each actor before it builds the rank's worker:
the driver's variables (engine/ray/ray_env.py) and its node's devices
(ray_utils.worker_placement). Pure functions, no Ray needed; the live check
is test_tensor_parallel.py::test_ray_workers_get_the_drivers_variables."""

from __future__ import annotations

from engine.ray.ray_env import get_env_vars_to_copy
from engine.v1.executor.ray_utils import (
    WORKER_SPECIFIC_ENV_VARS,
    WorkerPlacement,
    worker_placement,
)

DRIVER = {
    "NCCL_NVLS_ENABLE": "0",
    "GLASSBOX_LOGGING_LEVEL": "DEBUG",
    "GLASSBOX_HOST_IP": "10.0.0.1",
    "HF_HOME": "/data/hf",
    "PYTHONHASHSEED": "0",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "HOME": "/root",
    "PATH": "/usr/bin",
}


def test_prefixed_and_named_variables_are_copied_worker_specific_ones_not() -> None:
    got = get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS, environ=DRIVER)
    assert got == {
        "GLASSBOX_LOGGING_LEVEL": "DEBUG",
        "HF_HOME": "/data/hf",
        "NCCL_NVLS_ENABLE": "0",
        "PYTHONHASHSEED": "0",
    }


def test_the_user_adds_names_and_prefixes() -> None:
    env = {
        **DRIVER,
        "GLASSBOX_RAY_EXTRA_ENV_VARS_TO_COPY": " TORCH_SYMM_MEM_DISABLE_MULTICAST, UNSET_ONE ",
        "GLASSBOX_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "NVSHMEM_",
    }
    got = get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS, environ=env)
    assert got["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert got["NVSHMEM_DISABLE_NVLS"] == "1"
    assert "UNSET_ONE" not in got  # named but not set in the driver: nothing to copy
    assert "HOME" not in got and "CUDA_VISIBLE_DEVICES" not in got
    assert get_env_vars_to_copy(additional_vars=["HOME"], environ=env)["HOME"] == "/root"


def test_one_node_two_gpus_each_rank_sees_both_and_uses_its_own() -> None:
    # Ray gave rank 0 GPU 1 and rank 1 GPU 0 (the bundles' order is Ray's choice).
    got = worker_placement([("node-a", ["1"]), ("node-a", ["0"])])
    both = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert got == [WorkerPlacement(1, 2, both), WorkerPlacement(0, 2, both)]


def test_gpu_ids_sort_as_numbers_and_nodes_are_apart() -> None:
    got = worker_placement([("a", ["10"]), ("a", ["9"]), ("b", [3]), ("a", ["2"]), ("b", [0])])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in got] == ["2,9,10"] * 2 + ["0,3"] + ["2,9,10"] + [
        "0,3"
    ]
    assert [p.local_rank for p in got] == [2, 1, 1, 0, 0]
    assert [p.local_world_size for p in got] == [3, 3, 2, 3, 2]


def test_cpu_ranks_count_in_order_per_node_and_set_no_devices() -> None:
    got = worker_placement([("a", []), ("b", []), ("a", [])])
    assert got == [WorkerPlacement(0, 2), WorkerPlacement(0, 1), WorkerPlacement(1, 2)]

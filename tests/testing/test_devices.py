"""kiln.tasks.testing.devices: detection with the override, pinning, the pool."""

from __future__ import annotations

import threading

import pytest

from kiln.core.errors import InvalidInputError
from kiln.tasks.testing.devices import DevicePool, detect_gpu_count, pin_env, skip_reason


def test_override_wins_over_detection(tmp_path):
    (tmp_path / "nvidia0").touch()
    assert detect_gpu_count({"KILN_GPU_COUNT": "4"}, dev=tmp_path, kfd=tmp_path / "none") == 4


def test_nvidia_device_nodes_are_counted(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset"):
        (tmp_path / name).touch()
    assert detect_gpu_count({}, dev=tmp_path, kfd=tmp_path / "none") == 2


def test_amd_gpus_are_counted_from_kfd_topology(tmp_path):
    for node, gpu_id in (("0", "0"), ("1", "4412"), ("2", "52340")):  # node 0 is the CPU
        (tmp_path / node).mkdir()
        (tmp_path / node / "gpu_id").write_text(gpu_id + "\n")
    assert detect_gpu_count({}, dev=tmp_path / "none", kfd=tmp_path) == 2


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_bad_override_is_a_clear_error(value):
    with pytest.raises(InvalidInputError, match=f"KILN_GPU_COUNT={value!r}"):
        detect_gpu_count({"KILN_GPU_COUNT": value})


def test_pinning_sets_both_runtimes_and_hides_gpus_from_cpu_tests():
    assert pin_env((2, 3)) == {"CUDA_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "2,3"}
    assert pin_env(()) == {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}


def test_pool_hands_out_disjoint_sets_and_refuses_when_full():
    pool = DevicePool(4)
    first, second = pool.acquire(3), pool.acquire(2)
    assert first == (0, 1, 2) and second is None
    assert pool.acquire(1) == (3,)
    pool.release(first)
    assert pool.acquire(2) == (0, 1)
    assert pool.free == 1


def test_pool_refuses_a_double_release():
    pool = DevicePool(2)
    taken = pool.acquire(1)
    pool.release(taken)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(taken)


def test_pool_never_oversubscribes_under_contention():
    pool, lock = DevicePool(3), threading.Lock()
    in_use: set[int] = set()
    errors = []

    def worker(n: int) -> None:
        for _ in range(200):
            taken = pool.acquire(n)
            if taken is None:
                continue
            with lock:
                if in_use.intersection(taken) or len(in_use) + len(taken) > 3:
                    errors.append((taken, set(in_use)))
                in_use.update(taken)
            with lock:
                in_use.difference_update(taken)
            pool.release(taken)

    threads = [threading.Thread(target=worker, args=(n,)) for n in (1, 1, 2, 3, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert pool.free == 3


def test_skip_reason_only_when_more_are_needed_than_exist():
    assert skip_reason(2, 2) is None
    assert skip_reason(0, 0) is None
    assert skip_reason(1, 0) == "needs 1 GPU, 0 available"
    assert skip_reason(4, 2) == "needs 4 GPUs, 2 available"

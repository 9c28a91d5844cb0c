"""The GPU lane: every family test gets a [cpu] and a [gpu] cell, gpu-matrix refuses a host without a GPU,
and a set whose GPU cells were all skipped does not count as run."""

import subprocess
import sys

import pytest
import torch
from test_results import VERSIONS, cell

from stackcheck import REPO_ROOT
from stackcheck.core import results


def collected(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout
    return [line for line in out.splitlines() if "::" in line]


def test_family_tests_run_in_both_lanes_and_gpu_tests_in_the_gpu_lane_only():
    ids = collected("tests/families/test_seed_scenario.py", "tests/families/test_params4bit_kwargs.py")
    assert "tests/families/test_params4bit_kwargs.py::test_offload_hook_moves_loaded_param_to_meta[cpu-gemma4]" in ids
    assert "tests/families/test_params4bit_kwargs.py::test_offload_hook_moves_loaded_param_to_meta[gpu-gemma4]" in ids
    assert "tests/families/test_seed_scenario.py::test_all_gpu_4bit_peft_generate[gpu-gemma4]" in ids
    assert not any("test_all_gpu_4bit_peft_generate[cpu" in i for i in ids)
    assert collected("-m", "not gpu", "--stackcheck-arch=gemma4", "tests/families/test_seed_scenario.py") == [
        "tests/families/test_seed_scenario.py::test_seed_device_map_names_existing_modules[cpu-gemma4]"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_gpu_matrix_without_a_gpu_is_one_line_and_exit_2():
    run = subprocess.run([sys.executable, "-m", "stackcheck", "gpu-matrix", "--sets", "seed"], cwd=REPO_ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("stackcheck: no GPU: torch"), run.stderr


def test_a_set_counts_as_run_on_the_gpu_only_when_a_gpu_cell_of_the_run_ran(tmp_path):
    path = tmp_path / "matrix.json"
    results.record_set(path, "seed", VERSIONS)
    results.record_cells(path, [cell("t[cpu]", "pass")])
    results.record_cells(path, [cell("t[gpu]", "skipped", lane="gpu", run="r2")])
    assert not results.ran_in_lane(path, "seed", "gpu")
    results.record_cells(path, [cell("u[gpu]", "known_bug", bug="shared_kv_redispatch", lane="gpu", run="r1")])
    assert results.ran_in_lane(path, "seed", "gpu")
    assert not results.ran_in_lane(path, "seed", "gpu", run="r2")  # an earlier run's GPU cell does not count for this one

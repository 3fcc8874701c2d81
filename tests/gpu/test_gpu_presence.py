"""`make test` passes on a GPU node too: tests not marked gpu choose the CPU there (tests/conftest.py hides CUDA from
them and from the commands they start).

Checked by running tests that choose a device (the DALI loader picks the GPU when CUDA is present; train.py picks
cuda:0 and the H100's datasheet peak instead of a measured one) in a pytest whose torch.cuda reports an H100
(tests/gpu/fake_gpu_plugin.py): they pass. Their twin, with TESTS_KEEP_CUDA=1 (CUDA left visible), fails, as `make test`
did on a GPU node before. A failure points to pytest_runtest_protocol in tests/conftest.py.
"""
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

DEVICE_CHOOSING_TESTS = [
    "tests/datasets/test_data_loader_dali.py::test_dali_returns_the_pytorch_batches_on_each_shard[0]",
    "tests/training/test_reliability.py::test_mfu_never_above_100_percent_when_the_measured_peak_is_low",
]


def pytest_with_a_fake_gpu(keep_cuda):
    env_prefix = ["env", "TESTS_KEEP_CUDA=1"] if keep_cuda else []
    return subprocess.run([*env_prefix, sys.executable, "-m", "pytest", "-q", "-p", "tests.gpu.fake_gpu_plugin", "-p",
                           "no:cacheprovider", *DEVICE_CHOOSING_TESTS], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.compat
@pytest.mark.multiprocess
@pytest.mark.long
def test_device_choosing_tests_pass_where_torch_sees_a_gpu():
    result = pytest_with_a_fake_gpu(keep_cuda=False)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"{len(DEVICE_CHOOSING_TESTS)} passed" in result.stdout


@pytest.mark.multiprocess
@pytest.mark.long
def test_twin_with_cuda_left_visible_they_fail():
    result = pytest_with_a_fake_gpu(keep_cuda=True)
    assert result.returncode == 1, result.stdout[-3000:]
    assert f"{len(DEVICE_CHOOSING_TESTS)} failed" in result.stdout

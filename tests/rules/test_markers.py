"""The markers `make test-fast` relies on: a test not marked `multiprocess` cannot start a process (conftest.py
refuses it, naming the test), so leaving out the multiprocess tests leaves out every slow multi-process one. A
failure here: conftest's guard no longer holds (test-fast may then start training ranks), or it refuses too much."""
import subprocess
import sys

import pytest
import torch


def test_an_unmarked_test_cannot_start_a_command():
    with pytest.raises(RuntimeError, match="starts a process: mark it @pytest.mark.multiprocess"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_an_unmarked_test_cannot_start_loader_workers():
    loader = torch.utils.data.DataLoader(list(range(4)), num_workers=1)
    with pytest.raises(RuntimeError, match="starts a process: mark it @pytest.mark.multiprocess"):
        next(iter(loader))


@pytest.mark.multiprocess
def test_a_marked_test_can():
    """Twin: the same command runs in a test marked multiprocess."""
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True,
                          check=True).stdout.strip() == "42"

"""The tensor-parallel MLP exercise (exercises/) and its checker, on 2 gloo ranks (CPU).

The solution must match the serial MLP (output, input gradient and every weight gradient to 1e-5), and the
exercise as handed out must not: its placeholders give every rank the shard of rank 0 and skip both
collectives, so the checker can fail. A failure of the first points to exercises/tp_mlp_solution.py (shards,
bias added before the sum) or to distributed/mappings.py (copy/reduce with a wrong backward); of the second,
to placeholders that became a solution, or a checker that no longer compares (exercises/check_tp_mlp.py); of
the command-line test, to the checker's printing or exit status.
"""
import os
import re
import subprocess
import sys

import pytest

from exercises.check_tp_mlp import EXERCISE, SOLUTION, TOLERANCE, check, check_modules
from tests.conftest import REPO_ROOT
from utils.errors import UserError

KEYS = {"output", "input grad", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


@pytest.fixture(scope="module")
def errors_on_two_ranks():
    """Errors of the solution and of the unmodified exercise, checked in one set of 2 processes."""
    return check_modules([SOLUTION, EXERCISE], 2)


@pytest.mark.multiprocess  # not long: it reads the ranks the exercise's twin below spawns (one xdist group)
def test_solution_matches_the_serial_mlp_on_two_ranks(errors_on_two_ranks):
    errors = errors_on_two_ranks[SOLUTION]
    assert set(errors) == KEYS
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.multiprocess
def test_unmodified_exercise_fails_the_check_on_two_ranks(errors_on_two_ranks):
    errors = errors_on_two_ranks[EXERCISE]
    # wrong output (no sum over the ranks), wrong input gradient (no sum backward), and rank 1's weight gradients
    assert errors["output"] > 1e-3 and errors["input grad"] > 1e-3, errors
    assert errors["fc1.weight"] > 1e-3, errors


@pytest.mark.parametrize("nproc", [0, 3])
def test_sizes_that_cannot_work_are_refused_before_spawning(nproc):
    with pytest.raises(UserError, match="--nproc"):
        check(SOLUTION, nproc)


@pytest.mark.multiprocess
@pytest.mark.long
def test_command_line_prints_the_tutorial_lines_and_passes():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "exercises.check_tp_mlp", "--solution", "--nproc", "2"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for quantity in ("output", "gradients"):
        found = re.search(rf"^final relative error of {quantity} in mlp: (\S+)$", result.stdout, re.M)
        assert found and float(found.group(1)) <= TOLERANCE, result.stdout
    assert result.stdout.splitlines()[-1] == "PASSED", result.stdout

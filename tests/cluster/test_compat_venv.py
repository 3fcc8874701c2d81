"""`.ci/compat_venv.sh` (`make test-compat`'s torch 2.5 venv): on a disk without room it says so in one line
before pip starts, and pip keeps no cache (a second copy of every wheel, 3 GB).  The script runs with stand-ins for
`df` and the Python it finds, so nothing is installed."""
import os
import stat
import subprocess

import pytest

pytestmark = pytest.mark.multiprocess

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, ".ci", "compat_venv.sh")

# a Python 3.10 stand-in: `-m venv DIR` makes DIR/bin/python (itself), every call is logged with PIP_NO_CACHE_DIR
FAKE_PYTHON = """#!/bin/bash
echo "$PIP_NO_CACHE_DIR|$*" >> "$CALLS"
if [ "$1" = -m ] && [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
if [ "$1" = -c ]; then echo "Python 3.10.99 torch 2.5.1"; fi
exit 0
"""

FAKE_DF = """#!/bin/bash
# df -Pk PLACE / df -P PLACE with $FREE_KB available
echo "Filesystem 1024-blocks Used Available Capacity Mounted on"
echo "/dev/fake 300000000 1 $FREE_KB 1% /fake"
"""


def _write(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path, free_gb):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _write(bin_dir / "python3.10", FAKE_PYTHON)
    _write(bin_dir / "df", FAKE_DF)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(tmp_path / "calls"), "TMPDIR": str(tmp_path),
           "FREE_KB": str(int(free_gb * 1024 * 1024)), "HOME": str(tmp_path)}
    venv = tmp_path / "venv-compat"
    result = subprocess.run(["bash", SCRIPT, str(venv), "torch==2.5.1 torchvision==0.20.1"], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return result, venv, calls


@pytest.mark.parametrize("free_gb", [2.5, 9.9])
def test_a_full_disk_is_one_line_before_pip_runs(tmp_path, free_gb):
    result, venv, calls = _run(tmp_path, free_gb)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{int(free_gb)} GB free" in lines[0] and "needs about 10 GB" in lines[0], lines
    assert not venv.exists()
    assert not [call for call in calls if "pip" in call], calls  # pip never started


def test_with_room_pip_installs_without_a_cache(tmp_path):
    """The twin: 40 GB free, the venv is made and pip runs three times, each with PIP_NO_CACHE_DIR=1."""
    result, venv, calls = _run(tmp_path, 40)
    assert result.returncode == 0, result.stderr
    pips = [call for call in calls if "-m pip install" in call]
    assert len(pips) == 3, calls
    assert all(call.startswith("1|") for call in pips), pips
    assert "torch==2.5.1 torchvision==0.20.1" in pips[1]
    rest = (venv / "requirements-rest.txt").read_text()
    assert "h5py" in rest and "torch==" not in rest

"""start_tensorboard.ipynb: the log directory it picks, and that the TensorBoard it starts really serves it.

A failure in the log-directory test points to the notebook's first code cell (the order $LOGDIR, then
$SCRATCH/dl-at-scale-training/logs, then the repository's logs/). A failure in the headless run points to the
notebook's start cell (TensorBoard not started, its address not printed, the wrong folder served) or to the
server outliving the kernel (the notebook's atexit stop). The test kills a server left running, by its process id.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import REPO_ROOT

NOTEBOOK = os.path.join(REPO_ROOT, "start_tensorboard.ipynb")
pytestmark = pytest.mark.usefixtures("in_repo_root")


def _log_dir_cell():
    with open(NOTEBOOK) as f:
        cells = json.load(f)["cells"]
    (cell,) = [c for c in cells if "log-dir" in c.get("metadata", {}).get("tags", [])]
    return "".join(cell["source"])


@pytest.mark.parametrize("env, expected", [
    ({"LOGDIR": "/somewhere/logs", "SCRATCH": "/scratch/me"}, "/somewhere/logs"),
    ({"SCRATCH": "/scratch/me"}, "/scratch/me/dl-at-scale-training/logs"),
    ({}, os.path.join(REPO_ROOT, "logs")),
])
def test_log_dir_order(monkeypatch, capsys, env, expected):
    """$LOGDIR wins, then the original's ${SCRATCH}/dl-at-scale-training/logs, then the repository's logs/."""
    for name in ("LOGDIR", "SCRATCH"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    namespace = {}
    exec(_log_dir_cell(), namespace)
    assert namespace["log_dir"] == expected
    assert f"log directory: {expected}\n" in capsys.readouterr().out


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited already
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _fetch_json(url, timeout=20, until=lambda value: True):
    """GET url as JSON, retried until `until(value)` holds (TensorBoard scans the log folder in the background)."""
    deadline = time.time() + timeout
    while True:
        with urllib.request.urlopen(url, timeout=5) as response:
            value = json.loads(response.read())
        if until(value) or time.time() > deadline:
            return value
        time.sleep(0.2)


@pytest.mark.multiprocess
def test_notebook_starts_a_serving_tensorboard_and_stops_it(tmp_path, monkeypatch):
    """Run the notebook headless with $LOGDIR set to a folder holding one tiny run: it prints a localhost address
    where TensorBoard serves that folder and lists the run with its scalar tag; when the kernel shuts down the
    server is gone."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (pip install nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="nbclient not installed (pip install nbclient)")
    pytest.importorskip("ipykernel", reason="ipykernel not installed (pip install ipykernel)")
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install tensorboard)")
    from jupyter_client.kernelspec import KernelSpecManager
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    if "python3" not in KernelSpecManager().find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix"], check=True,
                       capture_output=True)

    log_dir = tmp_path / "logs"
    writer = EventFileWriter(str(log_dir / "tiny" / "1GPU" / "00" / "logs"))  # TensorBoard's own: no torch import
    for step, value in enumerate([0.9, 0.5, 0.3]):
        writer.add_event(Event(step=step, summary=Summary(value=[Summary.Value(tag="Loss/train", simple_value=value)])))
    writer.close()
    monkeypatch.setenv("LOGDIR", str(log_dir))  # the kernel inherits this environment
    monkeypatch.delenv("SCRATCH", raising=False)
    monkeypatch.delenv("TENSORBOARD_PORT", raising=False)

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=90, kernel_name="python3",
                                     resources={"metadata": {"path": REPO_ROOT}})
    pid = None
    try:
        with client.setup_kernel():
            for index, cell in enumerate(notebook.cells):
                client.execute_cell(cell, index)
            printed = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                              for output in cell.get("outputs", []) if output.get("name") == "stdout")
            assert f"log directory: {log_dir}\n1 runs with TensorBoard events\n  tiny/1GPU/00/logs\n" in printed
            match = re.search(r"TensorBoard \(process (\d+)\) serves (.+) at (http://localhost:\d+/)\n", printed)
            assert match, printed
            pid, url = int(match.group(1)), match.group(3)
            assert match.group(2) == str(log_dir)
            assert _fetch_json(url + "data/logdir") == {"logdir": str(log_dir)}
            tags = _fetch_json(url + "data/plugin/scalars/tags", until=lambda tags: "tiny/1GPU/00/logs" in tags)
            assert list(tags) == ["tiny/1GPU/00/logs"]
            assert list(tags["tiny/1GPU/00/logs"]) == ["Loss/train"]
        deadline = time.time() + 15
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "TensorBoard outlived the notebook's kernel"
    finally:
        if pid is not None and _alive(pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tensorboard" in f.read():
                    os.kill(pid, signal.SIGKILL)

"""`bash benchmarks/gpu_session.sh` stops cleanly on Ctrl-C (#58 item 4).

Ctrl-C sends SIGINT to the terminal's foreground process group: the script, its Python and tee, but not the commands
the session runs in process groups of their own (torchrun and its ranks under --multi, each part's `timeout`). Here
each session runs in a process group of its own and gets SIGINT as a terminal would send it; every process it
started carries a marker in its environment, so that a survivor is found wherever it went (another process group or
session). Checked: exit code 130, one `error:` line saying what was stopped, the report marked "interrupted" (an
earlier session's report replaced as the session starts), no process left. Twins, each with the clean stop switched
off, leave processes behind: --multi with benchmarks/gpu_multi.py's signal handler removed, the single-GPU session
with the script's traps removed. Without the project's Python the script says which to use, in one line.
A failure points to benchmarks/gpu_session.sh or benchmarks/gpu_multi.py (interrupt_on_signals, Session.run).
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.multiprocess]
SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "gpu_session.sh")


def marked(mark):
    """[(pid, command line)] of the living processes whose environment holds SESSION_MARK=`mark`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"SESSION_MARK={mark}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # a zombie has ended
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found.append((int(pid), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            continue
    return found


def kill_all(mark):
    for pid, _ in marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def as_a_terminal_starts_it():
    """(In the session's process, before bash starts.) SIGINT and SIGQUIT back to their defaults, as a terminal's
    foreground job has them. A command a non-interactive shell starts in the background (`make test-long &`, `nohup
    ... &`) inherits them ignored, and neither bash (a signal ignored at its start cannot be trapped) nor Python (no
    KeyboardInterrupt) would then stop on Ctrl-C: the tests below would fail when the suite itself runs in the
    background, and pass in the foreground."""
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def start(script, args, tmp_path, python=sys.executable):
    mark = uuid.uuid4().hex
    env = dict(os.environ, PYTHON=python, SESSION_MARK=mark, MULTI_WORK=str(tmp_path / "work"))
    process = subprocess.Popen(["bash", script, str(tmp_path / "out"), *args], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=as_a_terminal_starts_it)
    return process, mark


def wait_until(condition, seconds, process):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        if process.poll() is not None:
            raise AssertionError(f"the session ended first: {process.communicate()}")
        time.sleep(0.2)
    raise AssertionError("what the test waits for did not come")


def ctrl_c(process):
    """SIGINT to the session's process group, as a terminal sends it."""
    os.killpg(process.pid, signal.SIGINT)


def survivors(mark, seconds=5.0):
    """The marked processes still alive `seconds` after the session ended (reaping takes a moment)."""
    deadline = time.monotonic() + seconds
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    return marked(mark)


def ranks_running(mark):
    return any("train.py" in command for _, command in marked(mark))


def stale_report(out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "multi_gpu.json"), "w") as f:
        json.dump({"status": "done", "parts": {"exactness": {"ok": True}}}, f)


@pytest.mark.long
def test_ctrl_c_stops_the_multi_rehearsal_and_marks_its_report(tmp_path):
    stale_report(tmp_path / "out")
    process, mark = start(SCRIPT, ["--multi", "--tiny", "--allow-cpu", "--parts", "exactness"], tmp_path)
    try:
        wait_until(lambda: ranks_running(mark), 300, process)
        ctrl_c(process)
        out, err = process.communicate(timeout=120)
        left = survivors(mark)
    finally:
        kill_all(mark)
    assert process.returncode == 130, (out, err)
    errors = [line for line in (out + err).splitlines() if line.startswith("error: ")]  # the log merges both
    assert len(errors) == 1, out + err
    assert errors[0].startswith("error: interrupted by SIGINT: stopped exact_serial (python train.py"), errors
    assert "every process it started, in part exactness" in errors[0] and "Traceback" not in out + err
    with open(tmp_path / "out" / "multi_gpu.json") as f:
        report = json.load(f)
    assert report["status"] == "interrupted" and report["parts"]["exactness"]["status"] == "interrupted"
    assert left == [], left


@pytest.mark.long
def test_twin_without_the_handler_the_ranks_outlive_the_multi_rehearsal(tmp_path):
    wrapper = tmp_path / "python"
    wrapper.write_text(f"""#!/bin/bash
if [[ $1 == -m && $2 == benchmarks.gpu_multi ]]; then
    shift 2
    exec {sys.executable} -c "import sys, benchmarks.gpu_multi as g; g.interrupt_on_signals = lambda: None; \
sys.exit(g.main(sys.argv[1:]))" "$@"
fi
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    process, mark = start(SCRIPT, ["--multi", "--tiny", "--allow-cpu", "--parts", "exactness"], tmp_path,
                          python=str(wrapper))
    try:
        wait_until(lambda: ranks_running(mark), 300, process)
        ctrl_c(process)
        process.communicate(timeout=120)
        left = survivors(mark, seconds=2.0)
    finally:
        kill_all(mark)
    assert any("train.py" in command or "torch.distributed.run" in command for _, command in left), left


def single_session_in_a_part(tmp_path, script, grace):
    """The single-GPU session's check (--tiny --allow-cpu), Ctrl-C'd once its UNet rows run; (process, mark, out,
    err, the session's processes alive once the script ended, or `grace` seconds after Ctrl-C if it had not)."""
    process, mark = start(script, ["--tiny", "--allow-cpu"], tmp_path)
    try:
        wait_until(lambda: any("gpu_table" in command and "--rows" in command for _, command in marked(mark)), 300,
                   process)
        time.sleep(2)  # its training runs under way
        ctrl_c(process)
        try:  # the script itself (a part left running would keep its output pipe open)
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass  # still running: what is left is counted below
        left = survivors(mark)
    finally:
        kill_all(mark)
    out, err = process.communicate(timeout=60)
    return process, mark, out, err, left


@pytest.mark.long
def test_ctrl_c_stops_the_single_gpu_session_and_marks_its_report(tmp_path):
    process, _, out, err, left = single_session_in_a_part(tmp_path, SCRIPT, grace=45)
    assert process.returncode == 130, (out, err)
    errors = [line for line in (out + err).splitlines() if line.startswith("error: ")]  # the log merges both
    assert errors == [f'error: interrupted by SIGINT: stopped the part "UNet rows" and every process it started; '
                      f'{tmp_path / "out"}/session.json marks it "interrupted"'], out + err
    with open(tmp_path / "out" / "session.json") as f:
        report = json.load(f)
    assert report["status"] == "interrupted" and report["parts"][-1] == {"part": "UNet rows", "status": "interrupted"}
    assert left == [], left


@pytest.mark.long
def test_twin_without_the_traps_the_part_outlives_the_single_gpu_session(tmp_path):
    with open(SCRIPT) as f:
        text = f.read()
    trapless = text.replace("    trap 'interrupted INT' INT\n    trap 'interrupted TERM' TERM\n", "")
    assert trapless != text
    script = tmp_path / "gpu_session_without_traps.sh"
    script.write_text(trapless)
    process, mark, out, err, left = single_session_in_a_part(tmp_path, str(script), grace=5)
    # 5 s after Ctrl-C the part still runs (its four rows take longer): the script waits for it, deaf to Ctrl-C
    assert any("gpu_table" in command for _, command in left), (left, out, err)


def test_without_the_projects_python_it_says_which_to_use(tmp_path):
    """A Python without torch (here the venv's own, without its site-packages) is refused in one line."""
    bare = tmp_path / "python"
    bare.write_text(f"#!/bin/bash\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    for args in ([], ["--multi", "--tiny", "--allow-cpu"]):
        done = subprocess.run(["bash", SCRIPT, str(tmp_path / "out"), *args], cwd=REPO_ROOT, capture_output=True,
                              text=True, env=dict(os.environ, PYTHON=str(bare)), timeout=60)
        assert done.returncode == 2, done
        assert done.stderr.splitlines() == [
            f"error: '{bare}' cannot import torch, h5py and yaml (it is not the project's Python); run with the "
            f"project's venv: PYTHON=.venv/bin/python bash benchmarks/gpu_session.sh {tmp_path / 'out'}"
            + "".join(f" {arg}" for arg in args)], done.stderr

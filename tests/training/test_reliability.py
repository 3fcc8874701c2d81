"""What goes wrong in real runs: nan losses, two runs in one directory, a kill during validation, a missing peer,
bad files and flags, a full disk, a killed rank under torchrun. Each test fails on the code before the fix.

A failure points to lifecycle/run.py (checkpoints), loop/meter.py, lifecycle/run_lock.py,
utils/rendezvous.py, lifecycle/checkpoint.py, utils/YParams.py, lifecycle/cli.py, the data loaders, or train.py's loop.
"""
import errno
import gc
import os
import re
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import torch
from ruamel.yaml import YAML
from torch.utils.tensorboard import SummaryWriter

import lifecycle.checkpoint
import lifecycle.run
import loop.flops
import train
from lifecycle.checkpoint import DamagedCheckpoint, load_checkpoint, previous_path
from sample_data import write_era5
from tests.conftest import REPO_ROOT, free_port, run_command, run_ranks, scalar_points
from utils.errors import UserError
from utils.YParams import YParams

pytestmark = pytest.mark.usefixtures("in_repo_root")


@pytest.fixture
def small_era5(tmp_path):
    """A private copy of small ERA5 data (tests here damage it): 1 train year of 24 steps = 6 steps per epoch."""
    return str(write_era5(tmp_path / "era5", height=16, width=32, steps_per_year=24, train_years=1, valid_years=1,
                          test_years=1, verbose=False))


def tiny(data, expdir, *flags):
    return ["--config", "tiny", "--data_dir", str(data), "--expdir", str(expdir), *flags]


def run_dir_of(expdir):
    return os.path.join(str(expdir), "tiny", "1GPU", "00")


def fails_with(capsys, argv, pattern):
    """train.main(argv) exits 2 with exactly one `error:` line matching `pattern`."""
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err_lines) == 1 and re.search(pattern, err_lines[0]), err_lines
    return err_lines[0]


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(small_era5, tmp_path, capsys):
    train.main(tiny(small_era5, tmp_path, "--num_iters", "10"))
    checkpoint = os.path.join(run_dir_of(tmp_path), "checkpoints", "ckpt.pt")
    good = open(checkpoint, "rb").read()
    for path in (tmp_path / "era5" / "train").glob("*.h5"):  # corrupt data: every training sample is nan
        with h5py.File(path, "r+") as f:
            f["fields"][...] = np.nan
    line = fails_with(capsys, tiny(small_era5, tmp_path, "--num_iters", "20"),
                      r"training loss is not finite \(nan or inf\) at iteration 11 \(rank 0's batch: epoch 2, step 4: "
                      r".*\.h5 time steps .*\); stopped without saving, so the checkpoints are as they were "
                      rf"\(starting again resumes from '{re.escape(checkpoint)}' \(iteration 10\)\)")
    assert "2000.h5" in line  # the file the bad samples came from
    assert open(checkpoint, "rb").read() == good and not os.path.exists(checkpoint + ".tmp")


@pytest.mark.multiprocess
def test_second_run_in_the_same_directory_is_refused_until_the_first_ends(small_era5, tmp_path, capsys):
    run_dir = run_dir_of(tmp_path)
    os.makedirs(run_dir)
    # the holder forks a child (as a loader worker is): killing the holder alone must free the directory
    holder = subprocess.Popen([sys.executable, "-c", "import os, time; "
                               "from lifecycle.run_lock import RunDirectoryLock; "
                               f"RunDirectoryLock({run_dir!r}); child = os.fork(); child or time.sleep(60); "
                               "print('locked', child, flush=True); time.sleep(120)"],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        word, child = holder.stdout.readline().split()
        assert word == "locked"
        fails_with(capsys, tiny(small_era5, tmp_path, "--num_iters", "2"),
                   rf"run directory '.*' is in use by process {holder.pid} on .*; wait for that run to end")
        holder.send_signal(signal.SIGKILL)  # a killed run: its lock must not block the next start
        holder.wait()
        train.main(tiny(small_era5, tmp_path, "--num_iters", "2"))  # while the forked child still lives
    finally:
        holder.kill()
        if child:
            os.kill(int(child), signal.SIGKILL)
    train.main(tiny(small_era5, tmp_path, "--num_iters", "4"))  # the lock was released at the end of the last run
    assert torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)["iteration"] == 4


def test_kill_during_validation_loses_no_tensorboard_points(small_era5, tmp_path, monkeypatch):
    """Killed while validating epoch 2 (a checkpoint was due at its end): the restarted run redoes epoch 2 and
    its points, and TensorBoard shows each point once, as an uninterrupted run does."""
    flags = ["--num_iters", "18", "--checkpoint_interval", "6"]
    train.main(tiny(small_era5, tmp_path / "whole", *flags))
    calls = []
    real_validate = train.validate

    def dying_validate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            for writer in [o for o in gc.get_objects() if type(o) is SummaryWriter]:
                writer.flush()  # epoch 2's training points reach the disk before the kill: stale points to purge
            raise KeyboardInterrupt  # the job is killed during epoch 2's validation
        return real_validate(*args, **kwargs)

    monkeypatch.setattr(train, "validate", dying_validate)
    with pytest.raises(KeyboardInterrupt):
        train.main(tiny(small_era5, tmp_path / "split", *flags))
    monkeypatch.setattr(train, "validate", real_validate)
    train.main(tiny(small_era5, tmp_path / "split", *flags))
    whole, split = scalar_points(run_dir_of(tmp_path / "whole")), scalar_points(run_dir_of(tmp_path / "split"))
    assert sorted(split) == sorted(whole)
    for tag, points in whole.items():  # the same steps, each once, and the same values
        assert [step for step, _ in split[tag]] == [step for step, _ in points], tag
        assert [value for _, value in split[tag]] == pytest.approx([value for _, value in points], rel=1e-6), tag
    assert 12 in [step for step, _ in split["Loss/valid"]]


@pytest.mark.multiprocess
def test_missing_peer_times_out_with_one_line(tmp_path):
    port = free_port()
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    start = time.time()
    result = subprocess.run([sys.executable, "train.py", "--config", "tiny", "--dist_timeout", "2", "--expdir",
                             str(tmp_path)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and time.time() - start < 60
    assert f"rank 0 waiting for 2 ranks at 127.0.0.1:{port} (timeout 2 s" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: rank 0 could not gather 2 ranks at 127.0.0.1:{port} within 2 s") and "1/2" in last
    assert "Traceback" not in result.stderr


@pytest.mark.multiprocess
def test_rank_without_rank0_gives_up_with_one_line():
    env = dict(os.environ, WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = subprocess.run([sys.executable, "train.py", "--config", "tiny", "--dist_timeout", "1"], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.search(r"^error: rank 1 waited 1 s for rank 0 at 127\.0\.0\.1:\d+ and nobody answered",
                     result.stderr, re.M)


def test_mfu_never_above_100_percent_when_the_measured_peak_is_low(small_era5, tmp_path, monkeypatch):
    """A loaded machine measures a low start-up peak; MFU must not read 238% then."""
    monkeypatch.setattr(loop.flops, "measure_matmul_peak", lambda *args, **kwargs: 1e3)  # 1 kFLOP/s
    train.main(tiny(small_era5, tmp_path, "--num_iters", "6"))
    log = open(os.path.join(run_dir_of(tmp_path), "out.log")).read()
    mfu = [float(m) for m in re.findall(r"MFU (\d+\.\d)%", log)]
    assert mfu == [100.0]  # capped: the peak was raised to the throughput the run reached
    assert "MFU is approximate against a peak measured on this machine" in log


def write_yaml(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case, pattern", [
    ("yaml_syntax", r"YAML config file '.*bad\.yaml' has a syntax error at line 3, column \d+"),
    ("yaml_empty", r"YAML config file '.*bad\.yaml' holds no configs"),
    ("other_yaml", r"config 'bs128' is in config/ResNet50\.yaml, not config/ViT\.yaml; add --yaml_config "
                   r"config/ResNet50\.yaml"),
    # a named entry that is not a mapping, or lacks a key the run reads: before, a TypeError or AttributeError
    # traceback and exit 1
    ("yaml_not_a_mapping", r"config 'tiny' in .*bad\.yaml is 5, not a mapping of keys; write it as `tiny:` followed by "
                           r"indented `key: value` lines"),
    ("yaml_empty_config", r"config 'tiny' in .*bad\.yaml is empty; give it its keys"),
    ("yaml_missing_key", r"config 'tiny' in .*bad\.yaml has no key 'global_batch_size', which this run reads; add "
                         r"`global_batch_size: \.\.\.` to it; config/ViT\.yaml's tiny sets it: 4$"),
    ("expdir", r"cannot create the run directory '.*' \(.*\); choose a writable --expdir"),
    ("workers", r"num_data_workers is -1; it must be a whole number >= 0"),
    ("stop_at_iter", r"--stop_at_iter is 0; give the iteration to stop after"),
    ("checkpoint_interval", r"checkpoint_interval is -1; it must be a whole number >= 0 \(0: checkpoint only"),
    ("truncated", r"HDF5 file '.*2000\.h5' cannot be read \(.*\); copy it again or regenerate the data"),
])
def test_bad_input_is_one_line_not_a_traceback(small_era5, tmp_path, capsys, case, pattern):
    argv = tiny(small_era5, tmp_path, "--num_iters", "2")
    if case == "yaml_syntax":
        argv += ["--yaml_config", write_yaml(tmp_path, "tiny:\n  lr: [1, 2\n  depth: 3\n")]
    elif case == "yaml_empty":
        argv += ["--yaml_config", write_yaml(tmp_path, "# nothing yet\n")]
    elif case == "other_yaml":
        argv += ["--config", "bs128"]
    elif case == "yaml_not_a_mapping":
        argv += ["--yaml_config", write_yaml(tmp_path, "tiny: 5\n")]
    elif case == "yaml_empty_config":
        argv += ["--yaml_config", write_yaml(tmp_path, "tiny:\nother:\n  lr: 1\n")]
    elif case == "yaml_missing_key":
        keys = dict(YParams("config/ViT.yaml", "tiny").params)
        del keys["global_batch_size"]
        with open(write_yaml(tmp_path, ""), "w") as f:
            YAML().dump({"tiny": keys}, f)
        argv += ["--yaml_config", f.name]
    elif case == "expdir":
        (tmp_path / "a_file").write_text("")
        argv += ["--expdir", str(tmp_path / "a_file" / "runs")]
    elif case == "workers":
        argv += ["--num_data_workers", "-1"]
    elif case == "stop_at_iter":
        argv += ["--stop_at_iter", "0"]
    elif case == "checkpoint_interval":
        argv += ["--checkpoint_interval", "-1"]
    elif case == "truncated":
        path = tmp_path / "era5" / "train" / "2000.h5"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    fails_with(capsys, argv, pattern)


def test_checkpoint_that_does_not_fit_the_config_names_the_parameter(small_era5, tmp_path, capsys):
    train.main(tiny(small_era5, tmp_path, "--num_iters", "2"))
    original = open(os.path.join(REPO_ROOT, "config", "ViT.yaml")).read()
    tiny_block = "tiny:\n  <<: *demo\n  img_size: [16, 32]\n  embed_dim: 32\n"
    assert tiny_block in original
    wider = write_yaml(tmp_path, original.replace(tiny_block, tiny_block.replace("embed_dim: 32", "embed_dim: 48")))
    fails_with(capsys, tiny(small_era5, tmp_path, "--yaml_config", wider, "--num_iters", "4"),
               r"checkpoint '.*ckpt\.pt' holds 'pos_embed' of shape \(1, 32, 32\), but this config's model has "
               r"\(1, 32, 48\)")


@pytest.mark.parametrize("how", ["oserror", "torch_save", "zip_writer"])
def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(small_era5, tmp_path, capsys, monkeypatch, how):
    """A write that fails with ENOSPC: as an OSError, as torch.save reports writing into /dev/full (an OSError on
    torch 2.5 and 2.14), and as its zip writer reports a real full file system ("unexpected pos", a RuntimeError that
    says nothing of the disk). One line saying the disk is full, naming the folder and its free space; both
    checkpoints and no temporary."""
    train.main(tiny(small_era5, tmp_path, "--num_iters", "4", "--checkpoint_interval", "2"))
    checkpoint = os.path.join(run_dir_of(tmp_path), "checkpoints", "ckpt.pt")
    previous = checkpoint.replace("ckpt.pt", "ckpt_previous.pt")
    good, good_previous = open(checkpoint, "rb").read(), open(previous, "rb").read()
    real_save = torch.save

    def full_disk(obj, f):
        if how == "torch_save":  # torch's own error for the write that fails (its text varies with the version)
            full = open("/dev/full", "wb", buffering=0)
            try:
                real_save(obj, full)
            finally:
                full.close()
        f.write(b"the first megabytes of a checkpoint")
        if how == "zip_writer":  # what torch.save says when a real file system fills up (a 1 MB tmpfs, torch 2.14)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lifecycle.checkpoint.torch, "save", full_disk)
    # torch's zip writer says only "[enforce fail at inline_container.cc:...] . unexpected pos": named for what it is
    reason = "the disk is full or over its quota: [^;]+" if how == "zip_writer" else "No space left on device"
    fails_with(capsys, tiny(small_era5, tmp_path, "--num_iters", "8", "--checkpoint_interval", "2"),
               r"writing checkpoint '.*ckpt\.pt' failed \(" + reason + r"; [0-9.]+ GB free in '.*checkpoints'\); "
               r"the partial file was removed and the previous checkpoint is kept")
    assert open(checkpoint, "rb").read() == good and open(previous, "rb").read() == good_previous
    assert not os.path.exists(checkpoint + ".tmp")


def fake_free_space(monkeypatch, run_dir):
    """shutil.disk_usage reporting 12 MB free on the file system of `run_dir` (and of the folders in it) and 50 GB
    everywhere else (the working directory): a message that names the wrong folder shows the wrong number."""
    import shutil

    def disk_usage(folder):
        inside = os.path.abspath(folder).startswith(os.path.abspath(str(run_dir)))
        return shutil._ntuple_diskusage(100e9, 0, 12e6 if inside else 50e9)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def test_disk_full_at_start_is_one_line_and_leaves_no_lock(small_era5, tmp_path, capsys, monkeypatch):
    """The run lock is the first file a run writes: a full disk there is one line naming run.lock and the free space
    of the run directory's file system (not the working directory's), and no run.lock stays behind. The stand-in
    behaves as CPython's buffered file on a full disk (checked on a full 64 kB tmpfs): the write waits in the buffer,
    flush() fails, and close() tries the flush again and fails too, and neither error names the file. Before the
    fix, the second failure escaped as an OSError without a file name ("error: a write failed: ... 50.0 GB free in
    '<working directory>'") and left run.lock behind."""
    import lifecycle.run_lock

    class FullDiskFile:
        def __init__(self, path, mode):
            self.file = open(path, mode)
            self.pending = False

        def write(self, text):
            self.pending = True  # in the buffer
            return len(text)

        def flush(self):
            if self.pending:
                raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.file.close()
            self.flush()  # the buffer is flushed once more on close

        def __getattr__(self, name):
            return getattr(self.file, name)

        def fileno(self):
            return self.file.fileno()

    run_dir = run_dir_of(tmp_path)
    fake_free_space(monkeypatch, tmp_path)
    monkeypatch.setattr(lifecycle.run_lock, "open", FullDiskFile, raising=False)
    fails_with(capsys, tiny(small_era5, tmp_path, "--num_iters", "2"),
               rf"^error: writing the run lock '{re.escape(run_dir)}/run\.lock' failed \(No space left on device; "
               rf"12\.0 MB free in '{re.escape(run_dir)}'\); free disk space \(or raise the quota\), or choose another "
               r"--expdir$")
    assert not os.path.exists(os.path.join(run_dir, "run.lock"))


def test_disk_full_creating_the_run_directory_names_its_file_system(small_era5, tmp_path, capsys, monkeypatch):
    """A full disk when the run directory is made: one line with the free space of the file system it would be on
    (its nearest existing parent, here --expdir). Twin: another failure (a file in the way) keeps its own words."""
    import lifecycle.run

    def full_disk(path, exist_ok=False):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    fake_free_space(monkeypatch, tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(lifecycle.run.os, "makedirs", full_disk)
        fails_with(capsys, tiny(small_era5, tmp_path, "--num_iters", "2"),
                   rf"cannot create the run directory '{re.escape(run_dir_of(tmp_path))}' \(No space left on device; "
                   r"12\.0 MB free on its file system\); free disk space")
    (tmp_path / "a_file").write_text("")
    fails_with(capsys, tiny(small_era5, tmp_path / "a_file", "--num_iters", "2"),
               r"cannot create the run directory '.*' \(Not a directory\); choose a writable --expdir")


def test_free_space_below_a_gigabyte_is_in_megabytes(tmp_path, monkeypatch):
    """A nearly full disk says how much is left ('40.0 MB free', not '0.0 GB free'); a folder not made yet is
    measured on its nearest existing parent. Twin: above 1 GB, GB."""
    import shutil

    from utils.errors import free_space
    sizes = iter([40e6, 0, 2.5e9])
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(1e12, 0, next(sizes)))
    assert free_space(str(tmp_path / "not" / "made")) == "40.0 MB free"
    assert free_space(str(tmp_path)) == "0.0 MB free"
    assert free_space(str(tmp_path)) == "2.5 GB free"


def test_a_signal_before_the_first_step_says_what_the_start_wrote(small_era5, tmp_path, monkeypatch):
    """A signal received before start_run (here SIGUSR1 to this process, recorded from the start as a training
    script's first line does): the run stops with exit 75, and its line names every entry the start left in the run
    directory (run.lock, out.log, an empty logs/) and no checkpoint. Before the fix, the line said "nothing was
    written" beside those three."""
    from lifecycle import signals
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # record_from_start wraps it
    signals.record_from_start()
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.raises(SystemExit) as stop:
        train.main(tiny(small_era5, tmp_path, "--num_iters", "2"))
    assert stop.value.code == signals.EXIT_CODE
    run_dir = run_dir_of(tmp_path)
    assert sorted(os.listdir(run_dir)) == ["logs", "out.log", "run.lock"]
    assert os.listdir(os.path.join(run_dir, "logs")) == []
    (line,) = [line for line in open(os.path.join(run_dir, "out.log")) if "stopped by" in line]
    assert ("stopped by SIGUSR1 during start-up, before the first step; no checkpoint was written (this start wrote "
            f"only run.lock, out.log and logs/ in '{os.path.abspath(run_dir)}'), starting again resumes here") in line


def test_disk_full_in_tensorboard_or_the_log_file_is_one_line(small_era5, tmp_path, capsys, monkeypatch):
    """Writers without a message of their own: TensorBoard's event file filling up stops the run with one line that
    says the disk is full, naming the file, folder and free space (no traceback); the log file filling up is said
    once (not a traceback per record) and training goes on."""
    from torch.utils.tensorboard import SummaryWriter

    from utils.logging_utils import OneLineErrorFileHandler

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device", os.path.join(self.log_dir, "events.out.tfevents.1"))

    with monkeypatch.context() as patch:
        patch.setattr(SummaryWriter, "add_scalar", full_disk)
        fails_with(capsys, tiny(small_era5, tmp_path / "tb", "--num_iters", "2"),
                   r"writing '.*logs/events\.out\.tfevents\.1' failed: the disk is full or over its quota \(No space "
                   r"left on device; [0-9.]+ GB free in '.*logs'\); free disk space")

    def full_disk_write(self, record):
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            self.handleError(record)

    monkeypatch.setattr(OneLineErrorFileHandler, "emit", full_disk_write)
    train.main(tiny(small_era5, tmp_path / "log", "--num_iters", "2"))
    errors = [line for line in capsys.readouterr().err.splitlines() if "Logging error" in line or "error:" in line]
    assert len(errors) == 1 and re.match(r"error: writing '.*out\.log' failed: the disk is full .*; logging goes on "
                                         r"to the console only", errors[0]), errors
    assert os.path.isfile(os.path.join(run_dir_of(tmp_path / "log"), "checkpoints", "ckpt.pt"))


def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one(small_era5, tmp_path, capsys):
    """Zeroed or cut short, the newest checkpoint is reported in one line and the run goes on from the one
    before it, to the same weights as an uninterrupted run; with both damaged the run stops (never silently from
    scratch). A checkpoint that loads but was not written by train.py keeps its own message."""
    flags = ("--num_iters", "12", "--checkpoint_interval", "4")
    train.main(tiny(small_era5, tmp_path / "whole", *flags))
    whole = torch.load(os.path.join(run_dir_of(tmp_path / "whole"), "checkpoints", "ckpt.pt"), weights_only=True)
    train.main(tiny(small_era5, tmp_path, "--num_iters", "12", "--checkpoint_interval", "4", "--stop_at_iter", "8"))
    folder = os.path.join(run_dir_of(tmp_path), "checkpoints")
    newest, previous = os.path.join(folder, "ckpt.pt"), os.path.join(folder, "ckpt_previous.pt")
    assert torch.load(previous, weights_only=True)["iteration"] == 4
    with open(newest, "r+b") as f:  # a write cut short
        f.truncate(os.path.getsize(newest) // 2)
    capsys.readouterr()
    train.main(tiny(small_era5, tmp_path, *flags))
    assert re.search(r"checkpoint '.*ckpt\.pt' cannot be read \(.*\): it is damaged, incomplete .*; resuming "
                     r"from the previous checkpoint '.*ckpt_previous\.pt' \(iteration 4\)", capsys.readouterr().err)
    resumed = torch.load(newest, weights_only=True)
    assert resumed["iteration"] == 12
    for name, tensor in whole["model"].items():
        assert torch.allclose(resumed["model"][name], tensor, rtol=1e-5, atol=1e-7), name
    # both damaged: one line, no training from scratch
    for path in (newest, previous):
        with open(path, "r+b") as f:
            f.write(bytes(os.path.getsize(path)))  # zeroed
    fails_with(capsys, tiny(small_era5, tmp_path, "--num_iters", "16"),
               r"it is damaged, incomplete .*, and the previous one, '.*ckpt_previous\.pt', is damaged or incomplete "
               r"too; start a new --run_num")


@pytest.mark.parametrize("moved_aside", [True, False])
def test_after_falling_back_the_next_save_keeps_the_good_checkpoint_as_the_previous(small_era5, tmp_path, capsys,
                                                                                    monkeypatch, moved_aside):
    """Resumed from ckpt_previous.pt because ckpt.pt was damaged, the run's next save must not rotate the damaged
    file into ckpt_previous.pt (two copies, one damaged: a kill in the next save would lose the run). The damaged
    file is moved to ckpt.pt.damaged; the twin, with the move switched off, ends with a damaged previous one."""
    train.main(tiny(small_era5, tmp_path, "--num_iters", "12", "--checkpoint_interval", "4", "--stop_at_iter", "8"))
    folder = os.path.join(run_dir_of(tmp_path), "checkpoints")
    newest, previous = os.path.join(folder, "ckpt.pt"), os.path.join(folder, "ckpt_previous.pt")
    with open(newest, "r+b") as f:  # a write cut short
        f.truncate(os.path.getsize(newest) // 2)
    if not moved_aside:
        monkeypatch.setattr(lifecycle.checkpoint, "damaged_path", lambda path: path)  # os.replace onto itself: no move
    capsys.readouterr()
    train.main(tiny(small_era5, tmp_path, "--num_iters", "12", "--checkpoint_interval", "4", "--stop_at_iter", "6"))
    err = capsys.readouterr().err
    assert torch.load(newest, weights_only=True)["iteration"] == 6
    if moved_aside:
        assert re.search(r"resuming from the previous checkpoint '.*ckpt_previous\.pt' \(iteration 4\); the damaged "
                         r"file is kept as '.*ckpt\.pt\.damaged'", err), err
        assert load_checkpoint(previous)["iteration"] == 4
        assert os.path.getsize(newest + ".damaged") < os.path.getsize(previous)
    else:
        with pytest.raises(DamagedCheckpoint):
            load_checkpoint(previous)


@pytest.mark.parametrize("looked_up", [True, False])
def test_a_checkpoint_the_file_system_cannot_look_up_stops_the_run_instead_of_starting_over(
        small_era5, tmp_path, capsys, monkeypatch, looked_up):
    """On a restart, a stat of the checkpoints that fails with EIO (an evicted Lustre client, a failing disk) is not
    "no checkpoint": the run stops in one line and the checkpoints stay. The twin takes the error for a missing file
    (os.path.isfile, as before): the run starts again from iteration 0 and its first save pushes iteration 8 out."""
    flags = ("--num_iters", "12", "--checkpoint_interval", "4")
    train.main(tiny(small_era5, tmp_path, *flags, "--stop_at_iter", "8"))
    newest = os.path.join(run_dir_of(tmp_path), "checkpoints", "ckpt.pt")
    real_stat = os.stat

    def failing_stat(path, *args, **kwargs):
        if os.path.basename(os.fspath(path)) in ("ckpt.pt", "ckpt_previous.pt"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return real_stat(path, *args, **kwargs)

    if not looked_up:
        monkeypatch.setattr(lifecycle.run, "has_checkpoint",
                            lambda path: os.path.isfile(path) or os.path.isfile(previous_path(path)))
    monkeypatch.setattr(os, "stat", failing_stat)
    capsys.readouterr()
    if looked_up:
        fails_with(capsys, tiny(small_era5, tmp_path, *flags, "--stop_at_iter", "4"),
                   r"checkpoint '.*ckpt\.pt' cannot be looked up \(Input/output error\); nothing was started, the "
                   r"checkpoints are as they were; the file system under .* is failing")
    else:
        train.main(tiny(small_era5, tmp_path, *flags, "--stop_at_iter", "4"))
    monkeypatch.setattr(os, "stat", real_stat)
    assert torch.load(newest, weights_only=True)["iteration"] == (8 if looked_up else 4)


def test_a_torch_file_not_written_by_train_py_is_named_as_such(small_era5, tmp_path, capsys):
    """Twin of the damaged case: a readable torch file without a checkpoint's contents."""
    foreign = tmp_path / "weights.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    fails_with(capsys, tiny(small_era5, tmp_path, "--num_iters", "2", "--resume", str(foreign)),
               r"'.*weights\.pt' is not a checkpoint written by train\.py")


@pytest.mark.parametrize("content", ["text", "torch_file"])
def test_a_run_directorys_ckpt_pt_that_is_no_checkpoint_says_what_to_do(small_era5, tmp_path, capsys, content):
    """checkpoints/ckpt.pt is not a checkpoint (any text; a torch file of something else) and there is no previous
    one: one line saying so and what to do here (move it away, or a new --run_num), not --resume, which the run
    directory's own checkpoint would win over. Twin: the foreign file given to --resume (above) says --resume."""
    path = os.path.join(run_dir_of(tmp_path), "checkpoints", "ckpt.pt")
    os.makedirs(os.path.dirname(path))
    if content == "text":
        with open(path, "w") as f:
            f.write("not a checkpoint\n")
    else:
        torch.save({"weights": torch.zeros(3)}, path)
    line = fails_with(capsys, tiny(small_era5, tmp_path, "--num_iters", "2"), r"ckpt\.pt.*move it away to train "
                      r"from the beginning here, or start a new --run_num")
    assert "--resume" not in line


def test_non_finite_validation_stops_the_run_naming_the_iteration(small_era5, tmp_path, capsys):
    """nan in the validation data: one line naming the iteration and the checkpoint a restart resumes from; nothing
    saved over it.
    Twin: the same run on clean data finishes (the check is not always on)."""
    train.main(tiny(small_era5, tmp_path / "clean", "--num_iters", "6"))
    train.main(tiny(small_era5, tmp_path, "--num_iters", "6", "--checkpoint_interval", "3", "--stop_at_iter", "3"))
    checkpoint = os.path.join(run_dir_of(tmp_path), "checkpoints", "ckpt.pt")
    good = open(checkpoint, "rb").read()
    for path in (tmp_path / "era5" / "valid").glob("*.h5"):
        with h5py.File(path, "r+") as f:
            f["fields"][...] = np.nan
    fails_with(capsys, tiny(small_era5, tmp_path, "--num_iters", "6"),
               r"the validation loss is not finite \(nan or inf\) at iteration 6; stopped without saving, so the "
               rf"checkpoints are as they were \(starting again resumes from '{re.escape(checkpoint)}' "
               r"\(iteration 3\)\)")
    assert open(checkpoint, "rb").read() == good


def test_error_raised_in_a_loader_worker_is_still_one_line():
    """A UserError, and a key the config lacks (utils/YParams.MissingKey, a subclass built from its key), raised in a
    loader worker: re-raised by the DataLoader with the worker's traceback in its text, said as the message alone.
    Before the fix, the MissingKey came back as "utils.YParams.MissingKey: config ..." (the class name kept)."""
    from torch._utils import ExceptionWrapper

    from utils.errors import UserError, one_line
    try:
        raise UserError("HDF5 file 'x.h5' cannot be read at time step 3")
    except UserError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(UserError) as info:
        wrapped.reraise()  # what the DataLoader does in the main process
    assert "Traceback" in str(info.value)
    assert one_line(info.value) == "HDF5 file 'x.h5' cannot be read at time step 3"
    try:
        YParams("config/ViT.yaml", "tiny").nope  # noqa: B018 (the read is the test)
    except UserError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(UserError) as info:
        wrapped.reraise()
    assert one_line(info.value).startswith("config 'tiny' in config/ViT.yaml has no key 'nope'")


@pytest.mark.multiprocess
@pytest.mark.long
def test_torch_distributed_launch_command_runs(small_era5, tmp_path):
    """The SC20/ImageNet-DDP tutorials' launcher passes --local-rank=0 to the script."""
    result = run_command(["-m", "torch.distributed.launch", "--nproc_per_node=1", "--master_port", str(free_port()),
                          "train.py", *tiny(small_era5, tmp_path, "--num_iters", "2")])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "DONE ---- rank 0" in result.stderr


def test_profiler_window_spans_an_nvtx_range_named_profile(monkeypatch):
    """`nsys --capture-range=nvtx --nvtx-capture=PROFILE` needs the range; recorded here with CUDA stubbed out."""
    from loop.profiling import CudaProfilerWindow
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(f"push {name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    window = CudaProfilerWindow(epoch=1, num_iters=3)
    for epoch in range(3):
        for step in range(5):
            window.step(epoch, step)
        window.end_epoch()
    assert calls == ["start", "push PROFILE", "pop", "stop"]


@pytest.mark.multiprocess
@pytest.mark.long
def test_killed_rank_under_torchrun_restarts_and_finishes_like_an_uninterrupted_run(era5_dir, tmp_path):
    """torchrun --max-restarts 1, one rank SIGKILLed after the first checkpoint: the restarted ranks resume from
    it by themselves, and the final weights equal those of a run nobody killed."""
    argv = ["train.py", "--config", "tiny", "--data_dir", era5_dir, "--num_iters", "160", "--checkpoint_interval",
            "20"]
    whole = run_ranks(argv + ["--expdir", str(tmp_path / "whole")], 2)  # plain ranks: this launcher is not under test
    assert whole.returncode == 0, whole.stderr[-2000:]
    launcher, output, checkpoint = killed_under_torchrun(argv, tmp_path)
    assert launcher.returncode == 0, output[-3000:]
    assert "Resumed from" in output  # the restart really resumed (the comparison below could fail otherwise)
    final = torch.load(checkpoint, weights_only=True)
    reference = torch.load(os.path.join(str(tmp_path / "whole"), "tiny", "2GPU", "00", "checkpoints", "ckpt.pt"),
                           weights_only=True)
    assert final["iteration"] == reference["iteration"] == 160
    for name, weight in reference["model"].items():
        torch.testing.assert_close(final["model"][name], weight, atol=1e-6, rtol=0, msg=name)


def killed_under_torchrun(argv, tmp_path, run_dir="tiny/2GPU/00"):
    """`argv` under torchrun --max-restarts 1 on 2 ranks, one rank SIGKILLed once the first checkpoint is written:
    (the launcher, its output, the checkpoint's path; `run_dir` the run directory under --expdir)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # gloo: 2 ranks on the CPU
    env.pop("WORLD_SIZE", None)
    log_path = tmp_path / "torchrun.log"  # a file, not a pipe: a full pipe would stall the ranks' logging
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--max-restarts", "1", "--master_port", str(free_port()), *argv, "--expdir",
                                 str(tmp_path / "killed")], cwd=REPO_ROOT, env=env, stdout=open(log_path, "w"),
                                stderr=subprocess.STDOUT)
    checkpoint = os.path.join(str(tmp_path / "killed"), *run_dir.split("/"), "checkpoints", "ckpt.pt")
    deadline = time.time() + 120
    while not os.path.exists(checkpoint) and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.02)
    workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    assert workers, "no worker processes found"
    os.kill(int(workers[-1]), signal.SIGKILL)  # one rank dies mid-run
    launcher.wait(timeout=300)
    return launcher, log_path.read_text(), checkpoint


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EACCES])
def test_a_full_disk_in_an_atomic_writer_says_so_with_the_folder_and_its_free_space(tmp_path, monkeypatch, code):
    """write_json / write_bytes (benchmark results, example logs): a full disk or quota is one line naming the folder
    and its free space, and the old file stays. Twin: another OSError (permissions) is not called a full disk."""
    import utils.atomic
    target = tmp_path / "results.json"
    target.write_text("old")
    real_open = open

    class FullDisk:
        def __init__(self, path, mode):
            self.file = real_open(path, mode)

        def write(self, data):
            raise OSError(code, os.strerror(code))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(utils.atomic, "open", FullDisk, raising=False)
    if code == errno.EACCES:
        with pytest.raises(PermissionError):
            utils.atomic.write_json(target, {"a": 1})
    else:
        with pytest.raises(UserError, match=rf"writing '.*results\.json' failed: the disk is full \(.+; [0-9.]+ GB "
                                            rf"free in '{re.escape(str(tmp_path))}'\); nothing was changed"):
            utils.atomic.write_json(target, {"a": 1})
    assert target.read_text() == "old" and not os.path.exists(str(target) + ".tmp")

"""Checkpoints load as data, never as code (#58 items 1, 5, 7; lifecycle/checkpoint.py).

A checkpoint is a pickle, and a pickle may name any function to call as it loads. Every load of a checkpoint (and of
a save's `.tmp`) reads it with weights_only=True, and train.py's checkpoints hold nothing else (their RNG states as
tensors and numbers). A crafted checkpoint whose unpickling would create a file is tried where a user could meet it:
given as --resume, as the run directory's own ckpt.pt, and as ckpt.pt.tmp beside a good ckpt.pt. Each is refused
(the first two: one line, exit 2; the .tmp: removed, said, the run resumes from ckpt.pt) and no file appears; each
twin reads with a full unpickle, as before, and the file appears. Also: a directory at ckpt.pt stops the run before
training (twin: taken for "no checkpoint", the run trains and its save fails with a full disk's advice); a damaged
ckpt_previous.pt is said at start and kept as .damaged (twin: not checked, nothing said); --resume of a directory says
so; a checkpoint of the old format is refused with the command that converts it, and converted it resumes.
A failure points to lifecycle/checkpoint.py (read_as_data, has_checkpoint, check_previous, finish_interrupted_save,
get_rng_states) or lifecycle/convert_checkpoint.py.
"""
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import lifecycle.checkpoint
import lifecycle.run
import train
from lifecycle.checkpoint import previous_path
from sample_data import write_era5
from tests.conftest import REPO_ROOT
from tests.training.test_checkpoint_digest import damage

pytestmark = pytest.mark.compat  # weights_only loading on torch 2.5 too
FLAGS = ("--num_iters", "12", "--checkpoint_interval", "4")


class CreatesAFile:
    """Unpickled, it opens `path` for writing: what a crafted checkpoint could do with os.system instead."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def tiny(data, expdir, *flags):
    return ["--config", "tiny", "--data_dir", str(data), "--expdir", str(expdir), *flags]


def newest_of(expdir):
    return os.path.join(str(expdir), "tiny", "1GPU", "00", "checkpoints", "ckpt.pt")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """Small data, and a run stopped at iteration 8 holding ckpt.pt (8) and ckpt_previous.pt (4)."""
    root = tmp_path_factory.mktemp("as_data")
    data = str(write_era5(root / "era5", height=16, width=32, steps_per_year=24, train_years=1, valid_years=1,
                          test_years=1, verbose=False))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO_ROOT)
        patch.delenv("WORLD_SIZE", raising=False)
        train.main(tiny(data, root / "split", *FLAGS, "--stop_at_iter", "8"))
    return data, root / "split"


@pytest.fixture
def run(stopped, tmp_path, monkeypatch):
    """A copy of the stopped run; `run(*flags)` trains it on in this process: (exit code, stderr)."""
    data, split = stopped
    shutil.copytree(split, tmp_path / "exp")
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def go(capsys, *flags):
        capsys.readouterr()
        code = 0
        try:
            train.main(tiny(data, tmp_path / "exp", *FLAGS, *flags))
        except SystemExit as stop:
            code = stop.code
        return code, capsys.readouterr().err
    return go


def crafted(path, marker):
    """A torch file with a checkpoint's keys and an object whose unpickling creates `marker`."""
    torch.save({"model": {}, "iteration": 8, "config_name": "tiny", "params": {"model": "vit"},
                "note": CreatesAFile(marker)}, path)


def unpickled_fully(monkeypatch):
    """The twin's switch: checkpoints read with a full unpickle, as before."""
    monkeypatch.setattr(lifecycle.checkpoint, "read_as_data",
                        lambda path: torch.load(path, map_location="cpu", weights_only=False))


def error_lines(err):
    return [line for line in err.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("place", ["resume", "ckpt.pt", "ckpt.pt.tmp"])
@pytest.mark.parametrize("as_data", [True, False], ids=["as_data", "twin_unpickled"])
def test_a_crafted_checkpoint_runs_nothing_wherever_it_is_met(run, tmp_path, capsys, monkeypatch, place, as_data):
    marker = tmp_path / "ran"
    newest = newest_of(tmp_path / "exp")
    flags = ()
    if place == "resume":
        crafted(tmp_path / "evil.pt", marker)
        flags = ("--resume", str(tmp_path / "evil.pt"), "--run_num", "01")
    else:
        crafted(newest if place == "ckpt.pt" else f"{newest}.tmp", marker)
    if not as_data:
        unpickled_fully(monkeypatch)
    code, err = run(capsys, *flags)
    if not as_data:
        assert marker.exists(), err
        return
    assert not marker.exists(), err
    if place == "ckpt.pt.tmp":  # removed and said; the run resumes from its good ckpt.pt
        assert code == 0 and f"'{newest}.tmp' was removed (it would need to run code to load" in err, err
        assert f"Resumed from {newest} at iteration 8" in err
        return
    assert code == 2, err
    assert len(error_lines(err)) == 1 and "is not a checkpoint written by train.py: it would need to run code to " \
        "load (it names " in error_lines(err)[0] and "python -m lifecycle.convert_checkpoint" in err, err


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "twin_unchecked"])
def test_a_directory_at_ckpt_pt_stops_the_run_before_training(run, tmp_path, capsys, monkeypatch, checked):
    newest = newest_of(tmp_path / "exp")
    os.remove(newest)
    os.mkdir(newest)
    if not checked:  # as before: anything but a file was "no checkpoint"
        monkeypatch.setattr(lifecycle.run, "has_checkpoint", lambda path: lifecycle.checkpoint.present(path))
    code, err = run(capsys, "--num_iters", "4")
    if checked:
        assert code == 2 and error_lines(err) == [
            f"error: '{newest}' is a directory, not a checkpoint file; move it away, then start again (nothing was "
            "started)"], err
        assert os.path.isdir(newest)
    else:  # as before: it trained (from the previous checkpoint), then its save failed with a full disk's advice
        assert "Starting Training Loop" in err and "free disk space" in err, err


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "twin_unchecked"])
def test_a_damaged_previous_checkpoint_is_said_at_start_and_kept_aside(run, tmp_path, capsys, monkeypatch, checked):
    newest = newest_of(tmp_path / "exp")
    previous = previous_path(newest)
    damage(previous, "bit")
    if not checked:
        monkeypatch.setattr(lifecycle.checkpoint, "check_previous", lambda path: None)
    code, err = run(capsys, "--num_iters", "8")  # resumed at its end: nothing trained, nothing saved
    assert code == 0 and f"Resumed from {newest} at iteration 8" in err, err
    said = f"checkpoint '{previous}' does not hold what was written (its digest differs"
    if checked:
        assert said in err and f"it is kept as '{previous}.damaged': until the next checkpoint is written the " \
            "newest is this run's only good one" in err, err
        assert os.path.isfile(f"{previous}.damaged") and not os.path.exists(previous)
    else:
        assert said not in err and os.path.isfile(previous)


def test_resume_of_a_directory_says_it_is_a_directory(run, tmp_path, capsys):
    code, err = run(capsys, "--resume", str(tmp_path), "--run_num", "01")
    assert code == 2 and error_lines(err) == [
        f"error: '{tmp_path}' is a directory, not a checkpoint file; pass a checkpoint file to --resume (a run "
        "directory keeps its own as checkpoints/ckpt.pt)"], err


@pytest.mark.multiprocess
def test_a_checkpoint_of_the_old_format_is_refused_then_converted_resumes(run, tmp_path, capsys):
    """The RNG states as the earlier versions wrote them (numpy's a tuple holding an array, Python's a tuple): the
    run stops in one line naming numpy's function and the command; converted (--trusted), it resumes at 8."""
    newest = newest_of(tmp_path / "exp")
    checkpoint = torch.load(newest, weights_only=True)
    checkpoint.pop("digest")
    checkpoint["rng_states"] = [{"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                                 "python": random.getstate()}]
    torch.save(checkpoint, newest)
    code, err = run(capsys)
    assert code == 2 and "would need to run code to load (it names numpy" in err and \
        f"`python -m lifecycle.convert_checkpoint {newest}`" in err, err
    done = subprocess.run([sys.executable, "-m", "lifecycle.convert_checkpoint", newest, "--trusted"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "converted, iteration 8" in done.stdout, done
    assert isinstance(torch.load(newest, weights_only=True)["rng_states"][0]["numpy"], dict)
    code, err = run(capsys, "--num_iters", "8")
    assert code == 0 and f"Resumed from {newest} at iteration 8" in err, err


@pytest.mark.multiprocess
def test_the_converter_asks_before_it_unpickles(tmp_path):
    """Without --trusted and without a terminal to answer on, nothing is loaded: one line, exit 2."""
    marker = tmp_path / "ran"
    crafted(tmp_path / "evil.pt", marker)
    done = subprocess.run([sys.executable, "-m", "lifecycle.convert_checkpoint", str(tmp_path / "evil.pt")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and not marker.exists(), done
    assert error_lines(done.stderr) == ["error: nothing converted (add --trusted to say you trust the files without "
                                        "a prompt)"], done.stderr

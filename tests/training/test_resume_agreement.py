"""Every rank resumes from the same checkpoint, or the job stops (issue #40): rank 0 chooses the file (the newest
good one of the run directory's two, or --resume's) and sends it with its iteration; every other rank loads exactly
that file, with no fallback of its own; a rank that cannot read it, or reads another iteration, ends the whole job
with one line naming itself and the file.

A failure points to lifecycle/checkpoint.py (load_on_every_rank, load_rank0s_choice, resume_verdict) or to
lifecycle/run.py (start_run).
"""
import os
import re
import shutil
import sys

import pytest
import torch

import lifecycle.checkpoint
import train
from lifecycle.checkpoint import (
    load_newest_checkpoint,
    load_on_every_rank,
    load_rank0s_choice,
    previous_path,
    resume_verdict,
    save_checkpoint,
)
from sample_data import write_era5
from tests.conftest import REPO_ROOT, run_plain_ranks
from utils.errors import UserError

# ---------------------------------------------------------------- the agreement, in one process


def two_checkpoints(tmp_path):
    """checkpoints/ckpt.pt at iteration 4 and ckpt_previous.pt at iteration 2, as a run saving every 2 leaves them."""
    path = str(tmp_path / "checkpoints" / "ckpt.pt")
    save_checkpoint(path, {"iteration": 2})
    save_checkpoint(path, {"iteration": 4})
    return path


def unreadable_here(monkeypatch, path):
    """torch.load fails on `path` in this process, as on a node whose file system fails to read it."""
    real_load = torch.load

    def failing_load(f, *args, **kwargs):
        if os.path.abspath(str(f)) == os.path.abspath(path):
            raise OSError(5, "Input/output error")
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(lifecycle.checkpoint.torch, "load", failing_load)


def test_the_old_per_rank_fallback_would_restart_one_rank_older(tmp_path, monkeypatch):
    """The twin: before, every rank ran load_newest_checkpoint itself. Rank 0 read ckpt.pt (iteration 4); rank 1,
    whose node could not read it, fell back to ckpt_previous.pt on its own (iteration 2), silently (the warning was
    rank 0's): the two ranks would have trained from different states. Rank 0's choice followed instead stops it."""
    path = two_checkpoints(tmp_path)
    rank0_checkpoint, rank0_file = load_newest_checkpoint(path)
    unreadable_here(monkeypatch, path)
    monkeypatch.setattr(lifecycle.checkpoint, "damaged_path", lambda path: path)  # the old code moved nothing
    rank1_checkpoint, rank1_file = load_newest_checkpoint(path)  # the old rank 1
    assert (rank0_file, rank0_checkpoint["iteration"]) == (path, 4)
    assert (rank1_file, rank1_checkpoint["iteration"]) == (previous_path(path), 2)  # the guarantee, broken
    checkpoint, problem = load_rank0s_choice(rank0_file, rank0_checkpoint["iteration"])  # the new rank 1
    assert checkpoint is None and f"'{path}' cannot be read on this rank (OSError: Input/output error)" in problem


def test_a_rank_follows_rank_0s_choice_or_says_why_it_cannot(tmp_path, monkeypatch):
    path = two_checkpoints(tmp_path)
    checkpoint, problem = load_rank0s_choice(path, 4)
    assert checkpoint == {"iteration": 4} and problem is None
    # the file holds another iteration here (each node its own run directory, or one replaced in between)
    checkpoint, problem = load_rank0s_choice(path, 6)
    assert checkpoint is None
    assert re.fullmatch(rf"checkpoint '{re.escape(path)}' holds iteration 4 on this rank but 6 on rank 0; every rank "
                        r"must resume from the same checkpoint, so the job stops: check that every node sees the "
                        r"same '.*checkpoints' \(one shared file system for --expdir\), then start again", problem)
    # rank 0 fell back to the previous one: this rank loads that one too, even though ckpt.pt reads fine here
    assert load_rank0s_choice(previous_path(path), 2) == ({"iteration": 2}, None)
    checkpoint, problem = load_rank0s_choice(str(tmp_path / "elsewhere" / "ckpt.pt"), 4)  # a node-local --expdir
    assert checkpoint is None and "ckpt.pt' cannot be read on this rank (not found), though rank 0 read it " \
                                  "(iteration 4)" in problem
    with open(path, "r+b") as f:
        f.truncate(10)  # damaged as this rank sees it: no fallback of its own
    checkpoint, problem = load_rank0s_choice(path, 4)
    assert checkpoint is None and "cannot be read on this rank (" in problem


def test_the_verdict_lets_one_rank_speak_and_the_others_stop_quietly():
    assert resume_verdict([None, None, None], 0) is None  # every rank agrees: go on
    assert resume_verdict([None, None], 1) is None
    problems = [None, "rank 1's reason", None, None]
    assert resume_verdict(problems, 1) == "rank 1's reason"
    assert [resume_verdict(problems, rank) for rank in (0, 2, 3)] == ["", "", ""]  # exit 2 without a line
    problems = [None, None, "two", "three", None, "five"]
    assert resume_verdict(problems, 2) == "two (ranks 3, 5 cannot resume from it either)"
    assert resume_verdict(problems, 3) == resume_verdict(problems, 0) == ""
    many = [None] + ["no"] * 9
    assert resume_verdict(many, 1) == "no (ranks 2, 3, 4, 5, 6 and 3 more cannot resume from it either)"
    assert resume_verdict([None, "x", "y"], 1) == "x (rank 2 cannot resume from it either)"


def test_in_one_process_rank_0_chooses_the_newest_good_checkpoint(tmp_path, caplog):
    path = two_checkpoints(tmp_path)
    assert load_on_every_rank(path, newest=True) == ({"iteration": 4}, path)
    assert load_on_every_rank(previous_path(path)) == ({"iteration": 2}, previous_path(path))
    with open(path, "r+b") as f:
        f.truncate(10)
    assert load_on_every_rank(path, newest=True) == ({"iteration": 2}, previous_path(path))
    assert "resuming from the previous checkpoint" in caplog.text
    assert not os.path.exists(path) and os.path.getsize(path + ".damaged") == 10  # moved aside, kept
    with pytest.raises(UserError, match="cannot be read"):  # --resume's file: no fallback
        load_on_every_rank(path + ".damaged")

    def refuse(checkpoint, file):
        raise UserError(f"not ours: {file}")

    with pytest.raises(UserError, match="not ours: .*ckpt.pt$"):  # ckpt.pt missing: the previous one took its place
        load_on_every_rank(path, newest=True, check=refuse)
    assert not os.path.exists(previous_path(path))


def test_from_rank_0s_choice_on_a_lost_peer_names_the_checkpoint_to_resume_from(tmp_path, monkeypatch):
    """Once rank 0 has chosen, a rank whose wait for the others fails (a rank slower to read the file than
    --collective_timeout) says the job resumes from that file, not 'no checkpoint was written yet'."""
    from resilience import job
    path = two_checkpoints(tmp_path)
    monkeypatch.delitem(job.notes, "checkpoint", raising=False)
    load_on_every_rank(path, newest=True)
    assert job.notes["checkpoint"] == f"'{path}' (iteration 4)"


# ---------------------------------------------------------------- two ranks (gloo), a real resume

# Each rank runs train.py through this script; what it changes is written into the copy of each test (no switch
# in the product's code): on rank 1 alone the run directory's checkpoint cannot be read (a failing node); with
# `unchecked`, no rank checks a checkpoint's digest (the twins of the flipped-bit cases); every rank prints where its
# restore started.
RANK_SCRIPT = """\
import os, sys
sys.path.insert(0, {root!r})
import torch
import lifecycle.checkpoint
import train

if {unchecked}:
    lifecycle.checkpoint.verify_digest = lambda checkpoint, path: checkpoint.pop("digest", None)

if {fail_on_rank_1} and os.environ["RANK"] == "1":
    real_load = torch.load

    def failing_load(f, *args, **kwargs):
        if str(f).endswith("ckpt.pt"):
            raise OSError(5, "Input/output error")
        return real_load(f, *args, **kwargs)

    torch.load = failing_load
real_restore = train.restore


def restore(run, *args, **kwargs):
    start, sums = real_restore(run, *args, **kwargs)
    print(f"test: rank {{run.rank}} resumed at iteration {{start}} from {{run.resume_path}}", flush=True)
    return start, sums


train.restore = restore
train.main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def written_run(tmp_path_factory):
    """Small data and a run directory of two ranks ("2GPU") holding ckpt.pt at iteration 4 and ckpt_previous.pt at
    iteration 2: trained in this process (checkpoints hold the serial model and resume at any layout)."""
    root = tmp_path_factory.mktemp("resume")
    data = str(write_era5(root / "era5", height=16, width=32, steps_per_year=24, train_years=1, valid_years=1,
                          test_years=1, verbose=False))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO_ROOT)
        patch.delenv("WORLD_SIZE", raising=False)
        train.main(["--config", "tiny", "--data_dir", data, "--expdir", str(root / "exp"), "--num_iters", "4",
                    "--checkpoint_interval", "2"])
    run_dir = root / "exp" / "tiny" / "2GPU" / "00"
    os.rename(root / "exp" / "tiny" / "1GPU", run_dir.parent)
    folder = run_dir / "checkpoints"
    assert [torch.load(folder / name, weights_only=True)["iteration"] for name in ("ckpt.pt", "ckpt_previous.pt")] \
        == [4, 2]
    return data, root / "exp"


def copy_of(written_run, tmp_path):
    """The written run copied into this test's folder: its ckpt.pt."""
    shutil.copytree(written_run[1], tmp_path / "exp")
    return str(tmp_path / "exp" / "tiny" / "2GPU" / "00" / "checkpoints" / "ckpt.pt")


def two_ranks(data, tmp_path, fail_on_rank_1=False, timeout=120, unchecked=False):
    """Resume the copied run with two ranks (plain processes: each one's exit code and output)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(root=REPO_ROOT, fail_on_rank_1=fail_on_rank_1, unchecked=unchecked))
    codes, outputs, _ = run_plain_ranks(
        [sys.executable, str(script), "--config", "tiny", "--data_dir", data, "--expdir", str(tmp_path / "exp"),
         "--num_iters", "6", "--dist_timeout", "60"], 2, tmp_path, timeout)
    return codes, outputs


@pytest.mark.multiprocess
def test_a_rank_that_cannot_read_rank_0s_checkpoint_ends_the_whole_job_in_one_line(written_run, tmp_path):
    """Rank 1's node cannot read ckpt.pt, which rank 0 read: every rank exits with code 2 (none waits), and the
    console has rank 1's line, naming it and the file, once; no traceback. Before, rank 1 resumed from
    ckpt_previous.pt while rank 0 resumed from ckpt.pt (the twin above)."""
    checkpoint = copy_of(written_run, tmp_path)
    codes, outputs = two_ranks(written_run[0], tmp_path, fail_on_rank_1=True)
    console = "".join(outputs)
    assert codes == [2, 2], console[-3000:]
    errors = [line for line in console.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: rank 1: checkpoint '{checkpoint}' cannot be read on this rank (OSError: Input/output "
                      "error), though rank 0 read it (iteration 4); every rank must resume from the same checkpoint, "
                      f"so the job stops: check that this node sees '{os.path.dirname(checkpoint)}' as rank 0's does "
                      "(a shared, healthy file system), then start again"], console[-3000:]
    assert errors[0] in outputs[1]  # said by the rank that found it
    assert "Traceback" not in console and "resumed at iteration" not in console  # neither rank trained on


@pytest.mark.multiprocess
def test_a_damaged_newest_checkpoint_sends_every_rank_to_the_previous_one(written_run, tmp_path):
    """ckpt.pt cut short: rank 0 falls back to ckpt_previous.pt and says so once; rank 1 follows (both resume at
    iteration 2 from the same file) and the run finishes."""
    checkpoint = copy_of(written_run, tmp_path)
    with open(checkpoint, "r+b") as f:  # a write cut short
        f.truncate(os.path.getsize(checkpoint) // 2)
    codes, outputs = two_ranks(written_run[0], tmp_path)
    console = "".join(outputs)
    assert codes == [0, 0], console[-3000:]
    previous = previous_path(checkpoint)
    for rank in (0, 1):
        assert f"test: rank {rank} resumed at iteration 2 from {previous}" in outputs[rank], outputs[rank][-3000:]
    assert len(re.findall(r"cannot be read \(.*\): it is damaged, .*; resuming from the previous checkpoint "
                          rf"'{re.escape(previous)}' \(iteration 2\)", console)) == 1
    assert torch.load(checkpoint, weights_only=True)["iteration"] == 6


@pytest.mark.multiprocess
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("where", ["newest", "both"])
# a flipped bit: long here; in make test, found in one process (test_checkpoint_digest.py) and by two ranks at 100 bytes
@pytest.mark.parametrize("how", [pytest.param("bit", marks=pytest.mark.long), "bytes"])
def test_two_ranks_check_the_digest_of_rank_0s_choice(written_run, tmp_path, how, where, checked):
    """Two ranks, a flipped bit (or 100 flipped bytes) in ckpt.pt: both resume from ckpt_previous.pt (iteration 2),
    said once; the same in both checkpoints: one line, every rank exits with code 2, neither trains. Twins,
    unchecked: both ranks resume from the damaged ckpt.pt at iteration 4 without a word (their weights are not what
    was written)."""
    from tests.training.test_checkpoint_digest import damage
    checkpoint = copy_of(written_run, tmp_path)
    previous = previous_path(checkpoint)
    original = torch.load(checkpoint, weights_only=True)["model"]
    name = [damage(path, how) for path in ([checkpoint] if where == "newest" else [checkpoint, previous])][0]
    assert not torch.equal(torch.load(checkpoint, weights_only=True)["model"][name], original[name])
    codes, outputs = two_ranks(written_run[0], tmp_path, unchecked=not checked)
    console = "".join(outputs)
    flipped = f"checkpoint '{checkpoint}' does not hold what was written (its digest differs"
    if not checked:
        assert codes == [0, 0], console[-3000:]
        for rank in (0, 1):
            assert f"test: rank {rank} resumed at iteration 4 from {checkpoint}" in outputs[rank], outputs[rank][-3000:]
        assert "does not hold what was written" not in console
    elif where == "newest":
        assert codes == [0, 0], console[-3000:]
        for rank in (0, 1):
            assert f"test: rank {rank} resumed at iteration 2 from {previous}" in outputs[rank], outputs[rank][-3000:]
        assert console.count(flipped) == 1 and flipped in outputs[0], console[-3000:]
    else:
        assert codes == [2, 2], console[-3000:]
        errors = [line for line in console.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {flipped}") and "is damaged or incomplete too" \
            in errors[0], console[-3000:]
        assert "resumed at iteration" not in console and "Traceback" not in console

"""Every checkpoint carries a digest of what was written, checked on every load (issue #53): a bit flipped inside a
tensor's data, which torch.load reads without a word, sends the run to the previous checkpoint (said in one line,
the damaged file moved aside), or stops it in one line when both are damaged. Each case has its twin: the same
damage with the check switched off resumes from the damaged file silently and trains to other weights. The two-rank
cases are in test_resume_agreement.py.

A failure points to lifecycle/checkpoint.py (state_digest, verify_digest, save_checkpoint, load_checkpoint).
"""
import os
import re
import shutil

import pytest
import torch

import lifecycle.checkpoint
import train
from lifecycle.checkpoint import (
    DIGEST,
    DamagedCheckpoint,
    load_checkpoint,
    previous_path,
    save_checkpoint,
    state_digest,
)
from sample_data import write_era5
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.compat  # torch.save's and torch.load's bytes on torch 2.5 too
FLAGS = ("--num_iters", "12", "--checkpoint_interval", "4")


def tiny(data, expdir, *flags):
    return ["--config", "tiny", "--data_dir", str(data), "--expdir", str(expdir), *flags]


def newest_of(expdir):
    return os.path.join(str(expdir), "tiny", "1GPU", "00", "checkpoints", "ckpt.pt")


def largest_weight(path):
    """The bytes of the largest float32 tensor of the checkpoint's model, as written in the file."""
    model = torch.load(path, weights_only=True)["model"]
    name = max((n for n in model if model[n].dtype == torch.float32), key=lambda n: model[n].numel())
    return name, model[name].numpy().tobytes()


def damage(path, how):
    """Flip, inside the data of the model's largest tensor (found by its bytes in the file): `bit`, one bit (the
    lowest exponent bit of the float32 in the middle: the value doubles or halves), or `bytes`, the lowest bit of
    100 consecutive bytes from there (25 values off, finite). Returns the tensor's name."""
    name, data = largest_weight(path)
    content = bytearray(open(path, "rb").read())
    start = content.find(data)
    assert start > 0 and content.find(data, start + 1) == -1, "the tensor's bytes are not unique in the file"
    middle = start + (len(data) // 2) // 4 * 4
    if how == "bit":
        content[middle + 2] ^= 0x80
    else:
        for offset in range(middle, middle + 100):
            content[offset] ^= 0x01
    with open(path, "r+b") as f:
        f.write(content)
    return name


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Small data; a run stopped at iteration 8 that holds ckpt.pt (8) and ckpt_previous.pt (4); an uninterrupted run
    of 12 iterations: its last checkpoint and its expdir. Trained in this process."""
    root = tmp_path_factory.mktemp("flips")
    data = str(write_era5(root / "era5", height=16, width=32, steps_per_year=24, train_years=1, valid_years=1,
                          test_years=1, verbose=False))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO_ROOT)
        patch.delenv("WORLD_SIZE", raising=False)
        train.main(tiny(data, root / "whole", *FLAGS))
        train.main(tiny(data, root / "split", *FLAGS, "--stop_at_iter", "8"))
    whole = torch.load(newest_of(root / "whole"), weights_only=True)
    return data, root / "split", whole, root / "whole"


def unchecked(monkeypatch):
    """The twin's switch: every load takes what torch.load returned (the digest dropped, nothing compared)."""
    monkeypatch.setattr(lifecycle.checkpoint, "verify_digest", lambda checkpoint, path: checkpoint.pop(DIGEST, None))


def same_weights(a, b):
    return all(torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-7) for name in a)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("how", ["bit", "bytes"])
def test_a_flip_in_the_newest_checkpoint_resumes_from_the_previous_one(written, tmp_path, capsys, monkeypatch, how,
                                                                      checked):
    """One bit, or 100 bytes, flipped in ckpt.pt's largest weight: the run says which file does not hold what was
    written, resumes from ckpt_previous.pt (iteration 4), keeps the damaged file aside and ends at the weights of
    the uninterrupted run. Twin, unchecked: it resumes from ckpt.pt at iteration 8 without a word, to other weights."""
    data, split, whole, _ = written
    shutil.copytree(split, tmp_path / "exp")
    newest = newest_of(tmp_path / "exp")
    damage(newest, how)
    if not checked:
        unchecked(monkeypatch)
    monkeypatch.chdir(REPO_ROOT)
    capsys.readouterr()
    train.main(tiny(data, tmp_path / "exp", *FLAGS))
    err = capsys.readouterr().err
    resumed = torch.load(newest, weights_only=True)
    assert resumed["iteration"] == 12
    if checked:
        previous = previous_path(newest)
        assert len(re.findall(
            rf"checkpoint '{re.escape(newest)}' does not hold what was written \(its digest differs: bytes changed on "
            rf"disk or in a copy\); resuming from the previous checkpoint '{re.escape(previous)}' \(iteration 4\); the "
            rf"damaged file is kept as '{re.escape(newest)}\.damaged'", err)) == 1, err
        assert same_weights(resumed["model"], whole["model"])
    else:
        assert f"Resumed from {newest} at iteration 8" in err and "does not hold what was written" not in err, err
        assert not same_weights(resumed["model"], whole["model"])


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("how", ["bit", "bytes"])
def test_a_flip_in_both_checkpoints_stops_the_run_in_one_line(written, tmp_path, capsys, monkeypatch, how, checked):
    """Both checkpoints flipped: one line naming both, exit 2, nothing trained or written. Twin, unchecked: the run
    resumes from the damaged ckpt.pt without a word and trains on to other weights."""
    data, split, whole, _ = written
    shutil.copytree(split, tmp_path / "exp")
    newest = newest_of(tmp_path / "exp")
    for path in (newest, previous_path(newest)):
        damage(path, how)
    if not checked:
        unchecked(monkeypatch)
    monkeypatch.chdir(REPO_ROOT)
    capsys.readouterr()
    if checked:
        before = open(newest, "rb").read()
        with pytest.raises(SystemExit) as exit_info:
            train.main(tiny(data, tmp_path / "exp", *FLAGS))
        assert exit_info.value.code == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert errors == [f"error: checkpoint '{newest}' does not hold what was written (its digest differs: bytes "
                          f"changed on disk or in a copy), and the previous one, '{previous_path(newest)}', is damaged "
                          "or incomplete too; start a new --run_num (or --expdir) to train from the beginning"], errors
        assert open(newest, "rb").read() == before
    else:
        train.main(tiny(data, tmp_path / "exp", *FLAGS))
        err = capsys.readouterr().err
        assert f"Resumed from {newest} at iteration 8" in err and "does not hold what was written" not in err, err
        assert not same_weights(torch.load(newest, weights_only=True)["model"], whole["model"])


def test_the_digest_covers_every_tensor_and_value_and_survives_a_round_trip(tmp_path):
    """What save_checkpoint wrote loads back equal and checked; changing any tensor byte, a dtype, a shape, a number
    or numpy's RNG keys changes the digest (the comparison can fail)."""
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
             "iteration": 8, "lr": 1e-3, "rng": {"name": "MT19937", "keys": torch.arange(4), "pos": 2, "has_gauss": 0,
                                                 "cached_gaussian": 0.0},
             "scalar": torch.tensor(2.5), "empty": torch.zeros(0), "name": "tiny", "flag": None}
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, state)
    loaded = load_checkpoint(path)
    assert DIGEST not in loaded and state_digest(loaded) == state_digest(state)
    assert torch.load(path, weights_only=True)[DIGEST] == state_digest(state)
    changes = [lambda s: s["model"]["w"].view(-1)[5].add_(1e-6), lambda s: s["model"].update(w=s["model"]["w"].T),
               lambda s: s["model"].update(b=s["model"]["b"].float()), lambda s: s.update(iteration=9),
               lambda s: s.update(lr=1.0000000001e-3), lambda s: s["rng"]["keys"].__setitem__(0, 7),
               lambda s: s.update(name="tiny2"), lambda s: s.update(flag=False)]
    for change in changes:
        changed = torch.load(path, weights_only=True)
        written = changed.pop(DIGEST)
        change(changed)
        assert state_digest(changed) != written


def test_a_checkpoint_written_before_the_digest_loads_with_one_line(tmp_path, caplog):
    """A train.py checkpoint without a digest (an older version wrote it) loads, and one warning says it cannot be
    checked; a torch file of something else loads quietly (the caller refuses it in its own words)."""
    path = str(tmp_path / "old.pt")
    torch.save({"model": {"w": torch.ones(2)}, "iteration": 3}, path)
    assert load_checkpoint(path)["iteration"] == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint '{path}' was written before checkpoints carried a digest: what it holds cannot be checked "
        "against what was written"]
    caplog.clear()
    torch.save({"weights": torch.ones(2)}, path)
    assert list(load_checkpoint(path)) == ["weights"] and not caplog.records


def test_a_flipped_bit_is_a_damaged_checkpoint_and_unchecked_loads_other_values(tmp_path, monkeypatch):
    """The unit of the cases above: the flipped file raises DamagedCheckpoint with its reason; unchecked, it loads
    a weight whose value changed."""
    path = str(tmp_path / "ckpt.pt")
    weight = torch.randn(64, 64)
    save_checkpoint(path, {"model": {"w": weight}, "iteration": 1})
    damage(path, "bit")
    with pytest.raises(DamagedCheckpoint) as err:
        load_checkpoint(path)
    assert err.value.reason == "its digest differs from what was written"
    unchecked(monkeypatch)
    loaded = load_checkpoint(path)["model"]["w"]
    assert (loaded != weight).sum().item() == 1


@pytest.mark.parametrize("finished", [True, False], ids=["finished", "unfinished_twin"])
def test_a_restart_at_the_final_iteration_after_a_crash_between_the_renames_leaves_ckpt_pt(written, tmp_path, capsys,
                                                                                         monkeypatch, finished):
    """A save at the final iteration killed between its renames: ckpt.pt already became ckpt_previous.pt (iteration
    12), ckpt.pt.tmp (cut short here) not yet ckpt.pt. The restart trains no step and saves nothing: it removes the
    temporary file and ckpt_previous.pt is ckpt.pt again. Twin (the save left as it was, as before): the run ends
    with only ckpt_previous.pt and a stale ckpt.pt.tmp."""
    data, _, whole, whole_dir = written
    expdir = tmp_path / "exp"
    shutil.copytree(whole_dir, expdir)
    newest = newest_of(expdir)
    content = open(newest, "rb").read()
    os.replace(newest, previous_path(newest))  # the first rename of the save of iteration 12 (the same state)
    with open(newest + ".tmp", "wb") as f:
        f.write(content[:len(content) // 2])  # its file, cut short
    if not finished:
        monkeypatch.setattr(lifecycle.checkpoint, "finish_interrupted_save", lambda path: None)
    monkeypatch.chdir(REPO_ROOT)
    capsys.readouterr()
    train.main(tiny(data, expdir, *FLAGS))
    err = capsys.readouterr().err
    assert "already finished its 12 iterations" in err, err
    names = sorted(os.listdir(os.path.dirname(newest)))
    if finished:
        assert names == ["ckpt.pt"], names
        assert f"'{previous_path(newest)}' is '{newest}' again" in err, err
        assert load_checkpoint(newest)["iteration"] == 12
    else:
        assert names == ["ckpt.pt.tmp", "ckpt_previous.pt"], names


def test_a_whole_temporary_file_finishes_the_save_it_belonged_to(written, tmp_path, capsys, monkeypatch):
    """Killed between the renames of the save of iteration 12: ckpt_previous.pt holds 8, ckpt.pt.tmp is whole (its
    digest checks). The restart makes it ckpt.pt and resumes at 12, the final iteration, without training again
    the 4 steps a resume from iteration 8 would."""
    data, _, whole, whole_dir = written
    expdir = tmp_path / "exp"
    shutil.copytree(whole_dir, expdir)
    newest = newest_of(expdir)
    os.replace(newest, newest + ".tmp")  # ckpt_previous.pt (8) stays: the state between the two renames
    monkeypatch.chdir(REPO_ROOT)
    capsys.readouterr()
    train.main(tiny(data, expdir, *FLAGS))
    err = capsys.readouterr().err
    assert f"a save was cut short after writing '{newest}.tmp', which is whole: it is now '{newest}'" in err, err
    assert f"Resumed from {newest} at iteration 12" in err
    assert sorted(os.listdir(os.path.dirname(newest))) == ["ckpt.pt", "ckpt_previous.pt"]
    assert load_checkpoint(previous_path(newest))["iteration"] == 8


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_train_mp_checks_the_digest_of_the_checkpoint_it_gathers(written, tmp_path, capsys, monkeypatch, checked):
    """train_mp.py writes the serial model gathered on rank 0 through the same save: a flipped bit in its ckpt.pt
    sends it back to ckpt_previous.pt, to the uninterrupted run's weights (train_mp.py at tp=cp=1 is train.py).
    Twin, unchecked: it resumes from the damaged file without a word, to other weights."""
    import train_mp
    data, _, whole, _ = written
    monkeypatch.chdir(REPO_ROOT)
    train_mp.main(tiny(data, tmp_path, *FLAGS, "--stop_at_iter", "8"))
    newest = os.path.join(str(tmp_path), "tiny", "1MP", "00", "checkpoints", "ckpt.pt")
    damage(newest, "bit")
    if not checked:
        unchecked(monkeypatch)
    capsys.readouterr()
    train_mp.main(tiny(data, tmp_path, *FLAGS))
    err = capsys.readouterr().err
    resumed = torch.load(newest, weights_only=True)
    assert resumed["iteration"] == 12
    assert ("does not hold what was written" in err) == checked, err
    assert same_weights(resumed["model"], whole["model"]) == checked

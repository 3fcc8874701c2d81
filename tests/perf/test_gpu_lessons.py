"""benchmarks/gpu_lessons.py's own parts on the CPU (the whole script needs minutes; a GPU node runs it): the ERA5
set written by parallel processes and put together holds the training years the `short` lessons read, with the
first part's validation and test years and statistics; the archive keeps logs, events, traces and reports, never
the data or a checkpoint."""
import os
import tarfile

import h5py
import pytest

from benchmarks import gpu_lessons

SIZES = {"height": 8, "width": 16, "steps_per_year": 6}


@pytest.mark.multiprocess
def test_the_era5_parts_make_one_set_of_four_training_years(tmp_path):
    pool, pending, parts = gpu_lessons.era5_parts(str(tmp_path), SIZES)
    pending.get(timeout=300)
    pool.close()
    pool.join()
    target = gpu_lessons.era5_assemble(str(tmp_path), parts)
    assert sorted(os.listdir(os.path.join(target, "train"))) == ["2000.h5", "2003.h5", "2006.h5", "2009.h5"]
    assert os.listdir(os.path.join(target, "valid")) == ["2001.h5"]
    assert os.listdir(os.path.join(target, "test")) == ["2002.h5"]
    assert sorted(os.listdir(os.path.join(target, "stats"))) == ["global_means.npy", "global_stds.npy",
                                                                  "time_means.npy"]
    assert sorted(os.listdir(tmp_path)) == ["era5"]  # the parts are gone
    samples = 0
    for name in os.listdir(os.path.join(target, "train")):
        with h5py.File(os.path.join(target, "train", name)) as f:
            assert f["fields"].shape == (6, 20, 8, 16)
            samples += f["fields"].shape[0]
    assert samples == gpu_lessons.TRAIN_YEARS * SIZES["steps_per_year"]


def test_the_archive_keeps_logs_events_traces_and_reports_only(tmp_path):
    files = {
        "lessons.json": "{}", "runs/short/1GPU/a/out.log": "log", "runs/short/1GPU/a/logs/events.out.tfevents.1": "e",
        "profiles/a.json.gz": "t", "runs/short/1GPU/a/checkpoints/ckpt.pt": "w", "runs/short/1GPU/a/run.lock": "l",
        "data/era5/train/2000.h5": "d", "data/era5/stats/x.json": "s",
    }
    for name, text in files.items():
        os.makedirs(os.path.dirname(tmp_path / "out" / name), exist_ok=True)
        (tmp_path / "out" / name).write_text(text)
    gpu_lessons.pack(str(tmp_path / "out"), str(tmp_path / "lessons.tar.gz"))
    with tarfile.open(tmp_path / "lessons.tar.gz") as tar:
        kept = sorted(tar.getnames())
    assert kept == ["lessons.json", "profiles/a.json.gz", "runs/short/1GPU/a/logs/events.out.tfevents.1",
                    "runs/short/1GPU/a/out.log"]

"""The generated ERA5 data is learnable: brief ViT training beats persistence on the validation year.

A failure points to sample_data/era5.py (dynamics too weak or too noisy) or to the training loop.
"""
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from sample_data.era5 import persistence_error
from tests.conftest import REPO_ROOT


@pytest.mark.long
def test_brief_training_beats_persistence(era5_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    persistence = persistence_error(era5_dir, split="valid")
    train.main(["--config", "demo", "--data_dir", era5_dir, "--expdir", str(tmp_path), "--num_iters", "128",
                "--num_data_workers", "0"])
    events = EventAccumulator(os.path.join(str(tmp_path), "demo", "1GPU", "00", "logs"))
    events.Reload()
    val_loss = events.Scalars("Loss/valid")[-1].value  # the same relative L2 error, normalised units
    assert val_loss < 0.8 * persistence, (val_loss, persistence)

"""The committed `wfm_tiny` run beats persistence: its last validation loss, read from its out.log
(example_logs/vit/wfm_tiny/1GPU/00, `make example-logs`), against persistence's on the same validation year.

The data are regenerated here with the generator arguments `make example-logs` used (benchmarks/example_logs.DATA:
25 x 48, read as 24 x 48), and persistence (x(t+dt) predicted by x(t)) is scored with the training's own loss on the
validation loader's own samples and crop, so the two numbers are the same measure of the same pairs. A failure
points to a log made on other data or with another config, to a model that no longer learns (sample_data/era5.py,
the training loop) or to a loader that crops otherwise (loaders/era5.py).
"""
import os
import re

import pytest

from benchmarks.example_logs import DATA, RUNS
from lifecycle.cli import apply_overrides, training_parser
from loaders.era5 import era5_dataset
from sample_data.__main__ import main as sample_data_main
from sample_data.era5 import persistence_error
from task.loss import l2_loss
from utils.YParams import YParams

pytestmark = pytest.mark.usefixtures("in_repo_root")
RUN_DIR = os.path.join("example_logs", "vit", "wfm_tiny", "1GPU", "00")
VAL_LOSS = re.compile(r"Avg val loss=([0-9.]+)")


@pytest.fixture(scope="module")
def wfm_tiny_data(tmp_path_factory):
    """wfm_tiny's sample data, written by the command `make example-logs` runs."""
    out = tmp_path_factory.mktemp("wfm_tiny") / "era5"
    assert sample_data_main([*DATA[RUNS["wfm-tiny"][3]][1], "--out", str(out)]) == 0
    return str(out)


def loader_persistence(data_dir, img_size=None):
    """The training loss (task/loss.py) of predicting each validation target by its input, over every sample the
    validation loader gives, as validation averages it."""
    params = YParams("config/ViT.yaml", "wfm_tiny")
    apply_overrides(params, training_parser("t").parse_args(["--data_dir", data_dir]), dp_size=1, dp_rank=0)
    if img_size:
        params.update({"img_size": list(img_size)})
    dataset = era5_dataset(params, train=False)
    inp, tar = dataset.__getitems__(list(range(len(dataset))))
    return float(l2_loss(inp, tar)), inp.shape


def committed_log():
    with open(os.path.join(RUN_DIR, "out.log")) as f:
        return f.read()


def beats_persistence(log, persistence):
    """(whether the log's last validation loss is below persistence's, that loss)."""
    last = float(VAL_LOSS.findall(log)[-1])
    return last < persistence, last


def test_the_committed_run_is_wfm_tiny_on_its_sample_data():
    log = committed_log()
    assert "Training ViT: config/ViT.yaml, config wfm_tiny" in log and "DONE ---- rank 0" in log
    assert re.search(r"valid\. Number of examples: 128\. Image Shape: 24 x 48 x 20", log)
    assert "Number of parameters: 228,800" in log


def test_the_committed_wfm_tiny_run_ends_below_persistence(wfm_tiny_data):
    """The last validation loss below persistence's on the same pairs; the twin: a log ending at persistence's loss
    does not pass."""
    persistence, shape = loader_persistence(wfm_tiny_data)
    assert tuple(shape[1:]) == (20, 24, 48)  # the crop: 24 of the file's 25 rows
    beats, last = beats_persistence(committed_log(), persistence)
    assert beats and last < 0.8 * persistence, (last, persistence)
    at_persistence = committed_log() + f"\n... - root - INFO -   Avg val loss={persistence!r}\n"
    assert not beats_persistence(at_persistence, persistence)[0]


def test_loader_persistence_is_the_generators_on_the_same_crop(wfm_tiny_data):
    """The loader's pairs (inputs from step dt of a year on) and persistence_error's (every pair) differ by about a
    sample in 128, and both crop the same rows: within 1%. The twin: the whole 25-row grid is another number."""
    persistence, _ = loader_persistence(wfm_tiny_data)
    assert persistence == pytest.approx(persistence_error(wfm_tiny_data, img_size=(24, 48)), rel=0.01)
    whole = persistence_error(wfm_tiny_data)
    assert abs(whole - persistence) > 0.002, (whole, persistence)


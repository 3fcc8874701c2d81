"""The DALI ERA5 loader against the PyTorch loader, on CPU (DALI with device_id=None).

Same sampler, so the same samples in the same order: every batch of an epoch equal within float32 rounding (DALI
normalises by multiplying with 1/std), for training and validation, shard by shard on 2 data-parallel ranks, with
0 and 2 worker processes; a mid-epoch resume and the step-0 batch; a training run with either loader gives the
same losses. A failure points to loaders/dali_era5.py (order) or loaders/common.py (epoch length, resume, padding: the
interface it shares with the PyTorch loader).
"""
import os
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from lifecycle.cli import apply_overrides, training_parser
from loaders import get_data_loader
from utils.YParams import YParams

pytestmark = pytest.mark.usefixtures("in_repo_root")
ROUNDING = {"rtol": 1e-6, "atol": 1e-6}


def loader(era5_dir, config, train_split, dp_size=1, dp_rank=0, **flags):
    params = YParams("config/ViT.yaml", "tiny")
    argv = ["--data_dir", era5_dir] + [item for key, value in flags.items() for item in (f"--{key}", str(value))]
    apply_overrides(params, training_parser("t").parse_args(argv), dp_size=dp_size, dp_rank=dp_rank)
    params.data_loader_config = config
    return get_data_loader(params, train=train_split)


def epoch_batches(loader_, epoch, skip=0):
    loader_.set_epoch(epoch, skip)
    return [(inp.clone(), tar.clone()) for inp, tar in loader_]


@pytest.mark.compat
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.multiprocess
def test_dali_returns_the_pytorch_batches_on_each_shard(era5_dir, workers):
    seen = []
    for rank in (0, 1):
        for train_split in (True, False):
            if workers and (rank, train_split) != (1, True):  # with workers (slow to start): one shard, training
                continue
            torch_loader = loader(era5_dir, "pytorch", train_split, 2, rank, num_data_workers=workers)
            dali_loader = loader(era5_dir, "dali", train_split, 2, rank, num_data_workers=workers)
            assert type(dali_loader).__name__ == "DALILoader" and len(dali_loader) == len(torch_loader)
            for epoch in (0, 1):
                expected, got = epoch_batches(torch_loader, epoch), epoch_batches(dali_loader, epoch)
                assert len(got) == len(expected)
                for (inp, tar), (ref_inp, ref_tar) in zip(got, expected):
                    torch.testing.assert_close(inp, ref_inp, **ROUNDING)
                    torch.testing.assert_close(tar, ref_tar, **ROUNDING)
            if train_split:
                torch_loader.set_epoch(0)
                seen.append(set(torch_loader.sampler))
    if not workers:
        assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 256  # shards disjoint and covering


@pytest.mark.multiprocess
def test_dali_workers_start_after_the_step0_batch_was_read(era5_dir):
    """first_batch() opens HDF5 files in the main process; the pipeline's spawned workers must not get them
    (h5py handles cannot be pickled), and validation passes reuse their pipeline."""
    valid = loader(era5_dir, "dali", False, num_data_workers=1)
    expected = loader(era5_dir, "pytorch", False).first_batch()
    torch.testing.assert_close(valid.first_batch()[0], expected[0], **ROUNDING)
    first_pass = [inp.clone() for inp, _ in valid]
    pipeline = valid.iterator
    second_pass = [inp.clone() for inp, _ in valid]
    assert valid.iterator is pipeline and len(first_pass) == len(second_pass) == len(valid)
    torch.testing.assert_close(second_pass[0], first_pass[0], **ROUNDING)
    torch.testing.assert_close(first_pass[0], expected[0], **ROUNDING)


def test_dali_resumes_mid_epoch_and_its_first_batch_consumes_nothing(era5_dir):
    torch_loader = loader(era5_dir, "pytorch", True)
    dali_loader = loader(era5_dir, "dali", True)
    first = dali_loader.first_batch()
    whole = epoch_batches(dali_loader, 0)
    assert len(whole) == len(torch_loader) == 64  # the first epoch is not a batch short
    torch.testing.assert_close(first[0], whole[0][0], **ROUNDING)
    resumed = epoch_batches(dali_loader, 2, skip=60)  # another epoch, after 60 of its steps
    expected = epoch_batches(torch_loader, 2, skip=60)
    assert len(resumed) == len(expected) == 4
    for (inp, _), (ref_inp, _) in zip(resumed, expected):
        torch.testing.assert_close(inp, ref_inp, **ROUNDING)
    after = epoch_batches(dali_loader, 3)  # and the next epoch is whole again
    assert len(after) == 64
    torch.testing.assert_close(after[0][0], epoch_batches(torch_loader, 3)[0][0], **ROUNDING)


def losses(run_dir):
    events = EventAccumulator(os.path.join(run_dir, "logs"))
    events.Reload()
    return {(tag, e.step): e.value for tag in ("Loss/train", "Loss/valid") for e in events.Scalars(tag)}


@pytest.mark.compat
def test_training_with_either_loader_gives_the_same_losses(era5_dir, tmp_path):
    runs = {}
    for config in ("pytorch", "dali"):
        expdir = tmp_path / config
        train.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir), "--num_iters", "70",
                    "--data_loader_config", config])
        runs[config] = losses(os.path.join(str(expdir), "tiny", "1GPU", "00"))
        if config == "dali":
            assert "data loader initialized with config dali" in open(
                os.path.join(str(expdir), "tiny", "1GPU", "00", "out.log")).read()
    assert sorted(runs["dali"]) == sorted(runs["pytorch"]) and ("Loss/train", 70) in runs["dali"]
    # inputs equal within float32 rounding; after 70 Adam steps the losses agree to 1e-5
    assert runs["dali"] == pytest.approx(runs["pytorch"], rel=1e-5)


def test_missing_dali_is_one_clear_line(era5_dir, monkeypatch):
    from utils.errors import UserError
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # import nvidia.dali now raises ImportError
    with pytest.raises(UserError, match="data_loader_config 'dali' needs NVIDIA DALI, which cannot be imported"):
        loader(era5_dir, "dali", True)

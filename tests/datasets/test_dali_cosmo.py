"""The cosmology DALI loader (`--data_loader_config dali-lowmem`) against CosmoDataset's `lowmem` loader, on CPU
(DALI with device_id=None; the GPU variant is marked `gpu`).

Both loaders take every crop from one place, crop_plan (loaders/cosmo.py): the PyTorch loader reads the
window from the HDF5 file and rotates it with numpy, DALI reads it from the channels-last .npy copy (ROI read) and
turns it with a transpose and a flip. Equal arrays, bit for bit, mean both did the same thing. Training the UNet
`tiny` config with either loader gives the same losses, and a run stopped mid-epoch and resumed ends with the
weights of an uninterrupted one. A failure points to loaders/dali_cosmo.py (ROI, the translation of a
rotation into a permutation and flips, epoch length, validation padding, resume) or loaders/common.py (the
shared loader interface), or, for the rank and epoch checks, to crop_plan and CropSampler in
loaders/cosmo.py; the benchmark test to benchmarks/bench_loader.py.
"""
import os
import sys

import numpy.testing  # noqa: F401  here, as numpy < 2.1 runs lscpu on this import: a process tests may not start
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from lifecycle.cli import apply_overrides, training_parser
from loaders import get_data_loader
from loaders.common import dali_installed
from loaders.cosmo import ROTATIONS, CosmoDataset, CropPlan
from sample_data.cosmo import write_cosmo
from utils.errors import UserError
from utils.YParams import YParams

pytestmark = pytest.mark.usefixtures("in_repo_root")
CROP = 8


@pytest.fixture(scope="module")
def small_boxes(tmp_path_factory):
    """32^3 training and 16^3 validation boxes (HDF5 and .npy)."""
    return str(write_cosmo(tmp_path_factory.mktemp("cosmo_small"), train_size=32, valid_size=16, verbose=False))


def loader(data_dir, config, train_split, dp_size=1, dp_rank=0, **changes):
    params = YParams("config/UNet.yaml", "tiny")
    argv = ["--data_dir", data_dir, "--local_batch_size", "2"]
    apply_overrides(params, training_parser("t").parse_args(argv), dp_size=dp_size, dp_rank=dp_rank)
    params.update({"data_loader_config": config, "data_size": CROP, "Nsamples": 11, "Nsamples_val": 5,
                   "enable_flips": True, **changes})
    return get_data_loader(params, train=train_split)


def epoch_batches(loader_, epoch, skip=0):
    loader_.set_epoch(epoch, skip)
    return [(inp.clone(), tar.clone()) for inp, tar in loader_]


def assert_same_batches(got, expected):
    assert [inp.shape[0] for inp, _ in got] == [inp.shape[0] for inp, _ in expected]
    for (inp, tar), (ref_inp, ref_tar) in zip(got, expected):
        assert inp.dtype == ref_inp.dtype == torch.float32
        assert torch.equal(inp, ref_inp) and torch.equal(tar, ref_tar)


def test_one_fixed_transpose_of_a_per_sample_view_gives_each_permutation():
    """The reshape trick the DALI pipeline turns crops with, in numpy: viewing a (D, H, W, C) crop with
    turn_view's shape and applying the one TRANSPOSE equals putting the channels first and permuting the
    spatial axes, for each of the 6 permutations (and the 6 give 6 different arrays)."""
    import itertools

    import numpy as np

    from loaders.dali_cosmo import TRANSPOSE, turn_view
    crop = np.random.default_rng(0).random((3, 3, 3, 2), dtype=np.float32)
    turned = []
    for permutation in itertools.permutations(range(3)):
        view = [extent if extent > 0 else crop.shape[3] for extent in turn_view(permutation, 3)]
        got = crop.reshape(view).transpose(TRANSPOSE).reshape(2, 3, 3, 3)
        np.testing.assert_array_equal(got, crop.transpose(3, *permutation))
        turned.append(got)
    assert len({array.tobytes() for array in turned}) == 6


def test_every_rotation_and_flip_is_the_same_in_both_loaders(small_boxes, monkeypatch):
    """The plan fed to both loaders: sample i gets rotation i (all 24) and the flips of the bits of i % 8 (all 8),
    at a corner that moves with i."""
    def plan(self, key):
        index = key[1] if isinstance(key, tuple) else key
        flips = tuple(axis for axis in range(3) if (index % 8) >> axis & 1)
        return CropPlan((index % 9, 2 * index % 25, 24 - index), index % len(ROTATIONS), flips)

    monkeypatch.setattr(CosmoDataset, "plan", plan)
    torch_loader = loader(small_boxes, "lowmem", True, Nsamples=24)
    dali_loader = loader(small_boxes, "dali-lowmem", True, Nsamples=24)
    torch_loader.set_epoch(0)
    assert sorted(key[1] for key in torch_loader.sampler) == list(range(24))  # every rotation is drawn
    assert_same_batches(epoch_batches(dali_loader, 0), epoch_batches(torch_loader, 0))


@pytest.mark.compat
@pytest.mark.parametrize("dp_size", [1, 2])
def test_dali_returns_the_lowmem_crops_on_each_rank(small_boxes, dp_size):
    """Random plans: training (epochs 0 and 1, whole batches only) and validation (its last batch partial)."""
    first_crops = []
    for rank in range(dp_size):
        for train_split in (True, False):
            torch_loader = loader(small_boxes, "lowmem", train_split, dp_size, rank)
            dali_loader = loader(small_boxes, "dali-lowmem", train_split, dp_size, rank)
            assert type(dali_loader).__name__ == "CosmoDALILoader" and len(dali_loader) == len(torch_loader)
            assert dali_loader.sample_shape == torch_loader.sample_shape == (4, CROP, CROP, CROP)
            for epoch in (0, 1):
                expected = epoch_batches(torch_loader, epoch)
                assert_same_batches(epoch_batches(dali_loader, epoch), expected)
                if train_split and epoch == 0:
                    first_crops.append(expected[0][0])
                    assert len(expected) == 11 // dp_size // 2  # drop_last
                    torch_loader.set_epoch(0)
                    assert len({dali_loader.dataset.plan(key) for key in torch_loader.sampler}) == 11 // dp_size
                if not train_split:
                    assert [len(inp) for inp, _ in expected] == ([2, 2, 1] if dp_size == 1 else [2, 1])
    if dp_size == 2:  # upstream gave every rank the same crops
        assert not torch.equal(first_crops[0], first_crops[1])


@pytest.mark.multiprocess
def test_dali_threads_return_the_lowmem_crops(small_boxes):
    """`--num_data_workers 2` gives the pipeline 2 CPU threads (the reads and turns run in parallel): the same
    batches, training (and a resume mid-epoch) and validation."""
    for train_split in (True, False):
        torch_loader = loader(small_boxes, "lowmem", train_split, num_data_workers=2)
        dali_loader = loader(small_boxes, "dali-lowmem", train_split, num_data_workers=2)
        expected = epoch_batches(torch_loader, 1)
        assert_same_batches(epoch_batches(dali_loader, 1), expected)
        if train_split:
            assert_same_batches(epoch_batches(dali_loader, 1, skip=2), expected[2:])


def test_dali_resumes_mid_epoch_and_its_first_batch_consumes_nothing(small_boxes):
    torch_loader = loader(small_boxes, "lowmem", True, Nsamples=16)
    dali_loader = loader(small_boxes, "dali-lowmem", True, Nsamples=16)
    first = dali_loader.first_batch()
    whole = epoch_batches(dali_loader, 0)
    assert len(whole) == len(torch_loader) == 8  # the first epoch is not a batch short
    assert torch.equal(first[0], whole[0][0]) and torch.equal(first[1], whole[0][1])
    resumed = epoch_batches(dali_loader, 2, skip=5)  # another epoch, after 5 of its steps
    assert len(resumed) == 3
    assert_same_batches(resumed, epoch_batches(torch_loader, 2)[5:])
    after = epoch_batches(dali_loader, 3)  # and the next epoch is whole again, and another set of crops
    assert_same_batches(after, epoch_batches(torch_loader, 3))
    assert not torch.equal(after[0][0], whole[0][0])
    assert "rotation" in dali_loader.describe(0, 1)


def run_summary(run_dir):
    """(TensorBoard losses {(tag, step): value}, final weights) of a run."""
    events = EventAccumulator(os.path.join(run_dir, "logs"))
    events.Reload()
    losses = {(tag, e.step): e.value for tag in ("Loss/train", "Loss/valid") for e in events.Scalars(tag)}
    weights = torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)["model"]
    return losses, weights


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """UNet `tiny` (crops 32^3, 8 steps per epoch) for 10 iterations, so that a pipeline goes on into a second epoch
    after a validation pass: with lowmem, with dali-lowmem, and with dali-lowmem stopped at iteration 5 and resumed."""
    tmp = tmp_path_factory.mktemp("tiny_runs")
    data = str(write_cosmo(tmp / "cosmo", verbose=False))
    runs = {}
    for name, config, stops in (("lowmem", "lowmem", [None]), ("dali", "dali-lowmem", [None]),
                                ("dali_resumed", "dali-lowmem", [5, None])):
        for stop in stops:
            train.main(["--yaml_config", "config/UNet.yaml", "--config", "tiny", "--data_dir", data, "--expdir",
                        str(tmp / name), "--data_loader_config", config, "--num_iters", "10"]
                       + (["--stop_at_iter", str(stop)] if stop else []))
        run_dir = os.path.join(str(tmp / name), "tiny", "1GPU", "00")
        assert f"data loader initialized with config {config}" in open(os.path.join(run_dir, "out.log")).read()
        runs[name] = run_summary(run_dir)
    return runs


def test_training_with_either_loader_gives_the_same_losses(tiny_runs):
    """The inputs are bitwise equal, so every TensorBoard loss agrees to 1e-6 (room left for CPU kernels that
    reorder sums between runs)."""
    (torch_losses, _), (dali_losses, _) = tiny_runs["lowmem"], tiny_runs["dali"]
    assert sorted(dali_losses) == sorted(torch_losses) and ("Loss/train", 10) in torch_losses
    assert dali_losses == pytest.approx(torch_losses, rel=1e-6)
    assert torch_losses[("Loss/train", 10)] != torch_losses[("Loss/train", 8)]  # it trained: losses moved


def test_a_resumed_run_reads_the_crops_of_an_uninterrupted_one(tiny_runs):
    """Stopped mid-epoch at iteration 5 and resumed, the DALI pipeline restarts at (epoch 0, step 5): the crops are a
    function of (seed, epoch, index), so the run ends with the weights of the uninterrupted run (1e-6)."""
    (losses, weights), (resumed_losses, resumed_weights) = tiny_runs["dali"], tiny_runs["dali_resumed"]
    assert resumed_losses == pytest.approx(losses, rel=1e-6)
    assert weights.keys() == resumed_weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(resumed_weights[name], tensor, rtol=1e-6, atol=1e-7, msg=name)


def test_missing_dali_is_one_clear_line(small_boxes, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # import nvidia.dali now raises ImportError
    with pytest.raises(UserError, match="data_loader_config 'dali-lowmem' needs NVIDIA DALI, which cannot be "
                                        "imported .*; use --data_loader_config lowmem, or install"):
        loader(small_boxes, "dali-lowmem", True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU pipeline needs CUDA")
@pytest.mark.skipif(not dali_installed(), reason="NVIDIA DALI is not installed (pip install nvidia-dali-cuda120)")
def test_gpu_pipeline_returns_the_cpu_crops(small_boxes):
    torch_loader = loader(small_boxes, "lowmem", True, Nsamples=24)
    dali_loader = loader(small_boxes, "dali-lowmem", True, Nsamples=24)
    got = epoch_batches(dali_loader, 1)
    assert all(inp.is_cuda and tar.is_cuda for inp, tar in got)
    assert_same_batches([(inp.cpu(), tar.cpu()) for inp, tar in got], epoch_batches(torch_loader, 1))


@pytest.mark.multiprocess
def test_bench_loader_cosmo_reports_every_loader_against_the_raw_rate(tmp_path):
    """`make bench-loader-cosmo` on a 32^3 box (generated by the benchmark), 6 batches (CPU time counts in 10 ms
    ticks: with 2 the workers' could read 0 on a loaded machine), one variant of each loader with one worker or
    thread, two rounds: the report has exactly the expected rows, each with its CPU time per batch, and the loaders
    with a worker spend some; each row's rate is the median of its two rounds' and its ratio to the raw h5py rate
    is that median's; the workers' speed-up, issue #39's targets and DALI over PyTorch are the rows' rates divided
    round by round, and DALI's rounds ahead are counted from them."""
    import json
    import statistics

    from benchmarks import bench_loader
    out = tmp_path / "loader.json"
    assert bench_loader.main(["--dataset", "cosmo", "--data_dir", str(tmp_path / "cosmo"), "--box", "32", "--crop",
                              "16", "--nbatches", "6", "--warmup", "1", "--workers", "0", "1", "--threads", "1",
                              "--repeats", "2", "--before_workers", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    rows = {row["loader"]: row for row in results["rows"]}
    device = "GPU" if torch.cuda.is_available() else "CPU"
    dali, pytorch = f"DALI ({device}), 1 threads", "PyTorch lowmem, 1 workers"
    before = "PyTorch lowmem, 1 workers, fresh shared memory per batch (before the ring)"
    host_parts = {f"PyTorch lowmem, {count} workers, turned on the GPU (host part)" for count in (0, 1)}
    assert set(rows) == {"raw npy memmap (1 thread)", "raw h5py (1 thread)", "PyTorch lowmem, 0 workers", pytorch,
                         dali, before} | host_parts
    # CPU time per batch is read from /proc for the process and its workers, in clock ticks of 10 ms: a loader of
    # six small batches may spend less than one (so a single row may read 0), but the two loaders with a worker
    # together spend some; every row has one (the sum fails on a row whose /proc could not tell)
    cpu = {label: rows[label]["per_batch"]["user_ms"] + rows[label]["per_batch"]["system_ms"] for label in rows}
    assert cpu[pytorch] + cpu[before] > 0, cpu
    assert results["worker_speedups"]["1"]["over_0"]["runs"] == pytest.approx(
        [w / z for w, z in zip(rows[pytorch]["runs"], rows["PyTorch lowmem, 0 workers"]["runs"])])
    # the ratios are to the raw h5py rate of the same windows (the memory map's row is extra information)
    assert results["raw_reference"] == "raw h5py (1 thread)" and results["box"] == [32, 32, 32]
    raw = rows["raw h5py (1 thread)"]["samples_per_sec"]
    for row in rows.values():
        assert len(row["runs"]) == 2 and row["samples_per_sec"] == pytest.approx(statistics.median(row["runs"]))
        assert row["samples_per_sec"] > 0 and row["ratio_to_raw"] == pytest.approx(row["samples_per_sec"] / raw)
    # issue #39's target, round by round: lowmem without workers over the raw h5py reads, the host turning the
    # crops or the GPU (the host part), on one thread
    target = results["lowmem_over_raw_h5py"]["0 workers"]
    assert results["torch_threads"] == 1 and target["GPU turns"] == pytest.approx(statistics.median(
        [h / r for h, r in zip(rows["PyTorch lowmem, 0 workers, turned on the GPU (host part)"]["runs"],
                               rows["raw h5py (1 thread)"]["runs"])]))
    assert target["host turns"] == pytest.approx(statistics.median(
        [h / r for h, r in zip(rows["PyTorch lowmem, 0 workers"]["runs"], rows["raw h5py (1 thread)"]["runs"])]))
    versus = results["dali_over_pytorch"]
    assert list(versus) == ["1"] and versus["1"]["runs"] == pytest.approx(
        [d / p for d, p in zip(rows[dali]["runs"], rows[pytorch]["runs"])])
    assert versus["1"]["rounds_ahead"] == sum(ratio >= 1 for ratio in versus["1"]["runs"])


@pytest.mark.multiprocess
def test_bench_loader_cosmo_without_dali_measures_the_rest(tmp_path, monkeypatch, capsys):
    """On a GPU node without DALI (the 2026-11-28 H100 session ended in a traceback there) the cosmology benchmark
    leaves DALI's rows out, says so once, and writes the others, issue #39's target (lowmem over the raw h5py reads)
    computed from them. Twin: with DALI the row is there."""
    import json

    from benchmarks import bench_loader
    for installed in (False, True):
        if installed and not dali_installed():
            continue  # the twin needs DALI
        monkeypatch.setattr(bench_loader.loader_common, "dali_installed", lambda installed=installed: installed)
        out = tmp_path / f"loader_{installed}.json"
        assert bench_loader.main(["--dataset", "cosmo", "--data_dir", str(tmp_path / "cosmo"), "--box", "32",
                                  "--crop", "16", "--nbatches", "1", "--warmup", "0", "--workers", "0", "--threads",
                                  "1", "--before_workers", "0", "--out", str(out)]) == 0
        results = json.loads(out.read_text())
        dali_rows = [row["loader"] for row in results["rows"] if row["loader"].startswith("DALI")]
        if installed:
            assert dali_rows and "dali" not in results
        else:
            assert dali_rows == [] and results["dali_over_pytorch"] == {}
            assert results["dali"].startswith("NVIDIA DALI is not installed here")
            assert "[bench_loader] NVIDIA DALI is not installed here" in capsys.readouterr().out
            rows = {row["loader"]: row["runs"] for row in results["rows"]}  # one round each
            assert results["lowmem_over_raw_h5py"]["0 workers"]["host turns"] == pytest.approx(
                rows["PyTorch lowmem, 0 workers"][0] / rows["raw h5py (1 thread)"][0])  # issue #39's target still


def test_bench_loader_refuses_zero_rounds_in_one_line(capsys):
    from benchmarks import bench_loader
    with pytest.raises(SystemExit) as stop:
        bench_loader.main(["--dataset", "cosmo", "--repeats", "0"])
    assert stop.value.code == 2 and "--repeats and --nbatches must be at least 1" in capsys.readouterr().err

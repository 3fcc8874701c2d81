"""The shared training spine (utils/training.py, the loader interface, the "dp" group): train.py built on it
reproduces the recorded numbers of each stage, loaders serve the loop through one interface, reductions follow
the named group, and the LR schedule is stepped outside the training step.

A failure in the first test means a change altered what training computes (tests/data/spine_reference.json holds
every TensorBoard point and the weight sums of each stage's `tiny` run); the others point to
loaders/common.py (TorchLoader), utils/comm.py or train.py's step function.
"""
import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from sample_data import write_cifar100, write_cosmo
from tests.conftest import REPO_ROOT, as_spawned_rank, free_port

pytestmark = pytest.mark.usefixtures("in_repo_root")
REFERENCE = os.path.join(REPO_ROOT, "tests", "data", "spine_reference.json")
YAML = {"vit": "config/ViT.yaml", "unet": "config/UNet.yaml", "resnet": "config/ResNet50.yaml"}


@pytest.fixture(scope="module")
def stage_data(era5_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spine_data")
    return {"vit": era5_dir, "unet": str(write_cosmo(tmp / "cosmo", verbose=False)),
            "resnet": str(write_cifar100(tmp / "cifar", train_per_class=4, test_per_class=1, verbose=False))}


@pytest.mark.parametrize("stage", ["vit", "unet", "resnet"])
def test_train_reproduces_each_stages_recorded_points_and_weights(stage, stage_data, tmp_path):
    """Every TensorBoard point and the final weights of each stage's `tiny` run, against the recorded values
    (tests/data/spine_reference.json, first recorded with the original single-file train.py; where this CPU's kernels
    give other numbers, the original's values recorded on such a CPU)."""
    recorded = json.load(open(REFERENCE))
    reference = dict(recorded["stages"][stage])
    reference.update(recorded["by_cpu_capability"].get(torch.backends.cpu.get_cpu_capability(), {}).get(stage, {}))
    train.main(["--yaml_config", YAML[stage], "--config", "tiny", "--data_dir", stage_data[stage],
                "--expdir", str(tmp_path), *reference["flags"]])
    run_dir = os.path.join(str(tmp_path), "tiny", "1GPU", "00")
    events = EventAccumulator(os.path.join(run_dir, "logs"))
    events.Reload()
    for tag, points in reference["scalars"].items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [step for step, _ in got] == [step for step, _ in points], tag
        for (_, value), (_, expected) in zip(got, points):
            assert value == pytest.approx(expected, rel=1e-4, abs=1e-6), tag
    model = torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=False)["model"]
    sums = [tensor.double().sum().item() for tensor in model.values() if tensor.is_floating_point()]
    assert sums == pytest.approx(reference["weight_sums"], rel=1e-4, abs=1e-4)


def params_for(tmp_path, era5_dir, **changes):
    from utils.cli import apply_overrides, training_parser
    from utils.YParams import YParams
    params = YParams("config/ViT.yaml", "tiny")
    args = training_parser("t").parse_args(["--config", "tiny", "--data_dir", era5_dir])
    apply_overrides(params, args, dp_size=changes.pop("dp_size", 1), dp_rank=changes.pop("dp_rank", 0))
    params.update(changes)
    return params


def test_torch_loader_resumes_mid_epoch_and_peeks_without_consuming(era5_dir, tmp_path):
    from loaders import get_data_loader
    loader = get_data_loader(params_for(tmp_path, era5_dir), train=True)
    assert len(loader) == 64 and loader.sample_shape == (20, 16, 32)
    loader.set_epoch(1)
    whole_epoch = [inp for inp, _ in loader]
    loader.set_epoch(1, skip=5)  # exact mid-epoch resume: the same batches from step 5 on
    rest = [inp for inp, _ in loader]
    assert len(rest) == len(whole_epoch) - 5
    assert all(torch.equal(a, b) for a, b in zip(rest, whole_epoch[5:]))
    loader.set_epoch(0)
    first = next(iter(loader))[0]
    assert torch.equal(loader.first_batch()[0], first)
    assert not torch.equal(whole_epoch[0], first)  # epochs are shuffled differently (the check can fail)
    assert ".h5 time steps" in loader.describe(1, 3)


def test_first_batch_of_random_crops_leaves_the_training_stream_alone(tmp_path):
    """The cosmology dataset draws crops from its own generator: looking at the step-0 batch must not shift
    the crops training sees."""
    from loaders import get_data_loader
    from utils.cli import apply_overrides, training_parser
    from utils.YParams import YParams
    data = write_cosmo(tmp_path / "cosmo", verbose=False)
    params = YParams("config/UNet.yaml", "tiny")
    apply_overrides(params, training_parser("t").parse_args(["--data_dir", str(data)]), dp_size=1, dp_rank=0)
    untouched = get_data_loader(params, train=True)
    expected = next(iter(untouched))[0]
    loader = get_data_loader(params, train=True)
    peeked = loader.first_batch()[0]
    assert torch.equal(next(iter(loader))[0], expected)
    assert torch.equal(peeked, expected)  # the step-0 batch is the one training starts with


def _reduce_over_dp(rank, port, results):

    from utils import comm
    as_spawned_rank(rank, 2, port)
    # tp = 2 on 2 ranks: a "dp" group of one rank each (the other rank is a tensor-parallel partner): nothing to average
    comm.init({"tp": 2}, rendezvous_timeout=30)
    local = comm.all_reduce_mean(torch.tensor([float(rank + 1)]), "dp").item()
    comm.init({"tp": 1})  # every rank a replica: "dp" is the world
    world = comm.all_reduce_mean(torch.tensor([float(rank + 1)]), "dp").item()
    results[rank] = (local, world, comm.get_size("dp"))
    comm.destroy()


@pytest.mark.multiprocess
def test_reductions_follow_the_named_group():
    results = mp.Manager().dict()
    mp.spawn(_reduce_over_dp, args=(free_port(), results), nprocs=2)
    assert results[0] == (1.0, 1.5, 2) and results[1] == (2.0, 1.5, 2)


def test_benchmark_mode_does_not_advance_the_lr_schedule(era5_dir, tmp_path, monkeypatch):
    """The schedule steps in the loop, not in the step function the benchmark (and a CUDA graph) runs."""
    calls = []
    original = torch.optim.lr_scheduler.LambdaLR.step
    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "step",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    monkeypatch.setenv("BENCHY_OUTPUT", str(tmp_path / "bench"))
    train.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path), "--enable_benchy",
                "--benchy_nbatches", "3", "--benchy_ntrials", "1", "--benchy_nwarmup", "0"])
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["FULL"]["mean"] > 0 and 0 < results["FULL"]["mfu"] <= 1 and results["peak_memory_gb"] > 0
    assert len(calls) == 1  # LambdaLR's own initial step only: 6 training steps ran, none stepped it
    calls.clear()
    train.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path / "t"), "--num_iters", "3"])
    assert len(calls) == 1 + 3  # training does step it, once per iteration (the count above can fail)

"""Recorded numbers: train.py, on the helpers the training scripts share (lifecycle/run.py, loop/, the
loader interface, the "dp" group), reproduces the recorded numbers of each stage; loaders serve the loop through one
interface, reductions follow the named group, and the LR schedule is stepped outside the training step.

A failure in the first test means a change altered what training computes (recorded_runs.json, beside this file,
holds every TensorBoard point and the weight sums of each stage's `tiny` run, recorded with the original train.py);
the others point to loaders/common.py (TorchLoader), utils/comm.py or train.py's step function. The recorded numbers
are made and checked with the kernels pinned (tests/training/pinned_run.py), which makes them the same on every
x86-64 CPU; the two tests after the first show that the pinning holds against other code paths, and that without it
the numbers move. They depend on the torch version still: none of these tests is in the `compat` subset, and the ViT
stage is skipped on a torch whose nn.init.trunc_normal_ draws other weights than the recording 2.14.1's (2.5.1's).
"""
import json
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

import train
from sample_data import write_cifar100, write_cosmo
from tests.conftest import REPO_ROOT, as_spawned_rank, free_port, scalar_points

pytestmark = pytest.mark.usefixtures("in_repo_root")
HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, "recorded_runs.json")
PINNED_RUN = os.path.join(HERE, "pinned_run.py")
YAML = {"vit": "config/ViT.yaml", "unet": "config/UNet.yaml", "resnet": "config/ResNet50.yaml"}
X86_64 = platform.machine().lower() in ("x86_64", "amd64")
# what an AVX2 CPU and an AVX512 CPU would run, asked for on this one: ATen's kernels, oneDNN's instruction set, MKL's
# branch (MKL honours MKL_ENABLE_INSTRUCTIONS on Intel CPUs only; MKL_CBWR=AVX2 forces its AVX2 branch on any, where
# MKL otherwise picks its own), and the thread count of a smaller and a larger machine
EMULATED = {
    "AVX2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "MKL_CBWR": "AVX2", "OMP_NUM_THREADS": "1"},
    "AVX512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512", "OMP_NUM_THREADS": "2"},
}
needs_x86_64 = pytest.mark.skipif(not X86_64, reason="the pinned kernels give these numbers on x86-64 CPUs only")
needs_avx512 = pytest.mark.skipif(not (X86_64 and torch.cpu._is_avx512_supported()),
                                  reason="emulates AVX2 and AVX512 CPUs: needs a CPU with AVX512 (and so AVX2)")


def trunc_normal_draws_as_recorded():
    """Whether this torch's nn.init.trunc_normal_, the ViT's initialisation, draws what the recording torch's
    (2.14.1) drew: there, at the ViT's std 0.02 (bounds +-2, never reached), what normal_ draws from the same
    generator (rejection sampling, nothing rejected); torch 2.5.1's maps uniform draws through erfinv instead, so its
    ViT starts from other weights and every recorded number moves (by 0.1% at step 0)."""
    generators = [torch.Generator().manual_seed(0) for _ in range(2)]
    return torch.equal(torch.nn.init.trunc_normal_(torch.empty(64), std=0.02, generator=generators[0]),
                       torch.empty(64).normal_(0.0, 0.02, generator=generators[1]))


vit_weights_as_recorded = pytest.mark.skipif(
    not trunc_normal_draws_as_recorded(),
    reason=f"torch {torch.__version__}'s nn.init.trunc_normal_ draws other initial ViT weights than the recording "
           "torch 2.14.1's (inverse CDF, not rejection sampling): other numbers from step 0 on")


@pytest.fixture(scope="module")
def stage_data(era5_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stage_data")
    return {"vit": era5_dir, "unet": str(write_cosmo(tmp / "cosmo", verbose=False)),
            "resnet": str(write_cifar100(tmp / "cifar", train_per_class=4, test_per_class=1, verbose=False))}


def train_commands(*runs, data_dir, stage="resnet", flags=()):
    """Run train.py on `stage`'s `tiny` config as commands, all at once (a pinned run uses one thread): each run is
    (expdir, pinned, env), through pinned_run.py or not, with `env` added to the environment (CUDA is hidden
    already, conftest.py). The run directories."""
    processes = []
    try:
        for expdir, pinned, env in runs:
            command = [sys.executable, *([PINNED_RUN] if pinned else []), "train.py", "--yaml_config",
                       YAML[stage], "--config", "tiny", "--data_dir", data_dir, "--expdir", str(expdir), *flags]
            processes.append(subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, **env}, text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for process in processes:
            output = process.communicate(timeout=600)[0]
            assert process.returncode == 0, output[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [os.path.join(str(expdir), "tiny", "1GPU", "00") for expdir, _, _ in runs]


def final_weights(run_dir):
    return torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)["model"]


@needs_x86_64
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [pytest.param("vit", marks=vit_weights_as_recorded),
                                   pytest.param("unet", marks=pytest.mark.long),
                                   pytest.param("resnet", marks=pytest.mark.long)])
def test_train_reproduces_each_stages_recorded_points_and_weights(stage, stage_data, tmp_path):
    """Every TensorBoard point and the final weights of each stage's `tiny` run, against the values recorded with the
    original single-file train.py (recorded_runs.json). Both runs pin the kernels (pinned_run.py),
    so any x86-64 CPU gives the recorded numbers (here bit for bit but ViT's last Loss/train, which today's double
    sum of the step losses puts 1 ulp away from the original's float mean)."""
    reference = json.load(open(REFERENCE))["stages"][stage]
    run_dir, = train_commands((tmp_path, True, {}), stage=stage, data_dir=stage_data[stage], flags=reference["flags"])
    got = scalar_points(run_dir)
    for tag, points in reference["scalars"].items():
        assert [step for step, _ in got.get(tag, [])] == [step for step, _ in points], tag
        for (_, value), (_, expected) in zip(got[tag], points):
            assert value == pytest.approx(expected, rel=1e-4, abs=1e-6), tag
    sums = [tensor.double().sum().item() for tensor in final_weights(run_dir).values() if tensor.is_floating_point()]
    assert sums == pytest.approx(reference["weight_sums"], rel=1e-4, abs=1e-4)


def resnet_runs_as_on_avx2_and_avx512(stage_data, tmp_path, pinned):
    """(TensorBoard points, final weights) of two 1-step ResNet runs, one with the code paths of an AVX2 CPU asked
    for, one with those of an AVX512 CPU (EMULATED): step 0's points, then a step through convolutions, BatchNorm
    and SGD, and a validation pass."""
    run_dirs = train_commands(*[(tmp_path / name, pinned, env) for name, env in EMULATED.items()],
                              data_dir=stage_data["resnet"], flags=["--num_iters", "1"])
    return [(scalar_points(run_dir), final_weights(run_dir)) for run_dir in run_dirs]


def same_bits(run, other):
    (points, weights), (other_points, other_weights) = run, other
    return points == other_points and weights.keys() == other_weights.keys() and all(
        torch.equal(weights[name], other_weights[name]) for name in weights)


@needs_avx512
@pytest.mark.multiprocess
@pytest.mark.long  # the claim in make test: the ViT's recorded run, recorded on another CPU, reproduced here
def test_pinned_kernels_give_the_same_bits_for_avx2_and_avx512_code_paths(stage_data, tmp_path):
    """The pinning overrides what the environment asks for: with the AVX2 or the AVX512 code paths of ATen, oneDNN
    and MKL asked for, and 1 or 2 threads, pinned_run.py's runs end with the same points and weights, bit for bit."""
    avx2, avx512 = resnet_runs_as_on_avx2_and_avx512(stage_data, tmp_path, pinned=True)
    assert same_bits(avx2, avx512)


@needs_avx512
@pytest.mark.multiprocess
@pytest.mark.long
def test_unpinned_kernels_give_other_numbers_for_avx2_and_avx512_code_paths(stage_data, tmp_path):
    """Twin: the same two runs without the pinning end with other weights (after the one step, about 90 of the 102
    tensors differ in their last bits; the points happen to agree this early, at 6 steps the losses move by 0.2-0.4%):
    the kernels an AVX2 and an AVX512 CPU run differ, so the test above can fail."""
    avx2, avx512 = resnet_runs_as_on_avx2_and_avx512(stage_data, tmp_path, pinned=False)
    assert not same_bits(avx2, avx512)


def params_for(tmp_path, era5_dir, **changes):
    from lifecycle.cli import apply_overrides, training_parser
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
    from lifecycle.cli import apply_overrides, training_parser
    from loaders import get_data_loader
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

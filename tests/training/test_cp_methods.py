"""train_mp.py's `--cp_method ring` and `--cp_method alltoall` against the serial train.py, end to end (the attention
of each against the serial layer, and its twins, at cp=2, cp=4, tp=2 x cp=2 and cp=2 x dp=2:
tests/parallel/test_context_parallel.py).

On CPU with gloo, each run reproduces the serial run's TensorBoard points and weights after 20 iterations (1e-4
relative on the points; 1e-4 relative and 1e-5 absolute on the weights, as tests/training/test_train_mp.py):
- at cp=2 a ring run stopped at iteration 10 and resumed with all-to-all to 20: a checkpoint written under one
  method resumes under another (checkpoints hold the serial model; the methods add no parameters);
- (long) the methods composed with the rest of the recipe: ring at tp=2 x cp=2 with sequence parallelism and at
  cp=2 x dp=2 with activation checkpointing, all-to-all at cp=2 x dp=2 with FSDP and at tp=2 x cp=2 with sequence
  parallelism (on the tiny config with 4 heads, so that the 2 heads left after tp split over cp);
- (long) the twins, each method's switch flipped in the spawned ranks (the ring without the rescale of its running
  result, the ring with its own block taken twice, all-to-all's heads back in the wrong order): the run leaves the
  serial one.
A failure points to distributed/context_parallel.py, distributed/layers.py (DistributedAttention.attend),
distributed/parallelize.py (the method handed to the layers) or utils/layout.py (Layout.from_flags).
"""
import os

import pytest
import torch
import torch.multiprocessing as mp
import yaml

import train
import train_mp
from tests.conftest import as_spawned_rank, free_port, run_ranks
from tests.parallel.test_fsdp import FSDP_ON_CPU
from tests.training.test_train_mp import ITERS, assert_same_run, results

pytestmark = pytest.mark.usefixtures("in_repo_root")


def four_heads_config(folder):
    """The tiny config with 4 heads of 8 (tiny has 2 of 16): at tp=2 two heads are left, which all-to-all splits
    over cp=2. A YAML file of its own, config `tiny`."""
    tiny = dict(yaml.safe_load(open("config/ViT.yaml"))["tiny"])  # merge keys resolved: the whole config
    tiny["num_heads"] = 4
    path = os.path.join(str(folder), "vit_4heads.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"tiny": tiny}, f)
    return path


def serial_run(era5_dir, expdir, *flags):
    train.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir), "--num_iters", ITERS, *flags])
    return results(os.path.join(str(expdir), "tiny", "1GPU", "00"))


@pytest.fixture(scope="module")
def serial(era5_dir, tmp_path_factory):
    return serial_run(era5_dir, tmp_path_factory.mktemp("serial"))


@pytest.fixture(scope="module")
def serial_4heads(era5_dir, tmp_path_factory):
    expdir = tmp_path_factory.mktemp("serial_4heads")
    return serial_run(era5_dir, expdir, "--yaml_config", four_heads_config(expdir))


def run_method(era5_dir, expdir, nproc, tp, cp, method, *flags):
    """train_mp.py on `nproc` gloo ranks with --cp_method `method`: (TensorBoard points, checkpoint), and the log."""
    result = run_ranks(["train_mp.py", "--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir),
                        "--num_iters", ITERS, "--tensor_parallel", str(tp), "--context_parallel", str(cp),
                        "--cp_method", method, *flags], nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return results(os.path.join(str(expdir), "tiny", f"{tp * cp}MP", "00")), result.stderr


@pytest.mark.compat
@pytest.mark.multiprocess
def test_a_ring_run_resumed_with_all_to_all_reproduces_the_serial_run(era5_dir, tmp_path, serial):
    """cp=2 (16 tokens a rank): ring for 10 iterations (its checkpoint written), then all-to-all in the same run
    directory to 20. Every point of both halves and the final weights are the serial run's."""
    (points, checkpoint), log = run_method(era5_dir, tmp_path, 2, 1, 2, "ring", "--stop_at_iter", "10")
    assert checkpoint["iteration"] == 10 and "Setting DP = 1, TP = 1, CP = 2 (ring), PP = 1" in log
    first_half = {key: value for key, value in serial[0].items() if key[1] <= 10}
    assert sorted(points) == sorted(first_half) and points == pytest.approx(first_half, rel=1e-4)
    got, log = run_method(era5_dir, tmp_path, 2, 1, 2, "alltoall")
    assert "Resumed from" in log and "resumed at DP = 1, TP = 1, CP = 2 (alltoall), PP = 1" in log
    assert_same_run(got, serial)


@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.parametrize("method, tp, cp, flags", [
    ("ring", 2, 2, ("--sequence_parallel",)),
    ("ring", 1, 2, ("--activation_checkpointing",)),
    pytest.param("alltoall", 1, 2, ("--fsdp",), marks=FSDP_ON_CPU)],
    ids=["ring-tp2xcp2-sequence-parallel", "ring-cp2xdp2-checkpointing", "alltoall-cp2xdp2-fsdp"])
def test_each_method_composes_with_the_recipe_on_four_ranks(era5_dir, tmp_path, serial, method, tp, cp, flags):
    got, log = run_method(era5_dir, tmp_path, 4, tp, cp, method, *flags)
    assert f"Setting DP = {4 // (tp * cp)}, TP = {tp}, CP = {cp} ({method}), PP = 1" in log
    assert_same_run(got, serial)


@pytest.mark.multiprocess
@pytest.mark.long
def test_all_to_all_at_tp2_x_cp2_reproduces_the_serial_run(era5_dir, tmp_path, serial_4heads):
    """4 heads: tp=2 leaves 2 on each rank, all-to-all gives each cp rank 1 over all 32 tokens; with sequence
    parallelism (each cp chunk split again over tp between the blocks)."""
    got, _ = run_method(era5_dir, tmp_path, 4, 2, 2, "alltoall", "--sequence_parallel", "--yaml_config",
                        four_heads_config(tmp_path))
    assert_same_run(got, serial_4heads)


def _train_with_a_switch_off(rank, world, port, switch, argv):
    as_spawned_rank(rank, world, port, OMP_NUM_THREADS="1")
    from distributed import context_parallel
    torch.set_num_threads(1)
    setattr(context_parallel, switch, False)
    train_mp.main(argv)


@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.parametrize("method, switch", [("ring", "RESCALE"), ("ring", "EACH_BLOCK_ONCE"),
                                            ("alltoall", "HEADS_IN_ORDER")],
                         ids=["ring-without-the-rescale", "ring-with-a-block-taken-twice",
                              "alltoall-heads-in-the-wrong-order"])
def test_the_twins_leave_the_serial_run(era5_dir, tmp_path, serial, method, switch):
    argv = ["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path), "--num_iters", ITERS,
            "--context_parallel", "2", "--cp_method", method]
    mp.spawn(_train_with_a_switch_off, args=(2, free_port(), switch, argv), nprocs=2)
    (_, checkpoint) = got = results(os.path.join(str(tmp_path), "tiny", "2MP", "00"))
    with pytest.raises(AssertionError):
        assert_same_run(got, serial)
    largest = max((checkpoint["model"][name] - weight).abs().max().item()
                  for name, weight in serial[1]["model"].items())
    assert largest > 1e-3, largest  # far beyond the comparison's 1e-5

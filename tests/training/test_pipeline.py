"""train_mp.py's pipeline parallelism (--pipeline_parallel, distributed/pipeline.py) against the serial train.py, end
to end on gloo ranks: the tiny config with 4 blocks and 4 heads (so that pp 4, tp 2 and all-to-all at cp 2 split
it), 8 iterations.

Each run reproduces the serial run's TensorBoard points (1e-4 relative) and its weights and Adam moments after the
last step (1e-4 relative, 1e-5 absolute: tests/training/test_train_mp.py's assert_same_run):
- pp=2, 1F1B, M = P = 2 (make test); (long) pp=4 at M = 2P (1F1B, local batch 8, against a serial run at batch 8);
- (long) pp=2 x cp=2 with the ring and activation checkpointing (each cp rank reading its band), pp=2 x dp=2 (each
  dp rank its shard);
- (long) a run saved at pp=4 resumed at pp=2, then at pp=1, then in train.py: every half is the serial run's;
- (long) 1F1B one warm-up step short hangs, and the collective timeout ends it in one line.
The other layouts (GPipe, pp=4 at M = P, pp x tp with sequence parallelism, all-to-all, FSDP) and the twins that
leave the serial model: tests/parallel/test_pipeline_stages.py, in one group of spawned ranks.
The rules (M < P, a stage without blocks, a batch that does not split into microbatches) are the layout's:
tests/parallel/test_parallel_layout.py. The stages' cut: test_balanced_layers below.
A failure points to distributed/pipeline.py (the schedules, the exchanges), distributed/parallelize.py (step 0),
distributed/serial_state.py (the stages' checkpoint) or networks/vit.py (a stage's forward).
"""
import os
import re
import sys

import pytest
import torch
import yaml

import train
from distributed.pipeline import balanced_layers
from lifecycle import shards
from tests.conftest import REPO_ROOT, run_plain_ranks, run_ranks
from tests.training.test_reliability import killed_under_torchrun
from tests.training.test_train_mp import assert_same_run, results

pytestmark = pytest.mark.usefixtures("in_repo_root")
ITERS = "8"


def four_blocks_config(folder):
    """tiny with 4 blocks of 4 heads (tiny has 2 of 2): a YAML file of its own, config `tiny`."""
    tiny = dict(yaml.safe_load(open(os.path.join(REPO_ROOT, "config", "ViT.yaml")))["tiny"])
    tiny.update(depth=4, num_heads=4)
    path = os.path.join(str(folder), "vit_4blocks.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"tiny": tiny}, f)
    return path


def flags(era5_dir, expdir, config, *more):
    return ["--yaml_config", config, "--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir),
            "--num_iters", ITERS, "--checkpoint_interval", "0", *more]


def serial_run(era5_dir, tmp_path_factory, *more):
    expdir = tmp_path_factory.mktemp("serial")
    train.main(flags(era5_dir, expdir, four_blocks_config(expdir), *more))
    return results(os.path.join(str(expdir), "tiny", "1GPU", "00"))


@pytest.fixture(scope="module")
def serial(era5_dir, tmp_path_factory):
    return serial_run(era5_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def serial_batch8(era5_dir, tmp_path_factory):
    return serial_run(era5_dir, tmp_path_factory, "--local_batch_size", "8")


def run_pp(era5_dir, expdir, nproc, *more):
    """train_mp.py on `nproc` plain gloo ranks: (TensorBoard points, checkpoint), and the ranks' log."""
    result = run_ranks(["train_mp.py", *flags(era5_dir, expdir, four_blocks_config(expdir), *more)], nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = next(os.path.join(root, "00") for root, dirs, _ in os.walk(str(expdir)) if "00" in dirs)
    return results(run_dir), result.stderr


def test_balanced_layers():
    """The cut whose most loaded stage carries the least, then the most even; the embedding's and head's costs move
    blocks off the first and last stages; what is still tied gives the earlier stages fewer blocks."""
    assert balanced_layers(4, 2) == (2, 2) and balanced_layers(24, 4) == (6, 6, 6, 6)
    assert balanced_layers(24, 4, embed_cost=1.0) == (5, 6, 6, 7)  # stage costs 6, 6, 6, 7 (even 6,6,6,6: 7, 6, 6, 6)
    assert balanced_layers(24, 4, embed_cost=1.0, head_cost=2.0) == (5, 7, 7, 5)  # 6, 7, 7, 7
    assert balanced_layers(18, 5, 0.3, 0.7) == (3, 4, 4, 4, 3)  # 3.3, 4, 4, 4, 3.7
    assert balanced_layers(5, 2) == (2, 3) and balanced_layers(4, 4) == (1, 1, 1, 1)


@pytest.mark.compat
@pytest.mark.multiprocess
def test_two_stages_1f1b_reproduce_the_serial_run(era5_dir, tmp_path, serial):
    got, log = run_pp(era5_dir, tmp_path, 2, "--pipeline_parallel", "2")
    assert "Setting DP = 1, TP = 1, CP = 1, PP = 2 (1f1b, 2 microbatches)" in log
    assert "pipeline stage 0 of 2: blocks 0-1 of 4 (blocks per stage 2,2)" in log
    assert_same_run(got, serial)


@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.parametrize("nproc, pp, more, batch8", [
    (4, 4, ("--num_microbatches", "8", "--local_batch_size", "8", "--pp_layers", "1,1,1,1"), True),
    (4, 2, ("--context_parallel", "2", "--cp_method", "ring", "--activation_checkpointing"), False),
    (4, 2, ("--local_batch_size", "2"), False)],
    ids=["pp4-1f1b-M8", "pp2xcp2-ring-checkpointing", "pp2xdp2"])
def test_stages_compose_and_reproduce_the_serial_run(era5_dir, tmp_path, request, nproc, pp, more, batch8):
    """Through train_mp.py: each cp rank of a stage reads its band of rows; the dp ranks their shards, each stage
    of a dp rank the same batch."""
    got, log = run_pp(era5_dir, tmp_path, nproc, "--pipeline_parallel", str(pp), *more)
    assert f"PP = {pp} (" in log
    assert_same_run(got, request.getfixturevalue("serial_batch8" if batch8 else "serial"))


def resumed_in_turn(era5_dir, tmp_path, serial, parts):
    """Each part (ranks, script, iteration to stop at, flags) from the one before's checkpoint: its TensorBoard
    points the serial run's; yields each part's log and whether it resumed. After the last, its weights are the serial
    run's."""
    config = four_blocks_config(tmp_path)
    previous, start = None, -1
    for nproc, script, stop, more in parts:
        expdir = tmp_path / f"{script}_{stop}"
        resume = ("--resume", previous) if previous else ()
        result = run_ranks([script, *flags(era5_dir, expdir, config, "--checkpoint_interval", "2", "--stop_at_iter",
                                           str(stop), *resume, *more)], nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        run_dir = next(os.path.join(root, "00") for root, dirs, _ in os.walk(str(expdir)) if "00" in dirs)
        points, checkpoint = results(run_dir)
        expected = {key: value for key, value in serial[0].items() if start < key[1] <= stop}
        assert checkpoint["iteration"] == stop and sorted(points) == sorted(expected), (stop, sorted(points))
        assert points == pytest.approx(expected, rel=1e-4), stop
        yield result.stderr, previous is not None
        previous, start = os.path.join(run_dir, "checkpoints", "ckpt.pt"), stop
    assert_same_run((points, checkpoint), serial, after_step=6)


@pytest.mark.multiprocess
@pytest.mark.long
def test_a_pp4_checkpoint_resumes_at_pp2_at_pp1_and_in_train_py(era5_dir, tmp_path, serial):
    """pp=4 to iteration 2, pp=2 to 4, pp=1 (train_mp.py) to 6, train.py to 8, each from the one before's checkpoint:
    every part's points and the final weights are the serial run's."""
    parts = ((4, "train_mp.py", 2, ("--pipeline_parallel", "4")), (2, "train_mp.py", 4, ("--pipeline_parallel", "2")),
             (1, "train_mp.py", 6, ()), (1, "train.py", 8, ()))
    for (log, _), written in zip(resumed_in_turn(era5_dir, tmp_path, serial, parts), (None, "PP = 4", "PP = 2", None)):
        if written:  # the log says which layout wrote the checkpoint it resumed
            assert f"The checkpoint was written at DP = 1, TP = 1, CP = 1, {written}; resumed" in log


@pytest.mark.multiprocess
@pytest.mark.long
def test_a_sharded_checkpoint_reshards_to_tp_fsdp_cp_pp_and_train_py(era5_dir, tmp_path, serial):
    """--checkpoint_format sharded (lifecycle/shards.py): pp=2 x tp=2 to iteration 2, FSDP over dp=2 x cp=2 to 4,
    pp=4 to 6, train.py to 8, each resuming the one before's shards: every part's points and the final weights are
    the serial run's, and rank 0 reads only its part (a pp=4 stage 0: well under half the checkpoint's bytes)."""
    sharded = ("--checkpoint_format", "sharded")
    parts = ((4, "train_mp.py", 2, ("--pipeline_parallel", "2", "--tensor_parallel", "2", *sharded)),
             (4, "train_mp.py", 4, ("--fsdp", "--context_parallel", "2", "--local_batch_size", "2", *sharded)),
             (4, "train_mp.py", 6, ("--pipeline_parallel", "4", *sharded)), (1, "train.py", 8, ()))
    fractions = []
    for log, resumed in resumed_in_turn(era5_dir, tmp_path, serial, parts):
        read = re.search(r"This rank read ([\d.]+) MB of the checkpoint's ([\d.]+) MB", log)
        assert (read is not None) == resumed
        fractions += [float(read.group(1)) / float(read.group(2))] if read else []
    assert fractions[1] < 0.45 and fractions[2] == pytest.approx(1.0), fractions  # stage 0 of 4; train.py: all


@pytest.mark.multiprocess
@pytest.mark.long
def test_a_sharded_pp2_run_killed_with_sigkill_resumes_exactly(era5_dir, tmp_path):
    """torchrun --max-restarts 1 of train_mp.py at pp=2 with sharded checkpoints, one rank SIGKILLed after the first
    checkpoint: the restarted stages read their shards and end with the weights of a run nobody killed."""
    argv = ["train_mp.py", "--config", "tiny", "--data_dir", era5_dir, "--num_iters", "40", "--checkpoint_interval",
            "20", "--pipeline_parallel", "2", "--checkpoint_format", "sharded"]
    whole = run_ranks(argv + ["--expdir", str(tmp_path / "whole")], 2)
    assert whole.returncode == 0, whole.stderr[-2000:]
    launcher, output, checkpoint = killed_under_torchrun(argv, tmp_path, run_dir="tiny/1MP2PP/00")
    assert launcher.returncode == 0, output[-3000:]
    assert "Resumed from" in output and "This rank read" in output  # the restart read its shards
    reference = os.path.join(str(tmp_path / "whole"), "tiny", "1MP2PP", "00", "checkpoints", "ckpt.pt")
    final, expected = (shards.open_sharded(torch.load(path, weights_only=True), path)
                       for path in (checkpoint, reference))
    assert final["iteration"] == expected["iteration"] == 40 and isinstance(final["model"], shards.ModelShards)
    for name in expected["model"]:
        torch.testing.assert_close(final["model"][name], expected["model"][name], atol=1e-6, rtol=0, msg=name)


TWIN = """\
import sys
sys.path.insert(0, {root!r})
from distributed import pipeline
pipeline.{switch} = {value!r}
import train_mp
train_mp.main(sys.argv[1:])
"""


@pytest.mark.multiprocess
@pytest.mark.long
def test_1f1b_one_warmup_step_short_ends_in_the_timeouts_line(era5_dir, tmp_path):
    """The twin of the warm-up's length (pipeline.WARMUP_OFFSET = -1): the last stage runs one forward more than
    there are microbatches and waits for it. Not a hang: the collective timeout's one line, every rank non-zero."""
    script = tmp_path / "twin.py"
    script.write_text(TWIN.format(root=REPO_ROOT, switch="WARMUP_OFFSET", value=-1))
    codes, outputs, _ = run_plain_ranks([sys.executable, str(script), *flags(
        era5_dir, tmp_path / "exp", four_blocks_config(tmp_path), "--pipeline_parallel", "2", "--collective_timeout",
        "5")], 2, tmp_path, 120)
    output = "".join(outputs)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert all(code != 0 for code in codes) and len(errors) == 1, output[-3000:]
    assert "--collective_timeout (5 s)" in errors[0] and "Traceback" not in output, output[-3000:]

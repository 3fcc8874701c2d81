"""train_mp.py (tensor and context parallel ViT, composed with data parallelism) against the serial train.py.

On CPU with gloo, each reproduces the serial run's TensorBoard points and weights after 20 iterations: tp=2
(resuming a train.py checkpoint), cp=2, tp=2 x dp=2, tp=2 x cp=2 with sequence parallelism and activation
checkpointing across a restart, and FSDP (--fsdp) at tp=2 x dp=2 with sequence parallelism and at cp=2 x dp=2 with
checkpointing (from the tp=2 x cp=2 checkpoint, its own resumed in train.py). Twins: cp, sequence parallelism and
FSDP without their gradient sums drift. tp = cp = 1 is train.py; checkpoints (serial layout) load at any layout and
give the same loss on the same batch; every copy of a shared weight stays bitwise equal across ranks while
training. A failure points to distributed/ (layers, mappings, serial_state, parallelize: split_tokens_and_weights,
data_parallel), networks/vit.py (the cp scatter/gather) or train_mp.py.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import distributed.parallelize
import train
import train_mp
from tests.conftest import as_spawned_rank, free_port, run_ranks
from tests.parallel.test_fsdp import FSDP_ON_CPU

pytestmark = pytest.mark.usefixtures("in_repo_root")
ITERS = "20"


def results(run_dir):
    events = EventAccumulator(os.path.join(run_dir, "logs"))
    events.Reload()
    timings = {"Avg iters per sec", "Avg samples per sec"}
    points = {(tag, e.step): e.value for tag in events.Tags()["scalars"] if tag not in timings
              for e in events.Scalars(tag)}
    return points, torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)


@pytest.fixture(scope="module")
def serial(era5_dir, tmp_path_factory):
    expdir = tmp_path_factory.mktemp("serial")
    train.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir), "--num_iters", ITERS])
    return results(os.path.join(str(expdir), "tiny", "1GPU", "00"))


def run_mp(era5_dir, expdir, nproc, tp, cp, *flags):
    result = run_ranks(["train_mp.py", "--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir),
                        "--num_iters", ITERS, "--tensor_parallel", str(tp), "--context_parallel", str(cp), *flags],
                       nproc)  # plain ranks: torchrun is not under test
    assert result.returncode == 0, result.stderr[-3000:]
    return results(os.path.join(str(expdir), "tiny", f"{tp * cp}MP", "00")), result.stderr


MEMORY_FLAGS = ("--sequence_parallel", "--activation_checkpointing")


@pytest.fixture(scope="module")
def tp2_cp2(era5_dir, tmp_path_factory):
    """tp=2 x cp=2 with sequence parallelism and activation checkpointing for 10 iterations (mid-epoch), its
    checkpoint kept aside, then resumed to 20. (The flags change what each rank holds, not the numbers: tp2 x cp2
    without them is tp2 and cp2 below, composed as in test_distributed_layers.)"""
    expdir = tmp_path_factory.mktemp("tp2cp2")
    (_, halfway), _ = run_mp(era5_dir, expdir, 4, 2, 2, "--stop_at_iter", "10", *MEMORY_FLAGS)
    halfway_path = str(expdir / "halfway.pt")
    torch.save(halfway, halfway_path)
    return run_mp(era5_dir, expdir, 4, 2, 2, *MEMORY_FLAGS) + (halfway_path,)


def assert_same_run(got, expected, after_step=-1):
    """Same TensorBoard points (those after `after_step`: a run resumed in a new directory has no earlier ones)
    and the same weights."""
    (points, checkpoint), (ref_points, ref_checkpoint) = got, expected
    ref_points = {key: value for key, value in ref_points.items() if key[1] > after_step}
    assert sorted(points) == sorted(ref_points)
    assert points == pytest.approx(ref_points, rel=1e-4)
    assert sorted(checkpoint["model"]) == sorted(ref_checkpoint["model"])  # the serial layout, serial names
    for name, weight in ref_checkpoint["model"].items():
        torch.testing.assert_close(checkpoint["model"][name], weight, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.compat
@pytest.mark.parametrize("nproc, tp, cp, flags", [  # tp2 alone: resumed from train.py below; sp: also in tp2_cp2
    (2, 1, 2, ()), pytest.param(4, 2, 1, (), marks=pytest.mark.long),
    pytest.param(4, 2, 1, ("--fsdp", "--sequence_parallel"), marks=[FSDP_ON_CPU, pytest.mark.long])],
    ids=["cp2", "tp2xdp2", "tp2xdp2-fsdp-sequence-parallel"])
@pytest.mark.multiprocess
def test_model_parallel_run_reproduces_the_serial_run(era5_dir, tmp_path, serial, nproc, tp, cp, flags):
    (got, log) = run_mp(era5_dir, tmp_path, nproc, tp, cp, *flags)
    assert_same_run(got, serial)
    assert f"Setting DP = {nproc // (tp * cp)}, TP = {tp}, CP = {cp}" in log
    assert "Scaffolding memory high watermark:" in log and " Memory usage after forward pass:" in log
    from utils.layout import Layout
    assert_the_start_up_line_is_the_performance_models(log, Layout.for_world(
        nproc, tp, cp, sequence_parallel="--sequence_parallel" in flags, fsdp="--fsdp" in flags))


@pytest.mark.compat
@pytest.mark.multiprocess
@pytest.mark.long
def test_tp2_x_cp2_with_the_memory_flags_reproduces_the_serial_run_across_a_restart(tp2_cp2, serial):
    assert_same_run(tp2_cp2[0], serial)
    assert "Resumed from" in tp2_cp2[1]


@pytest.mark.compat
@pytest.mark.multiprocess
@pytest.mark.long
def test_flops_per_sample_are_the_serial_models_at_tp2_x_cp2(tp2_cp2):
    """MFU counts the model's FLOPs: train_mp.py at tp=2 x cp=2 logs those of the serial ViT (each rank does about a
    quarter of them), counted without a collective: torch 2.5 has no meta kernel for them and stopped here."""
    import re

    from loop.flops import train_flops_per_sample
    from networks import get_model
    from utils.YParams import YParams
    params = YParams("config/ViT.yaml", "tiny")
    serial = train_flops_per_sample(get_model, params, (params.n_in_channels, *params.img_size))
    logged = float(re.search(r"Training FLOPs per sample: (\S+);", tp2_cp2[1]).group(1))
    assert logged == pytest.approx(serial, rel=1e-3)


def assert_the_start_up_line_is_the_performance_models(log, layout):
    """train_mp.py logs the model's memory of rank 0's tensors (to read against the measured line on a GPU): the
    numbers of benchmarks/perf_model.memory_bytes for the layout at the tiny config's local batch (global 4 over dp);
    the twin, the same layout with checkpointing switched, differs."""
    import dataclasses
    import re

    from planning.perf_model import GIB, ViTShape, memory_bytes
    from utils.YParams import YParams
    found = re.search(r"Predicted memory of the tensors \(planning/perf_model.py\): (\S+) GB after the forward pass, "
                      r"(\S+) GB at the step's peak", log)
    assert found, "no prediction line"
    shape = ViTShape.from_params(YParams("config/ViT.yaml", "tiny"))
    logged = [float(value) for value in found.groups()]
    predicted = memory_bytes(shape, layout, 4 // layout.dp, False)
    assert logged == pytest.approx([predicted["after_forward"] / GIB, predicted["peak"] / GIB], abs=2e-6)
    twin = memory_bytes(shape, dataclasses.replace(layout, checkpointing=not layout.checkpointing), 4 // layout.dp,
                        False)
    assert logged[0] != pytest.approx(twin["after_forward"] / GIB, abs=2e-6)


@pytest.mark.compat
@pytest.mark.multiprocess
@pytest.mark.long
def test_the_start_up_line_is_the_performance_models_memory_at_tp2_x_cp2(tp2_cp2):
    from utils.layout import Layout
    assert_the_start_up_line_is_the_performance_models(
        tp2_cp2[1], Layout(tp=2, cp=2, sequence_parallel=True, checkpointing=True))


@pytest.mark.multiprocess
@pytest.mark.long
def test_train_py_resumes_a_tp2_x_cp2_checkpoint(era5_dir, tmp_path, serial, tp2_cp2):
    """Weights and Adam's moments gathered to the serial layout: train.py continues the run exactly. The checkpoint
    records the layout that wrote it (the log says so when another resumes it); train.py's own is the serial one."""
    from utils.layout import Layout
    written = torch.load(tp2_cp2[2], weights_only=True)["layout"]
    assert Layout(**written) == Layout(tp=2, cp=2, sequence_parallel=True, checkpointing=True)
    train.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path), "--num_iters", ITERS,
                "--resume", tp2_cp2[2]])
    resumed_dir = os.path.join(str(tmp_path), "tiny", "1GPU", "00")
    assert_same_run(results(resumed_dir), serial, after_step=10)
    log = open(os.path.join(resumed_dir, "out.log")).read()
    assert "The checkpoint was written at DP = 1, TP = 2, CP = 2; resumed at DP = 1, TP = 1, CP = 1" in log
    own = torch.load(os.path.join(resumed_dir, "checkpoints", "ckpt.pt"), weights_only=True)["layout"]
    assert Layout(**own) == Layout()


@pytest.mark.multiprocess
@pytest.mark.long
def test_train_mp_resumes_a_train_py_checkpoint_at_tp2(era5_dir, tmp_path, serial):
    serial_dir = tmp_path / "serial"
    train.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(serial_dir), "--num_iters", ITERS,
                "--stop_at_iter", "10"])
    checkpoint = os.path.join(str(serial_dir), "tiny", "1GPU", "00", "checkpoints", "ckpt.pt")
    got, log = run_mp(era5_dir, tmp_path / "mp", 2, 2, 1, "--resume", checkpoint)
    assert "Resumed from" in log
    assert_same_run(got, serial, after_step=10)


@pytest.mark.multiprocess
def test_without_gradient_reduction_the_cp_run_drifts(era5_dir, tmp_path, serial):
    """The comparisons above can fail: at cp=2 without DDP's hook (--noddp) the gradients of cp-shared weights
    cover half the tokens each, and the run leaves the serial one."""
    result = run_ranks(["train_mp.py", "--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path),
                        "--num_iters", ITERS, "--context_parallel", "2", "--noddp"], 2)
    assert result.returncode == 0, result.stderr[-3000:]
    with pytest.raises(AssertionError):
        assert_same_run(results(os.path.join(str(tmp_path), "tiny", "2MP", "00")), serial)


def test_tp_cp_1_is_train_py(era5_dir, tmp_path, serial):
    train_mp.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path), "--num_iters", ITERS])
    points, checkpoint = results(os.path.join(str(tmp_path), "tiny", "1MP", "00"))
    assert points == pytest.approx(serial[0], rel=1e-6)
    for name, weight in serial[1]["model"].items():
        assert torch.equal(checkpoint["model"][name], weight), name


def _load_and_train(rank, world, port, checkpoints, results):
    """tp=2 x cp=2: the loss of each checkpoint on a fixed batch, then 3 training steps and the equality of
    every copy of every shared weight over the groups it is shared in."""
    as_spawned_rank(rank, world, port)
    from distributed.data_parallel import init_ddp_model_and_reduction_hooks
    from distributed.parallelize import split_tokens_and_weights
    from distributed.serial_state import load_serial_state_dict
    from networks import get_model
    from task.loss import get_loss
    from utils import comm
    from utils.YParams import YParams
    torch.set_num_threads(1)
    grid = comm.init({"tp": 2, "cp": 2}, rendezvous_timeout=60)
    params = YParams("config/ViT.yaml", "tiny")
    torch.manual_seed(params.seed)
    model = split_tokens_and_weights(get_model(params), grid)  # and the copies of shared weights made equal
    loss_fn = get_loss(params)
    generator = torch.Generator().manual_seed(1)
    inp, tar = torch.randn(2, 20, 16, 32, generator=generator), torch.randn(2, 20, 16, 32, generator=generator)
    out = {}
    for label, path in checkpoints.items():
        load_serial_state_dict(model, torch.load(path, weights_only=True)["model"], path)
        with torch.no_grad():
            out[label] = loss_fn(model(inp), tar).item()
    ddp = init_ddp_model_and_reduction_hooks(model, grid, torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn(ddp(inp), tar).backward()
        optimizer.step()
    unequal = []
    for name, param in model.named_parameters():
        for group in param.is_shared_mp:
            copies = [torch.empty_like(param) for _ in range(comm.get_size(group))]
            dist.all_gather(copies, param.detach().contiguous(), group=comm.get_group(group))
            if not all(torch.equal(copy, copies[0]) for copy in copies):
                unequal.append(f"{name} over {group}")
    out["unequal"] = unequal
    results[rank] = out
    comm.destroy()


@pytest.mark.multiprocess
@pytest.mark.long
def test_checkpoints_load_at_any_layout_and_shared_weights_stay_equal(tmp_path, serial, tp2_cp2):
    """A train.py checkpoint and a tp=2 x cp=2 checkpoint, each loaded serially and at tp=2 x cp=2, give the
    same loss on the same batch; after training steps at tp=2 x cp=2 the shared copies are bitwise equal."""
    from lifecycle.checkpoint import load_model_state
    from networks import get_model
    from task.loss import get_loss
    from utils.YParams import YParams
    run_dirs = {"train.py": serial, "train_mp tp2xcp2": tp2_cp2[0]}  # (points, checkpoint)
    paths = {}
    for label, (_, checkpoint) in run_dirs.items():
        path = str(tmp_path / f"{label.replace(' ', '_')}.pt")
        torch.save(checkpoint, path)
        paths[label] = path
    params = YParams("config/ViT.yaml", "tiny")
    generator = torch.Generator().manual_seed(1)
    inp, tar = torch.randn(2, 20, 16, 32, generator=generator), torch.randn(2, 20, 16, 32, generator=generator)
    serial_losses = {}
    for label, path in paths.items():
        model = get_model(params)
        load_model_state(model, torch.load(path, weights_only=True)["model"], path)
        with torch.no_grad():
            serial_losses[label] = get_loss(params)(model(inp), tar).item()
    found = mp.Manager().dict()
    mp.spawn(_load_and_train, args=(4, free_port(), paths, found), nprocs=4)
    for rank, out in found.items():
        for label, loss in serial_losses.items():
            assert out[label] == pytest.approx(loss, rel=1e-5), (rank, label)
        assert out["unequal"] == [], (rank, out["unequal"])


@pytest.mark.multiprocess
@pytest.mark.long
def test_without_the_tp_gradient_sum_the_sequence_parallel_run_drifts(era5_dir, tmp_path, serial):
    """Without DDP's hook (--noddp) no gradient is summed over tp; at tp=2 alone that changes nothing (every rank
    sees all tokens). With --sequence_parallel the norms' and the row-parallel biases' gradients each cover half the
    tokens, and the run leaves the serial one: the tp sum those weights are marked for is what keeps it."""
    result = run_ranks(["train_mp.py", "--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path),
                        "--num_iters", ITERS, "--tensor_parallel", "2", "--noddp", "--sequence_parallel"], 2)
    assert result.returncode == 0, result.stderr[-3000:]
    with pytest.raises(AssertionError):
        assert_same_run(results(os.path.join(str(tmp_path), "tiny", "2MP", "00")), serial)


@pytest.mark.compat
@pytest.mark.multiprocess
@FSDP_ON_CPU
@pytest.mark.long
def test_fsdp_at_cp2_x_dp2_takes_over_a_ddp_checkpoint_and_train_py_takes_over_its_own(era5_dir, tmp_path, serial,
                                                                                     tp2_cp2):
    """--fsdp with checkpointing at cp=2 x dp=2 resumes the tp=2 x cp=2 DDP run's checkpoint of iteration 10 (each
    rank loads its dp shard) and stops at 15; train.py resumes that checkpoint (gathered over dp: the serial
    weights and Adam moments) and ends where the serial run ends. Every point on the way is the serial run's."""
    got, log = run_mp(era5_dir, tmp_path / "fsdp", 4, 1, 2, "--fsdp", "--activation_checkpointing", "--resume",
                      tp2_cp2[2], "--stop_at_iter", "15")
    assert "Resumed from" in log and "FSDP over dp=2" in log
    points, checkpoint = got
    assert checkpoint["iteration"] == 15
    expected = {key: value for key, value in serial[0].items() if 10 < key[1] <= 15}
    assert sorted(points) == sorted(expected) and points == pytest.approx(expected, rel=1e-4)
    fsdp_checkpoint = os.path.join(str(tmp_path / "fsdp"), "tiny", "2MP", "00", "checkpoints", "ckpt.pt")
    train.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path / "serial"), "--num_iters",
                ITERS, "--resume", fsdp_checkpoint])
    assert_same_run(results(os.path.join(str(tmp_path / "serial"), "tiny", "1GPU", "00")), serial, after_step=15)


def _train_without_the_shard_sums(rank, world, port, argv):
    as_spawned_rank(rank, world, port, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    distributed.parallelize.SUM_GRADIENT_SHARDS = False
    train_mp.main(argv)


@pytest.mark.multiprocess
@FSDP_ON_CPU
@pytest.mark.long
def test_without_the_sums_on_the_gradient_shards_the_fsdp_run_drifts(era5_dir, tmp_path, serial):
    """FSDP reduces the gradients over dp only: at cp=2 (dp=1, so each shard is the whole tensor) without the sums of
    the cp-shared gradients before the step (parallelize.sum_marked_gradient_shards switched off) each covers half
    the tokens, and the run leaves the serial one. That summing dp shards equals summing whole gradients is what the
    cp2 x dp2 run above shows."""
    argv = ["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path), "--num_iters", ITERS,
            "--context_parallel", "2", "--fsdp"]
    mp.spawn(_train_without_the_shard_sums, args=(2, free_port(), argv), nprocs=2)
    with pytest.raises(AssertionError):
        assert_same_run(results(os.path.join(str(tmp_path), "tiny", "2MP", "00")), serial)

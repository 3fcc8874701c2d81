"""DDP on 2 gloo processes == 1 process on the same global batch. Failures point to train.py's DDP
setup, the sampler sharding in loaders/common.py, or utils/comm.py."""
import os

import pytest
import torch

from tests.conftest import run_command, run_ranks

TOLERANCE = 1e-5  # fp32 weights after 10 Adam steps: only the order of the gradient sums differs


def trained_weights(era5_dir, expdir, nproc, *flags):
    argv = ["train.py", "--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir), "--num_iters", "10",
            *flags]
    result = run_ranks(argv, nproc) if nproc > 1 else run_command(argv)  # plain ranks: torchrun is not under test
    assert result.returncode == 0, result.stderr[-3000:]
    path = os.path.join(str(expdir), "tiny", f"{nproc}GPU", "00", "checkpoints", "ckpt.pt")
    return torch.load(path, weights_only=True)["model"], result.stderr


def max_difference(a, b):
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.fixture(scope="module")
def single(era5_dir, tmp_path_factory):
    return trained_weights(era5_dir, tmp_path_factory.mktemp("one"), 1)[0]


@pytest.mark.compat
@pytest.mark.multiprocess
def test_two_ranks_match_one_process(era5_dir, tmp_path, single):
    two, log = trained_weights(era5_dir, tmp_path, 2)
    assert max_difference(single, two) < TOLERANCE
    assert log.count("DONE ---- rank 0") == 1 and "DONE ---- rank 1" not in log  # rank 0 logs alone


@pytest.mark.multiprocess
def test_without_gradient_sync_the_ranks_drift(era5_dir, tmp_path, single):
    """--noddp: each rank steps on its half batch, so the comparison above is able to fail."""
    two, _ = trained_weights(era5_dir, tmp_path, 2, "--noddp")
    assert max_difference(single, two) > 100 * TOLERANCE


@pytest.mark.compat  # the keyword differs between the pinned torch and the container's 2.5
@pytest.mark.parametrize("every_forward", [True, False])
def test_ddp_buffer_sync_takes_the_keyword_this_torch_has_without_its_deprecation_warning(tmp_path, every_forward):
    """utils/compat.ddp_buffer_sync: `forward_sync_buffers` where DDP has it, else `broadcast_buffers`; DDP built with
    it warns nothing about buffers. Twin: on a torch that has the new keyword, the old one warns (every DDP run did)."""
    import inspect
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from utils.compat import ddp_buffer_sync
    has_new = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    keyword = ddp_buffer_sync(every_forward)
    assert keyword == {("forward_sync_buffers" if has_new else "broadcast_buffers"): every_forward}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DistributedDataParallel(model, **keyword)
        assert not [w for w in caught if "buffers" in str(w.message)], [str(w.message) for w in caught]
        if has_new:  # the twin
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                DistributedDataParallel(model, broadcast_buffers=every_forward)
            assert any("broadcast_buffers" in str(w.message) for w in caught)
    finally:
        dist.destroy_process_group()

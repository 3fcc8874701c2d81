"""FSDP2 in train_mp.py (`--fsdp`, distributed/parallelize.shard_fully) piece by piece; whole runs against serial
train.py (dp=2, tp=2 x dp=2, cp=2 x dp=2 across a restart, the drifting twin) are in tests/training/test_train_mp.py.

Here, with 2 ranks on gloo: each rank holds half of every block's parameters, gradients and Adam moments; under bf16
the blocks compute with bf16 weights gathered from the fp32 shards (MixedPrecisionPolicy), in fp32 without it; the
saved activations measured under FSDP are those of the unsharded model (the gathered weights, freed after each
block, are not counted); the torch-version shim (utils/compat.fsdp_api) refuses a CPU run on torch 2.5 in one line;
--fsdp with --noddp or channels_last is one line. A failure points to distributed/parallelize.py, utils/compat.py or
loop/profiling.py (SavedActivations).
"""
import pytest
import torch
import torch.distributed.fsdp
import torch.multiprocessing as mp

from tests.conftest import as_spawned_rank, free_port
from utils import compat
from utils.errors import UserError

pytestmark = [pytest.mark.compat, pytest.mark.usefixtures("in_repo_root")]
FSDP_ON_CPU = pytest.mark.skipif(not hasattr(torch.distributed.fsdp, "fully_shard"),
                                 reason="FSDP requires CUDA for streams on torch < 2.6 (CPU FSDP2 came in 2.6)")


def test_the_shim_refuses_fsdp_on_the_cpu_where_torch_has_no_cpu_fsdp(monkeypatch):
    """torch 2.5 (the container's): FSDP2 at torch.distributed._composable.fsdp, CUDA only. Emulated on a newer
    torch by hiding the public name; on torch 2.5 itself this is the real case."""
    import torch.distributed._composable.fsdp as private  # on a newer torch it imports the public name: first
    monkeypatch.delattr(torch.distributed.fsdp, "fully_shard", raising=False)
    with pytest.raises(UserError, match=r"^--fsdp on torch \S+ needs GPUs .* drop --fsdp$"):
        compat.fsdp_api(torch.device("cpu"))
    fully_shard, policy = compat.fsdp_api(torch.device("cuda"))  # a device type only: no GPU needed
    assert fully_shard is private.fully_shard and policy is private.MixedPrecisionPolicy


@FSDP_ON_CPU
def test_the_shim_gives_the_public_fsdp_where_it_runs_on_the_cpu():
    fully_shard, policy = compat.fsdp_api(torch.device("cpu"))
    assert fully_shard is torch.distributed.fsdp.fully_shard and policy is torch.distributed.fsdp.MixedPrecisionPolicy


@pytest.mark.parametrize("noddp, nhwc, message", [(True, False, "--fsdp replaces DDP: drop --noddp"),
                                                   (False, True, "add --no-enable_nhwc")])
def test_what_fsdp_does_not_combine_with_is_one_line(noddp, nhwc, message):
    """--noddp, and channels_last (FSDP2 refuses non-contiguous parameters with a traceback)."""
    from types import SimpleNamespace

    from distributed.parallelize import Options, parallelize
    from utils.layout import Grid, Layout
    from utils.YParams import YParams
    params = YParams("config/ViT.yaml", "tiny")
    params.update({"enable_nhwc": nhwc})
    params.update({"amp_enabled": False, "amp_dtype": torch.float32})  # what lifecycle/cli.py sets from the flags
    args = SimpleNamespace(noddp=noddp, bucket_cap_mb=25, disable_broadcast_buffers=False)
    with pytest.raises(UserError, match=message):
        parallelize(torch.nn.Linear(2, 2), Grid(Layout(fsdp=True)), torch.device("cpu"),
                    Options.from_flags(args, params))


def _sharded_rank(rank, world, port, found):
    as_spawned_rank(rank, world, port, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from distributed.parallelize import shard_fully
    from loop.benchy import model_memory
    from loop.profiling import SavedActivations
    from networks import get_model
    from utils import comm
    from utils.YParams import YParams
    grid = comm.init({"tp": 1, "cp": 1}, rendezvous_timeout=60)
    params = YParams("config/ViT.yaml", "tiny")
    inp = torch.randn(2, params.n_in_channels, *params.img_size, generator=torch.Generator().manual_seed(1))
    out = {}
    torch.manual_seed(params.seed)
    model = get_model(params)
    out["whole_bytes"] = sum(p.nbytes for p in model.parameters())
    with SavedActivations(model) as saved:
        model(inp)
    out["unsharded_saved"] = saved.nbytes
    for amp in ("bf16", "none"):
        params.update({"amp_mode": amp, "amp_enabled": amp != "none", "amp_dtype": torch.bfloat16})
        torch.manual_seed(params.seed)
        model = shard_fully(get_model(params), grid, torch.device("cpu"),
                            params.amp_dtype if params.amp_enabled else None)
        seen = []  # the weight a block's first MLP layer computes with
        model.blocks[0].mlp.fc1.register_forward_pre_hook(lambda module, _, seen=seen: seen.append(module.weight.dtype))
        optimizer = torch.optim.Adam(model.parameters())
        model(inp).float().square().mean().backward()
        optimizer.step()
        out[amp] = {"dtype": str(seen[0]), "memory": model_memory(model, inp, optimizer)}
    found[rank] = out
    comm.destroy()


@pytest.mark.multiprocess
@FSDP_ON_CPU
def test_two_ranks_each_hold_half_and_compute_with_gathered_weights():
    found = mp.Manager().dict()
    mp.spawn(_sharded_rank, args=(2, free_port(), found), nprocs=2)
    held = {rank: found[rank]["none"]["memory"] for rank in (0, 1)}
    whole = found[0]["whole_bytes"]
    # dim 0 of every parameter split in two (a dim 0 of odd size leaves rank 1 one row fewer, of size 1 all on rank 0)
    assert held[0]["parameters"] + held[1]["parameters"] == whole
    for rank in (0, 1):
        assert held[rank]["parameters"] == pytest.approx(whole / 2, rel=0.05)
        assert held[rank]["gradients"] == held[rank]["parameters"]
        assert held[rank]["optimizer_state"] == 2 * held[rank]["parameters"]
        # the unsharded model's saved activations (a batch of 2 on each rank); FSDP frees the gathered weights
        assert held[rank]["saved_activations"] == pytest.approx(found[rank]["unsharded_saved"], rel=0.01)
        assert found[rank]["bf16"]["dtype"] == "torch.bfloat16" and found[rank]["none"]["dtype"] == "torch.float32"

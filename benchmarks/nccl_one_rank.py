"""NCCL's paths that one GPU can run: a process group of one rank, made as the training scripts make theirs.

    python -m benchmarks.nccl_one_rank --out nccl_one_rank.json      # on a GPU node (gpu_session.sh runs it)
    python -m benchmarks.nccl_one_rank --out report.json --allow-cpu # the same checks over gloo: a check of this

Each check is run and reported on its own (`ok`, and the error's line when not), in order:
  init       utils/comm.join over NCCL for a world of one: NCCL told the GPU (`device_id`, so
             its communicator is made at once) and the collective timeout (--collective_timeout) given
  ddp        DistributedDataParallel on that group: one step of a small model equals the same step unwrapped
  dtensor    a DTensor on a one-rank device mesh: sharded and gathered back, the same values
  fsdp2      FSDP2 (utils/compat.fsdp_api) on the mesh: one Adam step equals the unwrapped model's
  destroy    utils/comm.destroy: the process group gone, nothing left waiting
The training scripts themselves over one NCCL rank (torchrun --nproc_per_node 1 makes no process group: a world of
one trains alone) are run by benchmarks/gpu_multi.py beside this.
"""
import copy
import os
import sys
import traceback

import torch

from benchmarks.common import free_port
from utils.atomic import write_json
from utils.errors import ArgumentParser, error_line

TIMEOUT_S = 60


def small_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)


def one_step(model, batch, optimizer=None):
    """The weights after one Adam step on `batch` (a list of CPU tensors)."""
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=1e-2)
    model(batch).square().mean().backward()
    optimizer.step()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu() for p in model.parameters()]


def backend_of(device):
    return "nccl" if device.type == "cuda" else "gloo"


def check_init(device):
    import torch.distributed as dist

    from utils import comm, rendezvous
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    store = comm.join(rendezvous.launch_settings(1, TIMEOUT_S), 1, device, TIMEOUT_S, TIMEOUT_S)
    comm.init(collective_timeout=TIMEOUT_S)  # the groups of a world of one, in the joined process group
    value = torch.ones(4, device=device)
    dist.all_reduce(value)
    assert store is not None and dist.get_backend() == backend_of(device) and value.sum().item() == 4.0
    found = {"backend": dist.get_backend(), "collective_timeout_s": TIMEOUT_S}
    if device.type == "cuda":
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return found


def check_ddp(device):
    from torch.nn.parallel import DistributedDataParallel
    batch = torch.randn(16, 32, device=device)
    alone = one_step(small_model(device), batch)
    ids = [device.index] if device.type == "cuda" else None
    wrapped = one_step(DistributedDataParallel(small_model(device), device_ids=ids), batch)
    difference = max((a - b).abs().max().item() for a, b in zip(alone, wrapped))
    assert difference == 0.0, f"DDP's step differs from the model's by {difference}"
    return {"max_weight_difference": difference}


def check_dtensor(device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh(device.type, (1,))
    full = torch.randn(8, 16, device=device)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(sharded.full_tensor(), full)
    return {"mesh": str(mesh)}


def check_fsdp2(device):
    from torch.distributed.device_mesh import init_device_mesh

    from utils.compat import fsdp_api
    fully_shard, _ = fsdp_api(device)
    batch = torch.randn(16, 32, device=device)
    plain = small_model(device)
    alone = one_step(copy.deepcopy(plain), batch)
    sharded = fully_shard(copy.deepcopy(plain), mesh=init_device_mesh(device.type, (1,)))
    with_fsdp = one_step(sharded, batch)
    difference = max((a - b).abs().max().item() for a, b in zip(alone, with_fsdp))
    assert difference < 1e-6, f"FSDP2's step differs from the model's by {difference}"
    return {"max_weight_difference": difference}


def check_destroy(device):
    import torch.distributed as dist

    from utils import comm
    comm.destroy()
    assert not dist.is_initialized()
    return {}


CHECKS = (("init", check_init), ("ddp", check_ddp), ("dtensor", check_dtensor), ("fsdp2", check_fsdp2),
          ("destroy", check_destroy))


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON report")
    parser.add_argument("--allow-cpu", action="store_true", help="without a GPU, the same checks over gloo")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    elif args.allow_cpu:
        device = torch.device("cpu")
    else:
        parser.error("NCCL runs on GPUs and this machine has none: run this on a GPU node (--allow-cpu: the same "
                     "checks over gloo)")
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
              "backend": backend_of(device), "torch": torch.__version__, "checks": {}}
    for name, check in CHECKS:
        try:
            report["checks"][name] = {"ok": True, **check(device)}
        except Exception as err:  # each check is reported on its own; the next still runs
            report["checks"][name] = {"ok": False, "error": error_line(traceback.format_exc()) or repr(err)}
        print(f"{name}: {report['checks'][name]}", flush=True)
        if name == "init" and not report["checks"][name]["ok"]:
            break  # nothing else has a process group to run on
    report["ok"] = len(report["checks"]) == len(CHECKS) and all(c["ok"] for c in report["checks"].values())
    write_json(args.out, report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

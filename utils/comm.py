"""Distributed setup from the launcher's variables: WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

torchrun sets them; under Slurm, export_DDP_vars.sh exports the same names from SLURM_*. NCCL on GPUs,
gloo on CPUs. Process groups are kept by name ("dp" for data parallel).
"""
import os

import torch
import torch.distributed as dist

from utils.errors import UserError

_groups = {}


def get_world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def get_world_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def get_local_rank():
    return int(os.environ.get("LOCAL_RANK", 0))


def get_group(name):
    return _groups.get(name)


def get_size(name):
    """Size of the named group (1 when not distributed or the group is unknown)."""
    return dist.get_world_size(_groups[name]) if dist.is_initialized() and name in _groups else 1


def get_rank(name):
    """This process's rank inside the named group (0 when not distributed or unknown)."""
    return dist.get_rank(_groups[name]) if dist.is_initialized() and name in _groups else 0


def get_device():
    """cuda:LOCAL_RANK when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def init():
    """Join the process group when WORLD_SIZE > 1; every rank is one data-parallel replica ("dp")."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1 and not dist.is_initialized():
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise UserError(f"WORLD_SIZE={world_size} but {', '.join(missing)} not set; launch with "
                            "torchrun, or source export_DDP_vars.sh under srun")
        device = get_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", init_method="env://")
    if dist.is_initialized():
        _groups["dp"] = dist.group.WORLD
    return get_world_size(), get_world_rank(), get_local_rank()


def broadcast_from_rank0(obj):
    """Rank 0's `obj` on every rank (a picklable Python object); also a barrier."""
    if not dist.is_initialized():
        return obj
    objects = [obj]
    dist.broadcast_object_list(objects, src=0)
    return objects[0]


def synchronize(device):
    """Wait for the device's queued work (CUDA kernels run asynchronously): needed before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier():
    if dist.is_initialized():
        dist.barrier()

"""Distributed setup from the launcher's variables: WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

torchrun sets them; under Slurm, export_DDP_vars.sh exports the same names from SLURM_*. NCCL on GPUs,
gloo on CPUs. Process groups are kept by name: "dp" is the data-parallel group (every rank of train.py is a
data-parallel replica, so there it is the whole world). Reductions take the group's name as an argument.
"""
import datetime
import logging
import os
import socket
import time

import torch
import torch.distributed as dist

from utils.errors import UserError

_groups = {}
DEFAULT_RENDEZVOUS_TIMEOUT = 600  # seconds a rank waits for the others to start


def get_world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def get_world_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def get_local_rank():
    return int(os.environ.get("LOCAL_RANK", 0))


def get_group(name):
    """The named process group (None, i.e. the world, when not distributed)."""
    return _groups.get(name)


def get_size(name):
    """Size of the named group (1 when not distributed or the group is unknown)."""
    return dist.get_world_size(_groups[name]) if dist.is_initialized() and name in _groups else 1


def get_rank(name):
    """This process's rank inside the named group (0 when not distributed or unknown)."""
    return dist.get_rank(_groups[name]) if dist.is_initialized() and name in _groups else 0


def get_names():
    """Names of the process groups that exist."""
    return list(_groups)


def get_device():
    """cuda:LOCAL_RANK when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def _wait_for_master(addr, port, rank, timeout):
    """A rank other than 0 waits until rank 0's store accepts connections, or says why it gave up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise UserError(f"rank {rank} waited {timeout:g} s for rank 0 at {addr}:{port} and nobody answered; "
                                "start every rank (srun -n N / torchrun --nproc_per_node N) with the same "
                                "MASTER_ADDR and MASTER_PORT, or raise --dist_timeout") from None
            time.sleep(0.5)


def init(rendezvous_timeout=DEFAULT_RENDEZVOUS_TIMEOUT):
    """Join the process group when WORLD_SIZE > 1, waiting at most `rendezvous_timeout` seconds for the other
    ranks; name the data-parallel group "dp" (the world: every rank is one replica)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1 and not dist.is_initialized():
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise UserError(f"WORLD_SIZE={world_size} but {', '.join(missing)} not set; launch with "
                            "torchrun, or source export_DDP_vars.sh under srun")
        rank, addr, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if rendezvous_timeout <= 0:
            raise UserError(f"--dist_timeout is {rendezvous_timeout}; give the seconds to wait for the other ranks")
        device = get_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        logging.info(f"rank {rank} waiting for {world_size} ranks at {addr}:{port} "
                     f"(timeout {rendezvous_timeout:g} s, --dist_timeout)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=rendezvous_timeout)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent hosts the store and restarts every rank after a failure; the keys of each attempt
            # are kept apart, so a restarted rank never reads an address its dead predecessor published
            store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
            store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        else:
            if rank != 0:
                _wait_for_master(addr, port, rank, rendezvous_timeout)
            try:  # the rendezvous alone, with our timeout (init_process_group's would also bound every collective)
                store, rank, world_size = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
            except (dist.DistError, RuntimeError) as err:  # "Timed out ... waiting for clients. 1/2 clients joined."
                raise UserError(f"rank {rank} could not gather {world_size} ranks at {addr}:{port} within "
                                f"{rendezvous_timeout:g} s ({err}); start every rank, or raise "
                                "--dist_timeout") from None
        dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world_size)
    if dist.is_initialized():
        _groups["dp"] = dist.group.WORLD
    return get_world_size(), get_world_rank(), get_local_rank()


def all_reduce_sum(tensor, group="dp"):
    """Sum of `tensor` over the named group (in place; returned)."""
    if dist.is_initialized() and get_size(group) > 1:
        dist.all_reduce(tensor, group=get_group(group))
    return tensor


def all_reduce_mean(tensor, group="dp"):
    """Mean of `tensor` over the named group."""
    return all_reduce_sum(tensor, group) / get_size(group)


def all_reduce_min(tensor):
    """Minimum over every rank (an agreement all ranks act on, e.g. to stop together)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor


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

"""Agreements the host reads, over every rank: collectives on comm's host group (gloo, CPU tensors), so that reading
them never waits for the GPU. lifecycle/signals.py agrees on a stop signal with them (max_over_ranks_on_host, and
HostMax without a wait), loaders/ on the data every rank sees (gather_on_host). One process, or a dry run's stand-ins:
each rank's own value.
"""
import torch
import torch.distributed as dist

from utils import comm


def max_over_ranks_on_host(value):
    """The largest integer `value` over every rank (collective), through gloo on the host: no device sync."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=comm.get_host_group())
    return int(tensor.item())


class HostMax:
    """max_over_ranks_on_host(value), started now and read later: the all-reduce runs in gloo's own thread while
    the rank goes on (lifecycle/signals.py starts one at a step boundary and reads it some boundaries later, so no
    step waits for it). Every rank must start the same sequence of them; a single process's is its own value."""

    def __init__(self, value):
        self.tensor = torch.tensor([value], dtype=torch.int64)
        self.work = None
        if dist.is_initialized() and dist.get_world_size() > 1 and not comm.is_dry_run():
            self.work = dist.all_reduce(self.tensor, op=dist.ReduceOp.MAX, group=comm.get_host_group(),
                                        async_op=True)

    def wait(self):
        """The largest value over every rank (waits for the all-reduce if it has not finished)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return int(self.tensor.item())


def gather_on_host(value):
    """Every rank's `value` (a small picklable object) in rank order, on every rank: one collective over the host's
    gloo group, for start-up checks that the ranks agree. [value] in one process or a dry run."""
    if not dist.is_initialized() or comm.is_dry_run():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=comm.get_host_group())
    return values

"""The one place where the PyTorch versions we serve differ: the pinned one (requirements.txt) and the tutorial
container's (nersc/pytorch:24.08.01, torch 2.5; `make test-compat` runs the compatibility tests on it).

Each entry names the version that changed the behaviour, so it can go when the oldest version we serve has it.
"""
import contextlib
import inspect

import torch
import torch.distributed as dist

from utils.errors import UserError


@contextlib.contextmanager
def lr_tensors_kept(optimizer):
    """Within the block, a schedule that puts a new lr into a param group whose lr is a tensor (torch < 2.6's
    ReduceLROnPlateau assigns a float) has the tensor filled with it instead and put back: a step captured in a CUDA
    graph reads the tensor it was captured with (task/optim.make_capturable). A no-op for float learning rates."""
    held = [group["lr"] for group in optimizer.param_groups]
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, held):
            if torch.is_tensor(lr) and group["lr"] is not lr:
                lr.fill_(float(group["lr"]))
                group["lr"] = lr


def fsdp_api(device):
    """(fully_shard, MixedPrecisionPolicy) of FSDP2: public as torch.distributed.fsdp from torch 2.6, at
    torch.distributed._composable.fsdp in 2.5, which runs it on CUDA only ("FSDP requires CUDA for streams"; CPU
    support came in 2.6): there a CPU run is refused in one line."""
    import torch.distributed.fsdp as fsdp
    if not hasattr(fsdp, "fully_shard"):  # torch < 2.6
        if device.type != "cuda":
            raise UserError(f"--fsdp on torch {torch.__version__} needs GPUs (FSDP2 runs on the CPU from torch 2.6); "
                            "run on GPUs, or drop --fsdp")
        import torch.distributed._composable.fsdp as fsdp
    return fsdp.fully_shard, fsdp.MixedPrecisionPolicy


def join_fake_process_group(rank, world_size):
    """Join a process group of `world_size` ranks as `rank`, alone: torch's "fake" backend, whose collectives return
    at once and move no data (an all-gather copies this rank's input into every slot, an all-reduce leaves the
    tensor as it is). Both versions keep it in torch.testing._internal (2.5 and 2.14); importing FakeStore registers
    the backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def ddp_buffer_sync(every_forward):
    """DistributedDataParallel's keyword that syncs the buffers (BatchNorm's running statistics) from the group's
    first rank before each forward (`--disable_broadcast_buffers` switches it off): `forward_sync_buffers` where
    torch has it (the pinned torch deprecates `broadcast_buffers`, with a FutureWarning in every DDP run), else
    `broadcast_buffers` (torch 2.5). The new keyword still syncs once when DDP is built, which the old one's False
    skipped; that changes nothing here: every rank of a "dp" group builds or restores the same buffers."""
    parameters = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers": every_forward}



def _backends():
    """The backend (gloo's, NCCL's) of every process group of this process, each as a Python object of its own."""
    found = []
    for group in list(getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {})):
        for device in ("cpu", "cuda"):
            with contextlib.suppress(Exception):  # no backend for that device (or none at all: the fake one)
                backend = group._get_backend(torch.device(device))
                if all(backend is not other for other in found):
                    found.append(backend)
    return found


def leave_process_group():
    """dist.destroy_process_group(), with each group's backend torn down without the GIL. Tearing gloo down joins
    its worker threads, and a worker may need the GIL to finish its last work: to free a tensor Python has let go
    of (the work's reset, just after the rank's wait returned), or to run a Python callback of its future. Torch
    2.5's ProcessGroup keeps the GIL while it is destroyed (torch 2.14's lets it go), so a rank whose worker was
    still that late hung for good in destroy_process_group, deaf to SIGTERM (a Python handler needs the GIL too).
    Held here, each backend outlives its ProcessGroup and goes last, from a Python object whose teardown lets the
    GIL go (torch's own holder for backends): the worker takes the GIL, finishes, and the join returns."""
    backends = _backends()
    dist.destroy_process_group()
    backends.clear()  # the last references: gloo's threads are joined here, without the GIL

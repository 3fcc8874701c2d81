"""Distributed setup from the launcher's variables: WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

torchrun sets them; under Slurm, export_DDP_vars.sh exports the same names from SLURM_*. NCCL on GPUs,
gloo on CPUs. Process groups are kept by name: "dp" is the data-parallel group (every rank of train.py is a
data-parallel replica, so there it is the whole world). Reductions take the group's name as an argument.

A model-parallel script passes its layout (utils/layout.py: built once from the flags; the original's
init({"tp": 2, "cp": 2, "order": "tp-cp-dp"}) works too): the ranks are laid out on a tp x cp x dp grid (the first
name of the order varies fastest; see utils/rank_generator.py) and the groups "dp", "tp", "cp", "tp-cp" and
"dp-cp" are built. init returns the run's Grid (utils/layout.py: the layout and each group's size, rank and process
group), which the script hands down to whatever splits the model; nothing below fetches it back. A layout that does
not divide the world is refused before the rendezvous, in one line; the model's own rules (heads, MLP width, tokens)
are the layout's too, checked when the model is split (distributed/parallelize.py).
Unknown group names have size 1 and rank 0, so code written for tp and cp also runs without them.
What keeps the job healthy (rank 0's posts in the rendezvous store, the host's maxima, the one line when a rank fails)
is resilience/, attached after init with the store init keeps (get_store); nothing here imports it.
"""
import datetime
import logging
import math
import os

import torch
import torch.distributed as dist

from utils import rendezvous
from utils.compat import ddp_buffer_sync, leave_process_group  # noqa: F401 (ddp_buffer_sync: for the scripts)
from utils.errors import OneRankError, UserError
from utils.layout import GROUP_SIZES, Axis, Grid, Layout
from utils.rendezvous import DEFAULT_COLLECTIVE_TIMEOUT, DEFAULT_RENDEZVOUS_TIMEOUT, world_size_to_be

_groups = {}  # name -> Axis of this rank (utils/layout.py), built by init from the layout's numbers
GROUP_TYPES = tuple(GROUP_SIZES)  # built, in this order, on every rank
_joined = {}  # "host": every rank over gloo (CPU tensors), for flags the host reads (not a named group);
# "timeout": --collective_timeout (seconds); "store": the rendezvous store (get_store)


def get_world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def get_world_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def get_local_rank():
    return int(os.environ.get("LOCAL_RANK", 0))


def get_group(name):
    """The named process group (None, i.e. the world, when not distributed)."""
    return _groups[name].group if name in _groups else None


def get_size(name):
    """Size of the named group (1 when not distributed or the group is unknown)."""
    return _groups[name].size if name in _groups else 1


def get_rank(name):
    """This process's rank inside the named group (0 when not distributed or unknown)."""
    return _groups[name].rank if name in _groups else 0


def get_names():
    """Names of the process groups that exist."""
    return list(_groups)


def is_initialized(name):
    """Whether the named process group exists."""
    return name in _groups


def _build_groups(layout):
    """Create every group of each type on every rank (new_group is collective: all ranks call it for every
    list, in the same order) and keep, under its type's name, the one holding this rank with its size and this
    rank's place from the layout's numbers, checked once against the group itself. A list that is the whole world
    reuses the world group (so train.py's "dp" stays the world, as for DDP before)."""
    world, rank = list(range(dist.get_world_size())), dist.get_rank()
    timeout = datetime.timedelta(seconds=_joined.get("timeout", DEFAULT_COLLECTIVE_TIMEOUT))  # the world's, too
    generator = layout.grid()
    for name in GROUP_TYPES:
        for ranks in generator.get_ranks(name):
            group = dist.group.WORLD if ranks == world else dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                _groups[name] = Axis(name, GROUP_SIZES[name](layout), sorted(ranks).index(rank), group)
                held = (dist.get_world_size(group), dist.get_rank(group))  # the layout's numbers are the group's
                if held != (_groups[name].size, _groups[name].rank):
                    raise ValueError(f"group '{name}': this rank is {held[1]} of {held[0]}, the layout says "
                                     f"{_groups[name].rank} of {_groups[name].size}")
    # host-side flags (lifecycle/signals.py) go through gloo, so that reading them never waits for the GPU
    _joined["host"] = (dist.new_group(backend="gloo", timeout=timeout) if dist.get_backend() == "nccl"
                       else dist.group.WORLD)


def get_device():
    """cuda:LOCAL_RANK (modulo the GPUs this process sees: one each when Slurm binds a GPU per task) when CUDA is
    present, else the CPU. A node that should have GPUs which PyTorch cannot use is refused in one line, instead of
    training on the CPU unnoticed."""
    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
    expected = rendezvous.gpus_expected()
    if expected:
        raise OneRankError(f"{expected}, but PyTorch cannot use a GPU ({rendezvous.why_no_cuda()}); load the "
                           "tutorial's container or a PyTorch built for this driver, or set CUDA_VISIBLE_DEVICES= "
                           "(empty) to run on the CPU on purpose")
    return torch.device("cpu")


def init(layout=None, rendezvous_timeout=DEFAULT_RENDEZVOUS_TIMEOUT, collective_timeout=DEFAULT_COLLECTIVE_TIMEOUT):
    """Join the process group when WORLD_SIZE > 1 (utils/rendezvous.py: waiting at most `rendezvous_timeout`
    seconds for the other ranks; every collective of every group then waits at most `collective_timeout` seconds
    for the others, after which the job stops in one line) and build the groups of the tp x cp x dp grid of
    `layout`: a Layout (train_mp.py), a dict or config with "tp", "cp", "order" (the original `comm.init(params)`),
    or None: every rank is one replica and "dp" is the world (train.py). A process group joined before (a dry run's
    stand-ins, planning/dry_run.py) is used as it is. Returns the run's Grid (utils/layout.py)."""
    world_size = world_size_to_be()
    # checked before the rendezvous, so that every rank stops at once with the same line (a Layout was checked when
    # it was built for this world)
    if isinstance(layout, Layout):
        if layout.world_size != world_size:
            raise ValueError(f"the layout is for {layout.world_size} ranks, the job has {world_size}")
    else:
        layout = Layout.from_dict(layout if layout is not None else {}, world_size)
    if not (math.isfinite(collective_timeout) and collective_timeout > 0):
        raise UserError(f"--collective_timeout is {collective_timeout:g}; give the seconds a collective may wait "
                        f"for the other ranks (default {DEFAULT_COLLECTIVE_TIMEOUT})")
    _groups.clear()
    _joined["timeout"] = collective_timeout
    if world_size > 1 and not dist.is_initialized():
        settings = rendezvous.launch_settings(world_size, rendezvous_timeout)  # checked before a GPU is touched
        device = get_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _joined["store"] = join(settings, world_size, device, rendezvous_timeout, collective_timeout)
    if dist.is_initialized():
        _build_groups(layout)
    if get_world_rank() == 0:
        logging.info(f"Setting {layout.describe()}")
    return Grid(layout, _groups)


def join(settings, world_size, device, rendezvous_timeout, collective_timeout):
    """Meet the other ranks (utils/rendezvous.py: the launcher's address, with its checks) and make the default process
    group on their store: NCCL on a GPU, told this rank's GPU (`device_id`: its communicator is made now, and each
    subgroup split from it), gloo on the CPU; each collective waits at most `collective_timeout` seconds. Returns
    the store."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    store, rank, world_size = rendezvous.meet(settings, world_size, backend, rendezvous.gpu_id(device),
                                              rendezvous_timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=collective_timeout),
                            **({"device_id": device} if backend == "nccl" else {}))
    return store


def get_store():
    """The rendezvous store init met the other ranks in (None without one: a single process, a process group joined
    before init, as a dry run's): resilience.attach keeps rank 0's posts and the ranks' notes in it."""
    return _joined.get("store")


def get_host_group():
    """Every rank over gloo (CPU tensors): the group of the host's collectives (resilience/host.py), which never
    wait for the GPU. None before init."""
    return _joined.get("host")


def is_dry_run():
    """Whether the other ranks are stand-ins (planning/dry_run.join): objects are then not exchanged, only tensors'
    shapes."""
    return dist.is_initialized() and dist.get_backend() == "fake"


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


def forget_groups():
    """Drop the named groups and the host's group (destroy, or a rank leaving the job on a failure:
    resilience/peers.py). Each Axis lets go of its process group, so the grid and the model's layers, which hold the
    same Axes, keep none alive: on torch 2.5 a group destroyed later, with the GIL held, can hang the rank for good
    (utils/compat.leave_process_group says why)."""
    for axis in _groups.values():
        axis.let_go()
    _groups.clear()
    _joined.pop("host", None)


def destroy():
    """Leave the process group and forget the named groups, the host's group and the store (a single process's
    again): a subgroup kept alive after the world is destroyed keeps gloo's threads running until the interpreter
    exits, which can abort it ("terminate called..."). The groups' backends are torn down without the GIL
    (utils/compat.leave_process_group)."""
    forget_groups()
    _joined.clear()
    if dist.is_initialized():
        leave_process_group()


def synchronize(device):
    """Wait for the device's queued work (CUDA kernels run asynchronously): needed before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier():
    if dist.is_initialized():
        dist.barrier()

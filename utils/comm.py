"""Distributed setup from the launcher's variables: WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

torchrun sets them; under Slurm, export_DDP_vars.sh exports the same names from SLURM_*. NCCL on GPUs,
gloo on CPUs. Process groups are kept by name: "dp" is the data-parallel group (every rank of train.py is a
data-parallel replica, so there it is the whole world). Reductions take the group's name as an argument.

A model-parallel script passes its layout (utils/layout.py: built once from the flags; the original's
init({"tp": 2, "cp": 2, "order": "tp-cp-dp"}) works too): the ranks are laid out on a tp x cp x dp grid (the first
name of the order varies fastest; see utils/rank_generator.py) and the groups "dp", "tp", "cp", "tp-cp" and
"dp-cp" are built. A layout that does not divide the world is refused before the rendezvous, in one line; the
model's own rules (heads, MLP width, tokens) are the layout's too, checked when the model is built.
Unknown group names have size 1 and rank 0, so code written for tp and cp also runs without them.
"""
import contextlib
import datetime
import logging
import math
import os

import torch
import torch.distributed as dist

from utils import health, rendezvous
from utils.compat import ddp_buffer_sync, join_fake_process_group  # noqa: F401 (ddp_buffer_sync: for the scripts)
from utils.errors import OneRankError, UserError, register_cleanup
from utils.health import world_size_to_be
from utils.layout import Layout

DEFAULT_RENDEZVOUS_TIMEOUT = 600  # seconds a rank waits for the others to start
DEFAULT_COLLECTIVE_TIMEOUT = 600  # seconds a collective waits for every rank (torch's default for NCCL, 10 minutes)
_groups = {}
_layout = {"now": Layout()}  # this run's layout (serial until init)
GROUP_TYPES = ("dp", "tp", "cp", "tp-cp", "dp-cp")  # built, in this order, on every rank
_host = {}  # "group": every rank over gloo (CPU tensors), for flags the host reads (not a named group);
# "timeout": --collective_timeout (seconds). The rendezvous store and what keeps the job healthy: utils/health.py


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


def is_initialized(name):
    """Whether the named process group exists."""
    return name in _groups


def get_layout():
    """This run's Layout (utils/layout.py): tp, cp, dp, order and the memory switches (all 1 before init)."""
    return _layout["now"]


@contextlib.contextmanager
def serial_layout():
    """Within the block every named group has size 1 and the layout is serial, as in a single process: builds the
    serial model on a rank of any layout (to count the model's FLOPs, say), without a collective."""
    saved, saved_layout = dict(_groups), _layout["now"]
    _groups.clear()
    _layout["now"] = Layout()
    try:
        yield
    finally:
        _groups.update(saved)
        _layout["now"] = saved_layout


def _build_groups(generator):
    """Create every group of each type on every rank (new_group is collective: all ranks call it for every
    list, in the same order) and keep, under its type's name, the one holding this rank. A list that is the
    whole world reuses the world group (so train.py's "dp" stays the world, as for DDP before)."""
    world, rank = list(range(dist.get_world_size())), dist.get_rank()
    timeout = datetime.timedelta(seconds=_host.get("timeout", DEFAULT_COLLECTIVE_TIMEOUT))  # the world's, too
    for name in GROUP_TYPES:
        for ranks in generator.get_ranks(name):
            group = dist.group.WORLD if ranks == world else dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                _groups[name] = group
    # host-side flags (lifecycle/signals.py) go through gloo, so that reading them never waits for the GPU
    _host["group"] = (dist.new_group(backend="gloo", timeout=timeout) if dist.get_backend() == "nccl"
                      else dist.group.WORLD)


def gpus_expected():
    """Why this process should have a GPU ('' when nothing says so): CUDA_VISIBLE_DEVICES naming devices (set but
    empty means no GPU on purpose), else Slurm's GPUs on this node, else the NVIDIA driver's device files."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return f"CUDA_VISIBLE_DEVICES={visible}" if visible.strip() not in ("", "-1", "NoDevFiles") else ""
    if os.environ.get("SLURM_GPUS_ON_NODE", "0") not in ("", "0"):
        return f"Slurm gave this node GPUs (SLURM_GPUS_ON_NODE={os.environ['SLURM_GPUS_ON_NODE']})"
    return "this node has NVIDIA devices (/dev/nvidia0)" if os.path.exists("/dev/nvidia0") else ""


def _why_no_cuda():
    if torch.version.cuda is None:
        return "this PyTorch is a CPU-only build"
    try:
        torch.cuda.init()
    except Exception as err:  # the driver's reason: none found, too old for this build, ...
        return str(err).splitlines()[0]
    return "torch.cuda.is_available() is False"


def get_device():
    """cuda:LOCAL_RANK (modulo the GPUs this process sees: one each when Slurm binds a GPU per task) when CUDA is
    present, else the CPU. A node that should have GPUs which PyTorch cannot use is refused in one line, instead of
    training on the CPU unnoticed."""
    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
    expected = gpus_expected()
    if expected:
        raise OneRankError(f"{expected}, but PyTorch cannot use a GPU ({_why_no_cuda()}); load the tutorial's "
                           "container or a PyTorch built for this driver, or set CUDA_VISIBLE_DEVICES= (empty) to "
                           "run on the CPU on purpose")
    return torch.device("cpu")


def gpu_id(device):
    """What tells this GPU apart from the others of its node (its UUID; '' on the CPU)."""
    if device.type != "cuda":
        return ""
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", "")) or f"index {device.index}"


def init(layout=None, rendezvous_timeout=DEFAULT_RENDEZVOUS_TIMEOUT, dry_run_rank=None,
         collective_timeout=DEFAULT_COLLECTIVE_TIMEOUT):
    """Join the process group when WORLD_SIZE > 1 (utils/rendezvous.py: waiting at most `rendezvous_timeout`
    seconds for the other ranks; every collective of every group then waits at most `collective_timeout` seconds
    for the others, after which the job stops in one line) and build the groups of the tp x cp x dp grid of
    `layout`: a Layout (train_mp.py),
    a dict or config with "tp", "cp", "order" (the original `comm.init(params)`), or None: every rank is one
    replica and "dp" is the world (train.py). With `dry_run_rank` this one process is that rank of the layout's
    world and the other ranks are stand-ins (join_dry_run). Returns (world size, world rank, local rank)."""
    if dry_run_rank is not None:
        join_dry_run(layout, dry_run_rank)  # the process group is then joined: the groups are built below
    world_size = world_size_to_be()
    # checked before the rendezvous, so that every rank stops at once with the same line (a Layout was checked when
    # it was built for this world)
    if isinstance(layout, Layout):
        if layout.world_size != world_size:
            raise ValueError(f"the layout is for {layout.world_size} ranks, the job has {world_size}")
    else:
        layout = Layout.from_dict(layout if layout is not None else {}, world_size)
    generator = layout.grid()
    if not (math.isfinite(collective_timeout) and collective_timeout > 0):
        raise UserError(f"--collective_timeout is {collective_timeout:g}; give the seconds a collective may wait "
                        "for the other ranks (default 600)")
    _groups.clear()
    _host["timeout"] = collective_timeout
    _layout["now"] = layout
    if world_size > 1 and not dist.is_initialized():
        settings = rendezvous.launch_settings(world_size, rendezvous_timeout)  # checked before a GPU is touched
        device = get_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = rendezvous.init_process_group(settings, world_size, "nccl" if device.type == "cuda" else "gloo",
                                              gpu_id(device), rendezvous_timeout, collective_timeout)
        health.watch(store, collective_timeout, forget_groups)  # one line when the job stops, not a hang
    if dist.is_initialized():
        _build_groups(generator)
    if get_world_rank() == 0:
        logging.info(f"Setting {layout.describe()}")
    return get_world_size(), get_world_rank(), get_local_rank()


# A dry run builds every process group of its world in this one process (_build_groups: about 0.1 ms and 0.3 KB a
# rank on a CPU core; 2^17 ranks take about 10 s, 10^8 ranks would take hours and over 20 GB): 2^17 = 131072 ranks,
# above the largest GPU jobs run today (about 100,000 GPUs), is as many as it stands in for.
DRY_RUN_MAX_RANKS = 2 ** 17


def dry_run_refusal(world_size):
    """Why a dry run of `world_size` ranks cannot run (one line without the flag's name), or None."""
    if world_size > DRY_RUN_MAX_RANKS:
        return (f"{world_size} ranks is more than a dry run stands in for: it builds every process group of the "
                f"layout in this one process (about 0.1 ms a rank), so it takes at most {DRY_RUN_MAX_RANKS} ranks "
                "(2^17, more than the largest GPU jobs); give a smaller N")
    return None


def join_dry_run(layout, rank):
    """Join, as rank `rank` of the Layout `layout` (train_mp.py --dry_run), a process group of torch's fake backend
    (utils/compat.py: its collectives return at once and move no data), alone: with the grid's groups (init) every
    kernel this rank runs is real and every tensor it holds has its real shape; the values that cross ranks are
    meaningless."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 or dist.is_initialized():
        raise UserError("--dry_run runs one process standing for the whole layout; start it with python, not "
                        "torchrun or srun with several tasks")
    too_large = dry_run_refusal(layout.world_size)
    if too_large:
        raise UserError(f"--dry_run {too_large}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.world_size:
        raise UserError(f"--dry_run_rank {rank} is not a rank of {layout.world_size}; give one of 0 to "
                        f"{layout.world_size - 1}")
    logging.info(f"Dry run: rank {rank} of {layout.world_size} ({layout.describe()}) in this one process; the "
                 "other ranks are stand-ins whose collectives move no data, so the numbers it computes are "
                 "meaningless: no checkpoint, no TensorBoard, no check for nan; memory is this rank's, time is "
                 "compute only")
    join_fake_process_group(rank, layout.world_size)
    register_cleanup(destroy)  # a refusal after this point leaves no process group behind (a finished run: no-op)


def is_dry_run():
    """Whether the other ranks are stand-ins (join_dry_run): objects are then not exchanged, only tensors' shapes."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def all_reduce_sum(tensor, group="dp"):
    """Sum of `tensor` over the named group (in place; returned)."""
    if dist.is_initialized() and get_size(group) > 1:
        dist.all_reduce(tensor, group=get_group(group))
    return tensor


def all_reduce_mean(tensor, group="dp"):
    """Mean of `tensor` over the named group."""
    return all_reduce_sum(tensor, group) / get_size(group)


def max_over_ranks_on_host(value):
    """The largest integer `value` over every rank (collective), through gloo on the host: no device sync."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_host.get("group"))
    return int(tensor.item())


class HostMax:
    """max_over_ranks_on_host(value), started now and read later: the all-reduce runs in gloo's own thread while
    the rank goes on (lifecycle/signals.py starts one at a step boundary and reads it some boundaries later, so no
    step waits for it). Every rank must start the same sequence of them; a single process's is its own value."""

    def __init__(self, value):
        self.tensor = torch.tensor([value], dtype=torch.int64)
        self.work = None
        if dist.is_initialized() and dist.get_world_size() > 1 and not is_dry_run():
            self.work = dist.all_reduce(self.tensor, op=dist.ReduceOp.MAX, group=_host.get("group"), async_op=True)

    def wait(self):
        """The largest value over every rank (waits for the all-reduce if it has not finished)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return int(self.tensor.item())


def gather_on_host(value):
    """Every rank's `value` (a small picklable object) in rank order, on every rank: one collective over the host's
    gloo group, for start-up checks that the ranks agree. [value] in one process or a dry run."""
    if not dist.is_initialized() or is_dry_run():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=_host.get("group"))
    return values


def all_reduce_min(tensor):
    """Minimum over every rank (an agreement all ranks act on, e.g. to stop together)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor


def on_rank0(action):
    """`action()` on rank 0 alone (its result there, None elsewhere). If it raises a UserError every rank raises
    it, instead of the others waiting forever at their next collective. The others wait for rank 0 on the host
    (broadcast_from_rank0), as long as the action takes: a checkpoint written to a slow file system is not bounded
    by --collective_timeout."""
    result, error = None, None
    if get_world_rank() == 0:
        try:
            result = action()
        except UserError as err:
            error = str(err)
    error = broadcast_from_rank0(error)
    if error:
        health.until_read_after_error()  # rank 0's process may hold the store: it stays up until the others read
        raise UserError(error)
    return result




def broadcast_from_rank0(obj):
    """Rank 0's `obj` on every rank (a picklable Python object); the others wait until rank 0 gets here. Through
    the rendezvous store where there is one (torchrun or srun): rank 0 posts it and goes on, the others poll the
    store on the host, however long rank 0 takes (a checkpoint write, a dataset download), without a collective
    that --collective_timeout (NCCL's watchdog) would end (utils/health.py). Without a store (a dry run, a process
    group made elsewhere, torchrun's agent that held it gone) a collective broadcast."""
    if not dist.is_initialized() or is_dry_run():
        return obj
    if health.has_store():
        return health.post_from_rank0(obj)
    objects = [obj]
    dist.broadcast_object_list(objects, src=0)
    return objects[0]


def forget_groups():
    """Drop the named groups and the host's group (a rank leaving the job on a failure: utils/health.py)."""
    _groups.clear()
    _host.pop("group", None)


def destroy():
    """Leave the process group and forget the named groups and the grid (a single process's again): a subgroup kept
    alive after the world is destroyed keeps gloo's threads running until the interpreter exits, which can abort it
    ("terminate called..."). The groups' backends are torn down without the GIL (health.leave_process_group)."""
    _groups.clear()
    health.forget()
    _host.clear()
    _layout["now"] = Layout()
    if dist.is_initialized():
        health.leave_process_group()


def synchronize(device):
    """Wait for the device's queued work (CUDA kernels run asynchronously): needed before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier():
    if dist.is_initialized():
        dist.barrier()

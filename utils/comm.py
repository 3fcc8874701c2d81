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
import atexit
import contextlib
import datetime
import logging
import math
import os
import pickle
import threading
import time

import torch
import torch.distributed as dist

from utils import rendezvous
from utils.compat import ddp_buffer_sync, join_fake_process_group  # noqa: F401 (ddp_buffer_sync: for the scripts)
from utils.errors import PEER_LOST, TIMED_OUT, OneRankError, UserError, on_job_failures, register_cleanup
from utils.layout import Layout

DEFAULT_RENDEZVOUS_TIMEOUT = 600  # seconds a rank waits for the others to start
DEFAULT_COLLECTIVE_TIMEOUT = 600  # seconds a collective waits for every rank (torch's default for NCCL, 10 minutes)
_groups = {}
_layout = {"now": Layout()}  # this run's layout (serial until init)
GROUP_TYPES = ("dp", "tp", "cp", "tp-cp", "dp-cp")  # built, in this order, on every rank
_host = {}  # "group": every rank over gloo (CPU tensors), for flags the host reads; not a named group;
# "store": the rendezvous store, where a failing rank leaves its note; "checkpoint": the last one written or resumed;
# "timeout": --collective_timeout (seconds); "posts": how many objects rank 0 has posted in the store
LOST_PEER_CENSUS_S = 1.0  # how long the ranks that lost a peer wait for each other's note before naming the lost
LOST_PEER_LINGER_S = 3.0  # how long rank 0 keeps the store up for the others' questions after a failure
USER_ERROR_WAIT_S = 1.0  # how long a rank other than 0 waits for rank 0 to say a UserError both found


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


def world_size_to_be():
    """The number of ranks of this job: the process group's once joined, else the launcher's WORLD_SIZE."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


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
        _host["store"] = rendezvous.init_process_group(settings, world_size,
                                                       "nccl" if device.type == "cuda" else "gloo", gpu_id(device),
                                                       rendezvous_timeout, collective_timeout)
        on_job_failures(announce_failure, explain_lost_peer, claim_user_error)
        if get_world_rank() == 0:
            _beat_while_alive(_host["store"])
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
        if get_world_rank() == 0 and _host.get("store") is not None and "posts" in _host:
            _until_read(_host["posts"])  # rank 0's process may hold the store: it stays up until the others read
        raise UserError(error)
    return result


RANK0_POLL_S = (0.005, 0.5)  # how often a rank waiting for rank 0's post looks at the store: first, at most
RANK0_BEAT_S = 2.0  # how often rank 0's heartbeat thread writes its count in the store
RANK0_SILENT_S = 20.0  # a rank 0 whose heartbeat has not moved for this long is gone (torchrun's agent holds the
# store then, and kills every rank 30 s after one died): shorter than that, longer than any pause of a live thread
RANK0_READ_WAIT_S = 10.0  # how long rank 0 waits for the others to read an error it posted before it exits


def _beat_while_alive(store):
    """Rank 0: a daemon thread that counts up a key in the store every RANK0_BEAT_S while the process lives (also
    while its main thread writes a checkpoint for minutes): the others' sign that a rank 0 they wait for is alive.
    It is stopped and joined before the interpreter finalizes (atexit, and destroy()): a daemon thread that comes
    back from the store's C++ call after finalization began is ended by Python inside that call, and the C++
    runtime aborts the whole process ("terminate called without an active exception", exit -6) although the run
    had exited cleanly."""
    stop = threading.Event()

    def beat():
        with contextlib.suppress(Exception):  # the store is gone (the job ends), or a new one replaced it
            while _host.get("store") is store and not stop.is_set():
                store.add("rank0_beat", 1)
                stop.wait(RANK0_BEAT_S)
    thread = threading.Thread(target=beat, name="rank0-heartbeat", daemon=True)
    thread.start()
    _host["heartbeat"] = (stop, thread)
    atexit.unregister(_stop_heartbeat)  # once per process, however many runs it makes
    atexit.register(_stop_heartbeat)


def _stop_heartbeat():
    """Stop rank 0's heartbeat thread, if it beats, and wait (briefly) until it has left the store's C++ code."""
    stop, thread = _host.pop("heartbeat", (None, None))
    if stop is not None:
        stop.set()
        thread.join(timeout=5.0)


def _until_read(number):
    """Rank 0, having posted an error: wait (at most RANK0_READ_WAIT_S) until every other rank has read post
    `number`, so that none finds the store gone (rank 0's process holds it under srun) and blames rank 0."""
    store, deadline = _host.get("store"), time.monotonic() + RANK0_READ_WAIT_S
    with contextlib.suppress(Exception):
        while store is not None and time.monotonic() < deadline:
            if store.add(f"rank0_post/{number}/read", 0) >= world_size_to_be() - 1:
                return
            time.sleep(0.01)


def broadcast_from_rank0(obj):
    """Rank 0's `obj` on every rank (a picklable Python object); the others wait until rank 0 gets here. Through
    the rendezvous store where there is one (torchrun or srun): rank 0 posts it and goes on, the others poll the
    store on the host, however long rank 0 takes (a checkpoint write, a dataset download), without a collective
    that --collective_timeout (NCCL's watchdog) would end; a store that is gone took rank 0 with it. Without a store
    (a dry run, a process group made elsewhere) a collective broadcast."""
    if not dist.is_initialized() or is_dry_run():
        return obj
    store = _host.get("store")
    if store is None:
        objects = [obj]
        dist.broadcast_object_list(objects, src=0)
        return objects[0]
    _host["posts"] = _host.get("posts", 0) + 1  # every rank counts the same posts: the key of this one
    key = f"rank0_post/{_host['posts']}"
    if get_world_rank() == 0:
        store.set(key, pickle.dumps(obj))
        return obj
    # 3 requests a look, from every other rank: slower on big jobs (at 4,096 ranks, every 1.2 s from the start)
    world = world_size_to_be()
    longest = rendezvous.store_poll_pause(world, RANK0_POLL_S[1], requests=3)
    pause, beat, beat_moved = rendezvous.store_poll_pause(world, RANK0_POLL_S[0], requests=3), None, time.monotonic()
    try:
        while not store.check([key]):  # check, not wait: a wait that times out warns on stderr every time
            if store.check(["failed"]):  # rank 0 said why it stops (a OneRankError): its line is the job's last
                raise RuntimeError("Connection closed by peer: rank 0 stopped with its own line")
            now_beat = store.add("rank0_beat", 0)
            if now_beat != beat:
                beat, beat_moved = now_beat, time.monotonic()
            elif time.monotonic() - beat_moved > RANK0_SILENT_S:  # rank 0 is gone; the store (torchrun's) is not
                raise RuntimeError(f"Connection closed by peer: rank 0's heartbeat stopped {RANK0_SILENT_S:g} s ago")
            time.sleep(pause)
            pause = min(2 * pause, longest)
        obj = pickle.loads(store.get(key))
        store.add(f"{key}/read", 1)
        return obj
    except dist.DistNetworkError:  # rank 0's process held the store: it is gone (utils/errors.py: one line)
        _host["store"] = None  # not asked again: its answer would be a second warning of torch's
        raise RuntimeError("Connection closed by peer: rank 0's rendezvous store is gone") from None


def destroy():
    """Leave the process group and forget the named groups and the grid (a single process's again): a subgroup kept
    alive after the world is destroyed keeps gloo's threads running until the interpreter exits, which can abort it
    ("terminate called..."). The groups' backends are torn down without the GIL (leave_process_group)."""
    _groups.clear()
    _stop_heartbeat()
    _host.clear()
    _layout["now"] = Layout()
    on_job_failures()  # a later error of this process is no longer a peer's
    if dist.is_initialized():
        leave_process_group()


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


def note_checkpoint(path, iteration):
    """The checkpoint a restart would resume from (written or resumed), for the line of a rank that lost a peer."""
    _host["checkpoint"] = f"'{path}' (iteration {iteration})"


def announce_failure(message):
    """A rank that stops on a OneRankError (utils/errors.py, after printing its line): note it in the rendezvous
    store, then leave the process group, which closes this rank's connections: the other ranks' next collective
    fails at once (gloo), or is aborted (NCCL, where torch can abort), instead of waiting for NCCL's timeout; they
    read the note and exit without a line of their own (explain_lost_peer), so this rank's line is the job's last
    word. On a cluster `srun --kill-on-bad-exit=1` (the submit scripts) ends the others as well."""
    store = _host.get("store")
    rank, world = get_world_rank(), world_size_to_be()
    try:
        if store is not None:
            store.set("failed", str(rank))
    except (RuntimeError, OSError):  # the store went with its host: the others will find out by themselves
        store = None
    _groups.clear()
    _host.pop("group", None)
    if dist.is_initialized():
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.6; NCCL without a wait
        if abort is not None and dist.get_backend() == "nccl":
            abort()
        else:
            leave_process_group()
    if rank == 0 and store is not None:
        try:
            linger_for_the_others(store, world)  # the others read the note from the store this process holds
        except (RuntimeError, OSError):
            pass


def claim_user_error():
    """Whether this rank says the UserError it stops on (utils/errors.py, stop_in_one_line): the first rank to
    claim it in the store does, and the others leave quietly, marked in the store (rank 0, which may hold it,
    then need not wait for them). Rank 0 claims at once; another rank first waits USER_ERROR_WAIT_S for rank 0,
    which finds the same error when every rank reads the same flags, config and files. A rank alone with its error
    (its node's missing mount or data) says it itself. Without a store (gone with rank 0): rank 0 says it."""
    store, rank = _host.get("store"), get_world_rank()
    try:
        if rank != 0:
            deadline, pause = time.time() + USER_ERROR_WAIT_S, rendezvous.store_poll_pause(world_size_to_be(), 0.05)
            while time.time() < deadline and not store.check(["user_error"]):
                time.sleep(pause)
        claimed = store.compare_set("user_error", "", str(rank)) == str(rank).encode()
        if not claimed:
            mark_alive(store, rank)
        return claimed
    except (AttributeError, RuntimeError, OSError):  # no store, or it is gone with its host
        return rank == 0


def explain_lost_peer(err):
    """This rank's line when a collective failed because another rank is gone (utils/errors.py), or None: the rank
    that failed said why (its note in the store), or a lower surviving rank says it. The survivors mark themselves
    in the store and wait LOST_PEER_CENSUS_S for each other; the ranks without a mark are the lost ones. Rank 0,
    whose process holds the store unless torchrun's agent does, waits (at most LOST_PEER_LINGER_S) until every rank
    has marked itself or its failure, so the store outlives the others' questions. A store that cannot be reached
    went with its host, rank 0: then the first rank of each node says so."""
    rank, world = get_world_rank(), world_size_to_be()
    if any(pattern in str(err) for pattern in TIMED_OUT):
        return explain_timeout(rank, world)
    cause = next((pattern for pattern in PEER_LOST if pattern in str(err)), "a collective failed")
    store = _host.get("store")
    try:
        mark_alive(store, rank)
        deadline, pause = time.time() + LOST_PEER_CENSUS_S, rendezvous.store_poll_pause(world, 0.05)
        while time.time() < deadline and not store.check(["failed"]):
            time.sleep(pause)
        failed = store.check(["failed"])
        lost = None if failed else lost_if_lowest_alive(store, rank, world)
        if rank == 0:
            with contextlib.suppress(RuntimeError, OSError):  # gone meanwhile: nobody is left to ask it
                linger_for_the_others(store, world)
    except (AttributeError, RuntimeError, OSError):  # no store, or it is gone with its host: one line a node
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return None
        lost = [0] if rank != 0 else []
    if lost is None:
        return None  # the failing rank's line says why, or a lower surviving rank's
    named = ", ".join(map(str, lost[:8])) + (f" and {len(lost) - 8} more" if len(lost) > 8 else "")
    who = f"rank{'s' if len(lost) > 1 else ''} {named}" if lost else "another rank"
    resume = _host.get("checkpoint")
    again = f"starting again resumes from {resume}" if resume else "no checkpoint was written yet"
    return (f"rank {rank}: {who} stopped answering in a collective ({cause}) without a line of its own (killed, "
            f"out of memory, or its node failed); the job stops; {again}")


def explain_timeout(rank, world):
    """This rank's line when a collective waited longer than --collective_timeout, or None: only the first rank to
    time out speaks (the store counts them) and notes itself as the failing one, so that the slow rank, which finds
    the others gone when it reaches the collective, stays quiet (explain_lost_peer)."""
    store, first = _host.get("store"), True
    try:
        first = store.add("timed_out", 1) == 1
        mark_alive(store, rank)
        if first:
            store.set("failed", str(rank))
        if rank == 0:
            linger_for_the_others(store, world)
    except (AttributeError, RuntimeError, OSError):  # no store, or it is gone with its host
        first = os.environ.get("LOCAL_RANK", "0") == "0"
    if not first:
        return None
    resume = _host.get("checkpoint")
    again = f"starting again resumes from {resume}" if resume else "no checkpoint was written yet"
    return (f"rank {rank}: a collective waited longer than --collective_timeout "
            f"({_host.get('timeout', DEFAULT_COLLECTIVE_TIMEOUT):g} s) for the other ranks (one of them is slow or "
            f"stuck: a file system, a compile, a hung GPU); the job stops; raise --collective_timeout if that wait "
            f"is expected; {again}")


def mark_alive(store, rank):
    """Mark this rank alive in the store, once: under a key of its own (which the rank that names the lost ones
    reads) and in a count (which rank 0 reads in one request, however many ranks the job has)."""
    if store.add(f"alive/{rank}", 1) == 1:
        store.add("alive_count", 1)


def lost_if_lowest_alive(store, rank, world):
    """The ranks not marked alive, if this rank is the lowest marked one (the one to name them), else None. A rank
    asks only about the ranks below it, up to the first marked one (one request when rank 0 lives): the job's
    requests grow as its ranks, not as their square (4,096 ranks each asking about every other: 16.8 million
    requests to one store, minutes)."""
    if any(store.check([f"alive/{other}"]) for other in range(rank)):
        return None
    return list(range(rank)) + [other for other in range(rank + 1, world) if not store.check([f"alive/{other}"])]


def linger_for_the_others(store, world):
    """Rank 0 leaving on a failure: wait (at most LOST_PEER_LINGER_S) until every rank has marked itself alive or
    failed in the store its process may hold, so that none finds the store gone while it asks."""
    deadline = time.time() + LOST_PEER_LINGER_S
    while time.time() < deadline:
        failing = int(store.get("failed")) if store.check(["failed"]) else None
        failing_unmarked = failing is not None and not store.check([f"alive/{failing}"])
        if store.add("alive_count", 0) >= world - failing_unmarked:
            return
        time.sleep(0.05)


def synchronize(device):
    """Wait for the device's queued work (CUDA kernels run asynchronously): needed before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier():
    if dist.is_initialized():
        dist.barrier()

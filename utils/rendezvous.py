"""Joining the process group: the rendezvous behind comm.init, with its checks (launch variables, room for the job's
sockets, a rank 0 that never comes, another job's rank 0 on the same port, two ranks on one GPU) and torchrun's
restarts. Every failure a user can cause ends in one line (UserError).

The rendezvous runs alone, with --dist_timeout; the process group comm.join then makes bounds every collective
(--collective_timeout); both defaults are here (DEFAULT_RENDEZVOUS_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT). Its checks
run before the process group exists, inside comm.init; what watches the job once it runs (rank 0's heartbeat, the
one line when a rank fails or times out) is resilience/, attached after comm.init.
"""
import datetime
import logging
import math
import os
import resource
import socket
import time

import torch
import torch.distributed as dist

from utils.errors import OneRankError, UserError

DEFAULT_RENDEZVOUS_TIMEOUT = 600  # seconds a rank waits for the others to start (--dist_timeout)
DEFAULT_COLLECTIVE_TIMEOUT = 600  # seconds a collective waits for every rank (--collective_timeout; torch's default
# for NCCL, 10 minutes)


def world_size_to_be():
    """The number of ranks of this job: the process group's once joined, else the launcher's WORLD_SIZE."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def launch_settings(world_size, timeout_s):
    """(rank, MASTER_ADDR, MASTER_PORT) from the launcher's variables, checked before anything touches a GPU."""
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise UserError(f"WORLD_SIZE={world_size} but {', '.join(missing)} not set; launch with "
                        "torchrun, or source export_DDP_vars.sh under srun")
    if timeout_s <= 0:
        raise UserError(f"--dist_timeout is {timeout_s}; give the seconds to wait for the other ranks")
    return int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


# the open files (file descriptors) of a rank before its sockets to the others: about 30 measured on torch 2.14 over
# gloo (its libraries' pipes and events, the store's client, gloo's listener)
RANK_OWN_FILES = 32
SPARE_FILES = 1024  # what the rank opens later: loader workers' pipes and shared batches, data files, NCCL, logs
# (a soft limit that leaves half of it beside the sockets is left alone: a small job on a usual 1,024 fits as before)


def raise_open_file_limit(world_size, rank, hosts_store=True):
    """Make room for this job's sockets. Gloo's groups are full meshes (the host's group spans every rank: a socket to
    each other rank) and rank 0 hosts the rendezvous store (a connection from each other rank; torchrun's agent holds
    it instead: `hosts_store` False), so rank 0 of N ranks holds about 2N open files, 2,048 at 1,024 GPUs. Many
    systems start a process with a soft limit of 1,024 (`ulimit -n`) below a hard limit it may raise itself: a soft
    limit that leaves less than SPARE_FILES / 2 beside rank 0's sockets is raised to what rank 0 needs plus
    SPARE_FILES, up to the hard limit. A hard limit below rank 0's need is one line (without it gloo aborts rank 0
    with 'accept: Too many open files' and the others end in tracebacks or wait). Every rank checks rank 0's need, so
    that ranks with the same limits (a partition's nodes are configured alike) stop together, rank 0 saying why; a
    node whose hard limit is below rank 0's would stop its ranks without a line of their own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = (2 if hosts_store else 1) * (world_size - 1) + RANK_OWN_FILES
    ceiling = math.inf if hard == resource.RLIM_INFINITY else hard
    if ceiling < need:
        raise UserError(f"{world_size} ranks need about {need} open files on rank 0 (a socket to every other rank, "
                        f"and the rendezvous store's connections), but a process here may open at most {hard} "
                        "(the hard limit, `ulimit -Hn`); ask the system's administrators for more, or run fewer "
                        "ranks")
    raised = int(min(ceiling, need + SPARE_FILES))
    if soft != resource.RLIM_INFINITY and soft < min(raised, need + SPARE_FILES // 2):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        except (ValueError, OSError) as err:  # a container that refuses: the job may fit all the same
            logging.warning(f"open files: could not raise the soft limit from {soft} to {raised} ({err}); if rank 0 "
                            "fails with 'Too many open files', raise `ulimit -n` before starting the ranks")
            return
        if rank == 0:
            logging.info(f"open files: the soft limit raised from {soft} to {raised} for {world_size} ranks "
                         "(a socket to every other rank)")


def gpus_expected():
    """Why this process should have a GPU ('' when nothing says so): CUDA_VISIBLE_DEVICES naming devices (set but
    empty means no GPU on purpose), else Slurm's GPUs on this node, else the NVIDIA driver's device files."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return f"CUDA_VISIBLE_DEVICES={visible}" if visible.strip() not in ("", "-1", "NoDevFiles") else ""
    if os.environ.get("SLURM_GPUS_ON_NODE", "0") not in ("", "0"):
        return f"Slurm gave this node GPUs (SLURM_GPUS_ON_NODE={os.environ['SLURM_GPUS_ON_NODE']})"
    return "this node has NVIDIA devices (/dev/nvidia0)" if os.path.exists("/dev/nvidia0") else ""


def why_no_cuda():
    """Why torch.cuda.is_available() is False, in a few words."""
    if torch.version.cuda is None:
        return "this PyTorch is a CPU-only build"
    try:
        torch.cuda.init()
    except Exception as err:  # the driver's reason: none found, too old for this build, ...
        return str(err).splitlines()[0]
    return "torch.cuda.is_available() is False"


def meet(settings, world_size, backend, gpu, timeout_s):
    """Meet the other `world_size - 1` ranks at `settings` (launch_settings: rank, MASTER_ADDR, MASTER_PORT) within
    `timeout_s` seconds and check one rank per GPU (NCCL; `gpu` tells this rank's GPU apart), before comm.join makes
    the process group on what this returns: (the rendezvous store, this rank, the world size). The store is also
    where resilience/ keeps rank 0's posts and the ranks' notes when one of them fails (comm.get_store)."""
    rank, addr, port = settings
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    raise_open_file_limit(world_size, rank, hosts_store=not agent_store)
    logging.info(f"rank {rank} waiting for {world_size} ranks at {addr}:{port} "
                 f"(timeout {timeout_s:g} s, --dist_timeout)")
    timeout = datetime.timedelta(seconds=timeout_s)
    if agent_store:
        # torchrun's agent hosts the store and restarts every rank after a failure; the keys of each attempt
        # are kept apart, so a restarted rank never reads an address its dead predecessor published
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    else:
        if rank != 0:
            wait_for_master(addr, port, rank, timeout_s)
        try:
            store, rank, world_size = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        except (dist.DistError, RuntimeError) as err:  # "Timed out ... waiting for clients. 1/2 clients joined."
            if "EADDRINUSE" in str(err) or "Address already in use" in str(err):  # libuv's words, or the OS's
                raise UserError(f"rank 0 cannot listen on {addr}:{port}: the port is taken (another job sharing "
                                "this node, or a process left over); set MASTER_PORT to a free port") from None
            raise UserError(f"rank {rank} could not gather {world_size} ranks at {addr}:{port} within "
                            f"{timeout_s:g} s ({err}); start every rank, or raise --dist_timeout") from None
        check_same_job(store, rank, addr, port)
    if backend == "nccl":
        check_one_rank_per_gpu(store, world_size, gpu, timeout_s)
    return store, rank, world_size


def check_same_job(store, rank, addr, port, job=None):
    """Rank 0 writes its Slurm job id (`job`; default $SLURM_JOB_ID, '' outside Slurm) in the store; every other
    rank checks it and claims its rank number there: two jobs sharing a node can pick the same MASTER_PORT
    (export_DDP_vars.sh derives it from the job id; ranks started by hand keep the default), and then the second
    job's rank 0 cannot listen while its other ranks reach the first job's store and would wait in that job's
    rendezvous for good. Such a rank stops in one line (a OneRankError: its own finding) instead: another job's id,
    or, outside Slurm, its rank number already claimed by that job's rank."""
    job = os.environ.get("SLURM_JOB_ID", "") if job is None else job
    if rank == 0:
        store.set("slurm_job_id", job)
        return
    try:
        raw = store.get("slurm_job_id")  # waits for rank 0 (the store's timeout: --dist_timeout)
    except (dist.DistError, RuntimeError) as err:
        raise OneRankError(f"the rank 0 answering at {addr}:{port} never said which job it belongs to ({err}); if "
                           "another job shares this node, set MASTER_PORT to a free port and submit again") from None
    # data from whatever answers at the port: any bytes are said, never decoded strictly (a job id is short ASCII)
    theirs = raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else str(raw)
    if theirs != job:
        theirs = theirs if len(theirs) <= 40 and theirs.isprintable() else f"{theirs[:40]!r}, not a job id"
        raise OneRankError(f"the rank 0 answering at {addr}:{port} belongs to another job (Slurm job "
                           f"{theirs or 'none'}, this is {job or 'none'}): two jobs sharing a node took the same "
                           "port; set MASTER_PORT to a free port and submit again")
    try:
        claims = store.add(f"rank_claims/{rank}", 1)
    except (dist.DistError, RuntimeError) as err:  # the key holds no count (another process's bytes): the host drops us
        raise OneRankError(f"the store answering at {addr}:{port} holds a claim of rank {rank} that is not a count "
                           f"({err}): another job (or a process left over) uses that port; set MASTER_PORT to a free "
                           "port and start again") from None
    if claims != 1:
        raise OneRankError(f"the job whose rank 0 answers at {addr}:{port} already has a rank {rank}: another job "
                           "(or a process left over) holds that port; set MASTER_PORT to a free port and start again")


# The rendezvous store is one server (in rank 0's process, or torchrun's agent) that every rank asks; of the order of
# 100,000 requests a second on one core (a rough count by hand). Ranks that poll it keep their polls to this many a
# second for the whole job, so a wait of 4,096 ranks takes at most a tenth of it, leaving the rest for the others'
# real work (NCCL's start, a note).
STORE_POLLS_PER_S = 10_000


def store_poll_pause(world_size, fastest, requests=1):
    """Seconds between a rank's looks at the store (each `requests` requests) while `world_size` ranks look alike:
    `fastest` for a small job, longer past STORE_POLLS_PER_S (0.05 s for 8 ranks, 0.41 s for 4,096)."""
    return max(fastest, world_size * requests / STORE_POLLS_PER_S)


def gpu_id(device):
    """What tells this GPU apart from the others of its node (its UUID; '' on the CPU)."""
    if device.type != "cuda":
        return ""
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", "")) or f"index {device.index}"


def check_one_rank_per_gpu(store, world_size, gpu, timeout, host=None):
    """Refuse, on every rank, two ranks of one node on the same GPU (more ranks than GPUs, or a wrong
    CUDA_VISIBLE_DEVICES): NCCL would fail later with "Duplicate GPU detected". Each rank counts itself in under its
    node and GPU in the rendezvous store, and all wait until every rank has."""
    host = host or socket.gethostname()
    if store.add(f"gpu_claims/{host}/{gpu}", 1) == 2:  # this GPU's second claim: count the GPU once
        store.add("gpu_claims/shared", 1)
    store.add("gpu_claims/ranks", 1)
    deadline, pause = time.monotonic() + timeout, store_poll_pause(world_size, 0.05)
    while store.add("gpu_claims/ranks", 0) < world_size:
        if time.monotonic() > deadline:
            raise UserError(f"not every rank of {world_size} reached the GPU check within {timeout:g} s; start every "
                            "rank, or raise --dist_timeout")
        time.sleep(pause)
    shared = store.add("gpu_claims/shared", 0)
    if shared:
        raise UserError(f"{shared} GPU(s) are shared by two or more ranks of one node (NCCL needs one GPU per rank); "
                        "start at most as many ranks per node as it has GPUs (srun --ntasks-per-node, torchrun "
                        "--nproc_per_node), or check CUDA_VISIBLE_DEVICES")


def wait_for_master(addr, port, rank, timeout):
    """A rank other than 0 waits until rank 0's store accepts connections, or says why it gave up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise OneRankError(f"rank {rank} waited {timeout:g} s for rank 0 at {addr}:{port} and nobody answered; "
                                "start every rank (srun -n N / torchrun --nproc_per_node N) with the same "
                                "MASTER_ADDR and MASTER_PORT, or raise --dist_timeout") from None
            time.sleep(0.5)

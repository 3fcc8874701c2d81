"""Loader workers, seen from the process that starts them: how many a rank may start on this machine
(check_worker_count, asked at start-up: lifecycle/cli.py), and how they start (WorkerStart: the loaders take one; a
training run hands them lifecycle/signals.py's, which keeps the job's stop signals from the workers). Here, not in
loaders/, because lifecycle/ asks too and may import only utils/."""
import contextlib
import os
from collections.abc import Callable
from typing import NamedTuple

from utils.errors import UserError

# The most loader workers a rank may start (check_worker_count): a guard against counts that cannot run, not a tuning
# rule. CPUs: 4 workers a CPU of this rank's share (a worker waiting for a read uses none), and 8, the most any config
# asks for, whatever the CPUs (many ranks on a few cores, as in the tests, are slow, not broken). Memory: each worker
# budgeted WORKER_MEMORY, twice (the training and the validation loader each keep that many). Measured: a forked
# worker of the tiny and demo configs (2 workers, ERA5, torch 2.14, 2-core CPU machine) holds about 10 MiB of its
# own (Private_Dirty in /proc/PID/smaps_rollup, steady from 10 s to 90 s); its Rss, 410-580 MB, is the training
# process's pages shared copy-on-write. 64 MiB leaves room for pages copied later, page tables and a worker's own
# decode buffers (images). The batches workers read ahead live in shared memory, which the loader sizes and checks
# itself (loaders/common.py: shared_tensor). A container's memory cap (cgroup) is not read: MemAvailable is the host's.
WORKERS_PER_CPU = 4
WORKERS_ALWAYS_ALLOWED = 8
WORKER_MEMORY = 64 * 2**20  # bytes


def machine_facts():
    """(CPUs this process may run on, bytes of memory available now or None, ranks on this node), read at start:
    the CPU affinity, /proc/meminfo's MemAvailable, LOCAL_WORLD_SIZE (torchrun's ranks share the affinity; srun
    sets no LOCAL_WORLD_SIZE but gives each task CPUs of its own, and the node's memory counts for each)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = None
    try:
        with open("/proc/meminfo") as meminfo:
            memory = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):  # not Linux: no memory bound
        pass
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        ranks = 1
    return cpus, memory, ranks


def worker_limit(cpus, memory, ranks):
    """(the most loader workers per rank, why in words) for `ranks` ranks sharing `cpus` CPUs and `memory` bytes
    available (None: unknown); the lower of the CPU and the memory bound (see WORKERS_PER_CPU)."""
    shared = f" shared by {ranks} ranks" if ranks > 1 else ""
    by_cpu = max(WORKERS_ALWAYS_ALLOWED, WORKERS_PER_CPU * cpus // ranks)
    limit, why = by_cpu, (f"{cpus} CPU{'s' * (cpus != 1)}{shared} allow{'s' * (cpus == 1)} at most "
                          f"{by_cpu} loader workers per rank ({WORKERS_PER_CPU} per CPU, never fewer than "
                          f"{WORKERS_ALWAYS_ALLOWED})")
    if memory is not None and memory // (ranks * 2 * WORKER_MEMORY) < limit:
        limit = memory // (ranks * 2 * WORKER_MEMORY)
        why = (f"{memory / 2**30:.1f} GiB of available memory{shared} allows at most {limit} loader workers per rank "
               f"({WORKER_MEMORY // 2**20} MiB each, for the training and the validation loader)")
    return limit, why


def check_worker_count(workers, facts=None):
    """A UserError, before any worker starts, when `workers` loader workers per rank are more than this machine can
    hold (worker_limit); `facts`: (cpus, memory, ranks) instead of machine_facts()."""
    limit, why = worker_limit(*(facts or machine_facts()))
    if workers > limit:
        raise UserError(f"--num_data_workers {workers} is more than this machine can hold: {why}; lower "
                        f"--num_data_workers to {limit} or fewer")


def _nothing():
    """A worker's first call where the start needs none (picklable: DALI's spawned workers unpickle it)."""


def _alone(value):
    return [value]


def _at_once(action):
    return action()


class WorkerStart(NamedTuple):
    """How a loader starts: its worker processes, and its agreement with the job's other ranks. `context()` the
    multiprocessing context of PyTorch's DataLoader (None: the default start method), `starting()` a context manager
    a DALI pipeline is built in (its workers spawn there), `in_worker()` the first call in each worker (PyTorch's
    worker_init_fn, DALI's sample source as it is unpickled); `gather(value)` every rank's value in rank order (a
    collective: the data set's size, checked alike everywhere), `first(action)` action() on rank 0 alone, before the
    others go on (a download): its result there, None elsewhere, its UserError every rank's. A module-level function
    each, so that a spawned worker can unpickle them. The defaults are a process alone's; a training run's come from
    lifecycle (Run.worker_start: lifecycle/signals.py, resilience/)."""
    context: Callable[[], object] = _nothing
    starting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    in_worker: Callable[[], None] = _nothing
    gather: Callable[[object], list] = _alone
    first: Callable[[Callable], object] = _at_once


PLAIN_START = WorkerStart()  # multiprocessing's default, as they are (tests, tools that build a loader alone)

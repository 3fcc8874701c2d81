"""The job's health: what keeps a job of many ranks from ending in silence or in a hang, beside the process groups
of utils/comm.py, which joins it (watch) once the ranks have met.

- Rank 0's heartbeat in the rendezvous store, and rank 0's posts that the other ranks poll (post_from_rank0,
  comm.broadcast_from_rank0): a rank waiting for a slow rank 0 (a checkpoint written for minutes) is not ended by
  --collective_timeout, and one whose rank 0 is gone says so.
- One line per job when it stops (utils/errors.py calls these): a rank that stops on its own error notes it in the
  store and leaves (announce_failure); the others, whose next collective fails, either read that note and leave
  quietly, or count who is still alive and the lowest survivor names the lost ranks (explain_lost_peer); the first
  rank to time out in a collective says so, naming the ranks that did not reach it (explain_timeout); a UserError
  every rank finds is said once (claim_user_error). Each line says which checkpoint a restart resumes from
  (note_checkpoint). A failing rank's questions to the store wait at most a few seconds (its host may be frozen);
  a rank that was itself stopped (SIGSTOP, a frozen node) adds no line when it wakes (was_frozen); a rank whose
  launcher, torchrun's agent, died asks the store it held nothing more (launcher_gone).
- A teardown of the process group that cannot hang (leave_process_group).
"""
import atexit
import contextlib
import os
import pickle
import threading
import time

import torch
import torch.distributed as dist

from utils import rendezvous
from utils.errors import PEER_LOST, TIMED_OUT, on_job_failures

_job = {}  # "store": the rendezvous store, where a failing rank leaves its note; "checkpoint": the last one written
# or resumed; "timeout": --collective_timeout (seconds); "posts": how many objects rank 0 has posted in the store;
# "heartbeat": rank 0's beating thread; "forget_groups": what comm.py drops when this rank leaves on a failure;
# "launcher": torchrun's agent's pid; "freeze_watch", "frozen": the freeze watch and the last freeze it saw;
# "bounded": the store with each request bounded (failing_store)
LOST_PEER_CENSUS_S = 1.0  # how long the ranks that lost a peer wait for each other's note before naming the lost
LOST_PEER_LINGER_S = 3.0  # how long rank 0 keeps the store up for the others' questions after a failure
USER_ERROR_WAIT_S = 1.0  # how long a rank other than 0 waits for rank 0 to say a UserError both found
RANK0_POLL_S = (0.005, 0.5)  # how often a rank waiting for rank 0's post looks at the store: first, at most
RANK0_BEAT_S = 2.0  # how often rank 0's heartbeat thread writes its count in the store
RANK0_SILENT_S = 20.0  # a rank 0 whose heartbeat has not moved for this long is gone (torchrun's agent holds the
# store then, and kills every rank 30 s after one died): shorter than that, longer than any pause of a live thread
RANK0_READ_WAIT_S = 10.0  # how long rank 0 waits for the others to read an error it posted before it exits
FREEZE_TICK_S = 0.5  # how often each rank's freeze watch looks at the clock
FAILING_STORE_WAIT_S = 5.0  # how long a rank that is stopping waits for the store to answer (its host may be frozen)


def world_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size_to_be():
    """The number of ranks of this job: the process group's once joined, else the launcher's WORLD_SIZE."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def watch(store, timeout, forget_groups):
    """Once the ranks have met (utils/comm.init): keep the rendezvous `store` and --collective_timeout (`timeout`,
    seconds), hand utils/errors.py this module's way of ending a job in one line, and start rank 0's heartbeat.
    `forget_groups()` drops comm.py's groups when this rank leaves the job on a failure."""
    _job.update(store=store, timeout=timeout, forget_groups=forget_groups)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # the store's host: torchrun's agent, our parent
        _job["launcher"] = os.getppid()
    on_job_failures(announce_failure, explain_lost_peer, claim_user_error)
    _watch_for_freezes()
    if world_rank() == 0:
        _beat_while_alive(store)


def forget():
    """This process's job has ended (comm.destroy): stop the heartbeat, drop the store and what was noted."""
    _stop_heartbeat()
    _job.get("freeze_watch", threading.Event()).set()
    _job.clear()
    on_job_failures()  # a later error of this process is no longer a peer's


def launcher_gone():
    """Whether torchrun's agent, which started this rank and holds the rendezvous store, has died (the kernel gave
    this rank another parent): then no store request can be answered, and none is sent (each would print a C++
    stack of torch's)."""
    return _job.get("launcher") is not None and os.getppid() != _job["launcher"]


def has_store():
    """Whether the rendezvous store can be asked: there is one, and its host (torchrun's agent) is alive."""
    return _job.get("store") is not None and not launcher_gone()


class _BoundedStore:
    """The rendezvous store whose every request waits at most FAILING_STORE_WAIT_S (TCPStore's add, check and set
    wait for ever on a host that is frozen, whatever set_timeout says): each runs in a daemon thread, and one that
    does not answer in time makes this and every later request raise RuntimeError at once. The thread left waiting
    holds no lock of Python's; the process exits with it (a host that wakes in the very milliseconds of this
    process's exit could make that exit an abort)."""

    def __init__(self, store):
        self.store, self.hung = store, False

    def _ask(self, name, *args):
        if self.hung:
            raise RuntimeError("the rendezvous store does not answer")
        answer = {}

        def ask():
            try:
                answer["value"] = getattr(self.store, name)(*args)
            except BaseException as err:  # handed to the asking thread
                answer["error"] = err
        thread = threading.Thread(target=ask, name="store-request", daemon=True)
        thread.start()
        thread.join(FAILING_STORE_WAIT_S)
        if thread.is_alive():
            self.hung = True
            raise RuntimeError(f"the rendezvous store did not answer within {FAILING_STORE_WAIT_S:g} s")
        if "error" in answer:
            raise answer["error"]
        return answer["value"]

    def __getattr__(self, name):
        if not callable(getattr(self.store, name)):
            return getattr(self.store, name)
        return lambda *args: self._ask(name, *args)


def failing_store():
    """The store, for a rank whose job is failing, each request bounded (_BoundedStore): its host, rank 0's process,
    may be frozen. None without one, or when its host, torchrun's agent, is gone."""
    store = _job.get("store")
    if store is None or launcher_gone():
        return None
    if getattr(_job.get("bounded"), "store", None) is not store:
        _job["bounded"] = _BoundedStore(store)
    return _job["bounded"]


def speaks_without_store(rank, store):
    """Whether this rank says why the job stops when rank 0's store cannot be asked. Gone (rank 0's process held it
    and has exited, after its own line or killed): the first rank of each node. Not answering (rank 0 is frozen,
    and cannot speak): on rank 0's node the second rank too (the ranks are numbered node by node, so rank -
    LOCAL_RANK is 0 there). A rank merely slower than the timeout, which finds the store gone when it comes back,
    then stays quiet on rank 0's node, where rank 0 named it."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return local == 0 or (getattr(store, "hung", False) and rank - local == 0 and local == 1)


def _watch_for_freezes():
    """A daemon thread of each rank that notes when the whole process could not run for a while (SIGSTOP, a node
    frozen or suspended): its clock jumps between two looks. A rank stopped longer than the others' patience was
    the one the job gave up on; woken, it must not add a line blaming the others (was_frozen)."""
    stop = threading.Event()

    def watch():
        last = time.monotonic()
        while not stop.wait(FREEZE_TICK_S):
            now = time.monotonic()
            if now - last > 4 * FREEZE_TICK_S:
                _job["frozen"] = (now - last, now)  # how long, and when it ended
            last = now
    threading.Thread(target=watch, name="freeze-watch", daemon=True).start()
    _job["freeze_watch"] = stop


def was_frozen():
    """Whether this process was frozen (no thread ran) for more than half --collective_timeout, lately: the other
    ranks then timed out waiting for it, and their line says so."""
    seconds, ended = _job.get("frozen", (0.0, 0.0))
    timeout = _job.get("timeout", 600)
    return seconds > max(2.0, timeout / 2) and time.monotonic() - ended < timeout + 60


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
            while _job.get("store") is store and not stop.is_set() and not launcher_gone():
                store.add("rank0_beat", 1)
                stop.wait(RANK0_BEAT_S)
    thread = threading.Thread(target=beat, name="rank0-heartbeat", daemon=True)
    thread.start()
    _job["heartbeat"] = (stop, thread)
    atexit.unregister(_stop_heartbeat)  # once per process, however many runs it makes
    atexit.register(_stop_heartbeat)


def _stop_heartbeat():
    """Stop rank 0's heartbeat thread, if it beats, and wait (briefly) until it has left the store's C++ code."""
    stop, thread = _job.pop("heartbeat", (None, None))
    if stop is not None:
        stop.set()
        thread.join(timeout=5.0)


def _until_read(number):
    """Rank 0, having posted an error: wait (at most RANK0_READ_WAIT_S) until every other rank has read post
    `number`, so that none finds the store gone (rank 0's process holds it under srun) and blames rank 0."""
    store, deadline = _job.get("store"), time.monotonic() + RANK0_READ_WAIT_S
    with contextlib.suppress(Exception):
        while store is not None and time.monotonic() < deadline:
            if store.add(f"rank0_post/{number}/read", 0) >= world_size_to_be() - 1:
                return
            time.sleep(0.01)


def post_from_rank0(obj):
    """Rank 0's `obj` on every rank through the store (comm.broadcast_from_rank0): rank 0 posts it and goes on, the
    others poll the store on the host, however long rank 0 takes, and stop when rank 0's heartbeat stops."""
    store = _job["store"]
    if launcher_gone():
        raise RuntimeError("Connection closed by peer: torchrun's agent, the store's host, is gone")
    _job["posts"] = _job.get("posts", 0) + 1  # every rank counts the same posts: the key of this one
    key = f"rank0_post/{_job['posts']}"
    if world_rank() == 0:
        store.set(key, pickle.dumps(obj))
        return obj
    # 3 requests a look, from every other rank: slower on big jobs (at 4,096 ranks, every 1.2 s from the start)
    world = world_size_to_be()
    longest = rendezvous.store_poll_pause(world, RANK0_POLL_S[1], requests=3)
    pause, beat, beat_moved = rendezvous.store_poll_pause(world, RANK0_POLL_S[0], requests=3), None, time.monotonic()
    try:
        while not store.check([key]):  # check, not wait: a wait that times out warns on stderr every time
            if launcher_gone():
                raise RuntimeError("Connection closed by peer: torchrun's agent, the store's host, is gone")
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
        _job["store"] = None  # not asked again: its answer would be a second warning of torch's
        raise RuntimeError("Connection closed by peer: rank 0's rendezvous store is gone") from None


def until_read_after_error():
    """Rank 0, having posted an error (comm.on_rank0): its process may hold the store, so it stays until the others
    have read that post."""
    if world_rank() == 0 and _job.get("store") is not None and "posts" in _job:
        _until_read(_job["posts"])


def note_checkpoint(path, iteration):
    """The checkpoint a restart would resume from (written or resumed), for the line of a rank that lost a peer."""
    _job["checkpoint"] = f"'{path}' (iteration {iteration})"


def resume_point():
    """What a restart would resume from, in words, for the lines that stop a job."""
    resume = _job.get("checkpoint")
    return f"starting again resumes from {resume}" if resume else "no checkpoint was written yet"


def announce_failure(message):
    """A rank that stops on a OneRankError (utils/errors.py, after printing its line): note it in the rendezvous
    store, then leave the process group, which closes this rank's connections: the other ranks' next collective
    fails at once (gloo), or is aborted (NCCL, where torch can abort), instead of waiting for NCCL's timeout; they
    read the note and exit without a line of their own (explain_lost_peer), so this rank's line is the job's last
    word. On a cluster `srun --kill-on-bad-exit=1` (the submit scripts) ends the others as well."""
    store = failing_store()
    rank, world = world_rank(), world_size_to_be()
    try:
        if store is not None:
            store.set("failed", str(rank))
    except (RuntimeError, OSError):  # the store went with its host: the others will find out by themselves
        store = None
    _job.get("forget_groups", lambda: None)()
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
    store, rank = failing_store(), world_rank()
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
    rank, world = world_rank(), world_size_to_be()
    if launcher_gone():  # its store went with it: one line a node, without a question to the store
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return None
        return (f"rank {rank}: the launcher that started this node's ranks (torchrun, process {_job['launcher']}) "
                f"stopped (killed, or its job ended), and with it the rendezvous store; the job stops; "
                f"{resume_point()}")
    if was_frozen():
        return None  # the others timed out waiting for this rank: the first of them said so
    if any(pattern in str(err) for pattern in TIMED_OUT):
        return explain_timeout(rank, world)
    cause = next((pattern for pattern in PEER_LOST if pattern in str(err)), "a collective failed")
    store = failing_store()
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
        if not speaks_without_store(rank, store):
            return None
        lost = [0] if rank != 0 else []
    if lost is None:
        return None  # the failing rank's line says why, or a lower surviving rank's
    named = ", ".join(map(str, lost[:8])) + (f" and {len(lost) - 8} more" if len(lost) > 8 else "")
    who = f"rank{'s' if len(lost) > 1 else ''} {named}" if lost else "another rank"
    again = resume_point()
    return (f"rank {rank}: {who} stopped answering in a collective ({cause}) without a line of its own (killed, "
            f"out of memory, or its node failed); the job stops; {again}")


def explain_timeout(rank, world):
    """This rank's line when a collective waited longer than --collective_timeout, or None: only the first rank to
    time out speaks (the store counts them) and notes itself as the failing one, so that the slow rank, which finds
    the others gone when it reaches the collective, stays quiet (explain_lost_peer). It names the ranks that did not
    reach the collective: the others that wait in it time out too and mark themselves alive within
    LOST_PEER_CENSUS_S; a rank stopped (SIGSTOP, a frozen node) or stuck does not."""
    store, first, stalled = failing_store(), True, []
    try:
        first = store.add("timed_out", 1) == 1
        mark_alive(store, rank)
        if first:
            store.set("failed", str(rank))
            deadline, pause = time.time() + LOST_PEER_CENSUS_S, rendezvous.store_poll_pause(world, 0.05)
            while time.time() < deadline and store.add("alive_count", 0) < world:
                time.sleep(pause)
            stalled = [other for other in range(world) if not store.check([f"alive/{other}"])]
        if rank == 0:
            linger_for_the_others(store, world)
    except (AttributeError, RuntimeError, OSError):  # no store, or its host (rank 0) is gone or frozen
        first, stalled = speaks_without_store(rank, store), [] if rank == 0 else [0]
    if not first:
        return None
    timeout = f"--collective_timeout ({_job.get('timeout', 600):g} s)"
    if stalled:
        named = ", ".join(map(str, stalled[:8])) + (f" and {len(stalled) - 8} more" if len(stalled) > 8 else "")
        return (f"rank {rank}: rank{'s' if len(stalled) > 1 else ''} {named} did not reach a collective within "
                f"{timeout} (stopped, or stuck: a file system, a compile, a hung GPU); the job stops; raise "
                f"--collective_timeout if that wait is expected; {resume_point()}")
    return (f"rank {rank}: a collective waited longer than {timeout} for the other ranks (one of them is slow or "
            f"stuck: a file system, a compile, a hung GPU); the job stops; raise --collective_timeout if that wait "
            f"is expected; {resume_point()}")


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
    failed in the store its process may hold, so that none finds the store gone while it asks (a rank that a timeout
    found stalled, back within the wait, reads that the job stops and stays quiet)."""
    deadline = time.time() + LOST_PEER_LINGER_S
    while time.time() < deadline:
        failing = int(store.get("failed")) if store.check(["failed"]) else None
        failing_unmarked = failing is not None and not store.check([f"alive/{failing}"])
        if store.add("alive_count", 0) >= world - failing_unmarked:
            return
        time.sleep(0.05)


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

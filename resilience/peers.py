"""One line per job when it stops, whatever rank stops it (resilience/exits.py asks these), agreed on in the
rendezvous store: a rank that stops on its own error notes it in the store and leaves (announce_failure); the
others, whose next collective fails, either read that note and leave quietly, or count who is still alive and the
lowest survivor names the lost ranks (explain_lost_peer); the first rank to time out in a collective says so, naming
the ranks that did not reach it (explain_timeout); a UserError every rank finds is said once (claim_user_error). Each
line says which checkpoint a restart resumes from (note_checkpoint, resume_point). A failing rank's questions to the
store wait at most a few seconds (store.failing_store: its host may be frozen); a rank that was itself stopped adds
no line when it wakes, and one whose launcher died asks the store nothing more (resilience/watch.py).
"""
import contextlib
import os
import time

import torch.distributed as dist

from resilience import job, watch
from resilience.store import failing_store, stored_int
from utils import comm, rendezvous
from utils.compat import leave_process_group

LOST_PEER_CENSUS_S = 1.0  # how long the ranks that lost a peer wait for each other's note before naming the lost
LOST_PEER_LINGER_S = 3.0  # how long rank 0 keeps the store up for the others' questions after a failure
USER_ERROR_WAIT_S = 1.0  # how long a rank other than 0 waits for rank 0 to say a UserError both found
# what a collective raises on a rank whose peer is gone (gloo's sockets closed by the peer's exit or abort; NCCL's
# communicator aborted, or its watchdog's timeout)
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "communicator was aborted",
             "NCCL communicator")
# a collective waited longer than its group's timeout (--collective_timeout): gloo's words (a recv's wait; a pair of
# sockets closed by the timeout, as in DDP's all-reduce), NCCL's watchdog's
TIMED_OUT = ("Timed out waiting", "Application timeout caused pair closure", "Watchdog caught collective operation "
             "timeout")


def lost_peer(err):
    """Whether `err` is a collective's failure because another rank is gone or too slow (TIMED_OUT)."""
    return isinstance(err, RuntimeError) and any(pattern in str(err) for pattern in PEER_LOST + TIMED_OUT)


def note_checkpoint(path, iteration):
    """The checkpoint a restart would resume from (written or resumed), for the line of a rank that lost a peer."""
    job.notes["checkpoint"] = f"'{path}' (iteration {iteration})"


def resume_point():
    """What a restart would resume from, in words, for the lines that stop a job."""
    resume = job.notes.get("checkpoint")
    return f"starting again resumes from {resume}" if resume else "no checkpoint was written yet"


def speaks_without_store(rank, store):
    """Whether this rank says why the job stops when rank 0's store cannot be asked. Gone (rank 0's process held it
    and has exited, after its own line or killed): the first rank of each node. Not answering (rank 0 is frozen,
    and cannot speak): on rank 0's node the second rank too (the ranks are numbered node by node, so rank -
    LOCAL_RANK is 0 there). A rank merely slower than the timeout, which finds the store gone when it comes back,
    then stays quiet on rank 0's node, where rank 0 named it."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return local == 0 or (getattr(store, "hung", False) and rank - local == 0 and local == 1)


def announce_failure(message):
    """A rank that stops on a OneRankError (resilience/exits.py, after printing its line): note it in the rendezvous
    store, then leave the process group, which closes this rank's connections: the other ranks' next collective
    fails at once (gloo), or is aborted (NCCL, where torch can abort), instead of waiting for NCCL's timeout; they
    read the note and exit without a line of their own (explain_lost_peer), so this rank's line is the job's last
    word. On a cluster `srun --kill-on-bad-exit=1` (the submit scripts) ends the others as well."""
    store = failing_store()
    rank, world = comm.get_world_rank(), comm.world_size_to_be()
    try:
        if store is not None:
            store.set("failed", str(rank))
    except (RuntimeError, OSError):  # the store went with its host: the others will find out by themselves
        store = None
    comm.forget_groups()
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
    """Whether this rank says the UserError it stops on (resilience/exits.stop_in_one_line): the first rank to
    claim it in the store does, and the others leave quietly, marked in the store (rank 0, which may hold it,
    then need not wait for them). Rank 0 claims at once; another rank first waits USER_ERROR_WAIT_S for rank 0,
    which finds the same error when every rank reads the same flags, config and files. A rank alone with its error
    (its node's missing mount or data) says it itself. Without a store (gone with rank 0): rank 0 says it."""
    store, rank = failing_store(), comm.get_world_rank()
    try:
        if rank != 0:
            deadline = time.time() + USER_ERROR_WAIT_S
            pause = rendezvous.store_poll_pause(comm.world_size_to_be(), 0.05)
            while time.time() < deadline and not store.check(["user_error"]):
                time.sleep(pause)
        claimed = store.compare_set("user_error", "", str(rank)) == str(rank).encode()
        if not claimed:
            mark_alive(store, rank)
        return claimed
    except (AttributeError, RuntimeError, OSError):  # no store, or it is gone with its host
        return rank == 0


def explain_lost_peer(err):
    """This rank's line when a collective failed because another rank is gone (resilience/exits.py), or None: the
    rank that failed said why (its note in the store), or a lower surviving rank says it. The survivors mark
    themselves in the store and wait LOST_PEER_CENSUS_S for each other; the ranks without a mark are the lost ones.
    Rank 0, whose process holds the store unless torchrun's agent does, waits (at most LOST_PEER_LINGER_S) until
    every rank has marked itself or its failure, so the store outlives the others' questions. A store that cannot be
    reached went with its host, rank 0: then the first rank of each node says so."""
    rank, world = comm.get_world_rank(), comm.world_size_to_be()
    if watch.launcher_gone():  # its store went with it: one line a node, without a question to the store
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return None
        return (f"rank {rank}: the launcher that started this node's ranks (torchrun, process "
                f"{job.notes['launcher']}) stopped (killed, or its job ended), and with it the rendezvous store; the "
                f"job stops; {resume_point()}")
    if watch.was_frozen():
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
        failed = stored_int(store, "failed") is not None  # a rank's number; anything else (not a rank's) is absent
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
    timeout = f"--collective_timeout ({job.notes.get('timeout', rendezvous.DEFAULT_COLLECTIVE_TIMEOUT):g} s)"
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
        failing = stored_int(store, "failed")  # None: absent, or not a rank's number
        failing_unmarked = failing is not None and not store.check([f"alive/{failing}"])
        if store.add("alive_count", 0) >= world - failing_unmarked:
            return
        time.sleep(0.05)

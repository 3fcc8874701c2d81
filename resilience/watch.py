"""Watches of a rank's own process, threads that start with resilience.attach and stop with detach: rank 0's
heartbeat in the rendezvous store (the others' sign that a rank 0 they wait for is alive), each rank's freeze watch
(was_frozen: a rank that was itself stopped adds no line when it wakes) and the launcher watch (launcher_gone:
torchrun's agent, which held the store, has died). They only note; what the job then says is resilience/peers.py's.
"""
import atexit
import contextlib
import os
import threading
import time

from resilience import job
from utils.rendezvous import DEFAULT_COLLECTIVE_TIMEOUT

RANK0_BEAT_S = 2.0  # how often rank 0's heartbeat thread writes its count in the store
FREEZE_TICK_S = 0.5  # how often each rank's freeze watch looks at the clock


def start(store, rank):
    """Start this rank's freeze watch and, on rank 0 (`rank`), its heartbeat in `store` (resilience.attach)."""
    _watch_for_freezes()
    if rank == 0:
        _beat_while_alive(store)


def stop():
    """Stop rank 0's heartbeat and the freeze watch (resilience.detach)."""
    _stop_heartbeat()
    job.notes.get("freeze_watch", threading.Event()).set()


def launcher_gone():
    """Whether torchrun's agent, which started this rank and holds the rendezvous store, has died (the kernel gave
    this rank another parent): then no store request can be answered, and none is sent (each would print a C++
    stack of torch's)."""
    return job.notes.get("launcher") is not None and os.getppid() != job.notes["launcher"]


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
                job.notes["frozen"] = (now - last, now)  # how long, and when it ended
            last = now
    threading.Thread(target=watch, name="freeze-watch", daemon=True).start()
    job.notes["freeze_watch"] = stop


def was_frozen():
    """Whether this process was frozen (no thread ran) for more than half --collective_timeout, lately: the other
    ranks then timed out waiting for it, and their line says so."""
    seconds, ended = job.notes.get("frozen", (0.0, 0.0))
    timeout = job.notes.get("timeout", DEFAULT_COLLECTIVE_TIMEOUT)
    return seconds > max(2.0, timeout / 2) and time.monotonic() - ended < timeout + 60


def _beat_while_alive(store):
    """Rank 0: a daemon thread that counts up a key in the store every RANK0_BEAT_S while the process lives (also
    while its main thread writes a checkpoint for minutes): the others' sign that a rank 0 they wait for is alive.
    It is stopped and joined before the interpreter finalizes (atexit, and detach()): a daemon thread that comes
    back from the store's C++ call after finalization began is ended by Python inside that call, and the C++
    runtime aborts the whole process ("terminate called without an active exception", exit -6) although the run
    had exited cleanly."""
    stop = threading.Event()

    def beat():
        with contextlib.suppress(Exception):  # the store is gone (the job ends), or a new one replaced it
            while job.notes.get("store") is store and not stop.is_set() and not launcher_gone():
                store.add("rank0_beat", 1)
                stop.wait(RANK0_BEAT_S)
    thread = threading.Thread(target=beat, name="rank0-heartbeat", daemon=True)
    thread.start()
    job.notes["heartbeat"] = (stop, thread)
    atexit.unregister(_stop_heartbeat)  # once per process, however many runs it makes
    atexit.register(_stop_heartbeat)


def _stop_heartbeat():
    """Stop rank 0's heartbeat thread, if it beats, and wait (briefly) until it has left the store's C++ code."""
    stop, thread = job.notes.pop("heartbeat", (None, None))
    if stop is not None:
        stop.set()
        thread.join(timeout=5.0)

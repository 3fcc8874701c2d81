"""Stopping cleanly on a signal: a time limit, a preemption, Ctrl-C.

Slurm sends SIGTERM at the time limit and on preemption (then SIGKILL after KillWait, often 30 s), and the
submit scripts ask for SIGUSR1 a few minutes before the limit (`#SBATCH --signal=USR1@180`); torchrun forwards
SIGTERM to its workers. A handler only records the first signal. At each step boundary the ranks agree on it
(`agreed()`: one collective on the host, no device sync), so every rank stops after the same iteration; the loop
then writes a checkpoint and the script exits with EXIT_CODE, which tells the submit scripts to requeue the job.
A second Ctrl-C stops at once (KeyboardInterrupt).
"""
import logging
import os
import signal

from utils import comm

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; the submit scripts requeue the job on it

_state = {"received": None, "agreed": None, "pid": None, "previous": {}}


def _record(signum, frame):
    if os.getpid() != _state["pid"]:  # a forked loader worker: the main process decides, and stops the workers
        return
    if _state["received"] is None:
        _state["received"] = signum
        logging.info(f"{signal.Signals(signum).name} received: stopping after this step, with a checkpoint")
    elif signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C: now


def install():
    """Record SIGTERM, SIGINT and SIGUSR1 from now on (main thread); `uninstall()` puts the old handlers back."""
    _state.update(received=None, agreed=None, pid=os.getpid())
    for signum in STOP_SIGNALS:
        _state["previous"][signum] = signal.signal(signum, _record)


def ignore_in_worker():
    """In a loader worker started afresh (DALI's spawned workers have none of this process's handlers): ignore Ctrl-C
    and Slurm's warning signal, which reach every process of the job; the main process stops at a step boundary
    and closes its workers. SIGTERM keeps its default: DALI ends a worker that does not exit with it."""
    if os.getpid() != _state["pid"]:
        for signum in (signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_IGN)


def uninstall():
    for signum, handler in _state["previous"].items():
        signal.signal(signum, handler)
    _state["previous"].clear()


def agreed():
    """The name of the signal that stops the run ('SIGTERM', ...), or None: collective over every rank (the
    highest signal number any rank received), so all ranks stop at the same step boundary."""
    number = comm.max_over_ranks_on_host(_state["received"] or 0)
    if number:
        _state["agreed"] = signal.Signals(number).name
    return _state["agreed"]


def stopped_by():
    """The signal the run stopped on (after agreed() said so), else None."""
    return _state["agreed"]

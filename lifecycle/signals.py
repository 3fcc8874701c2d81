"""Stopping cleanly on a signal: a time limit, a preemption, Ctrl-C, at any moment, sent to any process of the job.

Slurm sends SIGTERM at the time limit, on preemption and on `scancel` (then SIGKILL after KillWait, often 30 s), and
the submit scripts ask for SIGUSR1 a few minutes before the limit (`#SBATCH --signal=USR1@180`); Slurm signals every
process of the step (each rank and its loader workers), torchrun forwards SIGTERM to its ranks. A handler only
records the first signal. The ranks agree on it at the step boundaries (`agreed_in_loop()`), so every rank stops
after the same iteration; the loop then writes a checkpoint and the script exits with EXIT_CODE, which tells the
submit scripts to requeue the job.

The agreement costs no step anything while one all-reduce takes less than AGREEMENT_LAG steps (gloo's ring: 2(N-1)
messages over N ranks; measured up to 16 CPU ranks, docs/cluster.md): at each boundary a rank starts an all-reduce
(the highest signal number any rank received, over gloo on the host: no device sync) and reads the one it started
AGREEMENT_LAG boundaries before, which finished during the steps in between. Every rank reads the same all-reduce at
the same boundary, so all of them stop at the same one: AGREEMENT_LAG steps after the step the signal came in. An
agreement at every boundary that waited for its own all-reduce (as before) cost each step a round of gloo's ring
over all ranks plus the ranks' skew: 9 ms (median) at 16 CPU ranks on 2 cores (`make bench-agreement`).

From the first line of a training script (`lifecycle/early_signals.py`, imported before torch) the signals are recorded,
and a signal that came before the first step stops the run where the ranks next agree (end of start_run, end of
restore, the loop's first question) with one line and EXIT_CODE, no checkpoint written. Loader workers (PyTorch's and
DALI's) never act on a signal: they start with the signals blocked (`workers_start_blocked`) and hand them to a
thread (`ignore_in_worker`) that ignores them, except SIGTERM from their own parent (the loader closing them).
Inductor's compile workers and multiprocessing's resource tracker keep them blocked for life (`start_compile_workers`).
A second Ctrl-C stops at once (KeyboardInterrupt), in one line, until the stop's checkpoint is written; from then
on a signal is ignored in one line, and once the run's last line is said it ends the process at once with the
run's own exit code (`ending`).

This module imports no torch (it runs before torch's import); `agreed()` imports resilience.host when first asked.
The training loop and the loaders do not import it: a run hands them what they ask (lifecycle/run.py's Run: the
agreement at each step boundary, the signal-proof start of loader workers, SIGNAL_PROOF_START).
"""
import collections
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading

from lifecycle.workers import WorkerStart

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; the submit scripts requeue the job on it
INTERRUPTED = ("interrupted by a second Ctrl-C: stopped at once, without a checkpoint; starting again resumes from "
               "the last one")

AGREEMENT_LAG = 2  # step boundaries between a rank's report of a signal and the stop all ranks agree on
_state = {"received": None, "agreed": None, "pid": None, "early": False, "previous": {}, "waiting_in": None,
          "parent": None}
_in_flight = collections.deque()  # agreements started at the last boundaries (resilience.host.HostMax), oldest first


def _record(signum, frame):
    if os.getpid() != _state["pid"]:  # a forked process that has not taken its signals over yet: not its to act on
        return
    if _state.get("ending") is not None:  # the run's work is done (ending())
        _late(signum)
        return
    if _state["received"] is None:
        _state["received"] = signum
        logging.info(f"{signal.Signals(signum).name} received: stopping after this step, with a checkpoint")
    elif signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C: now


def _handle(signum):
    previous = signal.signal(signum, _record)
    _state["previous"].setdefault(signum, previous)  # what was there before the first install: uninstall() restores it


def record_from_start(program=False):
    """The first line of a training script: record the stop signals from now on (torch's import takes seconds, a
    rendezvous minutes), so that `install()` finds one that came early; a KeyboardInterrupt that ends the script
    (a second Ctrl-C) is said in one line, not a traceback. `program`: the script is this process's program
    (lifecycle/early_signals.py), whose end `ending()` may hasten."""
    _state.update(received=None, agreed=None, pid=os.getpid(), early=True, script=os.getpid() if program else None)
    for signum in STOP_SIGNALS:
        _handle(signum)
    if not getattr(sys.excepthook, "one_line_interrupt", False):
        sys.excepthook = _one_line_interrupt(sys.excepthook)


def _one_line_interrupt(hook):
    def excepthook(kind, value, traceback):
        if issubclass(kind, KeyboardInterrupt):
            if os.environ.get("RANK", "0") == "0":  # one line per job
                print(INTERRUPTED, file=sys.stderr, flush=True)
            return
        hook(kind, value, traceback)
    excepthook.one_line_interrupt = True
    return excepthook


def install():
    """Record SIGTERM, SIGINT and SIGUSR1 from now on (main thread), keeping one recorded since `record_from_start()`
    (a new run in the same process forgets an old one); `uninstall()` puts the old handlers back."""
    kept = _state["received"] if _state["early"] and _state["pid"] == os.getpid() else None
    _state.update(received=kept, agreed=None, pid=os.getpid(), early=False, parent=os.getppid(), ending=None,
                  launcher_died=False)
    _in_flight.clear()
    for signum in STOP_SIGNALS:
        _handle(signum)


def uninstall():
    if _ends_at_once():  # a training script whose run has ended: a signal still ends it at once, with the run's code
        return
    _state["ending"] = None
    for signum, handler in _state["previous"].items():
        signal.signal(signum, handler)
    _state["previous"].clear()
    _state["early"] = False


def agreed():
    """The name of the signal that stops the run ('SIGTERM', ...), or None: collective over every rank (the
    highest signal number any rank received), so all ranks stop at the same step boundary."""
    from resilience import host  # here, not at the top: this module is imported before torch
    number = host.max_over_ranks_on_host(_state["received"] or 0)
    if number:
        _state["agreed"] = _name(number)
    return _state["agreed"]


def _name(number):
    """How the stop is said: the signal's name, or for this process's dead launcher (which no signal announced) its
    launcher's death."""
    if number == signal.SIGHUP and _state.get("launcher_died"):
        return "its launcher's death"
    return signal.Signals(number).name


def launcher_gone():
    """Whether the process that started this one (torchrun, srun's step, a shell) has died since install(): the
    kernel then hands this process to another parent. torchrun forwards only SIGTERM, SIGINT, SIGHUP and SIGQUIT, so
    Slurm's SIGUSR1 (or `scancel -s USR1`) to the step kills it outright, while its ranks, each in a session of its
    own, never hear of it: they would train to the end as orphans, holding the run lock, and nothing would requeue."""
    return _state["parent"] is not None and os.getppid() != _state["parent"]


def _notice_a_dead_launcher():
    """A launcher that died stops the run as SIGHUP would (the signal of a lost controlling process): after this
    step, with a checkpoint, exit 75."""
    if _state["received"] is None and launcher_gone():
        _state["received"] = signal.SIGHUP
        _state["launcher_died"] = True
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once a node: every rank of it lost the same launcher
            logging.warning(f"the launcher (process {_state['parent']}) is gone: stopping after this step, with a "
                            "checkpoint")


def agreed_in_loop():
    """agreed() for the training loop's step boundaries, without a wait: this boundary's all-reduce is started and
    the one started AGREEMENT_LAG boundaries before is read (a single process reads its own at once). Every rank
    must ask at every boundary; the signal's name once the ranks agree on one, else None."""
    from resilience import host
    from utils import comm
    _notice_a_dead_launcher()
    _in_flight.append(host.HostMax(_state["received"] or 0))
    lag = AGREEMENT_LAG if comm.get_world_size() > 1 and not comm.is_dry_run() else 0
    number = 0
    while len(_in_flight) > lag:
        number = max(number, _in_flight.popleft().wait())
    if number and _state["agreed"] is None:
        _state["agreed"] = _name(number)
    return _state["agreed"]


def settle():
    """After the loop's last boundary (every rank at the same one): wait for the agreements still in flight, so
    that none is left in gloo when the process group goes. A signal they carry came in the last AGREEMENT_LAG steps,
    after the ranks had agreed to stop for another reason: the run ends as it would have, and says so."""
    number = 0
    while _in_flight:
        number = max(number, _in_flight.popleft().wait())
    if number and _state["agreed"] is None and os.environ.get("RANK", "0") == "0":
        logging.info(f"{signal.Signals(number).name} came in the run's last steps, after it had decided to stop "
                     "here: it changes nothing")


def received():
    """The name of the signal this process received, agreed on or not (None: none)."""
    return signal.Signals(_state["received"]).name if _state["received"] else None


def stopped_by():
    """The signal the run stopped on (after agreed() said so), else None."""
    return _state["agreed"]


def stop_before_training(where, run_dir=None):
    """Collective, before the training loop: if any rank received a signal since the script's first line, every rank
    stops here with one line (rank 0) and EXIT_CODE, having written no checkpoint (the submit scripts requeue the
    job). `run_dir`: the run directory this start created its lock, out.log and logs/ in (None: a dry run, which
    writes nothing)."""
    name = agreed()
    if name:
        written = ("nothing was written" if run_dir is None else
                   f"no checkpoint was written (this start wrote only run.lock, out.log and logs/ in "
                   f"'{run_dir}')")
        logging.info(f"stopped by {name} during {where}, before the first step; {written}, starting again resumes "
                     "here")
        ending(EXIT_CODE)  # from here a signal ends the process at once, with EXIT_CODE
        from utils import comm
        comm.destroy()
        raise SystemExit(EXIT_CODE)


# --- the run's end: its work done, a signal no longer changes what the run did, nor its exit code ---

_exiting = threading.Lock()


def ending(code, at_once=True):
    """The run's work is done, and its exit code is `code` (0: finished; EXIT_CODE: stopped on a signal). With
    `at_once` False, the stop's checkpoint is written and the run goes on to its last lines: a signal is ignored (no
    second-Ctrl-C interrupt, which would say no checkpoint was written). With `at_once` (its last line is said: DONE,
    or a stop before the first step) a signal ends the process at once with `code`, not the signal's status (130,
    143), also while the main thread waits in C++ (the process group's teardown) or the interpreter's end. Either way
    one line (rank 0) says the signal was ignored. Only where a training script is the program (early_signals.py): a
    test or notebook that runs a script's main() keeps its own Ctrl-C."""
    if _state.get("script") != os.getpid() or _state["pid"] != os.getpid():
        return
    _state["ending"] = {"code": code, "at_once": at_once}
    if code == EXIT_CODE:
        _mark_for_requeue()
    if at_once:
        _exit_on_a_signal_in_any_thread()


def _mark_for_requeue():
    """Before a rank exits EXIT_CODE it creates the file the submit scripts name in $REQUEUE_MARKER. With `srun
    --kill-on-bad-exit=1` the first rank to exit 75 makes Slurm kill the ranks still ending, and srun's status is
    then theirs (137), not 75: the file tells requeue_or_exit (submit_common.sh) that the job stopped to be resumed.
    Every such rank creates it (any one may exit first); an empty file, made once per process."""
    path = os.environ.get("REQUEUE_MARKER")
    if not path or _state.get("marked"):
        return
    _state["marked"] = True
    try:
        with open(path, "a"):
            pass
    except OSError as err:
        logging.warning(f"could not create '{path}' ({err.strerror}): the submit script requeues this job only if "
                        f"srun's status is {EXIT_CODE}")


def _ends_at_once():
    return bool((_state.get("ending") or {}).get("at_once")) and _state.get("script") == os.getpid()


def _late(signum):
    """A signal after the run's work was done (ending()): one line (rank 0); at once, the process's end."""
    code, at_once, name = _state["ending"]["code"], _state["ending"]["at_once"], signal.Signals(signum).name
    if not at_once:
        logging.info(f"{name} came after the stop's checkpoint: ignored; the run ends as it was ending, with exit "
                     f"code {code}")
        return
    if not _exiting.acquire(blocking=False):
        return  # another thread is ending the process
    with contextlib.suppress(Exception):  # the interpreter's end may have closed the streams already
        logging.info(f"{name} came after the run's end: ignored; the process exits now with the run's exit code "
                     f"{code}")
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _exit_on_a_signal_in_any_thread():
    """A Python handler runs in the main thread between two bytecodes, not while it waits in C++. The signal's number
    also goes down a pipe (signal.set_wakeup_fd, written by the C handler in whichever thread the signal lands) to a
    thread that ends the process as the handler would."""
    if _state.get("wakeup") == os.getpid():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: the Python handler alone
        os.close(read_end)
        os.close(write_end)
        return
    _state["wakeup"] = os.getpid()
    threading.Thread(target=_wait_for_a_late_signal, args=(read_end,), name="late-signals", daemon=True).start()


def _wait_for_a_late_signal(read_end):
    while True:
        for signum in os.read(read_end, 64):
            if signum in STOP_SIGNALS and os.getpid() == _state["pid"]:  # not SIGCHLD's (a loader's own handler)
                _late(signum)


# --- loader workers: forked (PyTorch) or spawned (DALI) processes that the main process starts and stops ---

@contextlib.contextmanager
def workers_start_blocked():
    """Start worker processes inside this: they begin with the stop signals blocked (a child inherits the mask, also
    through spawn's exec), so no signal reaches one before `ignore_in_worker()` takes them over. In the main process
    the signals wait until the block ends (or reach another of its threads; the handler still records them)."""
    start_resource_tracker()  # started later (spawn), it would unblock SIGINT and SIGTERM in this thread
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class WorkerProcess(multiprocessing.Process):
    """multiprocessing.Process (the default start method) started inside `workers_start_blocked()`."""

    def start(self):
        with workers_start_blocked():
            super().start()


class WorkerContext(multiprocessing.context.BaseContext):
    """The multiprocessing context a DataLoader's workers start in (DataLoader(multiprocessing_context=...)): the
    default start method's, with every worker started inside `workers_start_blocked()`."""
    Process = WorkerProcess

    def get_start_method(self, allow_none=False):
        return multiprocessing.get_start_method(allow_none)


def ignore_in_worker():
    """In a loader worker, started by `workers_start_blocked()` (DALI's spawned ones unpickle their source here): the
    stop signals are for the main process, which stops at a step boundary and then closes its workers. They stay
    blocked, and a thread takes them: SIGTERM from the parent (the loader closing a worker that did not exit) ends
    the worker as the loader expects; anything else (Slurm's SIGTERM, SIGUSR1, Ctrl-C to every process) is ignored."""
    if os.getpid() in (_state["pid"], _state["waiting_in"]) or multiprocessing.parent_process() is None:
        return  # the training process itself, or a worker whose thread already waits
    _state["waiting_in"] = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # already, if started blocked; this thread at least
    parent = os.getppid()
    threading.Thread(target=_wait_in_worker, args=(parent,), name="stop-signals", daemon=True).start()


def _wait_in_worker(parent):
    while True:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)  # what PyTorch's own worker handler does on its loader's SIGTERM


# how a training run's loaders start their workers (lifecycle/run.py hands it to them: Run.worker_start)
SIGNAL_PROOF_START = WorkerStart(context=WorkerContext, starting=workers_start_blocked, in_worker=ignore_in_worker)


# --- helpers that torch and multiprocessing start: inductor's compile workers, the resource tracker ---

def start_resource_tracker():
    """multiprocessing's resource tracker (one process per training process, started when first needed: DALI's
    spawned workers, shared memory) blocks and ignores SIGINT and SIGTERM itself, not SIGUSR1, of which it would
    die. Started here, it keeps the stop signals blocked for life (a child inherits the mask, also through exec); one
    already running stays as it was started."""
    from multiprocessing import resource_tracker
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # ensure_running() unblocked SIGINT and SIGTERM: put back


def start_compile_workers():
    """At the start of a run that compiles (--enable_jit), before its first compile: inductor's compile workers,
    started now with the stop signals blocked, which they keep for life (Slurm's SIGUSR1, SIGTERM and Ctrl-C reach
    every process of the step; the training process alone acts on them). Started at the first compile, as torch does,
    the pool died of SIGUSR1, and any later compile failed (torch 2.14: "Attempting to use a closed pool") or hung
    (torch 2.5). The pool is a sidecar process (torch/_inductor/compile_worker/__main__.py, by subprocess.Popen)
    whose ProcessPoolExecutor forks the workers; torch 2.5 starts it on the import of torch._inductor.async_compile,
    torch 2.14 in maybe_warm_pool() (what its inductor backend calls first), both only where Triton is installed and
    compile_threads > 1. The resource tracker is started here too, blocked (`start_resource_tracker`)."""
    import atexit
    with workers_start_blocked():
        from torch._inductor import async_compile  # torch 2.5: starts the pool on this import
        if hasattr(async_compile, "maybe_warm_pool"):  # torch 2.14: the sidecar, which forks its workers at once
            async_compile.maybe_warm_pool()
    if not _state.get("compile_workers_quiesce"):
        _state["compile_workers_quiesce"] = True
        atexit.register(_quiesce_compile_workers)  # after torch's shutdown_compile_workers: runs before it


def _quiesce_compile_workers():
    """At exit, before torch's shutdown: torch 2.14's sidecar ends its workers with SIGTERM, which they no longer
    hear, so it would wait 10 s for each pool and then kill them; told to quiesce first, it closes its pool the
    ordinary way (each worker ends on its queue's sentinel). torch 2.5 closes its pool that way anyway."""
    from torch._inductor import async_compile
    for pool in list(async_compile._pool_set):
        with contextlib.suppress(Exception):  # a pool already closed, or a kind without quiesce (torch 2.5)
            pool.quiesce()

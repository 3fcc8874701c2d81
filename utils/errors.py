"""User mistakes end in one clear line and a non-zero exit, never a traceback; one line per job, not one per rank."""
import argparse
import errno
import functools
import os
import re
import shutil
import sys

_cleanups = []
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# what a collective raises on a rank whose peer is gone (gloo's sockets closed by the peer's exit or abort; NCCL's
# communicator aborted, or its watchdog's timeout)
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "communicator was aborted",
             "NCCL communicator")
# a collective waited longer than its group's timeout (--collective_timeout): gloo's words (a recv's wait; a pair of
# sockets closed by the timeout, as in DDP's all-reduce), NCCL's watchdog's
TIMED_OUT = ("Timed out waiting", "Application timeout caused pair closure", "Watchdog caught collective operation "
             "timeout")
_job = {}  # "announce": a OneRankError to the other ranks, then leave; "explain": a lost peer in one line or None


def register_cleanup(function):
    """Call `function` when the main function wrapped by exit_on_user_error returns or fails (e.g. to release
    a run-directory lock even when the run stops with an error)."""
    _cleanups.append(function)


class UserError(Exception):
    """A mistake the user can fix (bad config, missing data, sizes that do not divide). Every rank reads the same
    flags, config and files, so every rank should find it: one rank prints it, rank 0 where it finds it too (every
    rank exits with code 2; stop_in_one_line)."""


class OneRankError(UserError):
    """A mistake one rank may find alone (a sample of its shard that cannot be read, its wait for rank 0, its node's
    GPU or shared memory): printed by the rank that finds it, whatever its rank, naming the rank."""


def on_job_failures(announce=None, explain=None, claim=None):
    """utils/comm.py, once in a process group: `announce(message)` tells the other ranks that this rank stops on a
    OneRankError (and leaves the group, so that they stop at once instead of waiting in a collective);
    `explain(err)` turns a collective that failed because a peer is gone into this rank's one line, or None when the
    peer said why itself (its line is the job's last word); `claim()`: whether this rank is the one to say the
    UserError it stops on (stop_in_one_line). Without arguments (the group left): forget them."""
    _job.clear()
    if announce is not None:
        _job.update(announce=announce, explain=explain, claim=claim)


def lost_peer(err):
    """Whether `err` is a collective's failure because another rank is gone or too slow (TIMED_OUT)."""
    return isinstance(err, RuntimeError) and any(pattern in str(err) for pattern in PEER_LOST + TIMED_OUT)


def prints_here(err):
    """Whether this process prints `err`: rank 0 ($RANK, set by torchrun and export_DDP_vars.sh), or the rank
    that found a OneRankError."""
    return isinstance(err, OneRankError) or os.environ.get("RANK", "0") == "0"


def exit_on_user_error(main):
    """Run `main`; turn a UserError into `error: <message>` on stderr (where prints_here says) and exit code 2;
    run the cleanups."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except OSError as err:
            if err.errno not in DISK_FULL:
                raise
            # a writer without its own message (TensorBoard's event files, a benchmark's output, ...), on this rank
            stop_in_one_line(disk_full(err), found_here=True)
        except UserError as err:
            stop_in_one_line(one_line(err), found_here=isinstance(err, OneRankError))
        except RuntimeError as err:
            if not lost_peer(err) or "explain" not in _job:
                raise
            line = _job["explain"](err)
            if line:
                print(f"error: {line}", file=sys.stderr, flush=True)
            sys.exit(2)
        finally:
            while _cleanups:
                _cleanups.pop()()

    return wrapper


def stop_in_one_line(message, found_here):
    """Print `message` as the job's one `error:` line where it belongs, and exit with code 2. `found_here`: this
    rank's own finding (a OneRankError, its disk full): it prints it, naming its rank in a job of several, and
    tells the others (announce), which then stop at once instead of waiting in a collective. Else a UserError that
    every rank should find alike: before the ranks meet, rank 0 prints it; once they share a store, the first rank
    to claim it (rank 0 first, when it finds it too) prints it and tells the others, so that an error only one
    node's ranks find (a missing mount) is said as well, once."""
    several = os.environ.get("WORLD_SIZE", "1") != "1"
    rank = os.environ.get("RANK", "0")
    if not found_here:
        if _job.get("claim") is None or not several:
            if rank == "0":
                print(f"error: {message}", file=sys.stderr, flush=True)
            sys.exit(2)
        if not _job["claim"]():
            sys.exit(2)  # another rank says it
        found_here = rank != "0"  # rank 0's line needs no name (it is the line of a job without a store)
    if found_here and several and not message.startswith("rank "):
        message = f"rank {rank}: {message}"  # which of the job's ranks found it
    print(f"error: {message}", file=sys.stderr, flush=True)
    if "announce" in _job:
        _job["announce"](message)  # the others stop now, not at NCCL's timeout
    sys.exit(2)


def free_space(folder):
    """The free space of the file system holding `folder` (or its nearest existing parent), in words, for error
    messages: '12.3 GB free', below 1 GB in MB ('40.2 MB free'; a full disk is not '0.0 GB')."""
    folder = os.path.abspath(folder)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)  # a folder a full disk did not let us create: its parent's file system
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return "free space unknown"
    return f"{free / 1e9:.1f} GB free" if free >= 1e9 else f"{free / 1e6:.1f} MB free"


def disk_full(err):
    """A full disk (or quota) that `err` (an OSError) reports, in one sentence naming the file, folder and free
    space."""
    path = os.path.abspath(err.filename) if err.filename else None
    folder = os.path.dirname(path) if path else os.getcwd()
    what = f"writing '{path}'" if path else "a write"
    return (f"{what} failed: the disk is full or over its quota ({err.strerror}; {free_space(folder)} in "
            f"'{folder}'); free disk space (or raise the quota), or write elsewhere (--expdir)")


def error_line(stderr, empty="(no output)"):
    """What a failed child process said went wrong: its last `error:` line (the project's one line), else its last
    exception line (`module.Name: message`; a traceback can end on a hint printed after it, as Inductor's 'See
    https://...opcheck'), else its last line, else `empty`. For the benchmarks and the planner, which run the
    training scripts in processes of their own."""
    lines = stderr.strip().splitlines()
    said = [line for line in lines if line.startswith("error: ")]
    raised = [line for line in lines if re.match(r"[A-Za-z_][\w.]*: ", line)]
    return (said or raised or lines or [empty])[-1]


def one_line(err):
    """The message of a UserError; for one re-raised from a DataLoader worker (its text then holds the worker's
    traceback), the original message alone."""
    message = str(err)
    if "\nOriginal Traceback" in message:  # its last line: "utils.errors.UserError: <message>" (or a subclass's name)
        message = re.sub(r"^[\w.]+: ", "", message.rstrip().splitlines()[-1], count=1)
    return message


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits with code 2."""

    def error(self, message):
        if prints_here(UserError(message)):  # every rank gets the same flags
            print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

"""User mistakes end in one clear line and a non-zero exit, never a traceback: the errors (UserError, OneRankError),
their messages (a full disk, a child process's last line), the one-line argument parser and the cleanups. The
decorator that says them, once per job, not once per rank (exit_on_user_error), is resilience/exits.py's."""
import argparse
import errno
import os
import re
import shutil
import sys

_cleanups = []
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def register_cleanup(function):
    """Call `function` when the main function wrapped by exit_on_user_error (resilience/exits.py) returns or fails
    (e.g. to release a run-directory lock even when the run stops with an error)."""
    _cleanups.append(function)


def run_cleanups():
    """Call the registered cleanups, the last registered first (exit_on_user_error, once the main function ended)."""
    while _cleanups:
        _cleanups.pop()()


class UserError(Exception):
    """A mistake the user can fix (bad config, missing data, sizes that do not divide). Every rank reads the same
    flags, config and files, so every rank should find it: one rank prints it, rank 0 where it finds it too (every
    rank exits with code 2; resilience/exits.stop_in_one_line)."""


class OneRankError(UserError):
    """A mistake one rank may find alone (a sample of its shard that cannot be read, its wait for rank 0, its node's
    GPU or shared memory): printed by the rank that finds it, whatever its rank, naming the rank."""


def prints_here(err):
    """Whether this process prints `err`: rank 0 ($RANK, set by torchrun and export_DDP_vars.sh), or the rank
    that found a OneRankError."""
    return isinstance(err, OneRankError) or os.environ.get("RANK", "0") == "0"


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

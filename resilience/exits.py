"""How a training script ends on a mistake: in one `error:` line and exit code 2, never a traceback, and once per job,
not once per rank. Its main function is wrapped in exit_on_user_error; in a job that resilience.attach watches, the
line is agreed on in the rendezvous store (resilience/peers.py): a UserError every rank finds is said by the first
rank to claim it, a rank's own finding (a OneRankError, its disk full) by that rank, which tells the others, and a
collective that failed because a peer is gone or too slow by the one rank that knows why. Without a job attached (a
single process, a dry run, a tool) rank 0 says a UserError, the rank that found a OneRankError says it.
"""
import functools
import os
import sys

from resilience import job, peers
from utils.errors import DISK_FULL, OneRankError, UserError, disk_full, one_line, run_cleanups


def exit_on_user_error(main):
    """Run `main`; turn a UserError into `error: <message>` on stderr (where utils/errors.prints_here says) and exit
    code 2; run the cleanups (utils/errors.register_cleanup)."""

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
            if not peers.lost_peer(err) or not job.attached():
                raise
            line = peers.explain_lost_peer(err)
            if line:
                print(f"error: {line}", file=sys.stderr, flush=True)
            sys.exit(2)
        finally:
            run_cleanups()

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
        if not job.attached() or not several:
            if rank == "0":
                print(f"error: {message}", file=sys.stderr, flush=True)
            sys.exit(2)
        if not peers.claim_user_error():
            sys.exit(2)  # another rank says it
        found_here = rank != "0"  # rank 0's line needs no name (it is the line of a job without a store)
    if found_here and several and not message.startswith("rank "):
        message = f"rank {rank}: {message}"  # which of the job's ranks found it
    print(f"error: {message}", file=sys.stderr, flush=True)
    if job.attached():
        peers.announce_failure(message)  # the others stop now, not at NCCL's timeout
    sys.exit(2)

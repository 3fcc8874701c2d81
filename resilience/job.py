"""What this process knows of the job it is a rank of, once resilience.attach has run: `notes`, the one dict the
package's modules share (without a job attached, as in a single process, it holds at most the last checkpoint).
Nothing here talks to the other ranks.
"""
notes = {}  # "attached": attach ran (detach clears everything); "store": the rendezvous store, where a failing rank
# leaves its note (None once found gone); "checkpoint": the last one written or resumed; "timeout":
# --collective_timeout (seconds); "posts": how many objects rank 0 has posted in the store; "heartbeat": rank 0's
# beating thread; "launcher": torchrun's agent's pid; "freeze_watch", "frozen": the freeze watch and the last freeze
# it saw; "bounded": the store with each request bounded (store.failing_store)


def attached():
    """Whether this process is a rank of a watched job (resilience.attach, until detach): its failures are then said
    once per job (resilience/exits.py), each rank's line agreed on in the store."""
    return notes.get("attached", False)

"""Rank 0's objects on every rank through the rendezvous store, and the store as a rank whose job is failing asks it.

- broadcast_from_rank0 and on_rank0 (every rank calls them; lifecycle/ and loaders/ do): rank 0 posts its object in
  the store and goes on, the others poll the store on the host, however long rank 0 takes (a checkpoint written for
  minutes), without a collective that --collective_timeout would end; they stop when rank 0's heartbeat stops
  (resilience/watch.py). Without a store (a single process, a dry run, a process group made elsewhere, torchrun's
  agent that held it gone) a collective broadcast.
- Store values are data, never code: the store has no authentication, and any process that reaches MASTER_PORT can
  set a key. A post is JSON (encode_post, decode_post: plain values only, at most POST_MAX_BYTES), so a foreign
  value stops the reading rank in one line naming the key instead of running; a rank number the census reads
  (stored_int) is an integer or taken as absent.
- failing_store: the store with each request bounded, for the lines that stop a job (resilience/peers.py): its host,
  rank 0's process, may be frozen.
"""
import contextlib
import json
import os
import re
import threading
import time

import torch.distributed as dist

from resilience import job, watch
from utils import comm, rendezvous
from utils.errors import OneRankError, UserError

RANK0_POLL_S = (0.005, 0.5)  # how often a rank waiting for rank 0's post looks at the store: first, at most
RANK0_SILENT_S = 20.0  # a rank 0 whose heartbeat has not moved for this long is gone (torchrun's agent holds the
# store then, and kills every rank 30 s after one died): shorter than that, longer than any pause of a live thread
RANK0_READ_WAIT_S = 10.0  # how long rank 0 waits for the others to read an error it posted before it exits
FAILING_STORE_WAIT_S = 5.0  # how long a rank that is stopping waits for the store to answer (its host may be frozen)
POST_MAX_BYTES = 64 * 1024  # the largest post of rank 0's a rank reads (a path, an iteration, an error line: < 1 KiB)
PLAIN = (type(None), str, int, float, bool)  # what a post holds: one of these, or a list (a tuple) of them


def _plain(obj):
    """Whether `obj` is what a post may hold: None, str, int, float, bool, or a list or tuple of those."""
    return isinstance(obj, PLAIN) or isinstance(obj, (list, tuple)) and all(isinstance(item, PLAIN) for item in obj)


def encode_post(obj):
    """Rank 0's `obj` as its post in the store: JSON bytes (a tuple comes back a list, which unpacks the same).
    Anything else than plain data (PLAIN, or a list or tuple of it) is a bug of the caller: TypeError."""
    if not _plain(obj):
        raise TypeError(f"rank 0's post must be None, str, int, float, bool or a list or tuple of those, not "
                        f"{type(obj).__name__}: {obj!r:.200}")
    data = json.dumps(obj).encode()
    if len(data) > POST_MAX_BYTES:
        raise ValueError(f"rank 0's post is {len(data)} bytes, over POST_MAX_BYTES ({POST_MAX_BYTES})")
    return data


def decode_post(key, raw):
    """Rank 0's post under `key`, read from the store as `raw` (encode_post's bytes). Anything else (not bytes, over
    POST_MAX_BYTES, not UTF-8 JSON, not plain data: a pickle set by another process) is never run: the reading rank
    stops with a OneRankError that names the key."""
    if not isinstance(raw, (bytes, bytearray)):
        what, why = f"a {type(raw).__name__} that is", "not bytes"
    else:
        what, why = f"{len(raw)} bytes that are", None
        if len(raw) > POST_MAX_BYTES:
            why = f"over the {POST_MAX_BYTES // 1024} KiB a post may hold"
        else:
            try:
                obj = json.loads(bytes(raw).decode("utf-8"))
            except UnicodeDecodeError:
                why = "not UTF-8 text"
            except (ValueError, RecursionError):
                why = "not JSON"
            else:
                if _plain(obj):
                    return obj
                why = f"JSON, but a {type(obj).__name__} of values rank 0 never posts"
    port = os.environ.get("MASTER_PORT")
    raise OneRankError(f"the rendezvous store's key '{key}' holds {what} not rank 0's post ({why}): another "
                       f"process reached this job's MASTER_PORT{f' ({port})' if port else ''} and wrote it (nothing of "
                       "it was run); the job stops; check who else uses that port (another job, or a process left "
                       "over), set MASTER_PORT to a free port and start again")


def stored_int(store, key):
    """The integer a rank wrote under `key` in the store (a rank number: "failed"), or None where the key is absent
    or holds anything else (a foreign process's bytes): the lines that stop a job take that as absent and never
    raise on it. Two requests, as the check and the get they replace."""
    if not store.check([key]):
        return None
    raw = store.get(key)
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).decode("ascii", "replace")
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if not isinstance(raw, str) or not re.fullmatch(r"-?[0-9]{1,18}", raw):
        return None
    return int(raw)


def has_store():
    """Whether the rendezvous store can be asked: there is one, and its host (torchrun's agent) is alive."""
    return job.notes.get("store") is not None and not watch.launcher_gone()


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
    store = job.notes.get("store")
    if store is None or watch.launcher_gone():
        return None
    if getattr(job.notes.get("bounded"), "store", None) is not store:
        job.notes["bounded"] = _BoundedStore(store)
    return job.notes["bounded"]


def _until_read(number):
    """Rank 0, having posted an error: wait (at most RANK0_READ_WAIT_S) until every other rank has read post
    `number`, so that none finds the store gone (rank 0's process holds it under srun) and blames rank 0."""
    store, deadline = job.notes.get("store"), time.monotonic() + RANK0_READ_WAIT_S
    with contextlib.suppress(Exception):
        while store is not None and time.monotonic() < deadline:
            if store.add(f"rank0_post/{number}/read", 0) >= comm.world_size_to_be() - 1:
                return
            time.sleep(0.01)


def post_from_rank0(obj):
    """Rank 0's `obj` on every rank through the store (broadcast_from_rank0): rank 0 posts it and goes on, the
    others poll the store on the host, however long rank 0 takes, and stop when rank 0's heartbeat stops."""
    store = job.notes["store"]
    if watch.launcher_gone():
        raise RuntimeError("Connection closed by peer: torchrun's agent, the store's host, is gone")
    job.notes["posts"] = job.notes.get("posts", 0) + 1  # every rank counts the same posts: the key of this one
    key = f"rank0_post/{job.notes['posts']}"
    if comm.get_world_rank() == 0:
        store.set(key, encode_post(obj))
        return obj
    # 3 requests a look, from every other rank: slower on big jobs (at 4,096 ranks, every 1.2 s from the start)
    world = comm.world_size_to_be()
    longest = rendezvous.store_poll_pause(world, RANK0_POLL_S[1], requests=3)
    pause, beat, beat_moved = rendezvous.store_poll_pause(world, RANK0_POLL_S[0], requests=3), None, time.monotonic()
    try:
        while not store.check([key]):  # check, not wait: a wait that times out warns on stderr every time
            if watch.launcher_gone():
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
        obj = decode_post(key, store.get(key))  # data, never code
        store.add(f"{key}/read", 1)
        return obj
    except dist.DistNetworkError:  # rank 0's process held the store: it is gone (resilience/exits.py: one line)
        job.notes["store"] = None  # not asked again: its answer would be a second warning of torch's
        raise RuntimeError("Connection closed by peer: rank 0's rendezvous store is gone") from None


def until_read_after_error():
    """Rank 0, having posted an error (on_rank0): its process may hold the store, so it stays until the others
    have read that post."""
    if comm.get_world_rank() == 0 and job.notes.get("store") is not None and "posts" in job.notes:
        _until_read(job.notes["posts"])


def broadcast_from_rank0(obj):
    """Rank 0's `obj` on every rank (plain data: None, str, int, float, bool, or a list or tuple of those, which
    comes back a list; encode_post); the others wait until rank 0 gets here. Through the rendezvous store where
    there is one (torchrun or srun): rank 0 posts it and goes on, the others poll the store on the host, however
    long rank 0 takes (a checkpoint write, a dataset download), without a collective that --collective_timeout
    (NCCL's watchdog) would end. Without a store (a dry run, a process group made elsewhere, torchrun's agent that
    held it gone) a collective broadcast."""
    if not dist.is_initialized() or comm.is_dry_run():
        return obj
    if has_store():
        return post_from_rank0(obj)
    objects = [obj]
    dist.broadcast_object_list(objects, src=0)
    return objects[0]


def on_rank0(action):
    """`action()` on rank 0 alone (its result there, None elsewhere). If it raises a UserError every rank raises
    it, instead of the others waiting forever at their next collective. The others wait for rank 0 on the host
    (broadcast_from_rank0), as long as the action takes: a checkpoint written to a slow file system is not bounded
    by --collective_timeout."""
    result, error = None, None
    if comm.get_world_rank() == 0:
        try:
            result = action()
        except UserError as err:
            error = str(err)
    error = broadcast_from_rank0(error)
    if error:
        until_read_after_error()  # rank 0's process may hold the store: it stays up until the others read
        raise UserError(error)
    return result

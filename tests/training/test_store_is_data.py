"""Store messages are data (#58 item 2): the job's rendezvous store (a TCPStore, no authentication) can be written by
any process that reaches MASTER_PORT, so nothing read from it runs as code. Rank 0's posts (broadcast_from_rank0,
on_rank0) are JSON, checked for type and size as they are read; a foreign value stops the reading rank in one line
naming the key. The rank numbers the census reads, and the job id check_same_job reads, are taken as absent or said
in one line when they hold anything else, never a traceback inside the lines that stop a job.

A failure points to resilience/store.py (encode_post, decode_post, stored_int), resilience/peers.py
(explain_lost_peer, linger_for_the_others) or utils/rendezvous.py (check_same_job).
"""
import datetime
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch.distributed as dist

from resilience import job, peers
from resilience import store as job_store
from utils import comm
from utils.errors import OneRankError
from utils.rendezvous import check_same_job

# a process that is not one of the job's: it reaches rank 0's store at `port` and sets `key` to a pickle whose
# unpickling opens `path` for writing (creates the file): what any code it chose would run as
FOREIGN = """\
import datetime, pickle
import torch.distributed as dist

class CreatesAFile:
    def __reduce__(self):
        return (open, ({path!r}, "w"))

store = dist.TCPStore("127.0.0.1", {port}, is_master=False, timeout=datetime.timedelta(seconds=60))
store.set({key!r}, pickle.dumps(CreatesAFile()))
"""


def rank0_store():
    """A TCPStore server in this process, as rank 0's rendezvous store."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def as_rank(monkeypatch, store, rank, world=2):
    """This process as rank `rank` of `world`, its job attached to `store` (resilience's notes), its posts counted
    from the start; returns the list whose only item is the rank, to change it."""
    ranks = [rank]
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(comm, "is_dry_run", lambda: False)
    monkeypatch.setattr(comm, "get_world_rank", lambda: ranks[0])
    monkeypatch.setattr(comm, "world_size_to_be", lambda: world)
    monkeypatch.setitem(job.notes, "store", store)
    monkeypatch.setitem(job.notes, "posts", 0)
    return ranks


def foreign_process_sets(port, key, path):
    """Run the foreign process (FOREIGN) to its end: `key` then holds its pickle."""
    subprocess.run([sys.executable, "-c", FOREIGN.format(port=port, key=key, path=str(path))], check=True,
                   timeout=120, capture_output=True)


def read_the_foreign_post(monkeypatch, tmp_path):
    """Rank 1 of 2 reads rank 0's next post (rank0_post/1), which a foreign process has set to its pickle. Returns
    (what the read returned or raised, whether the pickle's file appeared)."""
    store, path = rank0_store(), tmp_path / "created_by_the_pickle"
    as_rank(monkeypatch, store, 1)
    foreign_process_sets(store.port, "rank0_post/1", path)
    try:
        outcome = job_store.broadcast_from_rank0(None)
    except OneRankError as err:
        outcome = err
    if hasattr(outcome, "close"):
        outcome.close()  # the twin: the file object the pickle opened
    return outcome, path.exists()


@pytest.mark.multiprocess
def test_a_foreign_pickle_in_rank_0s_post_stops_the_rank_in_one_line_and_runs_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("MASTER_PORT", "29500")
    outcome, created = read_the_foreign_post(monkeypatch, tmp_path)
    assert not created
    assert isinstance(outcome, OneRankError), outcome
    line = str(outcome)
    assert "\n" not in line
    assert line.startswith("the rendezvous store's key 'rank0_post/1' holds "), line
    assert "that are not rank 0's post (not UTF-8 text): another process reached this job's MASTER_PORT (29500)" \
           in line, line
    assert line.endswith("set MASTER_PORT to a free port and start again"), line


@pytest.mark.multiprocess
def test_twin_read_as_a_pickle_the_foreign_post_runs(monkeypatch, tmp_path):
    """Twin: the post read as before (pickle.loads): the foreign process's pickle runs in rank 1 (its file appears),
    and the read goes on as if rank 0 had posted it."""
    monkeypatch.setattr(job_store, "decode_post", lambda key, raw: pickle.loads(raw))
    outcome, created = read_the_foreign_post(monkeypatch, tmp_path)
    assert created
    assert not isinstance(outcome, OneRankError)


@pytest.mark.parametrize("raw, why", [
    (pickle.dumps("rank 0's answer"), "not UTF-8 text"),  # a pickle, even of plain data
    (b"\xff garbage", "not UTF-8 text"),
    (b"{not json", "not JSON"),
    (b"[" * 5000 + b"]" * 5000, "not JSON"),  # nested deeper than the parser recurses
    (json.dumps({"path": "x"}).encode(), "JSON, but a dict of values rank 0 never posts"),
    (json.dumps([["nested"]]).encode(), "JSON, but a list of values rank 0 never posts"),
    (json.dumps("x" * job_store.POST_MAX_BYTES).encode(), "over the 64 KiB a post may hold"),
    ("a str", "not bytes"),
])
def test_a_malformed_post_is_one_line_naming_the_key(raw, why):
    with pytest.raises(OneRankError) as caught:
        job_store.decode_post("rank0_post/3", raw)
    line = str(caught.value)
    assert "\n" not in line and line.startswith("the rendezvous store's key 'rank0_post/3' holds "), line
    assert f"not rank 0's post ({why}): another process reached this job's MASTER_PORT" in line, line


def test_rank_0s_posts_come_back_equal_through_the_store(monkeypatch):
    """The posts the job makes, posted by rank 0 and read by rank 1 through a real TCPStore: on_rank0's error (None,
    or a line), run.py's resume path, load_on_every_rank's (path, iteration, error, crashed) (a list, which unpacks
    the same), a path of bytes that are not UTF-8 (os.fsdecode's surrogates)."""
    odd_path = os.fsdecode(b"/runs/\xff/ckpt.pt")
    posts = [None, "cannot create the run directory '/x' (Permission denied); choose a writable --expdir",
             "/runs/vit/ddp/0/checkpoints/ckpt.pt", ("/runs/vit/ddp/0/checkpoints/ckpt.pt", 120, None, False),
             ("/runs/ckpt.pt", None, "not a checkpoint written by train.py", False), (odd_path, None, None, True),
             [1.5, -3, True, "é"]]
    store = rank0_store()
    ranks = as_rank(monkeypatch, store, 0)
    for obj in posts:
        ranks[0] = 0
        assert job_store.broadcast_from_rank0(obj) == obj
    ranks[0], job.notes["posts"] = 1, 0
    for obj in posts:
        got = job_store.broadcast_from_rank0(None)
        assert got == (list(obj) if isinstance(obj, tuple) else obj)
    path, iteration, error, crashed = posts[3]
    assert (path, iteration, error, crashed) == tuple(job_store.decode_post("k", job_store.encode_post(posts[3])))
    assert store.add("rank0_post/4/read", 0) == 1  # each read counted (rank 0 may wait for it after an error)


@pytest.mark.parametrize("obj", [{"path": "x"}, ("x", object()), b"bytes", [["nested"]]])
def test_rank_0_posting_anything_but_plain_data_is_a_bug_said_on_rank_0(obj):
    with pytest.raises(TypeError, match="rank 0's post must be None, str, int, float, bool or a list or tuple"):
        job_store.encode_post(obj)


def test_a_malformed_failure_note_is_taken_as_absent_by_the_census(monkeypatch):
    """The failure note ("failed", a rank number) set to foreign bytes: stored_int finds no rank in it; rank 0's
    wait for the others (linger_for_the_others) reads it without a ValueError; a survivor whose collective failed
    does not take it for a failing rank's line (which would leave the job without one) and names the lost rank."""
    store = rank0_store()
    store.set("failed", b"\xff garbage")
    assert job_store.stored_int(store, "failed") is None
    assert job_store.stored_int(store, "absent") is None
    store.set("failed_well", "7")
    assert job_store.stored_int(store, "failed_well") == 7
    peers.mark_alive(store, 0)
    peers.mark_alive(store, 1)
    peers.linger_for_the_others(store, 2)  # every rank marked: returns at once, no ValueError

    survivor = rank0_store()
    survivor.set("failed", b"\xff garbage")
    as_rank(monkeypatch, survivor, 1)
    monkeypatch.setattr(peers, "failing_store", lambda: survivor)
    monkeypatch.setattr(peers.watch, "launcher_gone", lambda: False)
    monkeypatch.setattr(peers.watch, "was_frozen", lambda: False)
    monkeypatch.setattr(peers, "LOST_PEER_CENSUS_S", 0.1)
    line = peers.explain_lost_peer(RuntimeError("Connection closed by peer"))
    assert line is not None and line.startswith("rank 1: rank 0 stopped answering in a collective"), line


def test_twin_the_failure_note_parsed_as_before_raises_inside_rank_0s_wait(monkeypatch):
    """Twin: the note read as before (int() of the value): rank 0's wait for the others raises ValueError, inside
    the code that says why the job stops."""
    monkeypatch.setattr(peers, "stored_int", lambda store, key: int(store.get(key)) if store.check([key]) else None)
    store = rank0_store()
    store.set("failed", b"\xff garbage")
    with pytest.raises(ValueError):
        peers.linger_for_the_others(store, 2)


def test_a_foreign_job_id_or_rank_claim_is_one_line(monkeypatch):
    """check_same_job on rank 1: a job id that is not UTF-8 is said (escaped) as another job's, a rank claim that is
    not a count (the store's host then drops the asking connection) in one line too: OneRankErrors, no traceback."""
    store = rank0_store()
    store.set("slurm_job_id", b"\xff garbage")
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    with pytest.raises(OneRankError, match=r"belongs to another job \(Slurm job \\xff garbage, this is 12\)"):
        check_same_job(client, 1, "nid001", store.port, job="12")
    store.set("slurm_job_id", "12")
    store.set("rank_claims/1", b"\xff garbage")
    with pytest.raises(OneRankError, match="holds a claim of rank 1 that is not a count"):
        check_same_job(client, 1, "nid001", store.port, job="12")

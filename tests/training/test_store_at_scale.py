"""The rendezvous store at scale: it is one server (in rank 0's process, or torchrun's agent; of the order of 100,000
requests a second on a core) that every rank asks, so what the ranks ask of it must grow as the job, not as its
square. When a rank is lost, each survivor asks only about the ranks below it, up to the first one alive, and the
lowest survivor alone names the lost ones (before: every rank asked about every rank, 16.8 million requests at 4,096
ranks, minutes before the job's one line); rank 0 waits for the others' marks on one count; ranks that poll slow down
as the job grows (utils/rendezvous.store_poll_pause). Many ranks stood in for by one process and a store that counts
requests.

A failure points to resilience/peers.py (mark_alive, lost_if_lowest_alive, linger_for_the_others), resilience/store.py
(broadcast_from_rank0) or utils/rendezvous.py (store_poll_pause, check_one_rank_per_gpu).
"""
import json
import threading
import time

import pytest
import torch.distributed as dist

from resilience import job, peers
from resilience import store as job_store
from utils import comm, rendezvous
from utils.errors import UserError


class CountingStore:
    """torch's HashStore, counting the requests made of it."""

    def __init__(self):
        self.store, self.requests = dist.HashStore(), 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args):
            self.requests += 1
            return method(*args)
        return counted


def census(world, lost):
    """A store in which every rank of `world` but `lost` has marked itself alive."""
    store = CountingStore()
    for rank in range(world):
        if rank not in lost:
            peers.mark_alive(store, rank)
    store.requests = 0
    return store


def lost_as_before(store, rank, world):
    """The survivors' question as it was (the twin's stand-in for peers.lost_if_lowest_alive): every rank asks about
    every rank, the lowest marked speaks."""
    marked = [other for other in range(world) if other == rank or store.check([f"alive/{other}"])]
    return None if rank != min(marked) else [other for other in range(world) if other not in marked]


def lines_of_the_survivors(monkeypatch, world, lost):
    """explain_lost_peer on each rank of `world` but `lost`, one after another, their collective failed ("Connection
    closed by peer") and every survivor already marked alive (so no census wait, and rank 0 waits for nobody: the
    others ask after it here). Returns ({rank: its line or None}, the store, counting the survivors' requests)."""
    store = census(world, lost)
    asking = [0]
    monkeypatch.setattr(peers, "failing_store", lambda: store)
    monkeypatch.setattr(peers.comm, "get_world_rank", lambda: asking[0])
    monkeypatch.setattr(peers.comm, "world_size_to_be", lambda: world)
    monkeypatch.setattr(peers.watch, "launcher_gone", lambda: False)
    monkeypatch.setattr(peers.watch, "was_frozen", lambda: False)
    monkeypatch.setattr(peers, "LOST_PEER_CENSUS_S", 0)
    monkeypatch.setattr(peers, "LOST_PEER_LINGER_S", 0)
    said = {}
    for rank in range(world):
        if rank not in lost:
            asking[0] = rank
            said[rank] = peers.explain_lost_peer(RuntimeError("Connection closed by peer"))
    return said, store


def the_lowest_survivor_alone_names(said, world, lost):
    """Whether, of the lines `said`, the lowest survivor's alone is one, naming the `lost` ranks."""
    lines = {rank: line for rank, line in said.items() if line is not None}
    who = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}"
    lowest = min(set(range(world)) - set(lost))
    return lines.keys() == {lowest} and lines[lowest].startswith(
        f"rank {lowest}: {who} stopped answering in a collective (Connection closed by peer) without a line of its own")


def bound(world, lost):
    """The most requests the survivors make: each asks about the lost ranks below it and the first survivor, the
    speaker about the whole world as well (lost_if_lowest_alive); each marks itself and reads the failure note."""
    return (len(lost) + 2) * world + 2 * world


@pytest.mark.parametrize("lost", [[5], [0], [0, 1, 2, 3], [1020, 1023]])
def test_the_lowest_survivor_alone_names_the_lost_ranks_in_requests_that_grow_as_the_job(monkeypatch, lost):
    """1,024 ranks but the lost ones each ask, through explain_lost_peer, who is lost: the lowest survivor alone
    says a line, naming them, and the requests grow as the job (a few per rank), not as its square."""
    world = 1024
    said, store = lines_of_the_survivors(monkeypatch, world, lost)
    assert the_lowest_survivor_alone_names(said, world, lost), said
    assert store.requests <= bound(world, lost), store.requests


def test_twin_as_before_every_rank_asks_about_every_rank(monkeypatch):
    """Twin: the product's question put back as it was (peers.lost_if_lowest_alive replaced by lost_as_before,
    which explain_lost_peer then calls): the same line from the same rank, but the main test's bound fails, by about
    world squared requests."""
    monkeypatch.setattr(peers, "lost_if_lowest_alive", lost_as_before)
    world, lost = 1024, [5]
    said, store = lines_of_the_survivors(monkeypatch, world, lost)
    assert the_lowest_survivor_alone_names(said, world, lost), said
    assert store.requests > bound(world, lost) and store.requests > 100 * world, store.requests


class Clock:
    """resilience.peers' clock in the test's hands: a sleep moves it on at once, and is recorded."""

    def __init__(self):
        self.now, self.pauses = 1000.0, []

    def time(self):
        return self.now

    def sleep(self, seconds):
        self.pauses.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("failing, unmarked, waits", [
    (7, [7], False),  # the failing rank (announce_failure) never marks itself
    (None, [], False),
    (None, [9], True),
    (7, [9], True),  # the failing rank marked itself (the first to time out): rank 9 is still awaited
])
def test_rank_0_waits_for_the_others_marks_on_one_count(monkeypatch, failing, unmarked, waits):
    """Rank 0 leaving on a failure (its process may hold the store) waits until every rank but the failing one has
    marked itself, reading a count: a few requests a look, at 4,096 ranks as at 2; a rank that never marks itself
    is waited for LOST_PEER_LINGER_S. The clock is the test's (peers.time: a sleep returns at once, counted), so the
    wait is the pauses the call asked for, not one elapsed time compared with the linger, which a loaded machine
    could push past it."""
    clock = Clock()
    monkeypatch.setattr(peers, "time", clock)
    world = 4096
    store = census(world, unmarked)
    if failing is not None:
        store.set("failed", str(failing))
    store.requests = 0
    peers.linger_for_the_others(store, world)
    if waits:
        assert sum(clock.pauses) == pytest.approx(peers.LOST_PEER_LINGER_S, abs=0.05), clock.pauses
    else:
        assert clock.pauses == []
    looks = max(len(clock.pauses), 1)
    assert store.requests <= 4 * looks, store.requests


def test_a_rank_marks_itself_once():
    store = CountingStore()
    for _ in range(3):
        peers.mark_alive(store, 4)
    assert store.check(["alive/4"]) and store.add("alive_count", 0) == 1


def test_polls_slow_down_as_the_job_grows():
    assert rendezvous.store_poll_pause(8, 0.05) == 0.05  # a small job polls as fast as before
    assert rendezvous.store_poll_pause(4096, 0.05) == pytest.approx(0.4096)
    assert rendezvous.store_poll_pause(4096, 0.5, requests=3) == pytest.approx(1.2288)  # broadcast_from_rank0's
    # every rank's polls together stay at STORE_POLLS_PER_S
    for world in (2, 64, 4096, 100_000):
        assert world / rendezvous.store_poll_pause(world, 0.05) <= rendezvous.STORE_POLLS_PER_S


def test_the_wait_for_rank_0s_post_looks_every_1_2_s_at_4096_ranks(monkeypatch):
    """broadcast_from_rank0 on a rank of 4,096 whose rank 0 posts after 1.5 s (a checkpoint write): 3 requests a look,
    a look every 1.23 s (before: from 5 ms, doubling up to 0.5 s: 9 looks, 27 requests, in those 1.5 s)."""
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(comm, "is_dry_run", lambda: False)
    monkeypatch.setattr(comm, "get_world_rank", lambda: 1)
    monkeypatch.setattr(comm, "world_size_to_be", lambda: 4096)
    store = CountingStore()
    monkeypatch.setitem(job.notes, "store", store)
    monkeypatch.setitem(job.notes, "posts", 0)
    rank0 = threading.Timer(1.5, lambda: store.store.set("rank0_post/1", json.dumps("rank 0's answer").encode()))
    rank0.start()
    start = time.monotonic()
    assert job_store.broadcast_from_rank0(None) == "rank 0's answer" and time.monotonic() - start >= 1.5
    assert store.requests <= 3 * 3 + 2, store.requests  # 2 or 3 looks, then the post read and counted


def test_the_gpu_check_of_a_big_job_polls_a_few_times_a_second():
    """check_one_rank_per_gpu waits for every rank's claim: a rank of 4,096 (the others never come here) looks about
    2.4 times a second, not 20 (82,000 requests a second at 4,096 ranks while they start)."""
    store = CountingStore()
    start = time.monotonic()
    with pytest.raises(UserError, match="not every rank of 4096 reached the GPU check within 1 s"):
        rendezvous.check_one_rank_per_gpu(store, 4096, "GPU-0", 1.0, host="nid001")
    looks = store.requests - 2  # its claim: two requests
    assert time.monotonic() - start >= 1.0 and looks <= 4, looks

"""A job's sockets fit the open-file limit: gloo's host group is a full mesh (a socket to every other rank) and rank 0
hosts the rendezvous store (a connection from every other rank), so rank 0 of N ranks holds about 2N open files,
more than the 1,024 many systems start a process with (`ulimit -n`) once N passes about 500. Each rank raises its
soft limit up to the hard one before the ranks meet (utils/rendezvous.raise_open_file_limit); a hard limit below
rank 0's need is one line. Here the limit is injected: 4 plain processes over gloo whose script lowers its own soft
limit to 30 before it joins, below the open files rank 0 of 4 holds once they meet (37, counted by hand in /proc).

A failure points to utils/rendezvous.py (raise_open_file_limit).
"""
import resource
import sys

import pytest

from tests.conftest import REPO_ROOT, run_plain_ranks
from utils import rendezvous
from utils.errors import UserError

# each rank: its open-file limit lowered to `soft`/`hard` (as a node's defaults would be; None: the hard limit it has),
# then the ranks meet, sum a tensor and leave; `switched_off` takes the raise away (the twin)
RANK_SCRIPT = """\
import os, resource, sys
sys.path.insert(0, {root!r})
import torch
import utils.rendezvous
from resilience.exits import exit_on_user_error
from utils import comm
from utils.logging_utils import config_logger

config_logger()
resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard} or resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
if {switched_off}:
    utils.rendezvous.raise_open_file_limit = lambda *args, **kwargs: None


@exit_on_user_error
def main():
    comm.init(None)
    total = comm.all_reduce_sum(torch.ones(1))
    print(f"rank {{comm.get_world_rank()}}: sum {{total.item():g}}, soft limit "
          f"{{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}}", flush=True)
    comm.destroy()


main()
"""


HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # the ranks inherit it
needs_room = pytest.mark.skipif(HARD != resource.RLIM_INFINITY and HARD < 1062,
                                reason=f"this machine's hard limit of open files ({HARD}) is below 1062")


def run_ranks(tmp_path, soft, hard=None, switched_off=False, timeout=60):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(root=str(REPO_ROOT), soft=soft, hard=hard, switched_off=switched_off))
    return run_plain_ranks([sys.executable, str(script)], 4, tmp_path, timeout=timeout)


@pytest.mark.multiprocess
@pytest.mark.compat
@needs_room
def test_ranks_started_with_too_few_open_files_raise_the_soft_limit_and_meet(tmp_path):
    codes, outputs, _ = run_ranks(tmp_path, soft=30)
    assert codes == [0, 0, 0, 0], outputs
    for rank, output in enumerate(outputs):
        assert f"rank {rank}: sum 4, soft limit 1062" in output, output  # 2 x 3 + 32 needed, 1024 spare
    assert "open files: the soft limit raised from 30 to 1062 for 4 ranks" in outputs[0], outputs[0]
    assert not any("open files" in output for output in outputs[1:]), outputs  # rank 0 logs


@pytest.mark.multiprocess
@pytest.mark.long
def test_twin_without_the_raise_rank_0_aborts_on_too_many_open_files(tmp_path):
    codes, outputs, _ = run_ranks(tmp_path, soft=30, switched_off=True, timeout=90)
    assert codes[0] != 0 and "Too many open files" in outputs[0], outputs
    assert not any("sum 4" in output for output in outputs), outputs


@pytest.mark.multiprocess
@pytest.mark.long  # in make test: the refusal on every rank, in one process (below)
def test_a_hard_limit_below_rank_0s_need_stops_every_rank_in_one_line(tmp_path):
    codes, outputs, _ = run_ranks(tmp_path, soft=30, hard=30)
    assert codes == [2, 2, 2, 2], outputs
    assert outputs[0].count("error: ") == 1 and "Traceback" not in "".join(outputs), outputs
    assert ("error: 4 ranks need about 38 open files on rank 0 (a socket to every other rank, and the rendezvous "
            "store's connections), but a process here may open at most 30 (the hard limit, `ulimit -Hn`)") in outputs[0]
    assert not any("error: " in output for output in outputs[1:]), outputs


@pytest.fixture
def limits(monkeypatch):
    """The module's view of the limits, in a dict the test sets (the process's own are left alone)."""
    now = {"limits": (1024, 4096), "calls": 0}

    def setrlimit(which, limits):
        now["calls"] += 1
        if now.get("refuse"):
            raise ValueError("not allowed")
        now["limits"] = limits
    monkeypatch.setattr(rendezvous.resource, "getrlimit", lambda which: now["limits"])
    monkeypatch.setattr(rendezvous.resource, "setrlimit", setrlimit)
    return now


@pytest.mark.parametrize("world, hosts_store, soft, hard, after", [
    (4, True, 1024, 4096, (1024, 4096)),  # a small job on the usual 1,024: room enough, left alone (and unsaid)
    (4, True, 100, 4096, (1062, 4096)),  # too little room beside its sockets: raised, with 1,024 to spare
    (300, True, 1024, 4096, (1654, 4096)),  # 630 needed leaves 394 of 1,024: raised
    (1024, True, 1024, 524288, (3102, 524288)),  # 1,024 GPUs: rank 0's 2 x 1,023 sockets + 32 + 1,024 spare
    (1024, False, 1024, 524288, (2079, 524288)),  # torchrun's agent holds the store: one socket a peer
    (1024, True, 1024, 2500, (2500, 2500)),  # up to the hard limit, which fits rank 0's need (2,078)
    (1024, True, 65536, 524288, (65536, 524288)),  # already enough: left alone
    (1024, True, 1024, resource.RLIM_INFINITY, (3102, resource.RLIM_INFINITY)),
    (1024, True, resource.RLIM_INFINITY, resource.RLIM_INFINITY, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)),
])
def test_the_soft_limit_is_raised_to_what_rank_0_needs_and_no_further_than_the_hard_one(limits, world, hosts_store,
                                                                                          soft, hard, after):
    limits["limits"] = (soft, hard)
    rendezvous.raise_open_file_limit(world, 3, hosts_store)
    assert limits["limits"] == after


def test_a_limit_already_at_the_hard_one_is_left_alone_and_not_said(limits, caplog):
    limits["limits"] = (2500, 2500)  # between rank 0's need (2,078) and the need with room (3,102)
    with caplog.at_level("INFO"):
        rendezvous.raise_open_file_limit(1024, 0)
    assert limits["calls"] == 0 and "open files" not in caplog.text


def test_a_soft_limit_that_cannot_be_raised_is_a_warning_and_the_job_goes_on(limits, caplog):
    limits["refuse"], limits["limits"] = True, (100, 4096)
    rendezvous.raise_open_file_limit(4, 0)
    assert limits["calls"] == 1 and limits["limits"] == (100, 4096)
    assert "open files: could not raise the soft limit from 100 to 1062 (not allowed)" in caplog.text


def test_a_hard_limit_below_rank_0s_need_is_refused_on_every_rank(limits):
    limits["limits"] = (1024, 2000)
    for rank in (0, 5):
        with pytest.raises(UserError, match=r"^1024 ranks need about 2078 open files on rank 0 .* at most 2000 "
                                            r"\(the hard limit, `ulimit -Hn`\); ask the system's administrators"):
            rendezvous.raise_open_file_limit(1024, rank)
    assert limits["limits"] == (1024, 2000)

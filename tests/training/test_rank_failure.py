"""One rank failing ends the whole job in seconds, in one line (issue #40): a OneRankError on one rank (a sample of its
shard that cannot be read) is printed by that rank, which notes it in the rendezvous store and leaves the process
group, so the other ranks' next collective fails at once and they exit without a line of their own; a rank killed
without a word (SIGKILL, out of memory) is named by the lowest surviving rank, with the checkpoint a restart resumes
from. Plain processes over gloo (each rank's exit code and output), the failure injected by a script written into
the test's folder (no switch in the product's code).

A failure points to resilience/exits.py (exit_on_user_error) or resilience/peers.py (announce_failure,
explain_lost_peer).
"""
import re
import sys

import pytest
import torch.distributed

from sample_data import write_era5
from tests.conftest import REPO_ROOT, run_plain_ranks

# what each rank runs: train.py, with rank 1's 13th read of a training frame failing, mid-epoch (`error`: an
# unreadable sample; `kill`: the process dies at once, as an out-of-memory kill does); `switched_off` takes the
# job-failure handling away (the twin)
RANK_SCRIPT = """\
import os, signal, sys, time
sys.path.insert(0, {root!r})
import loaders.era5
import train
from utils.errors import OneRankError, UserError

reads = [0]
real_read_into = loaders.era5.ERA5Dataset.read_into


def read_into(self, year_idx, step, out):
    if "/train/" in self.files_paths[0] and os.environ["RANK"] == "1":
        reads[0] += 1
        if reads[0] == 13:
            print(f"test: rank 1 fails at {{time.time()}}", flush=True)
            if {mode!r} == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if {mode!r} == "usererror":  # what every rank would find, found by one (its node's mount is missing)
                raise UserError("data directory '/data/train' does not exist (injected)")
            if {mode!r} == "diskfull":  # a writer without its own message, on this rank alone
                raise OSError(28, "No space left on device", "/logs/run/events.out (injected)")
            raise OneRankError("sample 12 of the shard cannot be read (injected)")
    return real_read_into(self, year_idx, step, out)


loaders.era5.ERA5Dataset.read_into = read_into
if {switched_off}:
    import resilience.job
    resilience.job.attached = lambda: False
if {unclaimed}:  # as before the claim: rank 0 alone says a UserError
    import resilience.peers
    resilience.peers.claim_user_error = lambda: os.environ["RANK"] == "0"
train.main(sys.argv[1:])
"""


# "in seconds": every process gone within ENDS_WITHIN_S of rank 1's failure, measured against the run's own events
# (from the failing rank's timestamp of its failure to the last exit; the ranks' start-up is not counted). On one core
# of this 2-core machine (taskset -c 0: half of it, 2026-11-29) that took 1.7 s (2 ranks, the error) to 5.0 s (rank 1
# killed) and 5.7 s (4 ranks), mostly the handling's fixed waits (the census's 1 s, rank 0's linger of up to 3 s),
# which a slower machine does not lengthen: even all of it twice as long keeps 15 s. A wait that grows past it fails
# (the census at 20 s: 24 s, rank 1 killed). docs/testing.md and docs/cluster.md quote the 15 s.
ENDS_WITHIN_S = 15


@pytest.fixture(scope="module")
def era5(tmp_path_factory):
    return str(write_era5(tmp_path_factory.mktemp("failure") / "era5", height=16, width=32, steps_per_year=24,
                          train_years=1, valid_years=1, test_years=1, verbose=False))


def job(era5, tmp_path, ranks, mode, switched_off=False, timeout=120, unclaimed=False):
    """`ranks` plain processes of train.py (tiny, local batch 1, a checkpoint every 4 steps, no loader workers):
    (exit codes, outputs, seconds from rank 1's failure to the last exit)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(root=REPO_ROOT, mode=mode, switched_off=switched_off, unclaimed=unclaimed))
    codes, outputs, last_exit = run_plain_ranks(
        [sys.executable, str(script), "--config", "tiny", "--data_dir", era5, "--expdir", str(tmp_path / "exp"),
         "--num_iters", "40", "--local_batch_size", "1", "--num_data_workers", "0", "--checkpoint_interval", "4",
         "--dist_timeout", "60"], ranks, tmp_path, timeout)
    failed_at = re.search(r"test: rank 1 fails at ([\d.]+)", "".join(outputs))
    assert failed_at, "".join(outputs)[-3000:]
    return codes, outputs, last_exit - float(failed_at.group(1))


@pytest.mark.multiprocess
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.long)])
def test_one_ranks_error_ends_the_job_in_seconds_with_its_line_last(era5, tmp_path, ranks):
    """Rank 1 of 2 (of 4) cannot read a sample mid-epoch: every process exits non-zero within 15 s of it, the
    console has rank 1's line once and no other line or traceback. Before, the others waited in their next
    collective (NCCL: 10 minutes) or, over gloo, each printed a traceback."""
    codes, outputs, seconds = job(era5, tmp_path, ranks, "error")
    console = "".join(outputs)
    assert all(code != 0 for code in codes) and codes[1] == 2, (codes, console[-3000:])
    assert seconds < ENDS_WITHIN_S, seconds
    errors = [line for line in console.splitlines() if line.startswith("error: ")]
    assert errors == ["error: rank 1: sample 12 of the shard cannot be read (injected)"], console[-3000:]
    assert errors[0] in outputs[1] and "Traceback" not in console, console[-3000:]


@pytest.mark.multiprocess
def test_twin_without_the_handling_the_other_ranks_end_in_tracebacks(era5, tmp_path):
    """The check above can fail: with the job-failure handling switched off, rank 0 meets rank 1's closed sockets
    in its next collective and ends in gloo's traceback."""
    codes, outputs, _ = job(era5, tmp_path, 2, "error", switched_off=True)
    assert codes[1] == 2 and codes[0] != 0 and "Traceback" in outputs[0], outputs[0][-3000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, line", [
    pytest.param("usererror", "error: rank 1: data directory '/data/train' does not exist (injected)",
                 marks=pytest.mark.long),
    pytest.param("diskfull", "error: rank 1: writing '/logs/run/events.out (injected)' failed: the disk is full or "
                 "over its quota (No space left on device; ", marks=pytest.mark.long),
])
def test_an_error_only_one_rank_finds_is_said_by_it_once(era5, tmp_path, mode, line):
    """A UserError every rank would find alike, found by rank 1 alone (its node's data mount is missing), and a
    full disk under a writer without its own message: rank 1 says it, naming itself, and rank 0 stops without a
    line of its own. Before, rank 1 left in silence (only rank 0 said a UserError) or without telling the others
    (the disk), and rank 0 said that rank 1 stopped answering without a line of its own."""
    codes, outputs, seconds = job(era5, tmp_path, 2, mode)
    console = "".join(outputs)
    assert codes[1] == 2 and codes[0] != 0 and seconds < ENDS_WITHIN_S, (codes, seconds, console[-3000:])
    errors = [line for line in console.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(line) and errors[0] in outputs[1], console[-3000:]


@pytest.mark.multiprocess
@pytest.mark.long
def test_twin_unclaimed_a_user_error_of_rank_1_alone_is_never_said(era5, tmp_path):
    """The check above can fail: with rank 0 alone saying UserErrors (as before), rank 1's reason is nowhere."""
    codes, outputs, _ = job(era5, tmp_path, 2, "usererror", unclaimed=True)
    console = "".join(outputs)
    assert codes[1] == 2 and "does not exist (injected)" not in console, console[-3000:]


@pytest.mark.multiprocess
@pytest.mark.long
def test_a_rank_killed_without_a_word_is_named_with_the_checkpoint_to_resume_from(era5, tmp_path):
    """Rank 1 is SIGKILLed mid-run (no line of its own): rank 0 says, in one line, that rank 1 stopped answering and
    which checkpoint a restart resumes from (the last one written), and exits with code 2."""
    codes, outputs, seconds = job(era5, tmp_path, 2, "kill")
    console = "".join(outputs)
    assert codes == [2, -9], (codes, console[-3000:])
    assert seconds < ENDS_WITHIN_S, seconds
    errors = [line for line in console.splitlines() if line.startswith("error: ")]
    checkpoint = tmp_path / "exp" / "tiny" / "2GPU" / "00" / "checkpoints" / "ckpt.pt"
    last = re.findall(r"Checkpoint of iteration (\d+) written", outputs[0])[-1]  # rank 1 died in a later step
    assert len(errors) == 1 and re.fullmatch(
        r"error: rank 0: rank 1 stopped answering in a collective \(Connection (closed|reset) by peer\) without a "
        r"line of its own \(killed, out of memory, or its node failed\); the job stops; starting again resumes from "
        rf"'{re.escape(str(checkpoint))}' \(iteration {last}\)", errors[0]), console[-3000:]
    assert "Traceback" not in console


class GoneStore:
    """A rendezvous store whose host has died: every call fails as TCPStore's do."""

    def set(self, *args):
        raise RuntimeError("Broken pipe")

    check = get = add = set


@pytest.mark.parametrize("rank, local_rank, line", [
    (4, "0", "rank 4: rank 0 stopped answering"),  # the first rank of a node says it
    (5, "1", None),  # the others of that node do not
    (0, "0", "rank 0: another rank stopped answering"),  # rank 0 never names itself
])
def test_a_store_gone_with_its_host_is_said_once_a_node(monkeypatch, rank, local_rank, line):
    """Rank 0's process holds the rendezvous store under srun: when it dies, the survivors cannot take their census;
    the first rank of each node says that rank 0 stopped answering, with the checkpoint to resume from."""
    from resilience import job, peers
    from utils import comm
    monkeypatch.setattr(comm, "get_world_rank", lambda: rank)
    monkeypatch.setattr(comm, "world_size_to_be", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setitem(job.notes, "store", GoneStore())
    monkeypatch.setitem(job.notes, "checkpoint", "'ckpt.pt' (iteration 12)")
    said = peers.explain_lost_peer(RuntimeError("[pair.cc:561] Connection closed by peer [10.0.0.1]:1234"))
    if line is None:
        assert said is None
    else:
        assert said.startswith(line + " in a collective (Connection closed by peer)"), said
        assert said.endswith("starting again resumes from 'ckpt.pt' (iteration 12)"), said


@pytest.mark.parametrize("rank, keys, claimed", [
    (0, {}, True),                  # rank 0 says it at once
    (1, {"user_error": "0"}, False),  # rank 0 found it too: rank 1 leaves quietly, marked for rank 0's linger
    (1, {}, True),                  # rank 1 alone (its node's mount): after the wait, it says it
    (2, {"user_error": "1"}, False),  # rank 1 said it first
])
def test_the_first_rank_to_claim_a_user_error_says_it(monkeypatch, rank, keys, claimed):
    from resilience import job, peers
    from utils import comm
    store = torch.distributed.HashStore()  # answers check, set and compare_set as the rendezvous TCPStore does
    for key, value in keys.items():
        store.set(key, value)
    monkeypatch.setattr(comm, "get_world_rank", lambda: rank)
    monkeypatch.setattr(peers, "USER_ERROR_WAIT_S", 0.1)
    monkeypatch.setitem(job.notes, "store", store)
    assert peers.claim_user_error() == claimed
    if claimed:
        assert store.get("user_error") == str(rank).encode()
    else:
        assert store.get(f"alive/{rank}") == b"1"


@pytest.mark.parametrize("rank, claimed, line, announced", [
    ("1", True, "error: rank 1: data directory 'x' does not exist", True),
    ("0", True, "error: data directory 'x' does not exist", True),  # rank 0's line as in a job without a store
    ("1", False, None, False),  # another rank says it
])
def test_a_claimed_user_error_is_one_line_and_tells_the_others(monkeypatch, capsys, rank, claimed, line, announced):
    """stop_in_one_line in a job of 2 ranks sharing a store; the twin of the end-to-end run: without the claim
    (rank 0 alone printing, as before) rank 1's line would be missing."""
    from resilience import exits, job, peers
    told = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(job, "notes", {"attached": True})
    monkeypatch.setattr(peers, "announce_failure", told.append)
    monkeypatch.setattr(peers, "claim_user_error", lambda: claimed)
    with pytest.raises(SystemExit) as stop:
        exits.stop_in_one_line("data directory 'x' does not exist", found_here=False)
    assert stop.value.code == 2
    printed = capsys.readouterr().err.strip().splitlines()
    assert printed == ([line] if line else [])
    assert told == ([line.removeprefix("error: ")] if announced else [])


# each rank reads its own --data_dir: rank 1 a copy of the data missing one training year (a node whose copy is
# still running); `switched_off` takes the agreement away (the twin)
DATA_SCRIPT = """\
import os, sys
sys.path.insert(0, {root!r})
import loaders.common
import train

if {switched_off}:
    loaders.common.check_same_size_everywhere = lambda size, train, gather: None
argv = sys.argv[1:]
if os.environ["RANK"] == "1":
    argv[argv.index("--data_dir") + 1] = {partial!r}
train.main(argv)
"""


def different_data_job(tmp_path, switched_off):
    whole = write_era5(tmp_path / "whole", height=16, width=32, steps_per_year=24, train_years=2, valid_years=1,
                       test_years=1, verbose=False)
    partial = write_era5(tmp_path / "partial", height=16, width=32, steps_per_year=24, train_years=2, valid_years=1,
                         test_years=1, verbose=False)
    train_files = sorted((partial / "train").iterdir())
    train_files[-1].unlink()  # the copy of the last year has not arrived on rank 1's node
    script = tmp_path / "rank.py"
    script.write_text(DATA_SCRIPT.format(root=REPO_ROOT, partial=str(partial), switched_off=switched_off))
    return run_plain_ranks(
        [sys.executable, str(script), "--config", "tiny", "--data_dir", str(whole), "--expdir", str(tmp_path / "exp"),
         "--num_iters", "60", "--local_batch_size", "1", "--num_data_workers", "0", "--checkpoint_interval", "0",
         "--dist_timeout", "60", "--collective_timeout", "20"], 2, tmp_path, timeout=150)


@pytest.mark.multiprocess
def test_ranks_that_see_different_data_stop_before_training_in_one_line(tmp_path):
    """Rank 1's node sees one training year fewer: the job stops at start-up, exit 2 on both ranks, with one line
    naming the rank and both sizes. Before, the ranks shuffled different orders and ended their epochs at different
    steps (24 and 12 here), where their collectives stopped matching."""
    codes, outputs, _ = different_data_job(tmp_path, switched_off=False)
    console = "".join(outputs)
    errors = [line for line in console.splitlines() if line.startswith("error: ")]
    assert codes == [2, 2], (codes, console[-3000:])
    assert errors == ["error: the ranks see different training data: rank 1 has 24 samples where the other rank has "
                      "48; every rank must read the same files: check that every node sees the same data folder (a "
                      "copy still running, a stale or partial mount), then start again"], console[-3000:]
    assert "Traceback" not in console and "Time taken for epoch" not in console


@pytest.mark.multiprocess
@pytest.mark.long
def test_twin_without_the_agreement_ranks_on_different_data_train_on_and_fail_later(tmp_path):
    """The check above can fail: without the agreement both ranks train on their different data until rank 1's
    shorter epoch ends and the ranks' collectives stop matching (gloo notices the sizes; NCCL would hang until its
    timeout)."""
    codes, outputs, _ = different_data_job(tmp_path, switched_off=True)
    console = "".join(outputs)
    assert "different training data" not in console and codes != [0, 0], (codes, console[-3000:])
    assert re.search(r"collective mismatch|stopped answering", console), console[-3000:]

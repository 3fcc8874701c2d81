"""The ranks' agreement on a stop signal (lifecycle/signals.py): at every step boundary each rank starts an all-reduce
and reads the one it started AGREEMENT_LAG boundaries before, so no step waits for it, and every rank still stops at
the same boundary. CPU ranks over gloo, a real SIGUSR1 to one rank (benchmarks/bench_agreement.py's ranks, which
also time it: `make bench-agreement`)."""
import pytest

from benchmarks import bench_agreement
from lifecycle import signals

STEPS = 12  # the signal comes in step 6 on the last rank


@pytest.mark.multiprocess
def test_every_rank_stops_at_the_same_boundary_the_lag_after_the_signal():
    """3 ranks: waited for at every boundary, all stop after the step the signal came in (6); in the loop, all stop
    AGREEMENT_LAG boundaries later, together. Twin: each rank on its own flag (no agreement), only the signalled
    rank would stop, and the others would train on: the check the agreements pass can fail. What each way costs a
    step is not this test's claim but bench_agreement's measurement (make bench-agreement, docs/benchmarks.md): the
    row's ms_per_step is not asserted."""
    row = bench_agreement.measure(3, 0.005, STEPS, asked=("blocking", "in loop", "alone"))
    assert row["blocking"]["stopped_at"] == [STEPS // 2] and row["blocking"]["same_stop_on_every_rank"]
    assert row["in loop"]["stopped_at"] == [STEPS // 2 + signals.AGREEMENT_LAG]
    assert row["in loop"]["same_stop_on_every_rank"]
    assert not row["alone"]["same_stop_on_every_rank"] and row["alone"]["stopped_at"] == [STEPS // 2, None]


def test_a_single_process_stops_after_the_step_the_signal_came_in(monkeypatch):
    """No other rank to wait for: no lag (the loop's own test, tests/training/test_loop.py, stops on the next
    question); a signal only recorded in the last steps changes nothing after settle()."""
    signals.install()
    try:
        assert signals.agreed_in_loop() is None
        monkeypatch.setitem(signals._state, "received", 10)  # SIGUSR1, as the handler records it
        assert signals.agreed_in_loop() == "SIGUSR1" and signals.received() == "SIGUSR1"
        signals.settle()
        assert signals.stopped_by() == "SIGUSR1"
    finally:
        signals.uninstall()


def test_the_benchmark_writes_both_ways_for_each_number_of_ranks(tmp_path, monkeypatch):
    """The JSON's shape (the measuring itself is the test above): one row per number of ranks."""
    calls = []

    def fake(world, step_s, steps, asked=("blocking", "in loop")):
        calls.append((world, step_s, steps))
        numbers = {"mean": 1.0, "median": 1.0, "p99": 2.0, "max": 3.0}
        return {"ranks": world, **{way: {"ms_per_step": numbers, "stopped_at": [steps // 2],
                                         "same_stop_on_every_rank": True} for way in asked}}

    monkeypatch.setattr(bench_agreement, "measure", fake)
    out = tmp_path / "agreement.json"
    assert bench_agreement.main(["--ranks", "2", "8", "--steps", "10", "--step_ms", "5", "--out", str(out)]) == 0
    import json
    found = json.loads(out.read_text())
    assert [row["ranks"] for row in found["rows"]] == [2, 8] and calls == [(2, 0.005, 10), (8, 0.005, 10)]
    assert found["agreement_lag"] == signals.AGREEMENT_LAG and found["signal_at_step"] == 5


def test_the_committed_measurement_is_the_one_docs_show():
    """docs/benchmarks.md's table is bench_results/stop_agreement.json's rows (make bench-agreement), and there
    every rank stopped at the same step both ways, the in-loop way AGREEMENT_LAG steps later."""
    import json
    import os

    from tests.conftest import REPO_ROOT
    with open(os.path.join(REPO_ROOT, "bench_results", "stop_agreement.json")) as f:
        found = json.load(f)
    with open(os.path.join(REPO_ROOT, "docs", "benchmarks.md")) as f:
        doc = f.read()
    assert [row["ranks"] for row in found["rows"]] == [2, 8, 16]
    for row in found["rows"]:
        blocking, in_loop = row["blocking"], row["in loop"]
        assert blocking["same_stop_on_every_rank"] and in_loop["same_stop_on_every_rank"]
        assert in_loop["stopped_at"][0] == blocking["stopped_at"][0] + found["agreement_lag"]
        line = (f"| {row['ranks']} | {blocking['ms_per_step']['mean']:.2f} | {blocking['ms_per_step']['p99']:.1f} | "
                f"{in_loop['ms_per_step']['mean']:.2f} | {in_loop['ms_per_step']['p99']:.1f} | "
                f"{blocking['stopped_at'][0]} / {in_loop['stopped_at'][0]} |")
        assert line in doc, line

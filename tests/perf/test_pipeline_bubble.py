"""The pipeline's idle share and held activations (benchmarks/bench_pipeline.py: the real schedules of
distributed/pipeline.py on gloo ranks whose stages sleep for their work) against the bubble formula
(P - 1) / (M + P - 1), for P = 2 and 4 and M = P..4P, both schedules.

The committed measurement (`make bench-pipeline`: bench_results/pipeline_bubble.json): every stage's idle share
within 0.05 of the formula (which counts compute alone; each exchange's own time, a millisecond or two on gloo, adds
to the measured share); GPipe holds all M microbatches' activations on every stage, 1F1B P - s on stage s (at
most P, on stage 0). Twins: the same rows against Megatron's (P - 1) / M (the bubble over the ideal time, not a
share of the step) miss; a live run at P = 2 and M = 2, 4 (long) passes, and with 1F1B given one warm-up step too many
(pipeline.WARMUP_OFFSET = 1) stage 0 holds P + 1. A failure points to distributed/pipeline.py's schedules.
"""
import json
import os

import pytest

from benchmarks import bench_pipeline
from tests.conftest import REPO_ROOT

COMMITTED = os.path.join(REPO_ROOT, "bench_results", "pipeline_bubble.json")
TOLERANCE = 0.05


def misses(rows, formula=bench_pipeline.bubble):
    """'P=.. M=.. schedule stage s: ...' for each row whose idle share or activations in flight is not the
    schedule's."""
    found = []
    for row in rows:
        P, M, s = row["stages"], row["microbatches"], row["stage"]
        where = f"P={P} M={M} {row['schedule']} stage {s}"
        if abs(row["idle_share"] - formula(P, M)) > TOLERANCE:
            found.append(f"{where}: idle {row['idle_share']:.3f}, formula {formula(P, M):.3f}")
        held = M if row["schedule"] == "gpipe" else min(P - s, M)
        if row["in_flight"] != held:
            found.append(f"{where}: {row['in_flight']} microbatches in flight, the schedule holds {held}")
    return found


def test_the_committed_measurement_is_the_formula():
    report = json.load(open(COMMITTED))
    rows = report["rows"]
    assert {(r["stages"], r["microbatches"]) for r in rows} == {(P, M) for P in (2, 4) for M in (P, 2 * P, 3 * P,
                                                                                                   4 * P)}
    assert {r["schedule"] for r in rows} == {"gpipe", "1f1b"} and report["machine"] and report["date"]
    assert misses(rows) == []
    assert misses(rows, formula=lambda P, M: (P - 1) / M)  # the twin: another formula is told apart


@pytest.mark.multiprocess
@pytest.mark.long
def test_a_live_run_and_its_twin_with_one_warmup_step_too_many():
    rows = bench_pipeline.measure([2], forward_ms=25, steps=2, multiples=(1, 2))
    assert misses(rows) == []
    twin = bench_pipeline.measure([2], forward_ms=25, steps=1, warmup_offset=1, multiples=(1, 2))
    assert any("stage 0: 3 microbatches in flight" in line for line in misses(twin)), misses(twin)


def table_rows(rows):
    """docs/pipeline.md's table of the measurement: one row per (P, M), each stage's idle share and held microbatches
    for both schedules."""
    lines = []
    for P, M in sorted({(r["stages"], r["microbatches"]) for r in rows}):
        cells = {}
        for schedule in ("gpipe", "1f1b"):
            ordered = sorted((r for r in rows if (r["stages"], r["microbatches"], r["schedule"]) == (P, M, schedule)),
                             key=lambda r: r["stage"])
            cells[schedule] = (" / ".join(f"{r['idle_share']:.2f}" for r in ordered),
                               ", ".join(str(r["in_flight"]) for r in ordered))
        lines.append(f"| {P} | {M} | {bench_pipeline.bubble(P, M):.2f} | {cells['gpipe'][0]} | {cells['1f1b'][0]} | "
                     f"{cells['gpipe'][1]} | {cells['1f1b'][1]} |")
    return lines


def test_docs_quote_the_committed_measurement():
    """docs/pipeline.md's table is the JSON's, row for row; the twin: a changed idle share is caught."""
    rows = json.load(open(COMMITTED))["rows"]
    docs = open(os.path.join(REPO_ROOT, "docs", "pipeline.md")).read()
    assert [line for line in table_rows(rows) if line not in docs] == []
    changed = [dict(row, idle_share=row["idle_share"] + 0.1) if row["stage"] == 0 else row for row in rows]
    assert len([line for line in table_rows(changed) if line not in docs]) == 8

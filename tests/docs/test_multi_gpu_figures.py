"""README's multi-GPU steps show what this repository printed on CPU ranks until GPUs have run them: every such figure
is the committed session's (`make example-logs-multi`: example_logs/multi_gpu_cpu/multi_gpu.json), number for
number, and the session is whole (its six parts ok, its logs and traces committed, the figures drawn). A throughput
README shows from CPU ranks is the median of at least 3 trials with their range, and the words that compare two of
them ("slower", "outside the ranges", "ranges apart") are the ones the session's figures support.

A failure means README and the committed session disagree: run `make example-logs-multi` again and copy its numbers,
or mend the sentence that quotes them.
"""
import copy
import json
from pathlib import Path

from benchmarks import gpu_multi

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "example_logs" / "multi_gpu_cpu"


def report():
    return json.loads((SESSION / "multi_gpu.json").read_text())


def spread(row, key="samples_per_s"):
    """A throughput as README shows it: the median of the trials, then their range."""
    low, high = row[f"{key}_range"]
    return f"{row[key]:.1f} ({low:.1f}-{high:.1f})"


def apart(a, b):
    """Whether two rows' ranges of trials do not overlap: only then does README call their gap more than noise."""
    (a_low, a_high), (b_low, b_high) = a["samples_per_s_range"], b["samples_per_s_range"]
    return a_high < b_low or b_high < a_low


def said(session):
    """{what: the words README must hold} for each figure of the session README quotes."""
    parts = session["parts"]
    weak = {row["ranks"]: row for row in parts["data_parallel"]["weak"]}
    one, kept, scaled = parts["data_parallel"]["learning_rate"]["runs"]
    b25, b5 = parts["dp_profile"]["buckets"]["25"], parts["dp_profile"]["buckets"]["5"]
    layouts = {(row["tp"], row["cp"]): row for row in parts["model_parallel"]["layouts"]}
    checks = parts["exactness"]["checks"]
    exact = ["ddp", "tp2", "cp2", "tp2_cp2", "tp2_sequence_parallel", "cp2_activation_checkpointing", "fsdp_dp"]
    found = {"machine and date": f"2 cores, {session['date']}"}
    dp_local = int(parts["data_parallel"]["flags"].split("--local_batch_size ")[1].split()[0])
    for ranks, row in weak.items():
        assert row["trials"] >= 3, row  # a throughput README shows is a median of at least 3 trials
        found[f"{ranks} ranks: samples/s and memory"] = (
            f"| {ranks} rank{'s' if ranks > 1 else ''} (global batch {dp_local * ranks}) | {spread(row)} | "
            f"{spread(row, 'step_alone_samples_per_s')} | {row['peak_memory_gb']:.2f} GB |")
    found["weak-scaling efficiency"] = (f"{100 * weak[2]['weak_scaling_efficiency']:.0f}% at 2 ranks and "
                                        f"{100 * weak[4]['weak_scaling_efficiency']:.0f}% at 4")
    found["learning-rate runs"] = (f"reached {one['val_loss'][-1]:.3f}, 4 ranks (global {kept['global_batch_size']}) "
                                   f"{kept['val_loss'][-1]:.3f} with the rate kept and {scaled['val_loss'][-1]:.3f}")
    found["DDP profile"] = (f"{b25['ms_per_step']['communication']:.2f} ms of a {b25['step_ms']:.1f} ms step at 25 MB "
                            f"buckets, {b5['ms_per_step']['communication']:.2f} of {b5['step_ms']:.1f} at 5 MB")
    found["gain at 2 ranks"] = (f"2 ranks ran {weak[2]['samples_per_s'] / weak[1]['samples_per_s']:.2f}x as fast as 1 "
                                f"({weak[2]['samples_per_s']:.1f} against {weak[1]['samples_per_s']:.1f} samples/s)")
    slower = weak[4]["samples_per_s"] < weak[2]["samples_per_s"]
    found["4 ranks against 2"] = (f"4 ranks {'slower' if slower else 'faster'} than 2 ({weak[4]['samples_per_s']:.1f}, "
                                  f"{'outside' if apart(weak[4], weak[2]) else 'within'} the ranges)")
    alike = [str(ranks) for ranks, row in weak.items()
             if not apart(row, {"samples_per_s_range": row["step_alone_samples_per_s_range"]})]
    found["FULL against SYNTHETIC"] = f"FULL and SYNTHETIC differ within noise at {' and '.join(alike)} ranks."
    gap, gemm = abs(b25["step_ms"] - b5["step_ms"]), abs(b25["ms_per_step"]["gemm"] - b5["ms_per_step"]["gemm"])
    assert gap < gemm, "README calls the steps' gap noise: less than the GEMMs' own, which the buckets do not change"
    found["DDP profile's GEMMs"] = (f"The steps' {gap:.0f} ms gap is noise (3 each, ranks sharing 2 cores), not "
                                    f"buckets: their GEMMs alone took {b25['ms_per_step']['gemm']:.0f} and "
                                    f"{b5['ms_per_step']['gemm']:.0f} ms")
    local = int(parts["model_parallel"]["flags"].split("--local_batch_size ")[1].split()[0])
    for key, label in (((1, 1), "tp=1 (dp=4)"), ((1, 4), "cp=4 (`--parallel_order cp-tp-dp`)"),
                       ((2, 2), "tp=2 x cp=2")):
        row = layouts[key]  # the rows say the global batch each ran: samples/s compare only at the same one
        assert row["trials"] >= 3, row
        line = next(line for line in row["memory_lines"] if line.startswith("Predicted"))
        predicted = line.split(": ", 1)[1].split(" GB after")[0]
        found[f"model parallel {label}"] = f"| {label} | {local * row['dp']} | {spread(row)} | {predicted} GB |"
    tp1, cp4, tp2cp2 = layouts[(1, 1)], layouts[(1, 4)], layouts[(2, 2)]
    found["model parallel, unequal batch"] = (
        f"tp=1's {tp1['samples_per_s']:.1f} is no verdict on tp against cp, since its {tp1['dp']} replicas take a "
        f"global batch of {local * tp1['dp']} against the others' {local * cp4['dp']}")
    found["model parallel, equal batch"] = (
        f"at the equal batch of {local * cp4['dp']}, tp=2 x cp=2 ran {tp2cp2['samples_per_s']:.1f} and cp=4 "
        f"{cp4['samples_per_s']:.1f}, ranges {'apart' if apart(tp2cp2, cp4) else 'overlapping: within noise'}")
    found["model parallel tp=4"] = f"tp=4 stops before the ranks meet: `{layouts[(4, 1)]['refused']}`"
    found["exactness"] = (f"at most {max(checks[name]['max_weight_difference'] for name in exact):.1e} from the serial "
                          f"run's")
    found["twins"] = (f"{min(checks[t]['max_weight_difference'] for t in ('ddp_twin_noddp', 'cp2_twin_noddp')):.1e} or "
                      f"more for DDP and cp=2 without their gradient sums")
    return found


def missing(readme, session):
    flat = " ".join(readme.split())
    return [f"{what}: README does not say {text!r}" for what, text in said(session).items()
            if " ".join(text.split()) not in flat]


def test_readme_multi_gpu_figures_are_the_committed_sessions():
    assert missing((ROOT / "README.md").read_text(), report()) == []


def test_twin_a_changed_figure_is_missing():
    changed = copy.deepcopy(report())
    changed["parts"]["data_parallel"]["weak"][2]["samples_per_s"] += 1.0
    changed["parts"]["data_parallel"]["weak"][1]["samples_per_s_range"][0] -= 5.0  # 2 ranks' range now meets 4's
    changed["parts"]["exactness"]["checks"]["tp2"]["max_weight_difference"] = 3e-6
    found = missing((ROOT / "README.md").read_text(), changed)
    assert [line.split(":")[0] for line in found] == ["2 ranks", "4 ranks", "4 ranks against 2", "exactness"], found


def test_the_committed_session_is_whole_and_labelled():
    """Six parts, each ok, on CPU ranks over gloo (README says so), with the logs, rank 0's traces and the figures."""
    session = report()
    assert list(session["parts"]) == list(gpu_multi.PARTS) and all(p["ok"] for p in session["parts"].values())
    assert (session["backend"], session["gpus"], session["ranks"], session["mode"]) == ("gloo", 0, 4, "cpu")
    assert session["date"] and session["torch"] and "CPU cores" in session["machine"]
    for cap in ("25", "5"):
        bucket = session["parts"]["dp_profile"]["buckets"][cap]
        assert (SESSION / bucket["trace"]).exists() and (ROOT / bucket["figure"]).exists(), bucket
    logs = {path.stem for path in (SESSION / "logs").iterdir()}
    assert {"exact_ddp", "dp_weak4", "mp_tp2cp2", "collectives", "failure_error_rank1"} <= logs, logs
    assert "4 CPU ranks" in (ROOT / "README.md").read_text()


def said_in_benchmarks(session):
    """docs/benchmarks.md's table of the same session: its throughput (medians and ranges), losses and the failure's
    seconds."""
    weak = {row["ranks"]: row for row in session["parts"]["data_parallel"]["weak"]}
    runs = session["parts"]["data_parallel"]["learning_rate"]["runs"]
    rates = ", ".join(spread(weak[k]) for k in (1, 2, 4))
    return {"throughput": f"{rates} samples/s on 1, 2, 4 ranks",
            "losses": f"{runs[0]['val_loss'][-1]:.3f} on 1 rank, {runs[1]['val_loss'][-1]:.3f} on 4",
            "failure": f"the job ended {session['parts']['failure']['error']['seconds_to_last_exit']:.1f} s after"}


def test_docs_benchmarks_table_is_the_committed_session():
    flat = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    assert [what for what, text in said_in_benchmarks(report()).items() if text not in flat] == []
    changed = copy.deepcopy(report())
    changed["parts"]["failure"]["error"]["seconds_to_last_exit"] += 1.0  # the twin: a changed figure is missed
    assert [what for what, text in said_in_benchmarks(changed).items() if text not in flat] == ["failure"]

"""README's stage "A weather foundation model at 0.25 degrees": each figure it quotes against the file it comes from.

- the cp methods' runs (`make bench-wfm-methods`: bench_results/wfm_methods.json): each method's validation loss and
  its weights' largest difference from the serial run's, as printed;
- the band read (`make bench-band-read`: bench_results/band_read.json): the bytes per sample at cp = 1, 2, 4 and the
  range of its GB/s against a plain read;
- the memory table (`make bench-cp-memory`: bench_results/cp_memory.json): each row's measured and predicted GB, a
  measured row only where the JSON has a measurement;
- the planner's thresholds (where cp starts to pay, on A100s and H100s): docs/perf_model.md's (whose table
  tests/perf/test_perf_model_cp_methods.py holds to the planner's output);
- the pipeline step: each run of `make bench-wfm-pipeline` (bench_results/wfm_pipeline.json) as printed, and the
  idle shares and held microbatches of `make bench-pipeline` (bench_results/pipeline_bubble.json) it quotes.
Each check returns the figures that disagree; the twins change one figure in the text and must be caught.
"""
import json
import os
import re

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TITLE = "## A weather foundation model at 0.25 degrees"


def read(path):
    with open(os.path.join(REPO_ROOT, path)) as f:
        return f.read()


def stage(readme=None):
    text = readme if readme is not None else read("README.md")
    start = text.index(TITLE)
    end = text.find("\n## ", start + len(TITLE))
    return text[start:end if end >= 0 else len(text)]


def printed_run_errors(text, rows, label):
    """The runs' lines as the benchmarks print them (bench_wfm_methods.compared), each tagged `# <label>` in README's
    output block; one error a run whose line is not there."""
    errors = []
    for row in rows:
        line = (f"validation loss {row['val_loss']:.4f}; weights within {row['largest_weight_difference']:.1e} of the "
                f"serial run's (largest: {row['largest_in']})")
        if not re.search(rf"^ +{re.escape(line)} +# {re.escape(row[label])}$", text, re.M):
            errors.append(f"{row[label]}: {line}")
    return errors


def method_errors(text):
    report = json.loads(read("bench_results/wfm_methods.json"))
    errors = printed_run_errors(text, report["rows"], "method")
    if f"serially (validation loss {report['serial_val_loss']:.4f})" not in text:
        errors.append(f"serial: {report['serial_val_loss']:.4f}")
    return errors


def band_errors(text):
    rows = json.loads(read("bench_results/band_read.json"))["rows"]
    errors = []
    per_cp = {row["cp"]: row["bytes_per_sample"] / 1e6 for row in rows}  # every rank of a cp reads as much
    said = re.search(r"([\d.]+) MB read per sample\s+\(input\s+and\s+target\)\s+at\s+cp=1,\s+([\d.]+)\s+at\s+cp=2,\s+"
                     r"([\d.]+)\s+at\s+cp=4,\s+at\s+([\d.]+)\s+to\s+([\d.]+)\s+times", text)
    if not said:
        return ["the band read's sentence is not found"]
    for cp, figure in zip((1, 2, 4), said.groups()[:3]):
        if figure != f"{per_cp[cp]:.1f}":
            errors.append(f"cp={cp}: {figure} MB, the JSON {per_cp[cp]:.1f}")
    ratios = [row["ratio_to_raw"] for row in rows]
    if said.groups()[3:] != (f"{min(ratios):.2f}", f"{max(ratios):.2f}"):
        errors.append(f"ratios {said.groups()[3:]}, the JSON {min(ratios):.2f} to {max(ratios):.2f}")
    return errors


def memory_errors(text):
    report = json.loads(read("bench_results/cp_memory.json"))
    rows = {(row["tp"], row["cp"], row["method"]): row for row in report["rows"]}
    errors, found = [], 0
    for line in re.findall(r"^\| (\d+ x \d+ \|.*)\|$", text, re.M):
        layout, *cells = (cell.strip() for cell in line.split("|"))
        tp, cp = (int(n) for n in layout.split(" x "))
        for method, cell in zip(("allgather", "ring", "alltoall"), cells):
            found += 1
            row = rows[(tp, cp, method)]
            if row.get("refused"):
                if not cell.startswith("refused"):
                    errors.append(f"tp={tp} cp={cp} {method}: {cell}, refused in the JSON")
                continue
            got = row.get("measured", {}).get("total_gb")
            expected = f"{got:.2f}" if got is not None else "-"
            if cell != f"{expected} / {row['predicted']['total_gb']:.2f}":
                errors.append(f"tp={tp} cp={cp} {method}: {cell}, the JSON {expected} / "
                              f"{row['predicted']['total_gb']:.2f}")
    if found < 6:
        errors.append(f"only {found} cells of the memory table found")
    return errors


def plan_errors(text):
    said = re.search(r"predicts cp paying from ([\d,]+) tokens on 64\s+of Perlmutter's A100s, from ([\d,]+) on H100s",
                     text)
    if not said:
        return ["the planner's sentence is not found"]
    docs = " ".join(read("docs/perf_model.md").split())
    found = re.search(r"On 64 A100s every method starts to pay at ([\d,]+) tokens \(patch \d+\), on 64 H100s at "
                      r"([\d,]+)", docs)
    if not found:
        return ["docs/perf_model.md's sentence on where cp starts to pay is not found"]
    return [f"{gpu}: {figure} tokens, docs/perf_model.md {theirs}" for gpu, figure, theirs in
            zip(("A100", "H100"), said.groups(), found.groups()) if figure != theirs]


def pipeline_errors(text):
    errors = printed_run_errors(text, json.loads(read("bench_results/wfm_pipeline.json"))["rows"], "layout")
    rows = json.loads(read("bench_results/pipeline_bubble.json"))["rows"]

    def idle(microbatches, schedule):
        return next(r["idle_share"] for r in rows if (r["stages"], r["microbatches"], r["schedule"], r["stage"]) ==
                    (4, microbatches, schedule, 0))
    held = ", ".join(str(r["in_flight"]) for r in sorted((r for r in rows if (r["stages"], r["microbatches"],
                                                                               r["schedule"]) == (4, 16, "1f1b")),
                                                          key=lambda r: r["stage"]))
    sentence = (f"stage 0 idled {idle(4, '1f1b'):.2f} of the step at M = 4 (formula {3 / 7:.2f}), "
                f"{idle(16, '1f1b'):.2f} at M = 16 ({3 / 19:.2f}), GPipe alike; GPipe held all M microbatches on each "
                f"stage, 1F1B {held}")
    if sentence not in " ".join(text.split()):
        errors.append(f"the bubble: {sentence}")
    if any(abs(idle(m, "gpipe") - idle(m, "1f1b")) > 0.02 for m in (4, 16)):  # "GPipe alike": within 0.02
        errors.append("GPipe's idle share is not 1F1B's")
    return errors


CHECKS = (method_errors, band_errors, memory_errors, plan_errors, pipeline_errors)


def test_every_figure_of_the_stage_is_its_files():
    text = stage()
    errors = [error for check in CHECKS for error in check(text)]
    assert not errors, errors


def test_the_stage_stays_near_a_hundred_lines_and_readme_at_900():
    assert len(stage().splitlines()) <= 100
    assert len(read("README.md").splitlines()) <= 900


def test_twins_a_changed_figure_is_caught():
    text = stage()
    changes = {
        method_errors: ("weights within 1.5e-07", "weights within 1.5e-08"),
        band_errors: ("42.4 at cp=4", "83.0 at cp=4"),
        memory_errors: ("| 17.63 / 17.63 |", "| 17.63 / 18.63 |"),
        plan_errors: ("from 28,800 on H100s", "from 28,000 on H100s"),
        pipeline_errors: ("1F1B 4, 3, 2, 1", "1F1B 4, 4, 4, 4"),
    }
    for check, (old, new) in changes.items():
        assert old in text, (check.__name__, old)
        assert check(text.replace(old, new, 1)), check.__name__

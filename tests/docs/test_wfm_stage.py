"""README's stage "A weather foundation model at 0.25 degrees": each figure it quotes against the file it comes from.

- the cp methods' runs (`make bench-wfm-methods`: bench_results/wfm_methods.json): each method's validation loss and
  its weights' largest difference from the serial run's, as printed;
- the band read (`make bench-band-read`: bench_results/band_read.json): the bytes per sample at cp = 1, 2, 4 and the
  range of its GB/s against a plain read;
- the memory table (`make bench-cp-memory`: bench_results/cp_memory.json): each row's measured and predicted GB, a
  measured row only where the JSON has a measurement;
- the planner's table: the same rows as docs/perf_model.md's (which tests/perf/test_perf_model_cp_methods.py holds to
  the planner's output).
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


def method_errors(text):
    report = json.loads(read("bench_results/wfm_methods.json"))
    errors = []
    for row in report["rows"]:
        line = (f"validation loss {row['val_loss']:.4f}; weights within {row['largest_weight_difference']:.1e} of the "
                f"serial run's (largest: {row['largest_in']})")
        if not re.search(rf"^ +{re.escape(line)} +# {row['method']}$", text, re.M):
            errors.append(f"{row['method']}: {line}")
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
    docs = read("docs/perf_model.md")
    rows = [line for line in text.splitlines() if re.match(r"\| [\d,]+ \(\d+\) \|", line)]
    errors = [] if rows else ["the planner's table is not found"]
    for line in rows:
        tokens = line.split("|")[1].split("(")[0].strip()
        cells = [cell.strip() for cell in line.split("|")[2:-1]]
        docs_row = next((row for row in docs.splitlines() if row.startswith(f"| {tokens} |")), None)
        if docs_row is None or [cell.strip() for cell in docs_row.split("|")[2:-1]] != cells:
            errors.append(f"{tokens} tokens: {cells}, docs/perf_model.md: {docs_row}")
    return errors


CHECKS = (method_errors, band_errors, memory_errors, plan_errors)


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
        memory_errors: ("| 13.97 / 13.97 |", "| 13.97 / 14.97 |"),
        plan_errors: ("| 2.44 |", "| 3.44 |"),
    }
    for check, (old, new) in changes.items():
        assert old in text, (check.__name__, old)
        assert check(text.replace(old, new, 1)), check.__name__

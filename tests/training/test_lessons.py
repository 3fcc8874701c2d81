"""The lessons are the diffs, and the four training scripts are one loop.

`diff train.py train_graph.py` is the CUDA Graphs lesson and `diff train.py train_mp.py` the model-parallel one;
train_mp_graphs.py is both. Here the graph hunks and the model-parallel hunks are applied together to train.py (a
three-way merge with train.py as the base) and the result must be train_mp_graphs.py, line for line (module
docstrings aside: each script describes itself). The two lessons must not touch the same or neighbouring lines.

A failure means a fix or a change reached some copies of the loop but not all of them (change the others the same
way), or a lesson line differs between the two graph scripts or the two model-parallel ones; the message names the
lines.
"""
import ast
import difflib
import os

from tests.conftest import REPO_ROOT

SCRIPTS = ("train.py", "train_graph.py", "train_mp.py", "train_mp_graphs.py")


def code_lines(text):
    """The script's lines with its module docstring replaced by one placeholder line."""
    lines = text.splitlines()
    body = ast.parse(text).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        first, last = body[0].lineno - 1, body[0].end_lineno
        lines = lines[:first] + ['"""(module docstring)"""'] + lines[last:]
    return lines


def hunks(base, other):
    """Each change from `base` to `other`: (first base line, end base line, replacement lines)."""
    matcher = difflib.SequenceMatcher(None, base, other, autojunk=False)
    return [(i1, i2, other[j1:j2]) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]


def apply_both(base, first, second):
    """`base` with the hunks of both diffs applied; raises ValueError naming the lines where two hunks of different
    diffs overlap or touch (no unchanged line between them)."""
    changes = sorted([(*hunk, "first") for hunk in hunks(base, first)] +
                     [(*hunk, "second") for hunk in hunks(base, second)], key=lambda change: (change[0], change[1]))
    for before, after in zip(changes, changes[1:]):
        if before[3] != after[3] and after[0] <= before[1]:
            raise ValueError(f"the lessons touch the same lines: base lines {before[0] + 1}-{before[1]} and "
                             f"{after[0] + 1}-{after[1]} ({base[min(after[0], len(base) - 1)].strip()!r})")
    merged = list(base)
    for start, end, replacement, _ in reversed(changes):
        merged[start:end] = replacement
    return merged


def composition_errors(texts):
    """Lines where train.py + the graph lesson + the model-parallel lesson differ from train_mp_graphs.py."""
    base, graph, mp, mp_graphs = (code_lines(texts[name]) for name in SCRIPTS)
    merged = apply_both(base, graph, mp)
    return [line for line in difflib.unified_diff(merged, mp_graphs, "train.py + both lessons",
                                                  "train_mp_graphs.py", lineterm="", n=1)]


def read_scripts():
    texts = {}
    for name in SCRIPTS:
        with open(os.path.join(REPO_ROOT, name)) as f:
            texts[name] = f.read()
    return texts


def test_train_mp_graphs_is_train_py_with_both_lessons():
    errors = composition_errors(read_scripts())
    assert not errors, "\n".join(errors)


def test_each_lesson_is_small():
    """Each diff stays a lesson a reader takes in (the developers' guide: under ~80 changed lines)."""
    texts = read_scripts()
    base = code_lines(texts["train.py"])
    for name in ("train_graph.py", "train_mp.py"):
        changed = sum(max(end - start, len(new)) for start, end, new in hunks(base, code_lines(texts[name])))
        assert changed <= 80, f"diff train.py {name}: {changed} changed lines"


def test_each_lesson_keeps_its_size():
    """The lines `diff train.py X` prints, docstrings included, stay at the size the lessons had when the house was
    last rebuilt (74 and 35), plus the band read of #59 (a cp rank's loaders read its rows, its targets are gathered:
    4 lines): a feature reaches train_mp.py in one place, not spread over the loop."""
    texts = read_scripts()
    for name, limit in (("train_mp.py", 78), ("train_graph.py", 35)):
        lines = difflib.unified_diff(texts["train.py"].splitlines(), texts[name].splitlines(), lineterm="")
        changed = sum(1 for line in lines if line[:1] in "+-" and not line.startswith(("+++", "---")))
        assert changed <= limit, f"diff train.py {name}: {changed} lines, more than {limit}"


def test_a_fix_made_in_one_copy_only_fails():
    """Twin: a change to train_mp_graphs.py's loop that the other three scripts lack is reported."""
    texts = read_scripts()
    line = "            scheduler.step()"
    assert line in texts["train_mp_graphs.py"]
    texts["train_mp_graphs.py"] = texts["train_mp_graphs.py"].replace(line, line + "  # a fix in one copy", 1)
    errors = composition_errors(texts)
    assert any("a fix in one copy" in error for error in errors), errors


def test_a_fix_missing_from_one_copy_fails():
    """Twin: a change made in train.py, train_graph.py and train_mp.py but not in train_mp_graphs.py."""
    texts = read_scripts()
    line = "    logging.info(\"Starting Training Loop...\")"
    for name in ("train.py", "train_graph.py", "train_mp.py"):
        assert line in texts[name]
        texts[name] = texts[name].replace(line, line.replace("Loop...", "Loop (fixed)..."), 1)
    assert composition_errors(texts)


def test_lessons_that_touch_the_same_lines_are_refused():
    """Twin: a graph-lesson change on a line the model-parallel lesson also changes cannot be composed."""
    texts = read_scripts()
    line = "    run = start_run(args, params, grid, layout=f\"{comm.get_world_size()}GPU\")"
    assert line in texts["train_graph.py"]
    texts["train_graph.py"] = texts["train_graph.py"].replace(line, line + "  # graph", 1)
    try:
        composition_errors(texts)
    except ValueError as err:
        assert "touch the same lines" in str(err)
    else:
        raise AssertionError("overlapping lessons were merged")

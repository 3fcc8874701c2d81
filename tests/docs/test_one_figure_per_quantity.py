"""One figure per quantity in README: for each quantity below that README once gave several figures for, one figure
stands, once, with its machine and date beside it, and any other figure of it stays only where its label says what
else it measures ("under the profiler", "the loader as it was", ...), again once. A figure listed with no label must
not appear at all (it lives in docs/, labelled there).

Each figure is matched as a number (not inside a longer one), and its label must be in the same paragraph, or for a
table row or a quoted output in it or in the paragraph that introduces it. A failure names the quantity and the
figure: say the figure once, refer to it elsewhere, or label a second figure with what it measures. The twin: a
second, unlabelled figure of a quantity is caught.
"""
import os
import re

from tests.conftest import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")
# quantity -> [(figure, the label beside it)]: the first is the quantity's own figure; label None: not in README
QUANTITIES = {
    "the ViT `short` bf16 eager step on the H100 (ms)": [
        ("109.2", "H100, 2026-11-28"),  # the step alone as the code is now
        ("113.5", "before the change below"),  # the attention kernels compared, before the cast once
        ("116.8", "under the profiler"),  # the profile table, with the loader
        ("125.8", "2026-11-26's code"),  # the CUDA Graphs table
    ],
    "ResNet `bs256-amp-nhwc-extra-opts` on the H100 (img/s)": [
        ("8,039", "2026-11-27"),
        ("9,793", None),  # an earlier session's, in docs/testing.md
    ],
    "the UNet `short` in fp32 with 2 workers on the H100 (samples/s)": [
        ("898", "2026-11-28"),
        ("221", "the loader as it was"),
        ("236.370914", "the loader as it was"),  # the training run's epoch line
        ("266.3", None),  # an earlier session's, in docs/testing.md
    ],
    "the `mp` model's predicted peak at tp=1 (GB)": [
        ("46.2", "for the original's code"),  # with the CUDA context and cache, as NVML read the published runs
        ("43.0", "for this code"),
        ("36.6", "counting the tensors alone"),  # the dry run's model, at dp=4
        ("35.98", None),  # the one-GPU run's start-up line, in docs/testing.md
        ("35.979273", None),
    ],
    "the ViT demo's validation loss after 4 epochs": [
        ("0.150", "2-core CPU"),  # the demo's 8-epoch run, at its 4th epoch
        ("0.199", "4-epoch schedule"),
    ],
}


def blocks(text):
    """README cut at blank lines; a table or a quoted output joined to the paragraph that introduces it."""
    parts, joined = re.split(r"\n\s*\n", text), []
    for part in parts:
        if part.lstrip().startswith(("|", "```")) and joined:
            joined[-1] += "\n" + part
        else:
            joined.append(part)
    return joined


def figure_pattern(figure):
    return re.compile(rf"(?<![\d.,]){re.escape(figure)}(?![\d]|[.,]\d)")


def problems(text):
    found, parts = [], blocks(text)
    for quantity, figures in QUANTITIES.items():
        for i, (figure, label) in enumerate(figures):
            where = [part for part in parts for _ in figure_pattern(figure).finditer(part)]
            if label is None:
                found += [f"{quantity}: {figure} is in README; say the quantity's own figure" for _ in where]
                continue
            if i == 0 and not where:
                found.append(f"{quantity}: its figure {figure} is not in README")
            if len(where) > 1:
                found.append(f"{quantity}: {figure} is in README {len(where)} times; say it once, refer to it after")
            flat = [" ".join(part.split()) for part in where]
            found += [f"{quantity}: {figure} without its label {label!r} beside it" for part in flat
                      if " ".join(label.split()) not in part]
    return found


def test_each_quantity_has_one_figure_in_readme():
    assert problems(open(README).read()) == []


def test_twin_a_second_unlabelled_figure_is_caught():
    text = open(README).read()
    twice = text.replace("## Checkpoints and resume", "The ResNet ran at 8,039 img/s.\n\n## Checkpoints and resume")
    earlier = text.replace("## Checkpoints and resume", "A later run gave 9,793 img/s.\n\n## Checkpoints and resume")
    unlabelled = text.replace("under the profiler (H100, 2026-11-27)", "(H100, 2026-11-27)")
    assert problems(twice) == ["ResNet `bs256-amp-nhwc-extra-opts` on the H100 (img/s): 8,039 is in README 2 times; "
                               "say it once, refer to it after",
                               "ResNet `bs256-amp-nhwc-extra-opts` on the H100 (img/s): 8,039 without its label "
                               "'2026-11-27' beside it"]
    assert [line.split(": ")[1] for line in problems(earlier)] == ["9,793 is in README; say the quantity's own figure"]
    assert [line.split(": ")[1] for line in problems(unlabelled)] == [
        "116.8 without its label 'under the profiler' beside it"]

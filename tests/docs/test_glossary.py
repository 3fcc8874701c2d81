"""Every term of the glossary below is said in README at or before its first use: README holds the term's definition
(which names the term), and no use of the term comes before that definition. README reads top to bottom; a term used
before it is said sends the attendee searching.

A failure names the term and what comes first: move the definition up to the first use, or say the term there. The
twins: a use moved above its definition, and a definition dropped, are caught.
"""
import os
import re

from tests.conftest import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")
# term (as a pattern of its uses) -> README's definition of it, which names it
GLOSSARY = {
    r"\bmp\b": "`mp`, the original's 1024-wide config for the model-parallel lessons",
    r"FSDP": "FSDP (fully sharded data parallelism: each dp rank keeps 1/dp of the weights, gradients and Adam "
             "moments)",
    r"[Ss]equence[ -]parallel": "sequence parallelism: tp's ranks split the tokens between the blocks too",
    r"checkpointing": "activation checkpointing: each block's forward recomputed in the backward pass",
    r"\bbuckets?\b": "buckets (DDP packs the gradients into buckets, 25 MB by default, and all-reduces each as soon as",
    r"Scaffolding": "`Scaffolding memory high watermark: X GB.` (the original's name for the memory held once the "
                    "model and DDP are built, before the first step)",
    r"\bLOGDIR\b": "`LOGDIR` (the logs' folder, default `$SCRATCH/dl-at-scale-training/logs`)",
    r"\bAMP\b": "Automatic mixed precision (AMP)",
    r"u10m": "`RMSE(u10m)/valid` (u10m: the 10 m east-west wind",
}


def late_terms(text):
    """'term: ...' for each term README uses before its definition, or never defines."""
    flat = " ".join(text.split())  # prose wraps anywhere
    found = []
    for term, definition in GLOSSARY.items():
        assert re.search(term, definition), f"the definition of {term} must name it"
        at = flat.find(definition)
        first = re.search(term, flat)
        if at < 0:
            found.append(f"{term}: README does not define it as {definition!r}")
        elif first and first.start() < at:
            found.append(f"{term}: used before its definition: ...{flat[max(0, first.start() - 60):first.end()]}")
    return found


def test_every_term_is_said_at_or_before_its_first_use():
    assert late_terms(open(README).read()) == []


def test_twins_a_use_above_its_definition_and_a_dropped_definition_are_caught():
    text = open(README).read()
    early = text.replace("## Quick start", "## Quick start\n\nThe big runs use FSDP.", 1)
    assert [line.split(":")[0] for line in late_terms(early)] == ["FSDP"]
    dropped = text.replace("Automatic mixed precision (AMP)", "Mixed precision")
    assert [line.split(":")[0] for line in late_terms(dropped)] == [r"\bAMP\b"]

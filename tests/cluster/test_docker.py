"""docker/Dockerfile installs what requirements.txt lists, minus the packages the NGC PyTorch image provides (its text
and the filter script are checked; no image is built: no docker on CI).

A failure points to: the Dockerfile no longer starting from the NGC image or no longer installing the filtered
requirements.txt (e.g. a hand-written package list that drifts from requirements.txt), or a build context that
holds more than the copied files; docker/image_requirements.sh dropping a package it should keep (a prefix match
taking `torchinfo` with `torch`) or keeping torch/torchvision; an excluded name that is no longer in
requirements.txt (a stale exclusion, silently meaning nothing).
"""
import os
import re
import subprocess

import pytest

from tests.conftest import REPO_ROOT

DOCKERFILE = os.path.join(REPO_ROOT, "docker", "Dockerfile")
FILTER = os.path.join(REPO_ROOT, "docker", "image_requirements.sh")
PROVIDED_BY_IMAGE = {"torch", "torchvision"}


def names(lines):
    """Normalised distribution names (PEP 503) of requirement lines, ignoring comments and blank lines."""
    found = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            found.append(re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", line).group(0)).lower())
    return found


def image_requirements(path):
    result = subprocess.run(["bash", FILTER, str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.multiprocess
def test_the_image_installs_requirements_txt_minus_what_ngc_provides():
    with open(os.path.join(REPO_ROOT, "requirements.txt")) as requirements:
        lines = requirements.read().splitlines()
    wanted = names(lines)
    assert PROVIDED_BY_IMAGE <= set(wanted), "an excluded package is no longer in requirements.txt"
    installed = image_requirements(os.path.join(REPO_ROOT, "requirements.txt"))
    assert names(installed) == [name for name in wanted if name not in PROVIDED_BY_IMAGE]
    kept = [line.split("#", 1)[0].strip() for line in lines]
    assert set(installed) <= set(kept)  # lines pass unchanged: versions pinned in requirements.txt stay pinned


@pytest.mark.multiprocess
def test_the_filter_matches_whole_names_only(tmp_path):
    path = tmp_path / "requirements.txt"
    path.write_text("torch==2.14.1\nTorchVision>=0.2  # comment\ntorchinfo\ntorch-tb-profiler\n"
                    "  h5py ; python_version>'3'\n# torch\n\nnvidia-dali-cuda120\n")
    assert image_requirements(path) == ["torchinfo", "torch-tb-profiler", "h5py ; python_version>'3'",
                                        "nvidia-dali-cuda120"]


def test_dockerfile_starts_from_ngc_pytorch_and_installs_the_filtered_requirements():
    """The Dockerfile's text, read with regular expressions: FROM the NGC PyTorch image (24.08), one COPY of
    requirements.txt and the filter, one RUN that filters and pip-installs the filtered file and nothing else, and a
    build context of exactly the copied files. No image is built here (no docker on CI): whether the build succeeds
    on the NGC image is not checked (docker/README.md's commands, by hand)."""
    with open(DOCKERFILE) as dockerfile:
        text = dockerfile.read()
    instructions = re.sub(r"\\\n\s*", " ", re.sub(r"(?m)^\s*#.*\n", "", text))  # no comments, continuations joined
    assert re.search(r"(?m)^ARG BASE_IMAGE=nvcr\.io/nvidia/pytorch:24\.08-py3$", instructions)
    assert re.search(r"(?m)^FROM \$\{BASE_IMAGE\}$", instructions)
    copy = re.search(r"(?m)^COPY (.+)$", instructions).group(1).split()
    assert copy[:-1] == ["requirements.txt", "docker/image_requirements.sh"]
    run = re.search(r"(?m)^RUN (.+)$", instructions).group(1)
    steps = [" ".join(step.split()) for step in run.split("&&")]
    destination = copy[-1]
    filtered = f"{destination}requirements.image.txt"
    assert steps[0] == (f"bash {destination}image_requirements.sh {destination}requirements.txt > {filtered}")
    assert steps[1].startswith("pip install") and steps[1].endswith(f"-r {filtered}")
    assert len(re.findall(r"pip install", instructions)) == 1  # nothing installed beside the list
    # the build context (BuildKit's <Dockerfile>.dockerignore) is exactly the files copied: no .venv/ or data/
    with open(DOCKERFILE + ".dockerignore") as ignore:
        patterns = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*" and {pattern[1:] for pattern in patterns[1:]} == set(copy[:-1])

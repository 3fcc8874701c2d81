"""The paths an attendee needs are in README, and the advice they read is one.

- README's set-up gives the cosmology data's folder on Perlmutter (SC21's `DATADIR`) and NERSC's portal folder to
  download the data elsewhere;
- beside every multi-GPU command of README whose config loads with DALI by default (the `bs*_opt` and `mp`
  configs), README says DALI has not run on a GPU here and gives the flag for PyTorch's loader (the ViT's `pytorch`,
  the UNet's `lowmem`);
- the four-GPU `submit_pm.sh` line reads the same in README, docs/cluster.md, docs/differences.md and the script's
  header: every `sbatch ... -n 4 ... submit_pm.sh` they show has `-q regular`.

Twins: a caveat dropped, and the four-GPU line without `-q regular`, are caught.
"""
import os
import re

from tests.conftest import REPO_ROOT
from utils.YParams import YParams

README = os.path.join(REPO_ROOT, "README.md")
COSMO_ON_PERLMUTTER = "/pscratch/sd/j/joshr/nbody2hydro/datacopies"  # SC21's submit script's DATADIR
PORTAL = "https://portal.nersc.gov/project/dasrepo/pharring/sc23_data"  # the 2024 and SC25 READMEs' data
CAVEAT = "DALI, unverified on GPUs here; PyTorch's loader: --data_loader_config {}"
MULTI_GPU = re.compile(r"sbatch\s+(-N|--nodes)\b|torchrun --nproc_per_node [2-9]")
FOUR_GPU_PAGES = ("README.md", "docs/cluster.md", "docs/differences.md", "submit_pm.sh")
FOUR_GPU_LINE = re.compile(r"sbatch\b[^`\n]*?\s-n\s*4\b[^`\n]*?submit_pm\.sh")


def read(path):
    with open(os.path.join(REPO_ROOT, path)) as f:
        return f.read()


def fenced_lines(text):
    fence = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fence = not fence
        elif fence:
            yield number, line


def missing_caveats(text):
    """'README.md:N: ...' for each multi-GPU command whose config defaults to DALI and that does not say so."""
    found = []
    for number, line in fenced_lines(text):
        config = re.search(r"--config[= ](\S+)", line)
        if not MULTI_GPU.search(line) or not config or "--data_loader_config" in line.split("#")[0]:
            continue
        yaml = "config/UNet.yaml" if "UNet.yaml" in line else (
            "config/ResNet50.yaml" if "ResNet50.yaml" in line else "config/ViT.yaml")
        loader = str(YParams(os.path.join(REPO_ROOT, yaml), config.group(1)).params.get("data_loader_config", ""))
        if loader.startswith("dali"):
            caveat = CAVEAT.format("lowmem" if "UNet" in yaml else "pytorch")
            if caveat not in line:
                found.append(f"README.md:{number}: {config.group(1)} loads with DALI; say {caveat!r} beside it")
    return found


def four_gpu_lines_without_regular(pages):
    return [f"{page}: {match.group(0)}" for page, text in pages.items() for match in FOUR_GPU_LINE.finditer(text)
            if "-q regular" not in match.group(0)]


def test_readme_setup_gives_the_cosmology_folder_and_the_portal():
    text = read("README.md")
    setup = text[text.index("## Setup"):text.index("## Single-GPU training")]
    assert COSMO_ON_PERLMUTTER in setup and PORTAL in setup


def test_every_multi_gpu_dali_command_says_dali_is_unverified_and_gives_the_pytorch_loader():
    text = read("README.md")
    assert missing_caveats(text) == []
    assert len([1 for _, line in fenced_lines(text) if "DALI, unverified on GPUs here" in line]) >= 10


def test_twin_a_dropped_caveat_is_caught():
    text = read("README.md")
    line = next(line for _, line in fenced_lines(text) if "--config=bs1024_opt" in line and "DALI" in line)
    found = missing_caveats(text.replace(line, line.split("  #")[0]))
    assert len(found) == 1 and "bs1024_opt loads with DALI" in found[0], found


def test_the_four_gpu_line_reads_the_same_everywhere():
    pages = {page: read(page) for page in FOUR_GPU_PAGES}
    assert four_gpu_lines_without_regular(pages) == []
    assert all("sbatch -q regular -n 4 submit_pm.sh" in text for text in pages.values())
    before = pages["docs/differences.md"].replace("sbatch -q regular -n 4", "sbatch -n 4")
    old = {**pages, "docs/differences.md": before}
    assert [line.split(":")[0] for line in four_gpu_lines_without_regular(old)] == ["docs/differences.md"] * 2

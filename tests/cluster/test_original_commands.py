"""The original tutorials' DALI command lines (tests/cluster/original_commands.txt) are accepted as written, and every
config that names a DALI loader builds it.

For each command: the Python script the submit script runs parses the flags with its own parser; with
--yaml_config (ViT or UNet file) and --data_dir added, the config resolves for the data-parallel size the sbatch
options give; the loader it selects is the DALI one (`dali` for ERA5, `dali-lowmem` for the cosmology boxes), built
for rank 0 with the config's batch size, sample size and epoch length. Nothing trains (the original sizes are GPU
sizes). The ERA5 files are HDF5 of the real shape whose chunks were never written (they read as zeros and store
nothing); the cosmology boxes are generated at 64^3, the original crop size. One batch is read through each stage's
pipeline at the original sample size, with --local_batch_size 1 --num_data_workers 0 added.

A failure points to the command file (a stale line), to lifecycle/cli.py or the scripts' flags (the command no longer
parses or resolves), to config/ViT.yaml / config/UNet.yaml (a config no longer names a DALI loader), or to the
DALI loaders' dispatch and construction (loaders/__init__.py, loaders/dali_era5.py,
loaders/dali_cosmo.py).
"""
import importlib
import math
import os
import re
import shlex

import h5py
import numpy as np
import pytest
import torch

from lifecycle.cli import apply_overrides
from loaders import get_data_loader
from sample_data.cosmo import write_cosmo
from tests.conftest import REPO_ROOT
from utils.YParams import YParams, read_configs

pytestmark = pytest.mark.usefixtures("in_repo_root")
COMMANDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "original_commands.txt")
STAGES = {"A": ("config/ViT.yaml", "dali", "DALILoader"), "B": ("config/UNet.yaml", "dali-lowmem", "CosmoDALILoader")}
SUBMIT_SCRIPTS = {"submit_pm.sh": "train.py", "submit_pm_dp.sh": "train.py", "submit_pm_mp.sh": "train_mp.py"}
ERA5_STEPS = 1460  # 6-hourly, one year
ERA5_YEARS = {"train": 2, "valid": 1}  # 2920 training samples: one global batch of bs2048_opt


def original_commands():
    commands = []
    for number, line in enumerate(open(COMMANDS), start=1):
        if line.strip() and not line.startswith("#"):
            command, comment = line.split("  # ", 1)
            section = re.match(r"FACTS ([AB]\d+|G\.5): (verbatim|reconstructed)", comment)
            assert section, f"line {number}: the comment must name the FACTS section and say verbatim/reconstructed"
            stage = "B" if section.group(1).startswith("B") else "A"  # G.5: sc25's additions to the ViT tutorial
            commands.append(pytest.param(command.strip(), stage, id=f"line{number}"))
    return commands


def split_sbatch(command):
    """(Python script, its argv, ranks) of `[VAR=value ...] sbatch [options] submit_*.sh [script args]`."""
    words = shlex.split(command)
    while re.match(r"^[A-Za-z_]\w*=", words[0]):
        words.pop(0)
    assert words[0] == "sbatch"
    at = next(i for i, word in enumerate(words) if word.endswith(".sh"))
    submit = words[at]
    assert os.path.isfile(os.path.join(REPO_ROOT, submit)), submit
    options, i = {}, 1
    while i < at:
        name, _, value = words[i].partition("=")
        if not value and not name.startswith("--") and len(name) > 2:  # -n1
            name, value = name[:2], name[2:]
        if not value:
            i, value = i + 1, words[i + 1]
        options[name] = value
        i += 1
    per_node = re.search(r"#SBATCH --ntasks-per-node (\d+)", open(os.path.join(REPO_ROOT, submit)).read())
    nodes = int(options.get("-N", options.get("--nodes", 1)))
    ranks = int(options.get("-n", options.get("--ntasks", nodes * int(per_node.group(1) if per_node else 1))))
    return SUBMIT_SCRIPTS[submit], words[at + 1:], ranks


class Parsed(Exception):
    pass


def parse_with_the_scripts_parser(script, argv, monkeypatch):
    """The script's own argparse namespace for argv (its main stops right after parsing)."""
    module = importlib.import_module(script[:-3])
    found = {}
    factory = "model_parallel_parser" if hasattr(module, "model_parallel_parser") else "training_parser"
    make_parser = getattr(module, factory)

    def capturing_parser(description, **options):
        parser = make_parser(description, **options)
        parse = parser.parse_args

        def parse_and_stop(args=None, namespace=None):
            found["args"] = parse(args, namespace)
            raise Parsed

        parser.parse_args = parse_and_stop
        return parser

    monkeypatch.setattr(module, factory, capturing_parser)
    with pytest.raises(Parsed):
        module.main(argv)
    return found["args"]


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory):
    """ERA5 at the real 360 x 720 (two training years and one validation year, nothing stored) and 64^3 cosmology
    boxes."""
    era5 = tmp_path_factory.mktemp("era5_shapes")
    for split, years in ERA5_YEARS.items():
        (era5 / split).mkdir()
        for year in range(years):
            with h5py.File(era5 / split / f"{2000 + year}.h5", "w") as f:
                f.create_dataset("fields", shape=(ERA5_STEPS, 20, 360, 720), dtype="f4", chunks=(1, 1, 360, 720))
    (era5 / "stats").mkdir()
    np.save(era5 / "stats" / "global_means.npy", np.zeros((1, 20, 1, 1), dtype=np.float32))
    np.save(era5 / "stats" / "global_stds.npy", np.ones((1, 20, 1, 1), dtype=np.float32))
    cosmo = write_cosmo(tmp_path_factory.mktemp("cosmo_64"), train_size=64, valid_size=64, verbose=False)
    return {"A": str(era5), "B": str(cosmo)}


def resolve(script, argv, ranks, section, data_dirs, monkeypatch):
    """(params, args) as rank 0 of `ranks` would have them."""
    yaml_file = STAGES[section][0]
    args = parse_with_the_scripts_parser(script, argv + ["--yaml_config", yaml_file, "--data_dir", data_dirs[section]],
                                         monkeypatch)
    params = YParams(args.yaml_config, args.config)
    model_parallel = 1
    if script == "train_mp.py":
        params.update({"tp": args.tensor_parallel, "cp": args.context_parallel, "order": args.parallel_order})
        model_parallel = args.tensor_parallel * args.context_parallel
    assert ranks % model_parallel == 0
    apply_overrides(params, args, dp_size=ranks // model_parallel, dp_rank=0)
    return params, args


def check_loaders(params, section):
    """Build both loaders; check they are the stage's DALI loader at the config's sizes."""
    _, config, loader_class = STAGES[section]
    assert params.data_loader_config == config
    dp = params.data_num_shards
    if section == "A":
        sample_shape = (params.n_in_channels, *params.img_size)
        samples = {True: ERA5_YEARS["train"] * ERA5_STEPS, False: ERA5_YEARS["valid"] * ERA5_STEPS}
        for train, key in ((True, "limit_nsamples"), (False, "limit_nsamples_val")):
            if params.get(key) is not None:
                samples[train] = min(params[key], samples[train])
    else:
        sample_shape = (params.N_in_channels, *(params.data_size,) * 3)
        samples = {True: params.Nsamples, False: params.Nsamples_val}
    loaders = {}
    for train in (True, False):
        loader = get_data_loader(params, train=train)
        assert type(loader).__name__ == loader_class and loader.batch_size == params.local_batch_size
        assert loader.sample_shape == sample_shape
        steps = samples[True] // dp // params.local_batch_size if train else \
            math.ceil(math.ceil(samples[False] / dp) / params.local_batch_size)
        assert len(loader) == steps
        loaders[train] = loader
    return loaders


@pytest.mark.parametrize("command, section", original_commands())
def test_original_command_builds_its_dali_loader(command, section, data_dirs, monkeypatch):
    script, argv, ranks = split_sbatch(command)
    params, args = resolve(script, argv, ranks, section, data_dirs, monkeypatch)
    assert params.global_batch_size == ranks // (params.get("tp", 1) * params.get("cp", 1)) * params.local_batch_size
    if "--num_data_workers" in " ".join(argv):  # a flag the line gives is what the run uses
        assert params.num_data_workers == int(re.search(r"--num_data_workers[= ](\d+)", command).group(1))
    if "--enable_amp" in argv or re.search(r"--config=(bs\d+_opt|mp)(_short)?\b", command):
        assert params.amp_mode == "fp16"  # the *_opt configs really run optimised (upstream dropped their AMP)
    check_loaders(params, section)


def test_the_command_file_covers_both_stages_and_every_original_dali_line():
    sections = [param.values[1] for param in original_commands()]
    assert sections.count("A") >= 6 and sections.count("B") >= 5
    verbatim = [line for line in open(COMMANDS) if not line.startswith("#") and ": verbatim" in line]
    assert len(verbatim) == 8  # FACTS' literal DALI lines: A13's three, A23's two, G.5's three (sc25)


def dali_configs():
    """Every config of the two YAML files whose data_loader_config is a DALI loader; every *_opt and mp* is one."""
    found = []
    for section, (yaml_file, config, _) in STAGES.items():
        for name, values in read_configs(os.path.join(REPO_ROOT, yaml_file)).items():
            if name.endswith("_opt") or name.startswith("mp"):
                assert values.get("data_loader_config") == config, f"{yaml_file}: {name}"
            if str(values.get("data_loader_config", "")).startswith("dali"):
                found.append(pytest.param(name, section, id=f"{section}-{name}"))
    return found


@pytest.mark.parametrize("name, section", dali_configs())
def test_every_config_that_names_a_dali_loader_builds_it(name, section, data_dirs, monkeypatch):
    params = YParams(STAGES[section][0], name)
    ranks = max(1, params.global_batch_size // 16)  # the configs' 16 samples per GPU
    argv = ["--config", name] + (["--tensor_parallel", "4"] if name.startswith("mp") else [])
    script = "train_mp.py" if name.startswith("mp") else "train.py"
    params, _ = resolve(script, argv, ranks * (4 if name.startswith("mp") else 1), section, data_dirs, monkeypatch)
    check_loaders(params, section)


@pytest.mark.parametrize("section", ["A", "B"])
def test_one_batch_at_the_original_sample_size(section, data_dirs, monkeypatch):
    """The first line of each stage, one sample per batch and no worker processes: a batch goes through DALI."""
    command = next(param.values[0] for param in original_commands() if param.values[1] == section)
    script, argv, ranks = split_sbatch(command)
    params, _ = resolve(script, argv + ["--local_batch_size", "1", "--num_data_workers", "0"], ranks, section,
                        data_dirs, monkeypatch)
    loader = check_loaders(params, section)[True]
    loader.set_epoch(0)
    inp, tar = next(iter(loader))
    expected = loader.first_batch()
    assert inp.shape == (1, *loader.sample_shape) and torch.equal(inp.cpu(), expected[0])
    assert torch.equal(tar.cpu(), expected[1])

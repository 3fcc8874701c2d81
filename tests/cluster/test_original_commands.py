"""Every runnable line of the original tutorials' READMEs (tests/cluster/original_commands.txt) does here what it did
there, or stops in one line naming the command that does.

Each `sbatch` line goes through the stand-in sbatch (tests/cluster/fakebin/sbatch: the script's #SBATCH lines merged
with the command line's by Slurm's rules, 4 GPUs a node, the shared QOS on one node) and the stand-in srun, with the
real submit scripts and a recording `python`: the job must have the ranks and nodes the original's script gave the
same line (the originals' #SBATCH lines, FACTS PART H1, laid out by the same rules) and every rank must start the
original's training script with the original's arguments (plus --yaml_config for the SC21 and SC20 lines). Then the
training script's own parser and the config resolve those arguments as rank 0 of that many ranks would: the model
of the original's stage, its config, and every flag given. `python`, `torch.distributed.launch`, `torchrun` and
`nsys` lines go through the parser alone. A line whose `here:` command gives the original's layout (SC21's
multi-node lines on submit_pm.sh) must be refused by the shared QOS in Slurm's one line, stop in submit_pm.sh's one
line naming that command when another QOS is asked for, and that command must run as the original did and be
listed in docs/differences.md. Nothing trains.

The DALI lines (a config or flag naming `dali` or `dali-lowmem`) also build their loader for rank 0 at the config's
batch size, sample size and epoch length, and every config naming a DALI loader builds it. The ERA5 files are HDF5
of the real shape whose chunks were never written (they read as zeros and store nothing), but for the two time steps
of the first batch read below, which hold random values; the cosmology boxes are generated at 64^3, the original crop
size. One batch is read through each stage's pipeline at the original sample size, with --local_batch_size 1
--num_data_workers 0 added, and must equal the PyTorch loader's, its input and target holding different values.

A failure points to the command file (a line lost, a label or source missing), to the submit scripts' #SBATCH lines
or submit_pm.sh's one-node check (a layout changed: SC21's `-n 4` on 4 nodes), to the stand-ins (fakebin/sbatch,
fakebin/srun), to lifecycle/cli.py or the scripts' flags (a command no longer parses or resolves), to
config/ViT.yaml / config/UNet.yaml / config/ResNet50.yaml (a config renamed, a DALI loader no longer named), to
docs/differences.md (a here: command not listed), or to the DALI loaders (loaders/dali_era5.py,
loaders/dali_cosmo.py).
"""
import functools
import importlib
import importlib.machinery
import importlib.util
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import h5py
import numpy as np
import pytest
import torch

import lifecycle.cli
from lifecycle.cli import apply_overrides, check_stage_flags
from loaders import get_data_loader
from loaders.common import batch_indices
from sample_data.cosmo import write_cosmo
from tests.conftest import REPO_ROOT
from utils.errors import UserError
from utils.YParams import YParams, read_configs

pytestmark = pytest.mark.usefixtures("in_repo_root")
HERE = os.path.dirname(os.path.abspath(__file__))
COMMANDS = os.path.join(HERE, "original_commands.txt")
FAKEBIN = os.path.join(HERE, "fakebin")
ORIGINALS = os.path.join(REPO_ROOT, "..", "shared", "originals", "commands.txt")  # beside the checkout, if at all
DIFFERENCES = os.path.join(REPO_ROOT, "docs", "differences.md")
STAGES = {"A": ("config/ViT.yaml", "dali", "DALILoader"), "B": ("config/UNet.yaml", "dali-lowmem", "CosmoDALILoader")}
SUBMIT_SCRIPTS = {"submit_pm.sh": "train.py", "submit_pm_dp.sh": "train.py", "submit_pm_mp.sh": "train_mp.py"}
EDITIONS = ("sc21", "2024", "sc25", "sc20", "imagenet")
ADDED = {"sc21": ["--yaml_config", "config/UNet.yaml"], "sc20": ["--yaml_config", "config/ResNet50.yaml"]}
MODEL = {"sc21": "unet", "2024": "vit", "sc25": "vit", "sc20": "resnet", "imagenet": "resnet"}
DALI_STAGE = {"sc21": "B", "2024": "A", "sc25": "A"}
WHOLE_NODES = ["-q", "regular", "--ntasks-per-node", "4", "--gpus-per-node", "4"]
# the #SBATCH lines that shaped the originals' jobs (FACTS H1 and A21)
ORIGINAL_SBATCH = {("sc21", "submit_pm.sh"): ["--ntasks-per-node", "4", "--gpus-per-node", "4"],  # regular QOS
                   **{(edition, "submit_pm.sh"): ["-q", "shared", "--gpus-per-task", "1"]
                      for edition in ("2024", "sc25")},
                   **{(edition, script): WHOLE_NODES for edition in ("2024", "sc25")
                      for script in ("submit_pm_dp.sh", "submit_pm_mp.sh")}}
QOS_REFUSAL = ("sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, "
               "user's size and/or time limits)")
ENTRY = re.compile(r"^(\S+) (README\.md:\d+|FACTS [A-H][\d.]+) \| (verbatim|reconstructed: .+?|skip: .+?) \| (.+)$")
# a task's CPUs on a Perlmutter node (--cpus-per-task 32) and plenty of memory: the worker-count check of the node the
# line runs on, not of this machine
TASK_MACHINE = (32, 2**38, 1)
ERA5_STEPS = 1460  # 6-hourly, one year
ERA5_YEARS = {"train": 2, "valid": 1}  # 2920 training samples: one global batch of bs2048_opt


def stand_in(name):
    """A fakebin stand-in (no .py suffix) as a module: the sbatch stand-in's parse() and layout() model Slurm."""
    loader = importlib.machinery.SourceFileLoader(f"fake_{name}", os.path.join(FAKEBIN, name))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


SBATCH = stand_in("sbatch")


@dataclass
class Entry:
    edition: str
    source: str
    label: str
    command: str
    number: int  # line of original_commands.txt
    here: str = None
    stops: str = None

    @property
    def id(self):
        return f"{self.edition}-{self.source.replace('README.md:', 'L').replace(' ', '')}-line{self.number}"


@functools.cache
def entries():
    found = []
    for number, line in enumerate(open(COMMANDS), start=1):
        line = line.rstrip("\n")
        if not line.strip() or line.startswith("#"):
            continue
        match = ENTRY.match(line)
        assert match, f"original_commands.txt:{number}: not '<edition> <source> | <label> | <command> [| here: ...]'"
        edition, source, label, rest = match.groups()
        assert edition in EDITIONS, f"original_commands.txt:{number}: edition {edition}"
        command, *extras = rest.split(" | ")
        entry = Entry(edition, source, label, command, number)
        for extra in extras:
            key, _, value = extra.partition(": ")
            assert key in ("here", "stops") and value, f"original_commands.txt:{number}: {extra}"
            setattr(entry, key, value)
        found.append(entry)
    return tuple(found)


def runnable(select=lambda entry: True):
    """The entries that are launches (not skipped) and that `select` takes, as pytest params."""
    return [pytest.param(entry, id=entry.id) for entry in entries()
            if not entry.label.startswith("skip") and select(entry)]


@dataclass
class Launch:
    """What a command line starts: `kind` sbatch (submit script, its sbatch options) or a launcher (python, torchrun,
    torch.distributed.launch: nodes and ranks from its options), the Python script and its arguments."""
    kind: str
    env: dict
    script: str
    args: list
    options: list = field(default_factory=list)
    nodes: int = 1
    ranks: int = 1


def launch_of(command):
    words = shlex.split(command)
    env = {}
    while re.match(r"^[A-Za-z_]\w*=", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[0] == "nsys":  # nsys profile [options] python ...: what it wraps
        words = words[words.index("python"):]
    if words[0] == "sbatch":
        at = next(i for i, word in enumerate(words) if word.endswith(".sh"))
        return Launch("sbatch", env, os.path.basename(words[at]), words[at + 1:], options=words[1:at])
    if words[0] == "torchrun" or words[:3] == ["python", "-m", "torch.distributed.launch"]:
        start = 1 if words[0] == "torchrun" else 3
        at = next(i for i, word in enumerate(words) if word.endswith(".py"))
        options, _ = SBATCH.parse([word.replace("_", "-") for word in words[start:at]])  # --nproc_per_node=4
        nodes = int(options.get("--nnodes", 1))
        return Launch("launcher", env, words[at], words[at + 1:], nodes=nodes,
                      ranks=nodes * int(options.get("--nproc-per-node", 1)))
    assert words[0] == "python" and words[1].endswith(".py"), command
    return Launch("python", env, words[1], words[2:])


def original_layout(entry):
    """(nodes, ranks) the original gave the line: its own script's #SBATCH lines under Slurm's rules."""
    launch = launch_of(entry.command)
    if launch.kind != "sbatch":
        return launch.nodes, launch.ranks
    options, _ = SBATCH.parse(ORIGINAL_SBATCH[entry.edition, launch.script])
    options.update(SBATCH.parse(launch.options)[0])
    return SBATCH.layout(options)


# --- the stand-in cluster: the real submit scripts, a `python` that records what each rank was started with

RECORDING_PYTHON = """#!/bin/bash
# records the rank's place and its arguments (NUL-separated), and starts nothing
{ echo "$RANK $WORLD_SIZE $SLURM_NODEID $SLURM_JOB_NUM_NODES"; printf '%s\\0' "$@"; } > "$RECORD/rank$RANK"
"""
LEAKING = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINING_SCRIPT", "IMAGE",
           "ENABLE_PROFILING", "PROFILE_OUTPUT", "BENCHY_OUTPUT", "CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A submission directory with the real submit scripts (the training scripts only need to exist), and a bin
    folder whose `python` records each rank."""
    root = tmp_path_factory.mktemp("cluster")
    checkout, bin_dir = root / "checkout", root / "bin"
    for folder in (checkout, bin_dir, root / "data", root / "logs"):
        folder.mkdir()
    for name in (*SUBMIT_SCRIPTS, "submit_common.sh", "export_DDP_vars.sh"):
        shutil.copy(os.path.join(REPO_ROOT, name), checkout)
    for name in set(SUBMIT_SCRIPTS.values()):
        (checkout / name).write_text("")
    (bin_dir / "python").write_text(RECORDING_PYTHON)
    (bin_dir / "python").chmod(0o755)
    return root


def submit(cluster, env, words):
    """Run `sbatch words...` on the stand-in cluster: (result, {rank: (world size, node id, job nodes, argv)})."""
    record = cluster / f"record{len(list(cluster.glob('record*')))}"
    record.mkdir()
    job_env = {name: value for name, value in os.environ.items()
               if name not in LEAKING and not name.startswith(("SLURM_", "TORCHELASTIC_"))}
    # this Python's bin before the rest: the stand-ins' `python3` is then not a version manager's shim, which would put
    # its own bin (and `python`) first on the PATH of everything below it
    job_env.update(env, PATH=os.pathsep.join([str(cluster / "bin"), FAKEBIN, os.path.dirname(sys.executable),
                                              job_env.get("PATH", "")]),
                   RECORD=str(record), LOGDIR=str(cluster / "logs"), DATADIR=str(cluster / "data"),
                   CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([os.path.join(FAKEBIN, "sbatch"), *words], cwd=cluster / "checkout", env=job_env,
                            capture_output=True, text=True, timeout=120)
    runs = {}
    for path in record.iterdir():
        place, _, argv = path.read_text().partition("\n")
        rank, world, node, nodes = (int(word) for word in place.split())
        runs[rank] = (world, node, nodes, argv.split("\0")[:-1])
    return result, runs


def check_job(result, runs, nodes, ranks, script, args):
    """The job ran `ranks` ranks on `nodes` nodes, each starting `python script args...`."""
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(runs) == list(range(ranks)), (sorted(runs), result.stderr[-2000:])
    assert {run[0] for run in runs.values()} == {ranks}
    assert {run[1] for run in runs.values()} == set(range(nodes)) and {run[2] for run in runs.values()} == {nodes}
    for rank, run in runs.items():
        assert run[3] == [script, *args], rank


def sbatch_words(launch, added, options=()):
    return [*options, *launch.options, launch.script, *launch.args, *added]


class Parsed(Exception):
    pass


def parse_with_the_scripts_parser(script, argv, monkeypatch):
    """The script's own argparse namespace for argv (its main stops right after parsing)."""
    module = importlib.import_module(script[:-3])
    found = {}
    factory = "model_parallel_parser" if hasattr(module, "model_parallel_parser") else "training_parser"
    make_parser = getattr(lifecycle.cli, factory)  # not the module's: a previous call may have patched it

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


def resolve_args(script, argv, monkeypatch):
    """The training script's own parse of argv, the named config, and the UNet-flag check its main runs."""
    args = parse_with_the_scripts_parser(script, argv, monkeypatch)
    params = YParams(args.yaml_config, args.config)
    check_stage_flags(args, params)
    return args, params


def resolve_as_rank0(script, argv, ranks, monkeypatch):
    """(params, args) as rank 0 of `ranks` has them: the flags applied, the batch split over data parallelism."""
    args, params = resolve_args(script, argv, monkeypatch)
    model_parallel = 1
    if hasattr(args, "tensor_parallel"):
        params.update({"tp": args.tensor_parallel, "cp": args.context_parallel, "order": args.parallel_order})
        model_parallel = args.tensor_parallel * args.context_parallel
    assert ranks % model_parallel == 0
    monkeypatch.setattr("lifecycle.workers.machine_facts", lambda: TASK_MACHINE)
    dp = 1 if args.parallel == "dp" else ranks // model_parallel  # nn.DataParallel: one process
    apply_overrides(params, args, dp_size=dp, dp_rank=0)
    return params, args


FLAG_KEYS = {"--num_epochs": "num_epochs", "--num_data_workers": "num_data_workers", "--amp_mode": "amp_mode",
             "--data_loader_config": "data_loader_config", "--local_batch_size": "local_batch_size",
             "--arch": "arch", "-a": "arch"}


def original_flags(args):
    """{flag: value or True} of an original's arguments (`--flag=value`, `--flag value`, `--switch`)."""
    flags, i = {}, 0
    while i < len(args):
        name, equals, value = args[i].partition("=")
        if not equals and i + 1 < len(args) and not args[i + 1].startswith("-"):
            value, i = args[i + 1], i + 1
        flags[name] = value if (equals or value) else True
        i += 1
    return flags


def check_training(entry, launch, params, args, ranks):
    """The run is the original's: its stage's model, its config, every flag it gave."""
    flags = original_flags(launch.args)
    assert params.get("model", "vit") == MODEL[entry.edition]
    assert args.config == flags["--config"]
    for flag, key in FLAG_KEYS.items():
        if flag in flags:
            assert str(params[key]) == flags[flag], flag
    switches = {"--enable_amp": params.amp_mode == "fp16", "--enable_apex": params.enable_fused,
                "--enable_fused": params.enable_fused, "--enable_jit": params.enable_jit,
                "--enable_benchy": params.enable_benchy, "--noddp": args.noddp,
                "--disable_broadcast_buffers": args.disable_broadcast_buffers,
                "--enable_manual_profiling": (args.profile_epoch, args.profile_iters) == (1, 60)}
    for flag, taken in switches.items():
        if flag in flags:
            assert taken, flag
    if "--bucket_cap_mb" in flags:
        assert args.bucket_cap_mb == int(flags["--bucket_cap_mb"])
    dp = 1 if args.parallel == "dp" else ranks // (params.get("tp", 1) * params.get("cp", 1))
    assert params.global_batch_size == dp * params.local_batch_size


def without_config(args):
    return [arg for arg in args if not arg.startswith("--config=")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("entry", runnable())
def test_each_original_line_runs_as_the_original_did_or_names_the_command_that_does(entry, cluster, monkeypatch):
    launch = launch_of(entry.command)
    nodes, ranks = original_layout(entry)
    added = ADDED.get(entry.edition, [])
    script = SUBMIT_SCRIPTS.get(launch.script, launch.script)
    if launch.kind != "sbatch":
        assert entry.here is None and entry.stops is None
        params, args = resolve_as_rank0(script, launch.args + added, ranks, monkeypatch)
        check_training(entry, launch, params, args, ranks)
        return
    result, runs = submit(cluster, launch.env, sbatch_words(launch, added))
    if entry.here and not entry.stops:  # the shared QOS refuses it; with another QOS, submit_pm.sh names `here`
        assert result.returncode == 1 and result.stderr.splitlines() == [QOS_REFUSAL] and not runs, result.stderr
        result, runs = submit(cluster, launch.env, sbatch_words(launch, added, ["-q", "regular"]))
        lines = result.stderr.splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: submit_pm.sh runs on one "
                                                                                  "node"), result.stderr[-2000:]
        assert lines[0].endswith(f"submit: {entry.here}") and not runs
        here = launch_of(entry.here)
        result, runs = submit(cluster, here.env, sbatch_words(here, []))
        check_job(result, runs, nodes, ranks, SUBMIT_SCRIPTS[here.script], launch.args + added)
        launch = here
        added = []
    else:
        check_job(result, runs, nodes, ranks, script, launch.args + added)
    if entry.stops:  # the training script stops in one line; `here` runs the nearest
        with pytest.raises(UserError) as stopped:
            resolve_args(script, launch.args + added, monkeypatch)
        assert str(stopped.value).startswith(entry.stops) and "\n" not in str(stopped.value)
        here = launch_of(entry.here)
        result, runs = submit(cluster, here.env, sbatch_words(here, []))
        assert without_config(here.args) == without_config(launch.args)
        check_job(result, runs, nodes, ranks, SUBMIT_SCRIPTS[here.script], here.args)
        launch = here
    params, args = resolve_as_rank0(script, launch.args + added, ranks, monkeypatch)
    check_training(entry, launch, params, args, ranks)


def test_slurm_lays_out_the_originals_lines_as_their_readmes_say():
    """FACTS H1: SC21's script (4 tasks a node, regular QOS) gave -n 4 four ranks on one node, -n 8 eight on two,
    -N 2 eight and -N 8 thirty-two; the 2024 scripts gave -n 1 one rank and whole nodes of four."""
    def laid_out(edition, script, options):
        return original_layout(Entry(edition, "", "verbatim", f"sbatch {options} {script} --config=x", 0))
    assert laid_out("sc21", "submit_pm.sh", "-n 1") == (1, 1)
    assert laid_out("sc21", "submit_pm.sh", "-n 4") == (1, 4)
    assert laid_out("sc21", "submit_pm.sh", "-t 10 -n 8") == (2, 8)
    assert laid_out("sc21", "submit_pm.sh", "-N 2") == (2, 8)
    assert laid_out("sc21", "submit_pm.sh", "-N 8") == (8, 32)
    assert laid_out("2024", "submit_pm.sh", "-n 1 -t 20") == (1, 1)
    assert laid_out("2024", "submit_pm_dp.sh", "-N 16") == (16, 64)
    assert laid_out("sc25", "submit_pm_mp.sh", "--nodes=4") == (4, 16)


def this_repos_layout(script, options):
    """(nodes, ranks) this repository's script gets for these sbatch options (SystemExit: refused)."""
    merged, _ = SBATCH.parse(SBATCH.sbatch_lines(os.path.join(REPO_ROOT, script)))
    merged.update(SBATCH.parse(options)[0])
    return SBATCH.layout(merged)


@pytest.mark.parametrize("ntasks_per_node_1", [False, True], ids=["as_is", "twin_ntasks_per_node_1"])
def test_submit_pm_takes_one_to_four_ranks_on_one_node_and_the_shared_qos_no_more(ntasks_per_node_1):
    """submit_pm.sh: -n 1..4 on one node, plain sbatch one rank; -n 5, -n 8, -N 2 refused by the shared QOS in one
    line. The twin, `--ntasks-per-node 1` as the script had it: -n 4 asks for four nodes and is refused."""
    extra = ["--ntasks-per-node", "1"] if ntasks_per_node_1 else []
    assert this_repos_layout("submit_pm.sh", extra) == (1, 1)
    for options in (["-n", "5"], ["-n", "8"], ["-N", "2"], ["-N", "8"]) + ((["-n", "4"],) if extra else ()):
        with pytest.raises(SystemExit) as refused:
            this_repos_layout("submit_pm.sh", [*extra, *options])
        assert refused.value.code == QOS_REFUSAL
    if not extra:
        assert [this_repos_layout("submit_pm.sh", ["-n", str(n)]) for n in range(1, 5)] == [(1, n) for n in range(1, 5)]
    assert this_repos_layout("submit_pm_dp.sh", ["-N", "2"]) == (2, 8)


def uncovered(entries_, original_lines):
    """The originals' lines (`edition README.md:N:command`) that no entry of the file lists with that source and
    command."""
    listed = {(entry.edition, entry.source, entry.command) for entry in entries_}
    missing = []
    for line in original_lines:
        edition, source_and_command = line.split(" ", 1)
        readme, number, command = source_and_command.split(":", 2)
        if (edition, f"{readme}:{number}", command.rstrip()) not in listed:
            missing.append(line)
    return missing


def original_lines():
    if not os.path.exists(ORIGINALS):
        pytest.skip("../shared/originals/commands.txt is not beside this checkout")
    return [line.rstrip("\n") for line in open(ORIGINALS) if line.strip() and not line.startswith("#")]


def test_every_line_of_the_originals_is_listed_with_its_source_and_a_label():
    """Each line of the originals' READMEs (../shared/originals/commands.txt) is an entry, with its README line, and
    every README source the file gives is one of them; the twin: a file without one entry is caught."""
    lines = original_lines()
    assert len(lines) >= 67 and uncovered(entries(), lines) == []
    sources = {":".join(line.split(":", 2)[:2]) for line in lines}
    assert all(f"{entry.edition} {entry.source}" in sources for entry in entries() if "README" in entry.source)
    assert uncovered(entries()[1:], lines) == [f"{entries()[0].edition} {entries()[0].source}:{entries()[0].command}"]
    for entry in entries():
        words = entry.command.split()
        if entry.label.startswith("skip"):
            assert len(entry.label) > len("skip: ") + 10 and entry.here is None
        else:  # a training launch, each kind the originals use
            assert {"sbatch", "python", "torchrun", "nsys"} & set(words), entry.command
    labels = [entry.label.split(":")[0] for entry in entries()]
    assert labels.count("verbatim") >= 55 and labels.count("skip") >= 15 and labels.count("reconstructed") >= 6


def test_a_typo_of_the_original_is_refused_in_one_line_as_it_was_there(monkeypatch, capsys):
    typos = [entry for entry in entries() if entry.label.startswith("skip: a typo")]
    assert len(typos) == 1
    launch = launch_of(typos[0].command)
    with pytest.raises(SystemExit) as refused:
        parse_with_the_scripts_parser(launch.script, launch.args + ADDED["sc21"], monkeypatch)
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: unrecognized arguments: ---num_epochs 10 -enable_benchy (see --help)"]


def missing_from_docs(commands, text):
    """The commands that the page does not show in a code span (whitespace as in the file)."""
    spans = {" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text)}
    return [command for command in commands if " ".join(command.split()) not in spans]


def test_every_here_command_is_listed_in_differences_md():
    heres = [entry.here for entry in entries() if entry.here]
    assert len(heres) >= 9
    text = open(DIFFERENCES).read()
    assert missing_from_docs(heres, text) == []
    assert missing_from_docs(heres, text.replace(heres[0], "removed")) == [heres[0]]  # the twin: one taken out


SHARED_CONFIGS = sorted(set(read_configs(os.path.join(REPO_ROOT, "config/ViT.yaml"))) &
                        set(read_configs(os.path.join(REPO_ROOT, "config/UNet.yaml"))))


@pytest.mark.parametrize("entry", runnable(lambda entry: entry.edition == "sc21"))
def test_an_sc21_line_without_yaml_config_trains_the_vit_or_names_the_unet_file(entry, monkeypatch):
    """Without --yaml_config (train.py's default is config/ViT.yaml) an SC21 line trains the ViT when its config is
    in both files and it gives no UNet-only flag; otherwise it stops in one line naming config/UNet.yaml."""
    launch = launch_of(entry.command)
    flags = original_flags(launch.args)
    trains_the_vit = flags["--config"] in SHARED_CONFIGS and not {"--enable_amp", "--enable_apex",
                                                                  "--enable_manual_profiling"} & set(flags) \
        and flags.get("--data_loader_config") != "dali-lowmem"
    script = SUBMIT_SCRIPTS.get(launch.script, launch.script)
    if trains_the_vit:
        _, params = resolve_args(script, launch.args, monkeypatch)
        assert params.get("model", "vit") == "vit"
    else:
        with pytest.raises(UserError, match="add --yaml_config config/UNet.yaml"):
            resolve_args(script, launch.args, monkeypatch)


def test_the_configs_both_yaml_files_share_are_named_in_differences_md():
    """docs/differences.md names them: an SC21 command of one of these configs without --yaml_config trains the
    ViT."""
    assert {"short", "bs64_opt", "bs256_opt", "bs512_opt"} <= set(SHARED_CONFIGS), SHARED_CONFIGS
    text = open(DIFFERENCES).read()
    assert [name for name in SHARED_CONFIGS if f"`{name}`" not in text] == []


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


def loader_of(entry):
    """The data loader an entry's line asks for: its --data_loader_config, else its config's."""
    flags = original_flags(launch_of(entry.command).args)
    yaml_file = STAGES[DALI_STAGE[entry.edition]][0]
    return flags.get("--data_loader_config") or read_configs(os.path.join(REPO_ROOT, yaml_file))[
        flags["--config"]].get("data_loader_config")


def dali_entries():
    return runnable(lambda entry: entry.edition in DALI_STAGE and not entry.stops and
                    str(loader_of(entry)).startswith("dali"))


@pytest.mark.parametrize("entry", dali_entries())
def test_original_command_builds_its_dali_loader(entry, data_dirs, monkeypatch):
    launch, section = launch_of(entry.command), DALI_STAGE[entry.edition]
    _, ranks = original_layout(entry)
    script = SUBMIT_SCRIPTS.get(launch.script, launch.script)
    params, args = resolve(script, launch.args, ranks, section, data_dirs, monkeypatch)
    assert params.global_batch_size == ranks // (params.get("tp", 1) * params.get("cp", 1)) * params.local_batch_size
    flags = original_flags(launch.args)
    if "--num_data_workers" in flags:  # a flag the line gives is what the run uses
        assert params.num_data_workers == int(flags["--num_data_workers"])
    if "--enable_amp" in flags or re.fullmatch(r"(bs\d+_opt|mp)(_short)?", flags["--config"]):
        assert params.amp_mode == "fp16"  # the *_opt configs really run optimised (upstream dropped their AMP)
    check_loaders(params, section)


def test_the_dali_lines_cover_both_stages():
    stages = [DALI_STAGE[param.values[0].edition] for param in dali_entries()]
    assert stages.count("A") >= 15 and stages.count("B") >= 12, stages


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


def write_the_first_batch(loader):
    """Random values (fixed seed) into the ERA5 time steps the first training batch reads, input and target: the
    only chunks of the files ever written (2 x 20 x 360 x 720 float32, 41 MB). Returns them (inp, tar), unnormalised,
    each (C, H, W)."""
    (index,) = batch_indices(loader.sampler, 1, 0, 0)
    year_idx, step = loader.dataset.position(index)
    written = np.random.default_rng(62).standard_normal((2, *loader.sample_shape), dtype=np.float32)
    with h5py.File(loader.dataset.files_paths[year_idx], "r+") as f:
        for values, at in zip(written, (step, step + loader.dataset.dt)):
            f["fields"][at] = values
    return written


@pytest.mark.parametrize("section", ["A", "B"])
def test_one_batch_at_the_original_sample_size(section, data_dirs, monkeypatch):
    """The first line of each stage, one sample per batch and no worker processes: DALI's first batch equals the
    PyTorch loader's, bit for bit, and its input and target differ. ERA5's two time steps hold the values
    write_the_first_batch wrote (the statistics are 0 and 1: the PyTorch loader's batch is them as written), so a
    pipeline that hands out the target twice, or a time step other than the sampler's, fails; the cosmology boxes
    are generated (not all zeros), Nbody in and Hydro out."""
    entry = next(param.values[0] for param in dali_entries() if DALI_STAGE[param.values[0].edition] == section)
    launch, (_, ranks) = launch_of(entry.command), original_layout(entry)
    params, _ = resolve(SUBMIT_SCRIPTS.get(launch.script, launch.script),
                        launch.args + ["--local_batch_size", "1", "--num_data_workers", "0"], ranks, section, data_dirs,
                        monkeypatch)
    loader = check_loaders(params, section)[True]
    written = write_the_first_batch(loader) if section == "A" else None
    expected = loader.first_batch()  # the PyTorch loader's
    if written is not None:  # statistics 0 and 1: the values as written
        assert all(torch.equal(x[0], torch.from_numpy(values)) for x, values in zip(expected, written))
    else:
        assert all(x.abs().sum() > 0 for x in expected), "the generated boxes are all zeros"
    loader.set_epoch(0)
    inp, tar = next(iter(loader))
    assert inp.shape == (1, *loader.sample_shape) and torch.equal(inp.cpu(), expected[0])
    assert torch.equal(tar.cpu(), expected[1])
    if section == "A":  # (the cosmology's input and target differ in shape)
        assert not torch.equal(inp, tar), "DALI's input and target are the same values"

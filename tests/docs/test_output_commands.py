"""Every output README quotes names the command that printed it, and that is the command its run recorded.

An output block is a fenced block without a language. Its first line is the command, as a shell shows it
(`$ python train.py ...`); a value in capitals (`N`, `TP`, `CP`) stands for what changes from row to row, and the
rows say it. For the blocks whose runs recorded their command (SOURCES: a multi-GPU session log's first line, or the
`command` of example_logs/runs.json and gpu_runs.json), both commands are parsed with the script's own argument
parser and compared flag by flag:

- a flag the shown command gives must have the run's value;
- a flag only the run gave must either leave the run as the config has it (its value is the config's, or the
  parser's default), or say where the run wrote and read (WHERE), or be one the block's rows name (SOURCES);
- the script and the number of processes must be the run's.

A table of figures gathered from several runs (the medians of the multi-GPU session's trials) is not an output: the
paragraph that introduces it names the command in inline code (`` `$ torchrun ...` ``), which is checked against the
runs' the same way.

For the single-run blocks each quoted line must also be in the run's log. A failure names the block and the flag:
fix the command shown above the output (or the output, by running the shown command again). Twins: README's old DDP
command (local batch 2, no `--enable_benchy`), a block without its command and a table without its command are caught.
"""
import json
import os
import re
import shlex

import pytest

from tests.conftest import REPO_ROOT
from tests.docs.test_readme_commands import parse_with_script_parser

pytestmark = [pytest.mark.usefixtures("in_repo_root"),
              pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")]

README = os.path.join(REPO_ROOT, "README.md")
SESSION_LOGS = "example_logs/multi_gpu_cpu/logs"
# a line of the block -> (the records of the runs it shows, the log of a single run or None, flags its rows name)
SOURCES = {
    "Time taken for epoch 1 is 5.365523 sec": (["example_logs/runs.json#vit"], "example_logs/vit/demo/1GPU/00/out.log",
                                               ()),
    "Time taken for epoch 1 is 6.030631 sec": (["example_logs/gpu_runs.json#vit-short-bf16"],
                                               "example_logs/vit/short/1GPU/nw8_bf16/out.log", ()),
    "| 1 rank (global batch 8) |": ([f"{SESSION_LOGS}/dp_weak{n}.log" for n in (1, 2, 4)], None, ()),  # a table
    "| tp=1 (dp=4) |": ([f"{SESSION_LOGS}/mp_tp{tp}cp{cp}.log" for tp, cp in ((1, 1), (1, 4), (2, 2))], None,
                        ("--parallel_order",)),  # a table
    "Time taken for epoch 1 is 33.895035 sec": (["example_logs/gpu_runs.json#unet-short"],
                                                "example_logs/unet/short/1GPU/baseline/out.log", ()),
}
WHERE = {"data_dir", "expdir", "run_num", "checkpoint_interval"}  # where a run reads and writes, not what it runs
PLACEHOLDER = re.compile(r"^[A-Z]{1,3}$")


def output_blocks(text):
    """[(line number, [lines])] of every fenced block without a language."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            if current is not None:
                blocks.append((start, current))
                current = None
            elif line.strip() == "```":
                current, start = [], number
            else:
                current = "code"  # a block with a language: skipped to its end
            continue
        if isinstance(current, list):
            current.append(line)
    return [(number, lines) for number, lines in blocks if isinstance(lines, list)]


def table_blocks(text):
    """[(line number, [lines])] of every markdown table, its first line the `$ ...` command in inline code of the
    paragraph that introduces it (or that paragraph's last line, when it names none), then the table's rows."""
    lines, blocks, number = text.splitlines(), [], 0
    while number < len(lines):
        if not lines[number].startswith("|"):
            number += 1
            continue
        end = number
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        above = number - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        start = above
        while start > 0 and lines[start - 1].strip() and not lines[start - 1].startswith(("|", "```", "#")):
            start -= 1
        paragraph = " ".join(" ".join(lines[start:above + 1]).split())
        commands = re.findall(r"`\$ ([^`]+)`", paragraph)
        blocks.append((number + 1, [f"$ {commands[-1]}" if commands else paragraph, *lines[number:end]]))
        number = end
    return blocks


def shown_command(lines):
    """The block's `$ ...` command (continued over lines ending in a backslash), or None."""
    if not lines or not lines[0].startswith("$ "):
        return None
    command, i = lines[0][2:], 0
    while command.rstrip().endswith("\\"):
        i += 1
        command = command.rstrip()[:-1] + " " + lines[i].strip()
    return command


def recorded_command(source):
    path, _, name = source.partition("#")
    if name:
        runs = json.load(open(path))["runs"]
        return next(run["command"] for run in runs if run["name"] == name)
    first = open(path).readline()
    assert first.startswith("$ "), f"{path} does not record its command on its first line"
    return first[2:].strip()


def launch(command):
    """(processes, script, arguments) of a `python` or `torchrun` command."""
    tokens = shlex.split(command, comments=True)
    while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):
        tokens = tokens[1:]  # VAR=value before the command
    if tokens[0] == "torchrun":
        at = next(i for i, token in enumerate(tokens) if token.endswith(".py"))
        options = tokens[1:at]
        nproc = options[options.index("--nproc_per_node") + 1] if "--nproc_per_node" in options else "1"
        return nproc, tokens[at], tokens[at + 1:]
    assert re.fullmatch(r"(\S*/)?python3?", tokens[0]), command
    return "1", tokens[1], tokens[2:]


def fill_placeholders(args, recorded_args):
    """The shown arguments with each placeholder value taken from the run's; the flags the run lacks."""
    filled, missing = list(args), []
    for i, token in enumerate(args):
        if i and PLACEHOLDER.match(token) and args[i - 1].startswith("--"):
            flag = args[i - 1]
            if flag in recorded_args:
                filled[i] = recorded_args[recorded_args.index(flag) + 1]
            else:
                missing.append(flag)
    return filled, missing


def config_value(namespace, key, processes):
    """What the run would have for `key` without its flag: the config's value (the local batch: the global one split
    over the data-parallel ranks)."""
    from utils.YParams import YParams
    params = YParams(namespace.yaml_config, namespace.config).params
    if key == "local_batch_size":
        model_parallel = getattr(namespace, "tensor_parallel", 1) * getattr(namespace, "context_parallel", 1)
        return params["global_batch_size"] // (int(processes) // model_parallel)
    return params.get(key)


def differences(shown, recorded, named, monkeypatch):
    """How the shown command differs from the recorded one, as 'what: shown X, the run's Y' lines."""
    nproc, script, args = launch(shown)
    run_nproc, run_script, run_args = launch(recorded)
    found = []
    if PLACEHOLDER.match(nproc):
        nproc = run_nproc
    if (nproc, script) != (run_nproc, run_script):
        found.append(f"launch: shown {nproc} x {script}, the run's {run_nproc} x {run_script}")
        return found
    args, missing = fill_placeholders(args, run_args)
    found += [f"{flag}: shown with a value that varies, the run has none" for flag in missing]
    shown_ns = parse_with_script_parser(script, args, False, monkeypatch)
    run_ns = parse_with_script_parser(run_script, run_args, False, monkeypatch)
    defaults = parse_with_script_parser(script, [], False, monkeypatch)
    rows = {flag.lstrip("-").replace("-", "_") for flag in named}
    for key, value in vars(run_ns).items():
        said = getattr(shown_ns, key)
        if key in WHERE or key in rows:
            continue
        if key == "yaml_config":
            said, value = os.path.normpath(said), os.path.normpath(value)
        if said == value:
            continue
        unset = getattr(defaults, key)
        if said == unset and value == config_value(run_ns, key, run_nproc):
            continue  # the run gave what the config has anyway
        if value == unset and said == config_value(shown_ns, key, nproc):
            continue
        found.append(f"--{key}: shown {said!r}, the run's {value!r}")
    return found


def quoted_lines(lines):
    """The block's output lines as the log has them: the elided timestamp prefix and '...' lines dropped."""
    return [re.sub(r"^\.\.\. - root - INFO - ", "", line) for line in lines[1:] if line.strip() not in ("", "...")]


def block_problems(text, monkeypatch):
    """Every output block without its command, and every shown command that is not its run's."""
    problems, blocks, tables = [], output_blocks(text), table_blocks(text)
    for number, lines in blocks:
        if shown_command(lines) is None:
            problems.append(f"README.md:{number}: the output block does not start with its command (`$ ...`)")
    for key, (sources, log, named) in SOURCES.items():
        block = next(((number, lines) for number, lines in blocks + tables if any(key in line for line in lines)),
                     None)
        if block is None:
            problems.append(f"no output block or table of README shows {key!r} (SOURCES is stale)")
            continue
        number, lines = block
        shown = shown_command(lines)
        if shown is None:
            if block in tables:
                problems.append(f"README.md:{number}: the paragraph above the table does not name its command "
                                f"(`$ ...` in inline code)")
            continue
        for source in sources:
            problems += [f"README.md:{number} against {source}: {difference}"
                         for difference in differences(shown, recorded_command(source), named, monkeypatch)]
        if log:
            text_of_log = open(log).read()
            problems += [f"README.md:{number}: {line!r} is not in {log}" for line in quoted_lines(lines)
                         if line.strip() not in text_of_log]
    return problems


def test_every_output_block_names_the_command_its_run_recorded(monkeypatch, capsys):
    problems = block_problems(open(README).read(), monkeypatch)
    capsys.readouterr()
    assert problems == [], "\n".join(problems)


def test_twin_the_old_ddp_command_and_a_block_or_table_without_its_command_are_caught(monkeypatch, capsys):
    text = open(README).read()
    shown = next(shown_command(lines) for _, lines in table_blocks(text)
                 if "| 1 rank (global batch 8) |" in "\n".join(lines))
    old = text.replace(f"$ {shown}", "$ torchrun --nproc_per_node N train.py --config demo --data_dir data/era5 "
                                     "--local_batch_size 2")
    found = block_problems(old, monkeypatch)
    capsys.readouterr()
    assert {line.split(": ")[1] for line in found} >= {"--local_batch_size", "--enable_benchy", "--benchy_nbatches"}
    assert all("dp_weak" in line for line in found), found
    untold = text.replace(f"`$ {shown}`", "the command above", 1)
    assert [line for line in block_problems(untold, monkeypatch) if "does not name its command" in line]
    epoch = next(shown_command(lines) for _, lines in output_blocks(text)
                 if "Time taken for epoch 1 is 5.365523 sec" in "\n".join(lines))
    bare = text.replace(f"$ {epoch}\n", "", 1)
    assert [line for line in block_problems(bare, monkeypatch) if "does not start with its command" in line]
    capsys.readouterr()

"""Every command README shows still works: each `python`, `torchrun`, `sbatch` (and `nsys`, `srun`, `make`) line of
its code blocks and inline code is parsed here, and

- the script, module, submit script or make target exists;
- the flags parse with the script's own argument parser (argparse stops right after parsing: nothing trains);
- for the training scripts, the named config exists in the named YAML file;
- torchrun / torch.distributed.launch options parse with torch's own launcher parser, and sbatch options are
  ones sbatch has.

A failure names the README line and points to README.md (a stale command) or to the script whose flags changed.
"""
import argparse
import os
import re
import runpy
import shlex
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.usefixtures("in_repo_root")

README = os.path.join(REPO_ROOT, "README.md")
TRAINING_SCRIPTS = ("train.py", "train_mp.py", "train_graph.py", "train_mp_graphs.py")
SBATCH_OPTIONS = {"-N", "--nodes", "-n", "--ntasks", "-t", "--time", "-A", "--account", "-q", "--qos",
                  "--reservation", "-J", "--job-name", "-o", "--output", "-C", "--constraint", "-G", "--gpus",
                  "--ntasks-per-node", "--gpus-per-node", "--gpus-per-task", "--cpus-per-task", "--image",
                  "--module", "-d", "--dependency", "--exclusive"}
SBATCH_FLAGS = {"--exclusive"}  # options without a value
COMMAND_WORDS = ("python", "python3", "torchrun", "sbatch", "srun", "nsys", "shifter", "make")
RUNNERS = ("python", "python3", "torchrun")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


class Parsed(Exception):
    """Raised by the patched argparse right after a successful parse: the command is valid, nothing runs."""

    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


def readme_commands(text):
    """(line number, command string, fenced) of every command in fenced code blocks (fenced=True) and inline code
    spans; a fenced line holding several commands (`a && b`, `a; b`) gives each."""
    commands, in_block, pending, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            if pending:  # a continuation the block ends
                commands.append((start, pending, True))
            in_block, pending = not in_block, ""
            continue
        if in_block:
            stripped = line.strip()
            if pending:
                stripped, pending = pending + " " + stripped, ""
            elif not stripped or stripped.startswith("#"):
                continue
            else:
                start = number
            if stripped.endswith("\\"):
                pending = stripped[:-1].strip()
                continue
            commands.extend((start, part, True) for part in _top_level_parts(stripped))
        else:
            for span in re.findall(r"`([^`]+)`", line):
                commands.append((number, span, False))
    return [(number, command, fenced) for number, command, fenced in commands
            if _command_word(command) in COMMAND_WORDS and len(_tokens(command)) > 1]


def _top_level_parts(line):
    """`a && b; c` -> [a, b, c], leaving quoted strings (a `bash -c '...'` script) whole."""
    parts, current, quote = [], "", None
    i = 0
    while i < len(line):
        char = line[i]
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == ";" or line.startswith("&&", i):
            parts.append(current)
            current = ""
            i += 2 if char == "&" else 1
            continue
        current += char
        i += 1
    return [part.strip() for part in [*parts, current] if part.strip()]


def _tokens(command):
    return shlex.split(command.replace("[", " ").replace("]", " "), comments=True)


def _command_word(command):
    try:
        tokens = _tokens(command)
    except ValueError:  # unbalanced quotes: kept, so that the check reports it
        return command.split()[0] if command.split() else None
    words = [token for token in tokens if not ENV_ASSIGNMENT.match(token)]
    return words[0] if words else None


def _split_env(tokens):
    env = {}
    while tokens and ENV_ASSIGNMENT.match(tokens[0]):
        name, value = tokens[0].split("=", 1)
        env[name] = value
        tokens = tokens[1:]
    return env, tokens


def parse_with_script_parser(target, argv, as_module, monkeypatch):
    """The namespace the script's own argparse parser gives for argv; AssertionError with its message if it
    refuses them. The script is run as __main__ with parse_args patched to stop right after parsing."""
    real_parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(real_parse_args(self, args, namespace))

    for attempt in (argv, [token for token in argv if token != "..."]):  # "..." elides arguments or a value
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        monkeypatch.setattr(sys, "argv", [target, *attempt])
        try:
            if as_module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except Parsed as parsed:
            return parsed.namespace
        except SystemExit as exit_info:
            error = f"exit code {exit_info.code}"
            continue
        finally:
            monkeypatch.setattr(argparse.ArgumentParser, "parse_args", real_parse_args)
        raise AssertionError(f"{target} ran without parsing its arguments with argparse")
    raise AssertionError(f"{target} refused {' '.join(argv)} ({error}; its message is above)")


def check_training_script(script, argv, monkeypatch):
    from utils.YParams import YParams
    assert os.path.isfile(script), f"no script {script}"
    namespace = parse_with_script_parser(script, argv, False, monkeypatch)
    YParams(namespace.yaml_config, namespace.config)  # a UserError names a config missing from the YAML file
    return f"{script} --config {namespace.config}"


def check_python(tokens, monkeypatch):
    """tokens: everything after `python`."""
    if tokens[0] == "-m":
        module, argv = tokens[1], tokens[2:]
        if module in ("torch.distributed.launch", "torch.distributed.run"):
            return check_launcher(argv, monkeypatch)
        return f"-m {module} ({parse_with_script_parser(module, argv, True, monkeypatch) is not None})"
    script, argv = tokens[0], tokens[1:]
    if script in TRAINING_SCRIPTS:
        return check_training_script(script, argv, monkeypatch)
    assert os.path.isfile(script), f"no script {script}"
    parse_with_script_parser(script, argv, False, monkeypatch)
    return script


def check_launcher(tokens, monkeypatch):
    """torchrun / torch.distributed.launch options, then the script and its flags."""
    from torch.distributed.run import get_args_parser
    script_at = next((i for i, token in enumerate(tokens) if token.endswith(".py")), None)
    if script_at is None:  # an option named in the text (`torchrun --max-restarts N`), no command
        return None
    options = [token for token in tokens[:script_at] if token not in ("--use-env", "--use_env")]
    options = ["1" if re.fullmatch(r"\$\{?\w+\}?", token) else token for token in options]  # --nnodes $SLURM_NNODES
    launcher = get_args_parser()

    def refuse(message):
        raise AssertionError(f"launcher options {options}: {message}")

    launcher.error = refuse
    launcher.parse_args([*options, tokens[script_at]])
    return check_python(tokens[script_at:], monkeypatch)


def submit_script_target(path):
    """The Python script a submit script runs by default."""
    text = open(path).read()
    default = re.search(r"TRAINING_SCRIPT:-([\w.]+)", text) or re.search(r"python (\S+\.py)", text)
    assert default, f"{path} names no training script"
    return default.group(1)


def check_sbatch(env, tokens, monkeypatch):
    script_at = next((i for i, token in enumerate(tokens) if token.endswith(".sh")), None)
    if script_at is None:  # an option named in the text (`sbatch --image=...`), no job
        return None
    options = tokens[:script_at]
    i = 0
    while i < len(options):
        option = options[i]
        name = option.split("=", 1)[0]
        if not name.startswith("--") and len(name) > 2:  # -n1, -t20
            name = name[:2]
        elif name in SBATCH_OPTIONS and "=" not in option and name not in SBATCH_FLAGS:
            i += 1  # its value
        assert name in SBATCH_OPTIONS, f"sbatch has no option {option}"
        i += 1
    submit = tokens[script_at]
    assert os.path.isfile(submit), f"no submit script {submit}"
    script = env.get("TRAINING_SCRIPT") or submit_script_target(submit)
    return f"{submit}: " + check_training_script(script, tokens[script_at + 1:], monkeypatch)


def check_command(command, monkeypatch):
    """Check one README command; returns what was checked, or None when it names nothing to check."""
    env, tokens = _split_env(_tokens(command))
    word, rest = tokens[0], tokens[1:]
    if word in ("python", "python3"):
        return check_python(rest, monkeypatch)
    if word == "torchrun":
        return check_launcher(rest, monkeypatch)
    if word == "sbatch":
        return check_sbatch(env, rest, monkeypatch)
    if word in ("nsys", "srun", "shifter"):  # the command they wrap: after their options, or in `bash -c '...'`
        inner = next((i for i, token in enumerate(rest) if token in RUNNERS), None)
        if inner is not None:
            return check_command(shlex.join(rest[inner:]), monkeypatch)
        script = next((rest[i + 1] for i in range(len(rest) - 1) if rest[i] == "-c" and rest[i - 1] == "bash"), "")
        checked = [check_command(part, monkeypatch) for part in _top_level_parts(script)
                   if _command_word(part) in COMMAND_WORDS]
        return " ".join(what for what in checked if what) or None
    if word == "make":
        makefile = open(os.path.join(REPO_ROOT, "Makefile")).read()
        for target in (token for token in rest if not ENV_ASSIGNMENT.match(token)):
            pattern = re.escape(target).replace(r"\*", r"[\w-]+")  # `make bench-*`: some bench- target
            assert re.search(rf"^{pattern}:", makefile, re.M), f"the Makefile has no target {target}"
        return "make"
    return None


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_every_readme_command_names_existing_scripts_configs_and_flags(monkeypatch, capsys):
    commands = readme_commands(open(README).read())
    checked, failures = [], []
    for number, command, fenced in commands:
        try:
            what = check_command(command, monkeypatch)
        except (AssertionError, Exception) as err:  # noqa: B014 - every failure is reported with its line
            failures.append(f"README.md:{number}: {command}\n    {type(err).__name__}: {err}")
            continue
        if what:
            checked.append(what)
        elif fenced and any(word in RUNNERS + ("sbatch",) for word in command.split()):
            failures.append(f"README.md:{number}: {command}\n    runs something this test cannot check")
    capsys.readouterr()
    assert not failures, "stale README commands:\n" + "\n".join(failures)
    scripts = " ".join(checked)
    assert len(checked) >= 30, checked  # the README shows dozens; far fewer means the parser lost them
    for script in ("train.py", "train_mp.py", "train_graph.py", "submit_pm.sh", "submit_pm_dp.sh", "submit_pm_mp.sh",
                   "-m utils.sample_data"):
        assert script in scripts, f"no README command runs {script}"


@pytest.mark.parametrize("command, message", [
    ("python train.py --config short --no_such_flag", "refused"),
    ("python train.py --yaml_config config/UNet.yaml --config nope", "config 'nope' is not in config/UNet.yaml"),
    ("torchrun --nproc_per_node 4 train_mp.py --config mp --tensor_paralel 2", "refused"),
    ("sbatch -N 4 --colour=blue submit_pm_dp.sh --config=bs256_opt", "sbatch has no option --colour"),
    ("sbatch -N 4 submit_nowhere.sh --config=bs256_opt", "no submit script"),
    ("python -m utils.sample_data era5 --hieght 360", "refused"),
    ("make no-such-target", "the Makefile has no target"),
])
def test_the_checker_catches_stale_commands(command, message, monkeypatch, capsys):
    with pytest.raises(Exception, match=message):
        check_command(command, monkeypatch)
    capsys.readouterr()


def test_the_diff_sizes_readme_quotes_are_the_scripts_own():
    """README quotes `diff A B` (N changed lines) for the lessons; N must be what diff shows today (the lines it
    marks < or >), or the claim went stale when a script changed."""
    import shutil
    import subprocess
    if shutil.which("diff") is None:
        pytest.skip("no diff program on this machine")
    with open(README) as f:
        text = f.read()
    claims = re.findall(r"`diff (\S+) (\S+)`\s*\((\d+) changed lines\)", text)
    assert len(claims) >= 2  # train_graph.py and train_mp.py
    for first, second, quoted in claims:
        shown = subprocess.run(["diff", first, second], cwd=REPO_ROOT, capture_output=True, text=True).stdout
        changed = sum(line[:1] in ("<", ">") for line in shown.splitlines())
        assert int(quoted) == changed, f"README says `diff {first} {second}` is {quoted} changed lines: {changed}"

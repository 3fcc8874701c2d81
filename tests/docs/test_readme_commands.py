"""Every command README.md and the docs/ pages show still works, and every link in them leads somewhere.

Each `python`, `torchrun`, `sbatch` (and `nsys`, `srun`, `make`) line of their code blocks and inline code is
parsed here, and

- the script, module, submit script or make target exists;
- the flags parse with the script's own argument parser (argparse stops right after parsing: nothing trains);
- for the training scripts, the named config exists in the named YAML file;
- torchrun / torch.distributed.launch options parse with torch's own launcher parser, and sbatch options are
  ones sbatch has;
- `python -m pytest ...` (also `.venv/bin/python -m pytest ...`): the test paths it names exist;
- inline text that only names a module (`python -m sample_data.convert_to_npy`, no arguments): the module exists.

Every relative markdown link (`[text](path)`, images too) must point to an existing file, a `#anchor` into a
markdown page to one of its headings, and README must link every docs/ page.

A failure names the page and line (`docs/cluster.md:40`) and points to that page (a stale command or link) or to
the script whose flags changed. Each check has a failing twin below, so a checker that stopped looking fails there.
"""
import argparse
import glob
import importlib.util
import os
import re
import runpy
import shlex
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.usefixtures("in_repo_root")

README = os.path.join(REPO_ROOT, "README.md")
PAGES = (README, *sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md"))))  # the tutorial and its reference
TRAINING_SCRIPTS = ("train.py", "train_mp.py", "train_graph.py", "train_mp_graphs.py")
SBATCH_OPTIONS = {"-N", "--nodes", "-n", "--ntasks", "-t", "--time", "-A", "--account", "-q", "--qos",
                  "--reservation", "-J", "--job-name", "-o", "--output", "-C", "--constraint", "-G", "--gpus",
                  "--ntasks-per-node", "--gpus-per-node", "--gpus-per-task", "--cpus-per-task", "--image",
                  "--module", "-d", "--dependency", "--exclusive"}
SBATCH_FLAGS = {"--exclusive"}  # options without a value
PYTEST_OPTIONS_WITH_VALUE = {"-m", "-k", "-p", "-o", "-c", "-W", "-n", "--maxfail", "--durations", "--ignore",
                             "--deselect", "--rootdir", "--basetemp", "--confcutdir", "--timeout"}
COMMAND_WORDS = ("python", "python3", "torchrun", "sbatch", "srun", "nsys", "shifter", "make")
RUNNERS = ("python", "python3", "torchrun")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # http:, https:, mailto:


def page_name(path):
    return os.path.relpath(path, REPO_ROOT).replace(os.sep, "/")


class Parsed(Exception):
    """Raised by the patched argparse right after a successful parse: the command is valid, nothing runs."""

    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


def readme_commands(text):
    """(line number, command string, fenced) of every command in fenced code blocks (fenced=True) and inline code
    spans of a markdown page; a fenced line holding several commands (`a && b`, `a; b`) gives each, and an inline
    span the text wraps over two lines is read whole (with the line it starts on)."""
    commands, in_block, pending, start = [], False, "", 0
    open_span, span_start = None, 0  # an inline span the line ended inside of
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            if pending:  # a continuation the block ends
                commands.append((start, pending, True))
            in_block, pending, open_span = not in_block, "", None
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
            if open_span is not None:
                if "`" not in line:
                    open_span += " " + line.strip()
                    continue
                close = line.index("`")
                commands.append((span_start, (open_span + " " + line[:close].strip()).strip(), False))
                line, open_span = line[close + 1:], None
            if line.count("`") % 2:
                cut = line.rindex("`")
                line, open_span, span_start = line[:cut], line[cut + 1:].strip(), number
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


def _program(word):
    """`.venv/bin/python` and `/usr/bin/python3` run Python as `python` does."""
    return "python" if word is not None and re.fullmatch(r"(\S*/)?python3?", word) else word


def _command_word(command):
    try:
        tokens = _tokens(command)
    except ValueError:  # unbalanced quotes: kept, so that the check reports it
        return command.split()[0] if command.split() else None
    words = [token for token in tokens if not ENV_ASSIGNMENT.match(token)]
    return _program(words[0]) if words else None


def _split_env(tokens):
    env = {}
    while tokens and ENV_ASSIGNMENT.match(tokens[0]):
        name, value = tokens[0].split("=", 1)
        env[name] = value
        tokens = tokens[1:]
    return env, tokens


def parse_with_script_parser(target, argv, as_module, monkeypatch):
    """The namespace the script's own argparse parser gives for argv (None for `--help`, which prints and exits 0);
    AssertionError with its message if it refuses them. The script is run as __main__ with parse_args patched to
    stop right after parsing."""
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
            if exit_info.code in (0, None) and {"-h", "--help"} & set(attempt):
                return None
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
    if namespace is None:  # --help
        return f"{script} --help"
    YParams(namespace.yaml_config, namespace.config)  # a UserError names a config missing from the YAML file
    return f"{script} --config {namespace.config}"


def check_pytest(argv):
    """`python -m pytest [options] [paths]`: every path it names (before any `::test` part) exists."""
    paths, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token in PYTEST_OPTIONS_WITH_VALUE:
            i += 2
            continue
        if not token.startswith("-"):
            paths.append(token.split("::", 1)[0])
        i += 1
    for path in paths:
        assert os.path.exists(path), f"pytest is given {path}, which does not exist: no test path {path}"
    return "-m pytest " + " ".join(paths)


def check_python(tokens, monkeypatch, mention=False):
    """tokens: everything after `python`. mention: inline text naming a module with no arguments, which need only
    exist (`python -m sample_data.convert_to_npy` makes them)."""
    if tokens[0] == "-m":
        module, argv = tokens[1], tokens[2:]
        if module == "pytest":
            return check_pytest(argv)
        if module in ("torch.distributed.launch", "torch.distributed.run"):
            return check_launcher(argv, monkeypatch)
        if mention and not argv:
            assert importlib.util.find_spec(module) is not None, f"no module {module}"
            return f"-m {module}"
        parse_with_script_parser(module, argv, True, monkeypatch)
        return f"-m {module}"
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


def check_command(command, monkeypatch, mention=False):
    """Check one command of a page; returns what was checked, or None when it names nothing to check. mention:
    the command is inline text, where `python -m module` alone names a module rather than runs it."""
    env, tokens = _split_env(_tokens(command))
    word, rest = _program(tokens[0]), tokens[1:]
    if word == "python":
        return check_python(rest, monkeypatch, mention)
    if word == "torchrun":
        return check_launcher(rest, monkeypatch)
    if word == "sbatch":
        return check_sbatch(env, rest, monkeypatch)
    if word in ("nsys", "srun", "shifter"):  # the command they wrap: after their options, or in `bash -c '...'`
        inner = next((i for i, token in enumerate(rest) if _program(token) in RUNNERS), None)
        if inner is not None:
            return check_command(shlex.join(rest[inner:]), monkeypatch)
        script = next((rest[i + 1] for i in range(len(rest) - 1) if rest[i] == "-c" and rest[i - 1] == "bash"), "")
        parts = [part.removeprefix("exec ") for part in _top_level_parts(script)]  # `exec torchrun ...`: torchrun
        checked = [check_command(part, monkeypatch) for part in parts if _command_word(part) in COMMAND_WORDS]
        return " ".join(what for what in checked if what) or None
    if word == "make":
        makefile = open(os.path.join(REPO_ROOT, "Makefile")).read()
        for target in (token for token in rest if not ENV_ASSIGNMENT.match(token)):
            pattern = re.escape(target).replace(r"\*", r"[\w-]+")  # `make bench-*`: some bench- target
            assert re.search(rf"^{pattern}:", makefile, re.M), f"the Makefile has no target {target}"
        return "make"
    return None


def stale_commands(path, text, monkeypatch):
    """(what was checked, failures) for the commands of one page; each failure names page:line."""
    checked, failures = [], []
    for number, command, fenced in readme_commands(text):
        try:
            what = check_command(command, monkeypatch, mention=not fenced)
        except (AssertionError, Exception) as err:  # noqa: B014 - every failure is reported with its line
            failures.append(f"{page_name(path)}:{number}: {command}\n    {type(err).__name__}: {err}")
            continue
        if what:
            checked.append(what)
        elif fenced and any(_program(word) in RUNNERS + ("sbatch",) for word in command.split()):
            failures.append(f"{page_name(path)}:{number}: {command}\n    runs something this test cannot check")
    return checked, failures


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_every_command_names_existing_scripts_configs_and_flags(page, monkeypatch, capsys):
    checked, failures = stale_commands(page, open(page).read(), monkeypatch)
    capsys.readouterr()
    assert not failures, f"stale commands in {page_name(page)}:\n" + "\n".join(failures)
    if page != README:
        return
    scripts = " ".join(checked)
    assert len(checked) >= 30, checked  # the README shows dozens; far fewer means the parser lost them
    for script in ("train.py", "train_mp.py", "train_graph.py", "submit_pm.sh", "submit_pm_dp.sh", "submit_pm_mp.sh",
                   "-m sample_data"):
        assert script in scripts, f"no README command runs {script}"


@pytest.mark.parametrize("command, message", [
    ("python train.py --config short --no_such_flag", "refused"),
    ("python train.py --yaml_config config/UNet.yaml --config nope", "config 'nope' is not in config/UNet.yaml"),
    ("torchrun --nproc_per_node 4 train_mp.py --config mp --tensor_paralel 2", "refused"),
    ("sbatch -N 4 --colour=blue submit_pm_dp.sh --config=bs256_opt", "sbatch has no option --colour"),
    ("sbatch -N 4 submit_nowhere.sh --config=bs256_opt", "no submit script"),
    ("python -m exercises.check_tp_mlp --nprocs_typo 2", "refused"),
    ("python -m pytest -q -m gpu tests/test_nowhere.py", "no test path tests/test_nowhere.py"),
    (".venv/bin/python -m pytest tests/training/test_train.py::test_x tests/nowhere/", "no test path tests/nowhere/"),
    ("make no-such-target", "the Makefile has no target"),
])
def test_the_checker_catches_stale_commands(command, message, monkeypatch, capsys):
    with pytest.raises(Exception, match=message):
        check_command(command, monkeypatch)
    capsys.readouterr()


def test_a_stale_command_is_reported_with_its_page_and_line(monkeypatch, capsys):
    """The twin of the page test: a page holding a bad command fails, naming page:line; a module only named in
    inline text must exist, while the same words in a code block are a command and must parse."""
    page = os.path.join(REPO_ROOT, "docs", "example.md")
    text = ("Intro, `python -m pytest tests/docs/test_readme_commands.py` and `.venv/bin/python -m pytest -q tests`.\n"
            "```bash\npython train.py --config short --no_such_flag\n```\n"
            "Named only: `python -m no_such_module`.\n"
            "```bash\npython -m exercises.check_tp_mlp\n```\n"
            "Wrapped: see `python train.py --config short\n--no_such_flag` and `make\ndemo`.\n")
    checked, failures = stale_commands(page, text, monkeypatch)
    capsys.readouterr()
    assert checked == ["-m pytest tests/docs/test_readme_commands.py", "-m pytest tests",
                       "-m exercises.check_tp_mlp", "make"], checked
    assert [failure.split(": ")[0] for failure in failures] == ["docs/example.md:3", "docs/example.md:5",
                                                                "docs/example.md:9"], failures


def heading_anchors(text):
    """The `#anchors` GitHub gives a markdown page's headings: lower case, punctuation dropped, spaces as '-', and
    a repeated heading numbered (-1, -2, ...)."""
    anchors, in_block = set(), False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_block or not heading:
            continue
        anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        unique, n = anchor, 0
        while unique in anchors:
            n += 1
            unique = f"{anchor}-{n}"
        anchors.add(unique)
    return anchors


def page_links(text):
    """(line number, target) of every markdown link and image outside code blocks and inline code."""
    links, in_block = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if not in_block:
            links += [(number, target) for target in LINK.findall(re.sub(r"`[^`]*`", "", line))]
    return links


def broken_links(path, text):
    """page:line of each relative link of the page whose file, or whose #anchor in a markdown file, is missing."""
    broken = []
    for number, target in page_links(text):
        if URL_SCHEME.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if file_part and not os.path.exists(linked):
            broken.append(f"{page_name(path)}:{number}: ({target}): no file {page_name(linked)}")
        elif anchor and linked.endswith(".md"):
            linked_text = text if linked == path else open(linked).read()
            if anchor not in heading_anchors(linked_text):
                broken.append(f"{page_name(path)}:{number}: ({target}): {page_name(linked)} has no heading #{anchor}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_every_relative_link_points_to_an_existing_file(page):
    text = open(page).read()
    assert page_links(text) or page == README, f"{page_name(page)} links nothing; the parser may have lost them"
    broken = broken_links(page, text)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_links_every_docs_page():
    """A docs/ page README does not link is a page no reader finds."""
    linked = {os.path.normpath(os.path.join(REPO_ROOT, target.partition("#")[0]))
              for _, target in page_links(open(README).read())}
    assert len(PAGES) > 1
    missing = [page_name(page) for page in PAGES[1:] if page not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_the_link_checker_catches_broken_links():
    """The twin: a link to a missing file, and one to a missing heading, are reported with their line; good links,
    links in code and web addresses are not."""
    page = os.path.join(REPO_ROOT, "docs", "example.md")
    text = ("# Example page\n"
            "See [testing](testing.md#what-has-run-on-a-gpu), [the top](#example-page), "
            "![a figure](../tutorial_images/mp_layouts.png) and [PyTorch](https://pytorch.org).\n"
            "A [stale page](nowhere.md) and `[in code](nowhere.md)`.\n"
            "```\n[in a block](nowhere.md)\n```\n"
            "A [stale heading](../README.md#no-such-section).\n")
    broken = broken_links(page, text)
    assert [line.split(": ")[0] for line in broken] == ["docs/example.md:3", "docs/example.md:7"], broken
    assert "no file docs/nowhere.md" in broken[0] and "README.md has no heading #no-such-section" in broken[1]
    assert heading_anchors("## Launchers: torchrun, `torch.distributed.launch`\n## A\n## A\n") == {
        "launchers-torchrun-torchdistributedlaunch", "a", "a-1"}


def unshown_figures(figures, pages):
    """The figure files (paths relative to the repository) no page shows as an image: `![...](path)`."""
    shown = set()
    for path, text in pages:
        for _, target in page_links(text):
            shown.add(page_name(os.path.normpath(os.path.join(os.path.dirname(path), target.partition("#")[0]))))
    return sorted(set(figures) - shown)


def test_every_figure_is_shown_somewhere():
    """Each figure `make figures` draws is shown by README or a docs/ page (from docs/ the path is
    ../tutorial_images/). The twin: a figure no page shows is named, one shown from docs/ is not."""
    figures = [page_name(path) for path in glob.glob(os.path.join(REPO_ROOT, "tutorial_images", "*.png"))]
    assert figures
    unshown = unshown_figures(figures, [(path, open(path).read()) for path in PAGES])
    assert not unshown, f"figures no page shows: {unshown}"
    page = os.path.join(REPO_ROOT, "docs", "example.md")
    assert unshown_figures(["tutorial_images/a.png", "tutorial_images/b.png"],
                           [(page, "![A](../tutorial_images/a.png)")]) == ["tutorial_images/b.png"]

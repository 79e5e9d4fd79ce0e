"""Docs that cannot rot: README.md and docs/*.md checked against the code they describe.

* Every command in a fenced block (``python -m fbt_megatron.…``, ``torchrun … -m fbt_megatron.…``,
  the console scripts, ``python tools/….py``, ``lm-eval``, ``make``) parses against the real command
  line, in this process: the entry point's own parser runs (nothing trains, nothing is written), a
  recipe is loaded with the flags applied and checked for the command's world size. A renamed or
  removed flag, recipe or tool fails here, not for a user.
* Every ``--flag`` quoted in the prose belongs to one of those command lines.
* The README's layout table names every module and package of ``fbt_megatron/`` and of ``tools/``,
  and nothing that no longer exists.
* Every relative link points to a file, and every page of ``docs/`` is linked from the README.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import itertools
import re
import runpy
import shlex
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [ROOT / "recipes" / "README.md", ROOT / "slurm" / "README.md"]  # linked from the docs: links checked
# Pages linked before their branch is merged (h-vllm, h-evidence): delete a name once its page exists.
PENDING = set()
# Flags of programs whose parser is not in this process (sbatch options quoted from the job script).
FOREIGN_FLAGS = {"--requeue", "--open-mode", "--signal", "--dependency", "--no-kill",  # sbatch's
                 "--kill-on-bad-exit", "--wait", "--batch",  # srun's, scancel's
                 "--no-enable-chunked-prefill", "--hf-overrides", "--enforce-eager",  # vllm serve's
                 "--kv-cache-memory-bytes", "--gpu-memory-utilization",  # vllm serve's
                 "--isolation"}  # podman build's
MAX_README_LINES = 160


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ----------------------------------------------------------------------------------------------
# Reading the pages


def fenced_lines(text: str):
    """(line number, logical line) of every line in a fenced block, with ``\\`` continuations joined;
    a ```python block is code, not commands, and is skipped."""
    inside, code, pending, start = False, False, "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            code = inside and line.strip() == "```python"
            continue
        if not inside or code:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def inline_spans(text: str):
    """(line number, text) of every `code span` outside fenced blocks."""
    inside = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            yield from ((number, code) for code in re.findall(r"`([^`\n]+)`", line))


def inline_code(text: str) -> List[str]:
    return [code for _, code in inline_spans(text)]


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


# ----------------------------------------------------------------------------------------------
# The commands


@dataclass
class Command:
    where: str  # page:line
    line: str
    program: str  # "module" (python -m, torchrun -m, a console script), "tool", "script", "lm-eval", "make"
    target: str  # the module, the tool's or script's path, or the make target
    args: List[str]
    world: int = 1
    launcher: Optional[List[str]] = None  # torchrun's own arguments


def console_scripts() -> dict:
    """``fbt-train`` → ``fbt_megatron.train`` (pyproject's [project.scripts]; a command of
    ``fbt_megatron.commands`` by the name ``python -m`` runs it under)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: spec.split(":")[0].removesuffix(".__main__").replace("fbt_megatron.commands.", "fbt_megatron.", 1)
            for name, spec in scripts.items()}


def classify(where: str, line: str) -> Optional[Command]:
    """The command a line runs, or None for one these tests do not read (pip, sbatch, output)."""
    try:
        return _classify(where, line)
    except (ValueError, AssertionError, SystemExit) as e:  # unbalanced quotes, torchrun's own flags
        return Command(where, line, "unreadable", repr(e), [])


def _classify(where: str, line: str) -> Optional[Command]:
    tokens = shlex.split(line, comments=True)
    env = {}
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    if not tokens:
        return None
    head, rest = tokens[0], tokens[1:]
    world = int(env.get("WORLD_SIZE", 1))
    if head in ("python", "python3") and rest[:2] == ["-m", "fbt_megatron.torchrun"]:  # torchrun's command line
        head, rest = "torchrun", rest[2:]
    if head in ("python", "python3") and rest[:1] == ["-m"] and len(rest) > 1:
        return Command(where, line, "module", rest[1], rest[2:], world)
    if head in ("python", "python3") and rest and (rest[0].endswith(".py") or (ROOT / rest[0] / "__main__.py").is_file()):
        return Command(where, line, "tool", rest[0], rest[1:], world)
    if head == "torchrun":
        from torch.distributed.run import get_args_parser

        launch = get_args_parser().parse_args(rest)
        assert launch.module, f"{where}: torchrun without -m: {line}"
        world = int(str(launch.nproc_per_node)) * int(str(launch.nnodes).split(":")[-1])
        ours = len(launch.training_script_args) + 2  # -m MODULE ARGS
        return Command(where, line, "module", launch.training_script, launch.training_script_args, world, rest[:-ours])
    if head in console_scripts():
        return Command(where, line, "module", console_scripts()[head], rest, world)
    if head in ("lm-eval", "lm_eval"):
        return Command(where, line, "lm-eval", head, rest, world)
    if head == "make":
        return Command(where, line, "make", rest[0] if rest else "", rest[1:], world)
    if head.endswith(".sh"):
        return Command(where, line, "script", head, rest, world)
    assert not re.search(r"-m\s+fbt_megatron|fbt_megatron\.", line.split("#")[0]), \
        f"{where}: a command of this project run in a way these tests do not read: {line}"
    return None


INLINE_COMMAND = re.compile(r"([A-Z_]+=\S+ )*(python3? -m \S|python3? \S+\.py|torchrun .*-m \S|make \w|lm-eval \w|fbt-\w+\b)")


def commands(pages=PAGES) -> List[Command]:
    """Every command of a fenced block; and every command quoted in a sentence, as a reference:
    it is run with ``--help`` after its subcommands (its flags are checked with the prose's)."""
    found = []
    for page in pages:
        text = page.read_text()
        for number, line in fenced_lines(text):
            found.append(classify(f"{rel(page)}:{number}", line))
        for number, code in inline_spans(text):
            command = INLINE_COMMAND.match(code) and classify(f"{rel(page)}:{number}", code)
            if command and command.program != "make":
                command.args = [*itertools.takewhile(lambda a: not a.startswith("-"), command.args), "--help"]
            found.append(command)
    found, seen = [c for c in found if c], Counter()
    for c in found:  # two commands on one line: README.md:12, README.md:12.2
        seen[c.where] += 1
        c.where += f".{seen[c.where]}" if seen[c.where] > 1 else ""
    return found


# ----------------------------------------------------------------------------------------------
# Parsing a command against its entry point


class Parsed(Exception):
    """Raised by ArgumentParser.parse_args once it has parsed: an entry point run up to this point
    has read its command line and done nothing else."""


def run_until_parsed(run: Callable[[], object], prog: str, args: List[str], patch: pytest.MonkeyPatch):
    """Run an entry point (as ``__main__``, with ``sys.argv``) until its parser has parsed; the namespace."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse_args(self, args, namespace))

    patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    patch.setattr(sys, "argv", [prog, *args])
    try:
        run()
    except Parsed as parsed:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        return parsed.args[0]
    raise AssertionError("the entry point returned without parsing a command line")


def check_recipe(args: List[str], world: int):
    """The training command line: the recipe with every flag applied, valid for ``world`` processes
    (checked as the planner checks a layout for other machines)."""
    from fbt_megatron.commands.train import parse_args

    recipe = parse_args(args)
    recipe.validate(world, this_machine=False)
    return recipe


def check_train(command: Command, patch) -> None:
    check_recipe(command.args, command.world)


def check_plan(command: Command, patch) -> None:
    from fbt_megatron.commands.plan import parse

    options, recipe = parse(command.args)
    recipe.validate(options.nodes * options.gpus_per_node, this_machine=False)


def check_generate(command: Command, patch) -> None:
    from fbt_megatron.commands.generate import parse

    parse(command.args)


def check_slurm(command: Command, patch) -> None:
    """``submit`` with its own flags before ``--`` and training flags after it, for every stage."""
    from fbt_megatron.commands.slurm import parser

    args = command.args
    ours, training = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
    options = parser().parse_args(ours)
    if options.command != "submit":  # its flags parsed: no recipe to check
        return
    for recipe in options.chain or [options.recipe]:
        check_recipe(["--recipe", recipe, *training], options.nodes * max(options.gpus_per_node, 1))


def check_task_evaluation(command: Command, patch) -> None:
    """Its own flags, the rest read as training flags, up to evaluating the run."""
    import fbt_megatron.evaluation.tasks.evaluate as module

    def stop(*args, **kwargs):
        raise Parsed()

    patch.setattr(module, "evaluate_run", stop)
    with pytest.raises(Parsed):
        module.main(command.args)


def check_evaluation(command: Command, patch) -> None:
    if command.args[:1] == ["lm-eval"]:
        from fbt_megatron.evaluation.__main__ import _backend

        args, _ = _backend(command.args[1:])  # ``--backend vllm`` taken out, as the entry point does
        check_lm_eval(Command(command.where, command.line, "lm-eval", "lm-eval", args), patch)
    else:
        run_until_parsed(lambda: runpy.run_module("fbt_megatron.evaluation", run_name="__main__"),
                         "python -m fbt_megatron.evaluation", command.args, patch)


def check_lm_eval(command: Command, patch) -> None:
    """lm-eval's own command line (its console script's function); ``--model`` must be registered
    (``fbt`` is, by this project)."""
    import lm_eval.__main__
    from lm_eval.api.registry import get_model

    import fbt_megatron.evaluation.lm  # noqa: F401  (registers --model fbt)

    patch.setattr(lm_eval.__main__, "setup_logging", lambda *args, **kwargs: None)  # no handler on our stderr
    options = run_until_parsed(lm_eval.__main__.cli_evaluate, "lm-eval", command.args, patch)
    if getattr(options, "model", None) == "fbt-vllm":  # registered with vLLM installed (.venv-serve)
        if importlib.util.find_spec("vllm") is None:
            return
        import fbt_megatron.evaluation.vllm_lm  # noqa: F401
    if getattr(options, "model", None):
        get_model(options.model)


def stops_at_parse_args(source: Path, name: str) -> None:
    """An entry point run until ``parse_args`` must call it itself (else it would run for real)."""
    assert "parse_args(" in source.read_text(), (
        f"{name} does not call ArgumentParser.parse_args in {source.name}: give it a parse-only check in "
        f"tests/test_docs.py (MODULES)")


def command_source(target: str, spec) -> Path:
    """The file that holds an entry point's code: a shim at the package top (``python -m
    fbt_megatron.studies``) hands over to its command (``fbt_megatron.commands.studies``)."""
    package, _, name = target.rpartition(".")
    code = importlib.util.find_spec(f"fbt_megatron.commands.{name}") if package == "fbt_megatron" else None
    return Path((code or spec).origin)


def check_module(command: Command, patch) -> None:
    """Any other entry point: run as ``python -m`` until its parser has parsed."""
    spec = importlib.util.find_spec(command.target)
    assert spec is not None, f"no module {command.target}"
    if spec.submodule_search_locations:  # a package: its __main__
        spec = importlib.util.find_spec(command.target + ".__main__")
        assert spec is not None, f"{command.target} is a package without __main__"
    stops_at_parse_args(command_source(command.target, spec), command.target)
    run_until_parsed(lambda: runpy.run_module(command.target, run_name="__main__"),
                     f"python -m {command.target}", command.args, patch)


def check_tool(command: Command, patch) -> None:
    script = ROOT / command.target  # a file, or a folder with a __main__.py
    assert script.exists(), f"{command.target} does not exist"
    stops_at_parse_args(script / "__main__.py" if script.is_dir() else script, command.target)
    run_until_parsed(lambda: runpy.run_path(str(script), run_name="__main__"), command.target, command.args, patch)


def check_script(command: Command, patch) -> None:
    """A shell script of the repository; its arguments are those of the tool it hands them to."""
    script = ROOT / command.target
    assert script.is_file(), f"{command.target} does not exist"
    tool = re.search(r'(tools/\w+\.py)"? "\$@"', script.read_text())
    if command.args or tool:
        assert tool, f"{command.target} passes no arguments on to a tool"
        check_tool(Command(command.where, command.line, "tool", tool.group(1), command.args), patch)


def check_make(command: Command, patch) -> None:
    """The target exists; DEMO_ARGS are tools/demo.py's flags."""
    targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
    assert command.target in targets, f"make {command.target}: no such target (the Makefile has {targets})"
    for assignment in command.args:
        name, _, value = assignment.partition("=")
        assert name == "DEMO_ARGS", f"make {command.target}: {assignment!r} is not read by the Makefile"
        check_tool(Command(command.where, command.line, "tool", "tools/demo.py", shlex.split(value)), patch)


MODULES = {
    "fbt_megatron.train": check_train,
    "fbt_megatron.plan": check_plan,
    "fbt_megatron.generate": check_generate,
    "fbt_megatron.slurm": check_slurm,
    "fbt_megatron.evaluation.tasks.evaluate": check_task_evaluation,
    "fbt_megatron.evaluation": check_evaluation,
}


def check(command: Command, patch: pytest.MonkeyPatch) -> None:
    assert command.program != "unreadable", f"cannot read the command: {command.target}"
    if command.launcher is not None:
        from torch.distributed.run import get_args_parser

        get_args_parser().parse_args([*command.launcher, "-m", command.target])
    if command.program == "module":
        assert command.target.split(".")[0] in ("fbt_megatron", "tools"), f"not this project's module: {command.target}"
        MODULES.get(command.target, check_module)(command, patch)
    else:
        {"tool": check_tool, "script": check_script, "lm-eval": check_lm_eval, "make": check_make}[command.program](command, patch)


class Recorder:
    """Every argument parser that parses while the commands are checked: the flags the docs may quote."""

    def __init__(self):
        self.parsers: list = []

    def options(self) -> set:
        seen, found, todo = set(), set(), list(self.parsers)
        while todo:
            parser = todo.pop()
            if id(parser) in seen:
                continue
            seen.add(id(parser))
            for action in parser._actions:
                found.update(action.option_strings)
                if isinstance(action, argparse._SubParsersAction):
                    todo.extend(action.choices.values())
        return found


@pytest.fixture(scope="module")
def checked():
    """{where: None or the one-line failure} for every command, and the parsers that ran."""
    recorder, results = Recorder(), {}
    parse_known_args = argparse.ArgumentParser.parse_known_args

    def recording(self, *args, **kwargs):
        recorder.parsers.append(self)
        return parse_known_args(self, *args, **kwargs)

    for command in commands():
        stderr = io.StringIO()
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr), \
                contextlib.redirect_stdout(io.StringIO()):
            patch.setattr(argparse.ArgumentParser, "parse_known_args", recording)
            try:
                check(command, patch)
                results[command.where] = None
            except SystemExit as e:  # --help (0), an argparse error or run_cli's one line (2)
                failed = e.code not in (0, None)
                results[command.where] = f"exit {e.code}: {stderr.getvalue().strip()[-600:]}" if failed else None
            except Exception as e:  # noqa: BLE001  (reported per command below)
                results[command.where] = f"{type(e).__name__}: {e}"
    return results, recorder


ALL_COMMANDS = commands()


def test_the_docs_show_commands():
    modules = {c.target for c in ALL_COMMANDS if c.program == "module"}
    assert {"fbt_megatron.train", "fbt_megatron.generate", "fbt_megatron.convert"} <= modules, modules
    assert any(c.world > 1 for c in ALL_COMMANDS), "no torchrun command found"


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=[c.where for c in ALL_COMMANDS])
def test_command_parses(command, checked):
    results, _ = checked
    assert results[command.where] is None, f"{command.where}: {command.line.strip()}\n  → {results[command.where]}"


def test_every_quoted_flag_exists(checked):
    """A ``--flag`` in the prose (in backticks) is a flag of a command the docs show."""
    _, recorder = checked
    known = recorder.options() | FOREIGN_FLAGS
    missing = []
    for page in PAGES:
        text = page.read_text()
        for code in inline_code(text):
            for name in re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", code):
                if name not in known:
                    missing.append(f"{rel(page)}: `{code}`: {name}")
    assert not missing, "flags no command line of the docs has:\n" + "\n".join(missing)


def expand(path: str) -> List[str]:
    """``recipes/a_{x,y}.yaml`` → the two paths."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [p for choice in match.group(1).split(",") for p in expand(path[:match.start()] + choice + path[match.end():])]


def test_every_quoted_path_exists():
    """A file or folder of the repository quoted in the prose (`fbt_megatron/model/losses.py`, `tools/demo.py`,
    `recipes/sft.yaml`, `tests/test_stages.py`, `requirements-gpu.txt`) exists."""
    missing = []
    for page in PAGES:
        for code in inline_code(page.read_text()):
            for token in code.split():
                token = token.strip(".,;:()")
                if re.fullmatch(r"(fbt_megatron|tools|tests|recipes|slurm|docs|\.ci)/[\w./{},-]*|requirements[\w-]*\.txt", token):
                    missing += [f"{rel(page)}: `{code}`: {p}" for p in expand(token) if not (ROOT / p).exists()]
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


# ----------------------------------------------------------------------------------------------
# The layout table


def layout_rows() -> dict:
    """{path: description} of the README's layout table (rows ``| `path` | what |``)."""
    section = README.read_text().split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\|\s*`([^`]+)`\s*\|(.*)\|\s*$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def children(folder: Path) -> set:
    """A folder's modules and scripts (``name.py``, ``name.sh``) and packages (``name/``)."""
    names = set()
    for path in folder.iterdir():
        if path.is_dir() and any(path.glob("*.py")):
            names.add(path.name + "/")
        elif path.suffix in (".py", ".sh") and path.name not in ("__init__.py", "__main__.py"):
            names.add(path.name)
    return names


def named(description: str) -> set:
    """The module and package names a row's description quotes: ``name.py``, ``name/``."""
    return {code for code in re.findall(r"`([^`]+)`", description) if re.fullmatch(r"\w+(\.py|\.sh|/)", code)}


def test_layout_names_every_module():
    rows = layout_rows()
    package = ROOT / "fbt_megatron"
    expected = {f"fbt_megatron/{name}" for name in children(package)}
    listed = {path for path in rows if path.startswith("fbt_megatron/")}
    assert not expected - listed, f"modules without a row in the README's layout: {sorted(expected - listed)}"
    assert not listed - expected, f"rows for modules that do not exist: {sorted(listed - expected)}"
    for path in rows:
        assert (ROOT / path).exists(), f"layout row for a path that does not exist: {path}"
    problems = []
    for path, description in rows.items():
        folder = ROOT / path
        if not (path.endswith("/") and (path.startswith("fbt_megatron/") or path == "tools/")):
            continue
        have, quoted = children(folder), named(description)
        problems += [f"{path}: no mention of `{name}`" for name in sorted(have - quoted)]
        problems += [f"{path}: `{name}` does not exist" for name in sorted(quoted - have)]
    assert not problems, "the README's layout table is stale:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------------------------
# Links


def test_relative_links_point_to_files():
    broken, still_pending = [], []
    for page in PAGES + LINKED:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())):
            if re.match(r"[a-z]+:|#", target):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            name = rel(path) if path.is_relative_to(ROOT) else str(path)
            if path.exists():
                still_pending += [name] if name in PENDING else []
            elif name not in PENDING:
                broken.append(f"{rel(page)}: ({target})")
    assert not broken, "links to nothing:\n" + "\n".join(broken)
    assert not still_pending, f"these pages exist now: delete them from PENDING in tests/test_docs.py: {sorted(set(still_pending))}"


def test_readme_links_every_docs_page_and_stays_short():
    text = README.read_text()
    linked = {(ROOT / t.split("#")[0]).resolve() for t in re.findall(r"\]\(([^)\s]+)\)", text)}
    orphans = [rel(page) for page in PAGES[1:] if page.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"
    lines = len(text.splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail into docs/"

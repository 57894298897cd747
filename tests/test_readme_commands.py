"""Every ``sim2edge`` and ``sim2edge-agent`` command the README and the reference in ``docs/`` show parses with the
real CLIs, every model they name is a name the pipeline registers, and the quick read-only ones run.

Commands come from the fenced shell blocks (continuations joined, comments dropped) and from inline code spans.
Placeholders stay as written (``URL``, ``FILE``); ``[--opt X]`` is checked as ``--opt X``, ``a|b`` as ``a``, ``cmd | grep x`` as ``cmd``.
A fenced command must parse whole; an inline one may leave out required options (prose names a command,
``HEALTHCHECK = `sim2edge-agent verify` + …``), but its subcommand and the options it shows must exist.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from edge import cli as agent_cli
from flows import cli
from flows.params import PipelineParams
from stages.sim.registry import names

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
"""The front page and every reference page."""
PROGRAMS = ("sim2edge", "sim2edge-agent")
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "2>&1"}
ABSENT = {"sim2edge export --engine"}
"""Commands the docs say do not exist yet; they must not parse (else the docs are out of date)."""
RUN_HERE = {("tasks",), ("targets",)}
"""Read-only and quick: run for real, not only parsed."""


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of the fenced ``bash``/``sh``/``console``/``shell`` blocks."""
    found, block, start, pending = [], False, 0, ""
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):  # a fence may be indented (inside a list item)
            block = not block and line.lstrip()[3:].strip() in ("bash", "sh", "console", "shell")
            continue
        if not block:
            continue
        line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if not pending:
            start = n
        pending += (line if pending else line.strip()).removeprefix("$ ")
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            found.append((start, pending.strip()))
        pending = ""
    return found


def inline_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of inline code spans that start with a sim2edge program."""
    spans = re.finditer(r"(?<!`)`((?:\.venv/bin/)?sim2edge(?:-agent)?(?:\s[^`]*)?)`(?!`)", text)
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())) for m in spans]


def commands() -> list[tuple[str, str, list[str], bool]]:
    """(file:line, as written, argv, whether fenced) of every sim2edge/sim2edge-agent command in the pages."""
    found = []
    for page in PAGES:
        found += page_commands(page.read_text(), page.relative_to(REPO).as_posix())
    return found


def page_commands(text: str, name: str) -> list[tuple[str, str, list[str], bool]]:
    found = []
    for fenced, listed in ((True, shell_lines(text)), (False, inline_commands(text))):
        for line, command in listed:
            argv = shlex.split(re.sub(r"\[([^\]]*)\]", r"\1", command))
            cut = [i for i, a in enumerate(argv) if a in SHELL_OPERATORS]
            argv = argv[:cut[0]] if cut else argv  # the first command of a pipeline or list
            argv[0] = argv[0].removeprefix(".venv/bin/")
            if argv[0] in PROGRAMS:
                found.append((f"{name}:{line}", command, [argv[0]] + [a.split("|")[0] for a in argv[1:]], fenced))
    return found


COMMANDS = commands()
MODEL_NAMES = {PipelineParams(task=t).policy_name for t in names()}


def test_the_docs_show_commands_of_both_programs():
    programs = {argv[0] for _, _, argv, _ in COMMANDS}
    assert programs == set(PROGRAMS) and len(COMMANDS) >= 20, COMMANDS


def parse_sim2edge(args: list[str], whole: bool) -> None:
    """Parse ``args`` with the real command tree (typer's own click) without invoking it; raises ValueError.
    Not ``whole``: a missing required value is allowed (unknown commands and options still fail)."""
    command = typer.main.get_command(cli.app)
    name, rest = "sim2edge", list(args)
    ctx = command.make_context(name, [], resilient_parsing=True)  # the groups take no options
    while hasattr(command, "resolve_command"):  # a group
        word = rest[0] if rest else ""
        name, command, rest = command.resolve_command(ctx, rest)
        if command is None:
            raise ValueError(f"no command {word!r} under {ctx.command_path!r}")
        if hasattr(command, "resolve_command"):
            ctx = command.make_context(name, [], parent=ctx, resilient_parsing=True)
    try:
        command.make_context(name, list(rest), parent=ctx)  # click consumes the list it parses
    except Exception as e:  # typer's click: UsageError and its subclasses
        prose = type(e).__name__ == "MissingParameter" or (  # or an option named without its value
            type(e).__name__ == "BadOptionUsage" and rest and rest[-1].startswith("--"))
        if whole or not prose:
            raise ValueError(e.format_message() if hasattr(e, "format_message") else str(e)) from None


MISSING = re.compile(r"the following arguments are required: (?P<listed>.+)|one of the arguments (?P<either>.+) is required")
"""argparse's own error for required arguments left out."""


def parse_agent(args: list[str], whole: bool) -> None:
    """Parse ``args`` with the agent's argparse parser; not ``whole``: each required argument argparse names as missing
    gets a placeholder and the parse runs again (unknown subcommands and options still fail)."""
    args = list(args)
    for _ in range(4):  # one round per argparse level that checks required arguments
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                agent_cli.parser().parse_args(args)
            return
        except SystemExit:
            missing = None if whole else MISSING.search(err.getvalue())
            if missing is None:
                sys.stderr.write(err.getvalue())
                raise
            names = missing["listed"].split(", ") if missing["listed"] else missing["either"].split()[:1]
            args += [a for name in names for a in ([name, "0"] if name.startswith("-") else ["0"])]
    raise ValueError(f"still missing required arguments after placeholders: {args}")


@pytest.mark.parametrize("line,command,argv,fenced", COMMANDS, ids=[n for n, *_ in COMMANDS])
def test_readme_command_parses_and_names_registered_models(line, command, argv, fenced, capsys):
    args = argv[1:]
    if command in ABSENT:
        with pytest.raises((ValueError, SystemExit)):
            (parse_sim2edge if argv[0] == "sim2edge" else parse_agent)(args, fenced)
        return
    if "--help" in args or not args:
        if argv[0] == "sim2edge":
            r = CliRunner().invoke(cli.app, args or ["--help"])
            assert r.exit_code == 0, f"{line}: `{command}` exits {r.exit_code}: {r.output[-500:]}"
        else:
            with pytest.raises(SystemExit) as e:
                agent_cli.parser().parse_args(args or ["--help"])
            assert e.value.code == 0, f"{line}: `{command}`"
        return
    try:
        if argv[0] == "sim2edge":
            parse_sim2edge(args, whole=fenced)
        else:
            parse_agent(args, whole=fenced)
    except ValueError as e:
        pytest.fail(f"{line}: `{command}` does not parse: {e}")
    except SystemExit:
        pytest.fail(f"{line}: `{command}` does not parse: {capsys.readouterr().err.strip()[-300:]}")
    for ref in (a for a in args if re.fullmatch(r"[\w.-]+@\w+", a)):
        name = ref.split("@")[0]
        assert name in MODEL_NAMES, f"{line}: `{command}` names model {name!r}; the pipeline registers {sorted(MODEL_NAMES)}"


@pytest.mark.parametrize("args", sorted(RUN_HERE))
def test_readme_read_only_commands_run(args):
    shown = {tuple(argv[1:]) for _, _, argv, _ in COMMANDS}
    assert args in shown, f"neither the README nor docs/ shows `sim2edge {' '.join(args)}`"
    r = CliRunner().invoke(cli.app, list(args))
    assert r.exit_code == 0 and r.output.strip(), r.output


@pytest.mark.parametrize("program,args,whole", [
    ("sim2edge", ["nosuch"], False), ("sim2edge", ["devices", "--nope", "x"], False),
    ("sim2edge", ["run", "--iterations", "many"], True), ("sim2edge", ["keys", "generate"], True),
    ("sim2edge", ["evaluate", "--bundle"], True), ("sim2edge", ["package", "BUNDLE", "--target", "orin-jp6.1"], False),
    ("sim2edge-agent", ["pull", "cartpole@champion", "--nope"], False), ("sim2edge-agent", ["verify"], True)])
def test_the_checker_refuses_what_the_clis_refuse(program, args, whole, capsys):
    with pytest.raises((ValueError, SystemExit)):
        (parse_sim2edge if program == "sim2edge" else parse_agent)(args, whole)

"""The docs name only commands, options, modules and files that exist.

Every `dualpath CMD ... --option` in README.md and docs/*.md (inline code and code blocks) must
be a command of the CLI whose `--help` lists that option; every `python -m MODULE` must import;
every path of this repository the docs name (`testbed/...py`, `scripts/...`, `topologies/...`)
must be there. A page that falls behind the code fails here, not in a reader's shell."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tests.conftest import REPO
from testbed.cli import app

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CODE_SPAN = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"\bdualpath ((?:[a-z][a-z-]*)(?:\\?\|[a-z][a-z-]*)*)(.*)")
PATH = re.compile(r"(?<![\w./-])((?:testbed|dualpath|emulators|simulator|scripts|topologies|examples|docs)/[\w./-]*\w)")


def code_of(text: str) -> list[str]:
    """Inline code spans and the lines of fenced or indented code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") and not line.lstrip().startswith(("-", "*")):
            out.append(line.strip())
        else:
            out.extend(CODE_SPAN.findall(line))
    return out


def invocations(text: str) -> list[tuple[str, set[str]]]:
    """(command, options) for every `dualpath CMD ...` in the code of a page; `run|sim` gives two."""
    found = []
    for code in code_of(text):
        for m in COMMAND.finditer(code):
            rest = m.group(2).split(" -- ")[0]  # after a bare --, the options are the program's
            rest = re.split(r"\bdualpath |[;#]| \| |&&", rest)[0]
            opts = {o.split("=")[0] for o in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest)}
            for name in m.group(1).replace("\\|", "|").split("|"):
                found.append((name, opts))
    return found


def _options(cmd) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


def cli_options() -> dict[str, set[str]]:
    """Each command's options; a group's are its subcommands' (`dualpath profile run|model`), and a
    subcommand that hands what it does not know to `dualpath run` (profile run) has run's too."""
    group = typer.main.get_command(app)
    out = {}
    for name, cmd in group.commands.items():
        opts = _options(cmd)
        for sub in getattr(cmd, "commands", {}).values():
            opts |= _options(sub)
            if sub.context_settings.get("ignore_unknown_options"):
                opts |= _options(group.commands["run"])
        out[name] = opts | {"--help"}
    return out


def test_the_parser_finds_commands_and_options_in_code_only():
    text = ("Run `dualpath run topologies/x.yaml --modes a,b --seed=3` now; dualpath fake --nope is prose.\n"
            "| `dualpath run\\|sim ... --trace FILE` | x |\n"
            "```sh\ndualpath exec p0e0 --class kv -- iperf3 --client x   # comment --not\n```\n"
            "    dualpath check --json\n")
    assert invocations(text) == [("run", {"--modes", "--seed"}), ("run", {"--trace"}), ("sim", {"--trace"}),
                                 ("exec", {"--class"}), ("check", {"--json"})]


def test_every_documented_command_and_option_exists():
    known = cli_options()
    bad, checked = [], 0
    for page in PAGES:
        for name, opts in invocations(page.read_text()):
            checked += 1
            if name not in known:
                bad.append(f"{page.name}: no command `dualpath {name}`")
                continue
            bad += [f"{page.name}: `dualpath {name}` has no {o}" for o in sorted(opts - known[name])]
    assert checked > 50, f"only {checked} commands found in the docs: the pattern is wrong"
    assert bad == [], "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("name", sorted(cli_options()))
def test_every_command_prints_its_help(name):
    result = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_every_module_the_docs_run_imports():
    modules = {m for page in PAGES for m in re.findall(r"python3? -m ([\w.]+)", page.read_text())}
    ours = sorted(m for m in modules if m.split(".")[0] in ("testbed", "dualpath", "emulators", "simulator"))
    assert ours, "the docs run no module of ours: the pattern is wrong"
    assert [m for m in ours if importlib.util.find_spec(m) is None] == []


def test_every_path_the_docs_name_exists():
    missing = []
    for page in PAGES:
        for p in PATH.findall(page.read_text()):
            p = p.rstrip(".")
            if any(c in p for c in "*<>") or p.startswith(("results/",)):
                continue
            if not (REPO / p).exists():
                missing.append(f"{page.name}: {p}")
    assert missing == [], "\n".join(sorted(set(missing)))

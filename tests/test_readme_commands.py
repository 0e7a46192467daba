"""Every ``lightning-dfl`` command in the README's and docs' ``bash`` blocks parses, and every file it names
exists in the repository or is written by an earlier command of the same page; every ``python`` block of the
README and docs runs as printed (a block that is deliberately not runnable starts with ``# fragment: why``),
and the README's own algorithm runs from the command line as its "Running it" says."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_dfl.cli import entry
from lightning_dfl.cli.analysis import SUBCOMMANDS
from lightning_dfl.cli.plot import PLOT_KINDS

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROG = "lightning-dfl"
_BLOCK = re.compile(r"^([ \t]*)```bash[^\n]*\n(.*?)^\1```", re.M | re.S)
_SEPARATORS = {"&&", "||", ";", "|", "&"}
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def commands(markdown: str) -> list[list[str]]:
    """The ``lightning-dfl`` command lines of the ``bash`` blocks in order, as argument lists without the
    program (commands joined by ``&&``, ``;`` or ``|`` are split; comments and continuations handled)."""
    found = []
    for _, block in _BLOCK.findall(markdown):
        for text in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            line: list[str] = []
            for token in [*lexer, ";"]:
                if token not in _SEPARATORS:
                    line.append(token)
                    continue
                if line and line[0] == PROG:
                    found.append(line[1:])
                line = []
    return found


#: the first line of a ``python`` block that is deliberately not runnable (a fragment), with the reason after it
FRAGMENT = "# fragment:"
#: at most this many fragments in all pages: an example a reader can run is the rule
MAX_FRAGMENTS = 3


def all_python_blocks(markdown: str) -> list[tuple[int, str]]:
    """Every ``python`` block of a page with the line number of its opening fence."""
    return [(markdown.count("\n", 0, m.start()) + 1, m.group(1)) for m in _PYTHON_BLOCK.finditer(markdown)]


def python_blocks(markdown: str, heading: str) -> list[str]:
    """The ``python`` blocks of the section under ``heading`` (a whole heading line, e.g. ``"### Pieces"``), up to
    the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = markdown.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == heading)
    end = next((i for i in range(start + 1, len(lines))
                if re.match(rf"#{{1,{level}}} ", lines[i]) and not _in_fence(lines[:i])), len(lines))
    return _PYTHON_BLOCK.findall("".join(lines[start:end]))


def _in_fence(lines: list[str]) -> bool:
    """Whether the line after ``lines`` is inside a fenced code block (a ``#`` there is a comment)."""
    return sum(line.lstrip().startswith("```") for line in lines) % 2 == 1


def _option(args: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``args`` (the last one given)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _call(args: list[str]) -> tuple[int, str, str]:
    """``lightning-dfl ARGS`` in this process: exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            entry.main(args)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def _algorithm_name(class_path: str) -> str:
    """The registry name of an algorithm class (its run folders' parent: ``<root>/<name>/version_N``)."""
    module, _, attribute = class_path.rpartition(".")
    return getattr(__import__(module, fromlist=[attribute]), attribute).name


def check_page(markdown: str) -> list[str]:
    """The problems of a page's commands, run in order from the current folder (which holds ``configs/``):
    options that do not parse, config files that do not exist, run folders and checkpoints that no earlier
    ``fit`` of the page writes."""
    problems: list[str] = []
    produced: set[str] = set()
    runs_per_parent: dict[str, int] = {}

    def need(path: str | None, what: str, line: str, repository: bool) -> None:
        if path is None:
            return
        normal = str(Path(path))
        in_repo = repository and (REPO / normal).exists() and not normal.startswith("runs")
        if normal not in produced and not in_repo:
            problems.append(f"{line}: {what} {path!r} is neither in the repository nor written by an earlier command")

    for args in commands(markdown):
        line = " ".join([PROG, *args])
        if not args:
            continue
        name, rest = args[0], args[1:]
        if name == "fit":
            need(_option(rest, "--config"), "config", line, repository=True)
            need(_option(rest, "--ckpt_path"), "checkpoint", line, repository=True)
            if "--print_config" in rest:
                code, _, err = _call(args)
                if code:
                    problems.append(f"{line}: {err.strip()}")
                continue
            code, out, err = _call([*args, "--print_config"])
            if code:
                problems.append(f"{line}: {err.strip()}")
                continue
            trainer = yaml.safe_load(out)["trainer"]
            if trainer["logger"] is False:
                continue
            parent = str(Path(trainer["default_root_dir"]) / _algorithm_name(trainer["algorithm"]["class_path"]))
            version = runs_per_parent.get(parent, 0)
            runs_per_parent[parent] = version + 1
            run = str(Path(parent) / f"version_{version}")
            produced.add(run)
            checkpoint = _option(rest, "--ckpt_path")
            if checkpoint is not None and len(Path(checkpoint).parents) > 3 and \
                    str(Path(checkpoint).parents[2]) != str(Path(parent)):
                problems.append(f"{line}: resumes {checkpoint} but writes its run to {run}, not beside it; keep "
                                "the first run's --trainer.default_root_dir")
            if trainer["checkpoint_every"]:
                produced.add(str(Path(run) / "checkpoints" / "last.ckpt"))
        elif name in ("plot", *SUBCOMMANDS):
            if "--help" in rest or "-h" in rest:
                continue
            try:
                namespace = entry.command_parser(name).parse_args(rest)
            except (Exception, SystemExit) as err:  # argparse without exit_on_error exits
                problems.append(f"{line}: {err}")
                continue
            if name == "plot":
                if namespace.kind not in PLOT_KINDS:
                    problems.append(f"{line}: unknown plot kind {namespace.kind!r}")
                need(namespace.run_dir, "run folder", line, repository=True)
            for run in getattr(namespace, "runs", None) or []:
                need(run, "run folder", line, repository=True)
            if name == "export":
                need(namespace.checkpoint, "checkpoint", line, repository=True)
        else:
            code, _, err = _call(args)
            if code:
                problems.append(f"{line}: {err.strip()}")
    return problems


@pytest.fixture
def in_scratch(tmp_path, monkeypatch):
    """A temporary working folder holding a link to ``configs/``: nothing is written into the checkout."""
    (tmp_path / "configs").symlink_to(REPO / "configs", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"], "a command wrote into the working folder"


def test_commands_are_extracted_in_order():
    """Commands joined by ``&&``, continued lines, comments and indented blocks are all found."""
    text = ('```bash\npython3 -m venv .venv && lightning-dfl fit --config a.yaml  # run\n'
            'lightning-dfl fit --config b.yaml \\\n    --x=\'[1,2]\'\n```\n'
            'text lightning-dfl fit --config c.yaml\n'
            '  ```bash\n  lightning-dfl cost --runs \'[r/a,r/b]\'\n  ```\n'
            '```python\nlightning-dfl fit --config d.yaml\n```\n')
    assert commands(text) == [["fit", "--config", "a.yaml"], ["fit", "--config", "b.yaml", "--x=[1,2]"],
                              ["cost", "--runs", "[r/a,r/b]"]]


def test_the_readme_has_commands():
    """The README's main job and the commands of its sections are found."""
    found = commands((REPO / "README.md").read_text())
    assert found[0] == ["fit", "--config", "configs/dispfl_digits.yaml"]
    assert {args[0] for args in found} >= {"fit", "cost", "schedule", "export", "plot"}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_commands_parse_and_name_existing_files(page, in_scratch):
    """Each command of the page parses (``fit`` with ``--print_config``) and names files that exist."""
    assert check_page(page.read_text()) == []


@pytest.mark.parametrize("bad, expected", [
    ("lightning-dfl fit --config configs/dispfl_digits.yaml --trainer.roundz=10", "roundz"),
    ("lightning-dfl fit --config configs/dispfl_digitz.yaml", "dispfl_digitz"),
    ("lightning-dfl fit --config configs/dadpfl_digits.yaml --ckpt_path runs/x/dadpfl/version_0/checkpoints/last.ckpt",
     "checkpoint"),
    ("lightning-dfl fit --config configs/dadpfl_digits.yaml --trainer.default_root_dir=runs/a\n"
     "lightning-dfl export runs/a/dadpfl/version_0/checkpoints/last.ckpt", "checkpoint"),
    ("lightning-dfl fit --config configs/dadpfl_digits.yaml --trainer.default_root_dir=runs/a\n"
     "lightning-dfl cost --runs '[runs/a/dadpfl/version_1]'", "run folder"),
    ("lightning-dfl fit --config configs/dadpfl_digits.yaml --trainer.checkpoint_every=10 "
     "--trainer.default_root_dir=runs/a\n"
     "lightning-dfl fit --config configs/dadpfl_digits.yaml --ckpt_path runs/a/dadpfl/version_0/checkpoints/last.ckpt",
     "not beside it"),
    ("lightning-dfl cost --runz '[runs/a]'", "runz"),
    ("lightning-dfl schedule --neighbours '[5]'", "neighbours"),
    ("lightning-dfl plot diagnostic runs/a/dadpfl/version_0", "diagnostic"),
    ("lightning-dfl fitt --config configs/dispfl_digits.yaml", "fitt"),
])
def test_a_broken_command_is_reported(bad, expected, in_scratch):
    """A misspelled option, subcommand or config, and a run folder or checkpoint nothing writes, fail."""
    problems = check_page(f"```bash\n{bad}\n```\n")
    assert problems and expected in problems[-1]


def test_an_earlier_fit_provides_run_folders_and_checkpoints(in_scratch):
    """A fit with ``checkpoint_every`` and a root writes ``root/<algorithm>/version_0/checkpoints/last.ckpt``;
    a second fit there writes ``version_1``."""
    page = ("```bash\n"
            "lightning-dfl fit --config configs/dadpfl_digits.yaml --trainer.checkpoint_every=10 "
            "--trainer.default_root_dir=runs/a\n"
            "lightning-dfl fit --config configs/dadpfl_digits.yaml --trainer.default_root_dir=runs/a\n"
            "lightning-dfl export runs/a/dadpfl/version_0/checkpoints/last.ckpt --client 3 --out c.pt2\n"
            "lightning-dfl cost --runs '[runs/a/dadpfl/version_0,runs/a/dadpfl/version_1]'\n"
            "```\n")
    assert check_page(page) == []


def test_python_blocks_are_those_of_the_section():
    """A section's blocks end at the next heading of its level, not at a ``#`` comment inside a block."""
    text = ("## A\n```python\na = 1\n# not a heading\n```\n### A.1\n```python\nb = 2\n```\n"
            "## B\n```python\nc = 3\n```\n")
    assert python_blocks(text, "## A") == ["a = 1\n# not a heading\n", "b = 2\n"]
    assert python_blocks(text, "### A.1") == ["b = 2\n"]


def test_the_callbacks_in_a_plain_trainer_examples_run_as_printed(in_scratch, capsys):
    """Each example of "Callbacks in your own `Trainer`" runs alone, as printed, and prints what it says."""
    blocks = python_blocks((REPO / "README.md").read_text(), "### Callbacks in your own `Trainer`")
    assert len(blocks) == 3
    printed = []
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "__readme__"})  # a fresh namespace each
        printed.append(capsys.readouterr().out.strip().splitlines()[-1])
    stated = [line.removeprefix("# ") for line in blocks[0].splitlines() if line.startswith("# density")]
    assert printed[0] == stated[0] == "density 0.30, 4 mask updates"
    assert re.fullmatch(r"t\* = \d+, pruning rounds \[\d+(, \d+)*\], density 0\.\d\d", printed[1]), printed[1]
    t_star, first = (int(n) for n in re.findall(r"\d+", printed[1])[:2])  # both 1-based: none before t*
    assert first >= t_star
    stated = [line.removeprefix("# ") for line in blocks[2].splitlines() if line.startswith("# density")]
    assert printed[2] == stated[0] == "density 0.30, 4 mask updates"  # the user's own LightningCLI


# -- every Python example of the README and docs runs as printed -------------------------------------------------
_EXAMPLES = [(page, line, block) for page in PAGES for line, block in all_python_blocks(page.read_text())]
#: sections whose blocks a dedicated test runs (and checks what they print)
_RUN_ELSEWHERE = {("README.md", "### Callbacks in your own `Trainer`")}


def _run_elsewhere(page: Path, block: str) -> bool:
    return any(page.name == name and block in python_blocks(page.read_text(), heading)
               for name, heading in _RUN_ELSEWHERE)


def test_python_blocks_are_found_everywhere():
    """Every Python fence is a plain ```` ```python ```` at the start of a line (an indented or ```` ```py ````
    block would escape the tests), the README has its examples, and fragments stay few and say why."""
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if re.match(r"\s*```\s*py", line):
                assert line == "```python", f"{page.name}:{number}: write Python blocks as ```python at column 0"
    assert len([e for e in _EXAMPLES if e[0].name == "README.md"]) >= 4
    fragments = [(page.name, line) for page, line, block in _EXAMPLES if block.startswith(FRAGMENT)]
    assert len(fragments) <= MAX_FRAGMENTS, fragments
    for page, line, block in _EXAMPLES:
        if block.startswith(FRAGMENT):
            assert len(block.splitlines()[0]) > len(FRAGMENT) + 3, f"{page.name}:{line}: say why it is a fragment"


@pytest.mark.parametrize("page, line, block", _EXAMPLES, ids=[f"{p.name}:{n}" for p, n, _ in _EXAMPLES])
def test_python_example_runs_as_printed(page, line, block, tmp_path, monkeypatch, capsys):
    """Each block runs alone, in a fresh namespace, as a script (``__name__ == "__main__"``), from an empty
    folder holding a link to ``configs/``."""
    if block.startswith(FRAGMENT):
        pytest.skip(block.splitlines()[0])
    if _run_elsewhere(page, block):
        pytest.skip("run by a dedicated test of its section")
    (tmp_path / "configs").symlink_to(REPO / "configs", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(block, f"{page.name}:{line}", "exec"), namespace)
    finally:  # an example's classes (docs' Ditto) must not outlive it: the CLI would see two Algorithm subclasses
        namespace.clear()
        gc.collect()


def test_the_readme_algorithm_runs_from_python_and_the_command_line(tmp_path):
    """"Writing an algorithm": the block saved as ``my_algorithms.py`` runs with ``python my_algorithms.py``,
    and "Running it"'s command line, run by a shell as printed, trains it (its run folder is named by it)."""
    readme = (REPO / "README.md").read_text()
    [block] = python_blocks(readme, "## Writing an algorithm")
    (tmp_path / "my_algorithms.py").write_text(block)
    (tmp_path / "configs").symlink_to(REPO / "configs", target_is_directory=True)
    [command] = [line for _, text in _BLOCK.findall(readme) for line in text.splitlines()
                 if "my_algorithms.Chain" in line]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "LIGHTNING_DFL_CACHE": "off"}
    env.pop("PYTHONPATH", None)
    script = subprocess.run([sys.executable, "my_algorithms.py"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert script.returncode == 0, script.stderr[-3000:]
    assert re.search(r"^2 rounds, final accuracy \d+\.\d\d%, in runs/chain/version_0$", script.stdout, re.M), \
        script.stdout[-2000:]
    shell = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
    assert shell.returncode == 0, shell.stderr[-3000:]
    history = (tmp_path / "runs" / "chain" / "version_1" / "metrics.csv").read_text().splitlines()
    assert len(history) == 3  # a header and 2 rounds


# -- links between the pages ---------------------------------------------------------------------------------------
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    lines = page.read_text().splitlines()
    return {_anchor(line.lstrip("#")) for i, line in enumerate(lines)
            if re.match(r"#{1,6} ", line) and not _in_fence(lines[:i])}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_links_reach_files_and_headings(page):
    """Every relative link of the page names a file of the repository, and its ``#anchor`` a heading there
    (the README's internals moved to docs/: a link left pointing at an old section fails here)."""
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert broken == []

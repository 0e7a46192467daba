"""``lightning-dfl fit --help`` (and a class's ``--*.help``): every option described, nothing internal."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from lightning_dfl.cli import main
from lightning_dfl.federation.algorithms import ALGORITHMS

#: what the help once showed that a user cannot act on: code names, options that do not exist, class lists
INTERNAL = ("known subclasses", "store.compact", "checkpoint_path", "resolve_store_device", "lightning_dfl.",
            "lightning.pytorch.callbacks", "callbacks.base", "store_memory", "sharding", ":mod:", ":func:", "``")


def _help(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        main(list(args))
    assert info.value.code == 0
    return out.getvalue()


def options(text: str) -> list[tuple[str, str]]:
    """``(option, description)`` of every option in a help text, the description without its type."""
    found: list[list[str]] = []
    current = None
    for line in text.splitlines():
        match = re.match(r"^  (-[-\w.+]+)(?: \S+)?(?:, -[-\w.+]+(?: \S+)?)*(?:\s{2,}(.*))?$", line)
        if match:
            current = [match[1], match[2] or ""]
            found.append(current)
        elif current is not None and line.startswith(" " * 6):
            current[1] += " " + line.strip()
        else:
            current = None
    return [(option, description.split("(type:")[0].strip()) for option, description in found]


HELPS = [["fit", "--help"], *(["fit", f"--trainer.algorithm.help={cls.__name__}"] for cls in ALGORITHMS.values()),
         ["fit", "--trainer.clock.help=Clock"],
         *(["fit", f"--trainer.callbacks.help={name}"] for name in ("RigL", "PruningTimeVoting", "PQIPruning"))]


@pytest.mark.parametrize("args", HELPS, ids=[a[-1].rpartition("=")[2] for a in HELPS])
def test_every_option_is_described(args):
    text = _help(*args)
    described = options(text)
    assert len(described) >= (70 if args[-1] == "--help" else 0)  # Local takes no option
    assert [option for option, description in described if not description] == []


@pytest.mark.parametrize("args", HELPS, ids=[a[-1].rpartition("=")[2] for a in HELPS])
def test_no_sentence_lost_a_reference(args):
    """A docstring's Sphinx reference (``:mod:`x```) is dropped from the help: no sentence may end in one
    ("the hooks of .") or hold an empty pair of parentheses."""
    text = " ".join(_help(*args).split())
    broken = re.search(r".{0,40}(\w \.(\s|$)|(?<!default: )\(\s*\)|\bof [,;.)])", text)
    assert broken is None, broken[0]


def test_fit_help_names_nothing_internal():
    text = _help("fit", "--help")
    for name in INTERNAL:
        assert name not in text, name
    assert len(text.splitlines()) < 400  # the help stays short enough to read (381 lines after issue 37's checks)


@pytest.mark.parametrize("name", [cls.__name__ for cls in ALGORITHMS.values() if cls.__name__ != "Local"])
def test_an_algorithm_is_introduced_by_a_whole_sentence(name):
    """The heading of an algorithm's options (Local has none) is a whole sentence, not a first line."""
    text = _help("fit", f"--trainer.algorithm.help={name}")
    heading = next(line for line in text.splitlines() if line.endswith(":") and not line.startswith(" "))
    assert not re.search(r"\b(client k|and|or|the|of|a)$", heading.rstrip(":")), heading


def test_the_projects_docstring_reader_is_put_back_after_the_command():
    """The project's docstring conventions (an Args entry naming several parameters describes each) are read
    while ``fit`` builds its parser and runs; after it, other jsonargparse parsers in the process have
    jsonargparse's own reader back."""
    from jsonargparse import _optionals

    from lightning_dfl import fit_cli

    original = fit_cli._jsonargparse_parse_docstring
    assert _optionals.parse_docstring is original
    described = dict(options(_help("fit", "--help")))
    assert described["--model.momentum"].startswith("SGD settings") and described["--model.weight_decay"]
    assert _optionals.parse_docstring is original


def test_the_kept_help_texts_are_those_of_the_sources():
    """``lightning_dfl/help_texts.json`` holds what ``fit``'s help requests print for these sources (refresh
    with ``python -m lightning_dfl.help_texts`` after changing a source file)."""
    from lightning_dfl import cli, help_texts

    kept = json.loads(cli.KEPT_HELP.read_text())
    assert kept["key"] == cli.help_source_key(), "the sources changed: run python -m lightning_dfl.help_texts"
    if kept["environment"] != cli.help_environment():  # another Python or library version renders other texts
        pytest.skip(f"the kept texts were written with {kept['environment']}, this is {cli.help_environment()}")
    rendered = help_texts.render_all()
    assert sorted(kept["texts"]) == sorted(rendered)
    for request, text in rendered.items():
        assert kept["texts"][request] == text, request


def test_kept_texts_of_other_sources_or_for_a_narrow_terminal_are_not_shown(monkeypatch):
    from lightning_dfl import cli

    kept = json.loads(cli.KEPT_HELP.read_text())
    monkeypatch.setattr(cli, "help_environment", lambda: kept["environment"])  # as where they were written
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.kept_help("--help") is not None and cli.kept_help("--trainer.algorithm.help=Nope") is None
    monkeypatch.setenv("COLUMNS", "79")
    assert cli.kept_help("--help") is None
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setattr(cli, "help_source_key", lambda: "other sources")
    assert cli.kept_help("--help") is None
    monkeypatch.setattr(cli, "help_source_key", lambda: kept["key"])
    assert cli.kept_help("--help") is not None
    monkeypatch.setattr(cli, "help_environment", lambda: "python 3.0|torch=0")  # other versions
    assert cli.kept_help("--help") is None


@pytest.mark.parametrize("args, request_", [
    (["fit", "--help"], "--help"), (["fit", "-h"], "--help"), (["fit", "--trainer.clock.help=Clock"],
                                                                "--trainer.clock.help=Clock"),
    (["fit", "--trainer.algorithm.help", "PSFL"], "--trainer.algorithm.help=PSFL"),
    (["fit", "--config", "a.yaml", "--help"], None), (["fit", "--trainer.algorithm.help"], None),
    (["cost", "--help"], None)])
def test_the_help_requests_kept(args, request_):
    from lightning_dfl.cli import fit_help_request

    assert fit_help_request(args) == request_

"""``lightning-dfl fit --help`` (and a class's ``--*.help``): every option described, nothing internal."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from lightning_dfl.cli import main
from lightning_dfl.federation import ALGORITHMS

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


@pytest.mark.parametrize("args", HELPS, ids=[a[-1].rpartition("=")[2] for a in HELPS])
def test_no_description_is_cut_at_an_abbreviation(args):
    """An option's sentence goes on past "Eq." or "Alg." (DADPFL's delta_pr read "pruning threshold of Eq.")."""
    cut = [(option, text) for option, text in options(_help(*args))
           if re.search(r"\b(Eqs?|Alg|Sec|Figs?|App|Tab|e\.g|i\.e|cf|vs)\.$", text)]
    assert cut == []


@pytest.mark.parametrize(("text", "sentence"), [
    ("pruning threshold of Eq. 5, > 0 (the papers use 0.01-0.03). More.", "pruning threshold of Eq. 5, > 0 (the "
     "papers use 0.01-0.03)."),
    ("whose masks Alg. 2 compacts. Next one.", "whose masks Alg. 2 compacts."),
    ("as in Figs. 8-9, e.g. the delay. Then more.", "as in Figs. 8-9, e.g. the delay."),
    ("ends. fit(ckpt_path=...) resumes.", "ends."),  # a sentence may start with a code name
    ("a step (Sec. 3. Sub) here. Next.", "a step (Sec. 3. Sub) here."),  # inside brackets nothing ends
    ("Seq. 2 is not an abbreviation.", "Seq."),
])
def test_first_sentence_ends_at_a_full_stop_not_after_an_abbreviation(text, sentence):
    from lightning_dfl.cli.help import first_sentence

    assert first_sentence(text) == sentence


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

    from lightning_dfl.cli import fit

    original = fit._jsonargparse_parse_docstring
    assert _optionals.parse_docstring is original
    described = dict(options(_help("fit", "--help")))
    assert described["--model.momentum"].startswith("SGD settings") and described["--model.weight_decay"]
    assert _optionals.parse_docstring is original


def test_the_kept_help_texts_are_those_of_the_sources():
    """``lightning_dfl/cli/help_texts.json`` holds what ``fit``'s help requests print for these sources (refresh
    with ``python -m lightning_dfl.cli.kept_help`` after changing a docstring, a signature or a default)."""
    from lightning_dfl.cli import kept_help

    kept = json.loads(kept_help.KEPT_HELP.read_text())
    assert kept["key"] == kept_help.help_source_key(), ("a docstring, signature or default changed: run "
                                                        "python -m lightning_dfl.cli.kept_help")
    if kept["environment"] != kept_help.help_environment():  # another Python or library version renders others
        pytest.skip(f"the kept texts were written with {kept['environment']}, this is "
                    f"{kept_help.help_environment()}")
    rendered = kept_help.render_all()
    assert sorted(kept["texts"]) == sorted(rendered)
    for request, text in rendered.items():
        assert kept["texts"][request] == text, request


def test_kept_texts_of_other_sources_or_for_a_narrow_terminal_are_not_shown(monkeypatch):
    from lightning_dfl.cli import kept_help

    kept = json.loads(kept_help.KEPT_HELP.read_text())
    monkeypatch.setattr(kept_help, "help_environment", lambda: kept["environment"])  # as where they were written
    monkeypatch.setattr(kept_help, "help_source_key", lambda: kept["key"])  # as the sources they were written for
    monkeypatch.setenv("COLUMNS", "80")
    assert kept_help.kept_text("--help") is not None and kept_help.kept_text("--trainer.algorithm.help=Nope") is None
    monkeypatch.setenv("COLUMNS", "79")
    assert kept_help.kept_text("--help") is None
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setattr(kept_help, "help_source_key", lambda: "other sources")
    assert kept_help.kept_text("--help") is None
    monkeypatch.setattr(kept_help, "help_source_key", lambda: kept["key"])
    assert kept_help.kept_text("--help") is not None
    monkeypatch.setattr(kept_help, "help_environment", lambda: "python 3.0|torch=0")  # other versions
    assert kept_help.kept_text("--help") is None


SOURCE = '''"""A module."""

import dataclasses

#: the default width
WIDTH = 80


class Settings:
    """Settings of a run."""

    rounds: int = 10

    def __init__(self, lr: float = 0.1, width: int = WIDTH) -> None:
        """Args:
            lr: the learning rate.
        """
        self.lr = lr  # the step size
        self.width = width

    @property
    def twice(self) -> float:
        return 2 * self.lr


def build(name: str = "digits") -> Settings:
    """Build the settings of ``name``."""
    return Settings()
'''


@pytest.mark.parametrize(("change", "same"), [
    (lambda s: s.replace("import dataclasses", "import dataclasses  # for later"), True),  # a comment
    (lambda s: s.replace("\n\n\nclass Settings", "\n# settings\n\n\nclass  Settings"), True),  # comment, spaces
    (lambda s: s.replace("self.lr = lr  # the step size", "self.lr = float(lr)"), True),  # a method's body
    (lambda s: s.replace("return 2 * self.lr", "return self.lr + self.lr"), True),  # a property's body
    (lambda s: s.replace("    return Settings()", "    settings = Settings()\n    return settings"), True),
    (lambda s: s.replace("lr: the learning rate.", "lr: the step size."), False),  # a parameter's docstring
    (lambda s: s.replace("Build the settings", "Make the settings"), False),  # a function's docstring
    (lambda s: s.replace("lr: float = 0.1", "lr: float = 0.2"), False),  # a default
    (lambda s: s.replace("width: int = WIDTH", "width: int | None = WIDTH"), False),  # an annotation
    (lambda s: s.replace("WIDTH = 80", "WIDTH = 100"), False),  # a module-level value (a default refers to it)
    (lambda s: s.replace("rounds: int = 10", "rounds: int = 20"), False),  # a class attribute
    (lambda s: s.replace("    @property\n", ""), False),  # a decorator
], ids=["comment", "blank_lines", "method_body", "property_body", "function_body", "parameter_doc", "docstring",
        "default", "annotation", "module_value", "class_attribute", "decorator"])
def test_the_help_key_reads_docstrings_and_signatures_not_comments_or_bodies(tmp_path, change, same):
    """The kept texts' key changes with what a help text can read (docstrings, signatures, defaults, module
    and class statements), not with a comment, the layout or a function's body: an unrelated change leaves the
    kept texts valid (a body that changes a help text is caught by rendering and comparing them all)."""
    from lightning_dfl.cli.kept_help import help_source_key

    original, changed = tmp_path / "original.py", tmp_path / "changed.py"
    original.write_text(SOURCE)
    changed.write_text(change(SOURCE))
    assert changed.read_text() != SOURCE
    key = help_source_key([("lightning_dfl/settings.py", original)])
    assert (help_source_key([("lightning_dfl/settings.py", changed)]) == key) is same
    assert help_source_key([("lightning_dfl/other.py", original)]) != key  # a file's name counts too


def test_the_modules_that_write_the_help_count_whole(tmp_path):
    """A function body of the help's writers (formatting, the parser) changes the key: it changes every text."""
    from lightning_dfl.cli.kept_help import help_source_key

    original, changed = tmp_path / "original.py", tmp_path / "changed.py"
    original.write_text(SOURCE)
    changed.write_text(SOURCE.replace("return Settings()", "return Settings(lr=0.5)"))
    for name, same in (("lightning_dfl/cli/help.py", False), ("lightning_dfl/cli/fit.py", False),
                       ("lightning_dfl/settings.py", True)):
        assert (help_source_key([(name, original)]) == help_source_key([(name, changed)])) is same, name


def test_a_comment_in_a_real_source_keeps_the_key(tmp_path):
    """The real tree's key over copies of its files: a comment added to one (``sparse/select.py``, which no help
    text reads) leaves it as it was."""
    from lightning_dfl.cli.kept_help import help_source_key, help_sources

    sources = help_sources()
    name, path = next((n, p) for n, p in sources if n == "lightning_dfl/sparse/select.py")
    copy = tmp_path / "select.py"
    copy.write_text(path.read_text() + "\n# a comment\n")
    assert help_source_key([(n, copy if n == name else p) for n, p in sources]) == help_source_key()


@pytest.mark.parametrize("args, request_", [
    (["fit", "--help"], "--help"), (["fit", "-h"], "--help"), (["fit", "--trainer.clock.help=Clock"],
                                                                "--trainer.clock.help=Clock"),
    (["fit", "--trainer.algorithm.help", "PSFL"], "--trainer.algorithm.help=PSFL"),
    (["fit", "--config", "a.yaml", "--help"], None), (["fit", "--trainer.algorithm.help"], None),
    (["cost", "--help"], None)])
def test_the_help_requests_kept(args, request_):
    from lightning_dfl.cli.fit_help import fit_help_request

    assert fit_help_request(args) == request_

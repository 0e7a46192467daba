"""Help formatting: docstring markup as plain text, the allowed names of every choice, and the program's name and
version as the help and ``--version`` show them.

Pure Python with jsonargparse's formatter (no torch): the registries are imported only when a help text names
their entries.
"""

from __future__ import annotations

import argparse
import importlib
import re

from jsonargparse import DefaultHelpFormatter

__all__ = ["PROG", "HelpFormatter", "allowed", "first_sentence", "help_text", "plain_text", "version"]

#: the program's name, in usage lines and messages
PROG = "lightning-dfl"


def version() -> str:
    """The installed distribution's version (the package's ``__version__`` when not installed), as
    ``lightning-dfl --version`` prints it."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("lightning-dfl")
    except PackageNotFoundError:
        from lightning_dfl import __version__

        return __version__

#: the allowed names of each choice: (module, attribute) of its registry or tuple, imported when help is shown
_CHOICES = {
    "dataset": ("lightning_dfl.datamodules.datasets", "DATASETS"),
    "partition": ("lightning_dfl.datamodules.partition", "PARTITIONERS"),
    "model": ("lightning_dfl.models", "MODELS"),
    "topology": ("lightning_dfl.federation.exchange.topology", "TOPOLOGIES"),
    "algorithm": ("lightning_dfl.federation.algorithms", "ALGORITHMS"),
    "regrowth": ("lightning_dfl.sparse.rigl", "REGROWTH_MODES"),
    "distribution": ("lightning_dfl.sparse.erk", "DISTRIBUTIONS"),
    "clock_distribution": ("lightning_dfl.federation.loop.clock", "DISTRIBUTIONS"),
    "update_interval": ("lightning_dfl.callbacks.rigl", "UPDATE_INTERVALS"),
    "store_device": ("lightning_dfl.federation.store.memory", "STORE_DEVICES"),
    "memory_format": ("lightning_dfl.federation.trainer.kernel_settings", "MEMORY_FORMATS"),
    "matmul_precision": ("lightning_dfl.federation.trainer.kernel_settings", "MATMUL_PRECISIONS"),
}
_FIXED_CHOICES = {"logger": ["true", "false", "csv", "tensorboard"], "store": ["dense", "compact"],
                  "diagnostics": ["auto", "true", "false"], "between": ["dirichlet", "pathological"]}


def allowed(kind: str) -> list[str]:
    """The allowed names of a choice (registries sorted, tuples in their order, algorithms by class name)."""
    if kind not in _CHOICES:
        return _FIXED_CHOICES.get(kind, [])
    module, attribute = _CHOICES[kind]
    names = getattr(importlib.import_module(module), attribute)
    if kind == "algorithm":
        return [cls.__name__ for cls in names.values()]
    return list(names) if isinstance(names, tuple) else sorted(names)


#: documentation names (the last part of a Sphinx role's target) that stand for a list of allowed names
_ROLE_KINDS = {"DATASETS": "dataset", "PARTITIONERS": "partition", "MODELS": "model", "available_models": "model",
               "TOPOLOGIES": "topology", "ALGORITHMS": "algorithm", "REGROWTH_MODES": "regrowth"}
_ROLE = re.compile(r"(?P<lead>\b(?:see|one of)\s+)?:(?:py:)?(?P<kind>[a-z]+):`(?P<tilde>~?)(?P<target>[^`<]+?)"
                   r"(?:\s*<[^>]*>)?`")
#: roles naming the code (a module, a function): references for readers of the source, left out of the help
_CODE_ROLES = ("mod", "func", "meth")


def _option_kind(dest: str) -> str | None:
    """Which list of allowed names an option (``data.dataset``, ``trainer.algorithm.topology``, ...) takes."""
    last = dest.rsplit(".", 1)[-1]
    if last == "distribution":
        return "clock_distribution" if ".clock." in f".{dest}" else "distribution"
    if last == "arch":
        return "model"
    if dest in ("trainer.algorithm", "trainer.logger"):
        return last
    if dest in ("trainer.store", "trainer.diagnostics", "data.between"):
        return last
    return last if last in ("dataset", "partition", "topology", "regrowth", "store_device", "update_interval",
                            "memory_format", "matmul_precision") else None


def plain_text(text: str, code_references: bool = True) -> str:
    """Docstring markup as plain text: a Sphinx role becomes its name (a registry's role the allowed names),
    a ``literal`` loses its backticks; without ``code_references``, a module's or function's role is left out."""

    def role(match: re.Match) -> str:
        target = match["target"].strip()
        name = target.rsplit(".", 1)[-1].removesuffix("()")
        kind = _ROLE_KINDS.get(name)
        if name == "DISTRIBUTIONS":
            kind = "clock_distribution" if "clock" in target else "distribution"
        if kind is not None:
            return "one of: " + ", ".join(allowed(kind))
        if not code_references and match["kind"] in _CODE_ROLES:
            return "\0"  # removed below, with the punctuation that introduced it
        return (match["lead"] or "") + (name if match["tilde"] else target)

    text = _ROLE.sub(role, text)
    text = re.sub(r"(?:[;,]\s*)?(?:\bsee\s+)?\0", "", text)
    text = re.sub(r"\(\s*\)", "", re.sub(r"\(\s*[;,]\s*", "(", text))
    return re.sub(r"``([^`]*)``", r"\1", text)


#: abbreviations whose full stop ends no sentence ("Eq. 5", "Alg. 1's", "e.g. the")
_ABBREVIATION = re.compile(r"(?:^|\W)(?:e\.g|i\.e|cf|vs|et al|Eqs?|Alg|Sec|Figs?|App|Tab|Thm)$")


def first_sentence(text: str) -> str:
    """``text`` up to the end of its first sentence: a full stop outside brackets and not after an abbreviation
    (:data:`_ABBREVIATION`: ``Eq. 5`` goes on), followed by a space or a line break."""
    depth = 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if char == "." and depth <= 0 and text[i + 1:i + 2] in (" ", "\n") and not _ABBREVIATION.search(text[:i]):
            return text[:i + 1]
    return text


def help_text(text: str) -> str:
    """A docstring's description as one sentence of plain text (no markup, no references to the code)."""
    return " ".join(first_sentence(plain_text(text, code_references=False)).split())


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help without reStructuredText markup, naming the allowed values of every choice."""

    def _get_help_string(self, action: argparse.Action) -> str:
        original = action.help
        if original != argparse.SUPPRESS:
            text = help_text(original or "")
            kind = _option_kind(action.dest)
            names = allowed(kind) if kind else []
            if names and not all(re.search(rf"\b{re.escape(n)}\b", text) for n in names):
                text = f"{text} Allowed: {', '.join(names)}." if text else f"one of: {', '.join(names)}."
            action.help = text or original
        try:
            return re.sub(r", known subclasses: [^)]*", "", super()._get_help_string(action) or "")
        finally:
            action.help = original

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def start_section(self, heading: str | None) -> None:
        super().start_section(help_text(heading).rstrip(".:") if heading else heading)

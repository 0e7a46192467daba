"""``fit``'s help texts kept in the package (``lightning_dfl/cli/help_texts.json``), so that the first
``lightning-dfl fit --help`` (and ``--trainer.algorithm.help=DADPFL``, ...) of a fresh clone is shown without
importing torch and Lightning.

The texts are kept with a key of what the help is read from (:func:`help_source_key`): every source file's
syntax tree with comments, formatting and function bodies left out (module and class statements, signatures,
defaults, decorators and docstrings kept), and the whole code of the modules that write the help. A comment or a
change inside a function elsewhere keeps the texts; a changed docstring, signature or default needs them written
again: ``python -m lightning_dfl.cli.kept_help`` (the test suite renders every kept text and compares). Texts
written with other versions of Python or of the libraries that write the help are not shown: the help is
rendered (and cached) as usual.
"""

from __future__ import annotations

import ast
import contextlib
import os
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path

from lightning_dfl.cli.help import PROG

__all__ = ["KEPT_HELP", "KEPT_HELP_WIDTH", "help_environment", "help_shape", "help_source_key", "help_sources",
           "kept_text", "render_all", "render_fit_help", "requests", "source_folders", "write"]

#: ``fit``'s help texts kept in the package, written at this width
KEPT_HELP = Path(__file__).with_name("help_texts.json")
KEPT_HELP_WIDTH = 80

#: the libraries whose versions change what ``fit``'s help texts say
_HELP_LIBRARIES = ("lightning", "jsonargparse", "docstring-parser", "torch", "omegaconf")
#: the modules that write the help (formatting, the parser, the requests): their function bodies count too
_HELP_WRITERS = ("lightning_dfl/cli/help.py", "lightning_dfl/cli/fit.py", "lightning_dfl/cli/kept_help.py")
#: our callbacks, offered by ``--trainer.callbacks.help``
CALLBACKS = ("RigL", "PruningTimeVoting", "PQIPruning")


def library_versions() -> str:
    """``name=version`` of each library that writes the help (``-`` where it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    found = []
    for dist in _HELP_LIBRARIES:
        try:
            found.append(f"{dist}={dist_version(dist)}")
        except PackageNotFoundError:
            found.append(f"{dist}=-")
    return "|".join(found)


def help_environment() -> str:
    """What ``fit``'s help texts depend on besides the sources: the Python version (argparse's layout) and the
    versions of the libraries that write the help."""
    return f"python {sys.version_info[0]}.{sys.version_info[1]}|{library_versions()}"


def source_folders() -> tuple[Path, ...]:
    """The folders of the project's packages (``lightning_dfl`` and its ``callbacks``, ``datamodules``), found
    without importing them (they import torch)."""
    from importlib.util import find_spec

    specs = (find_spec("lightning_dfl.callbacks"), find_spec("lightning_dfl.datamodules"))
    folders = (Path(__file__).resolve().parents[1],
               *(Path(s.origin).resolve().parent for s in specs if s is not None and s.origin))
    return tuple(dict.fromkeys(folders))


def help_sources() -> list[tuple[str, Path]]:
    """``(name, path)`` of every source file of the project's packages, the name its package folder's and its
    path in it (``lightning_dfl/cli/help.py``): equal in every clone."""
    return [(f"{root.name}/{path.relative_to(root).as_posix()}", path)
            for root in source_folders() for path in sorted(root.rglob("*.py"))]


class _Shape(ast.NodeTransformer):
    """A syntax tree reduced to what a help text can read: every function's body becomes its docstring."""

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        doc = ast.get_docstring(node, clean=False)
        node.body = [ast.Expr(ast.Constant(doc))] if doc is not None else []
        return node  # the signature (defaults, annotations) and decorators as they are

    visit_AsyncFunctionDef = visit_FunctionDef


def _dump(node: object, out: list[str]) -> None:
    """``node`` as text: the class and fields of each node, without positions; a field that is empty or None is
    left out (newer Pythons add such fields), so that the text is the same for every Python that parses it."""
    if isinstance(node, ast.AST):
        out.append(f"{type(node).__name__}(")
        for field in node._fields:
            value = getattr(node, field, None)
            if value is None or (isinstance(value, list) and not value):
                continue
            out.append(f"{field}=")
            _dump(value, out)
            out.append(",")
        out.append(")")
    elif isinstance(node, list):
        out.append("[")
        for item in node:
            _dump(item, out)
            out.append(",")
        out.append("]")
    else:
        out.append(repr(node))


def help_shape(source: str | bytes, whole: bool = False) -> str:
    """What of a source file the help can read: its syntax tree without comments, formatting and (unless
    ``whole``) function bodies, docstrings kept. A file that does not parse is its text."""
    try:
        tree = ast.parse(source)
        if not whole:
            tree = _Shape().visit(tree)
        out: list[str] = []
        _dump(tree, out)
        return "".join(out)
    except (SyntaxError, ValueError, RecursionError):
        return source.decode(errors="replace") if isinstance(source, bytes) else source


def help_source_key(sources: Iterable[tuple[str, Path]] | None = None) -> str:
    """The key of ``fit``'s kept help texts: the :func:`help_shape` of every source (by default
    :func:`help_sources`), the modules that write the help whole; equal in every clone of one commit."""
    import hashlib

    digest = hashlib.sha256()
    for name, path in help_sources() if sources is None else sources:
        digest.update(f"|{name}|".encode())
        digest.update(help_shape(path.read_bytes(), whole=name in _HELP_WRITERS).encode())
    return digest.hexdigest()[:32]


def kept_text(request: str) -> str | None:
    """The help text kept in the package for ``request``, when it was written for these sources, this Python and
    these libraries' versions, and the terminal is at least :data:`KEPT_HELP_WIDTH` columns wide; else None."""
    import json
    import shutil

    if shutil.get_terminal_size().columns < KEPT_HELP_WIDTH:
        return None
    try:
        kept = json.loads(KEPT_HELP.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("environment") != help_environment() or \
            kept.get("key") != help_source_key():
        return None
    text = (kept.get("texts") or {}).get(request)
    return text if isinstance(text, str) else None


def render_fit_help(request: str) -> str:
    """What ``lightning-dfl fit <request>`` prints (it imports torch and Lightning: seconds); a request that is
    no help (an unknown class) raises the command's error."""
    import io

    from lightning_dfl.cli.fit import FederatedCLI

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        try:
            FederatedCLI(args=["fit", request], parser_kwargs={"exit_on_error": False, "prog": PROG})
        except SystemExit as stop:
            if stop.code not in (0, None):
                raise
    return buffer.getvalue()


def requests() -> list[str]:
    """The help requests kept: ``--help``, every algorithm's, the clock's and our callbacks'."""
    from lightning_dfl.federation.algorithms import ALGORITHMS

    return ["--help", *(f"--trainer.algorithm.help={cls.__name__}" for cls in ALGORITHMS.values()),
            "--trainer.clock.help=Clock", *(f"--trainer.callbacks.help={name}" for name in CALLBACKS)]


def render_all() -> dict[str, str]:
    """Every kept request's text, rendered at :data:`KEPT_HELP_WIDTH` columns."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(KEPT_HELP_WIDTH)
    try:
        return {request: render_fit_help(request) for request in requests()}
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def write() -> None:
    """Write every kept text, with its key and environment, into :data:`KEPT_HELP`."""
    import json

    texts = render_all()
    KEPT_HELP.write_text(json.dumps({"key": help_source_key(), "environment": help_environment(),
                                     "width": KEPT_HELP_WIDTH, "texts": texts},
                                    indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(texts)} help texts to {KEPT_HELP}")


if __name__ == "__main__":
    write()

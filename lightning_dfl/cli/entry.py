"""The entry point of ``lightning-dfl``: the usage, the subcommands and what ends a command.

``fit`` trains a federation through LightningCLI (:mod:`lightning_dfl.cli.fit`); ``schedule``, ``cost``,
``curves`` and ``export`` are the analysis subcommands (:mod:`lightning_dfl.cli.analysis`); ``plot`` draws a
run's figures (:mod:`lightning_dfl.cli.plot`). An error about the user's input (a config value, an unknown name,
a path, a data set, a checkpoint, YAML), raised by validation before the first round, ends the command with one
line on stderr and exit code 2. A run in which every client diverged ends with one line and exit code 3.
Anything else, and any error raised inside a round whatever its type, is a bug: its traceback, exit code 1 and a
last line saying where to report it (:mod:`lightning_dfl.cli.errors`). ``--debug`` (anywhere on the command
line) or ``LIGHTNING_DFL_DEBUG=1`` shows the traceback instead. Ctrl-C prints how to resume, not a traceback.
``--safe`` and ``--trust MODULE`` set what a config may import and call (:mod:`lightning_dfl.cli.trust`).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import lightning_dfl.startup  # noqa: F401  (first: where the process's start cannot be read, start-up counts from here)
from lightning_dfl.cli.analysis import SUBCOMMANDS
from lightning_dfl.cli.errors import DEBUG_ENV, DEBUG_FLAG, interrupted, report
from lightning_dfl.cli.fit_help import CLASS_HELP, fit_help, fit_help_request
from lightning_dfl.cli.help import PROG, HelpFormatter, version
from lightning_dfl.cli.trust import SAFE_FLAG, TRUST_FLAG, Policy, applied, strip_flags

# torch, Lightning and the project's modules that need them are imported where they are used (``fit`` in
# lightning_dfl.cli.fit), so that ``--help``, ``--version`` and the analysis subcommands start in a moment

__all__ = ["COMMANDS", "USAGE", "command_parser", "is_help_request", "main", "show_warning"]

USAGE = """usage: lightning-dfl {fit,schedule,cost,curves,export,plot} ... [--safe [--trust MODULE]] [--debug]
                     [--version]

  fit       train a federation: lightning-dfl fit --config configs/dispfl_digits.yaml (fit --help)
  schedule  DA-DPFL dynamic aggregation: parallelism and delay against M and N (Figs. 8-9)
  cost      C_total(theta) cost curves of finished runs (DA-DPFL Sec. VI-A5)
  curves    plot logged metrics against the round for finished runs (needs .[plots])
  export    a client's channel-pruned model as a smaller network, with its size, MACs and latency
  plot      figures of one run: lightning-dfl plot diagnostics RUN_DIR [--out DIR] (needs .[plots])

  --safe    run a config from elsewhere: it may name only lightning_dfl, torch, torchvision and lightning
            (also LIGHTNING_DFL_SAFE=1); --trust MODULE adds a module of your own (docs/command-line.md)
  --debug   show the full traceback of an error (also LIGHTNING_DFL_DEBUG=1)
  --version print the version
"""

COMMANDS = ("fit", *SUBCOMMANDS, "plot")
#: the options that may come before a subcommand
GLOBAL_OPTIONS = ("--help", "--version", DEBUG_FLAG, SAFE_FLAG, TRUST_FLAG)


def _command_error(first: str) -> NoReturn:
    """An unknown subcommand, or an option before any: name the subcommands, one line each."""
    close = difflib.get_close_matches(first, GLOBAL_OPTIONS, n=1) if first.startswith("-") else []
    if close:
        message = f"unknown option {first!r} (did you mean {close[0]!r}?)"
    elif first.startswith("-"):
        message = f"the subcommand comes first ({PROG} fit {first} ...)"
    else:
        close = difflib.get_close_matches(first, COMMANDS, n=1)
        message = f"unknown subcommand {first!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
    listing = "\n".join(line for line in USAGE.splitlines() if re.match(r"  [a-z]", line))
    sys.stderr.write(f"{PROG}: error: {message}; allowed: {', '.join(COMMANDS)}\n{listing}\n")
    raise SystemExit(2)


def _subcommand(name: str, args: list[str]) -> None:
    """Run an analysis subcommand (``schedule``, ``cost``, ``curves``, ``export``) on its arguments."""
    from jsonargparse import CLI

    CLI(SUBCOMMANDS[name], args=args, exit_on_error=False, formatter_class=HelpFormatter, prog=f"{PROG} {name}",
        allow_abbrev=False)  # --run=... is not --runs


def command_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of ``plot`` or an analysis subcommand, built without running anything (``fit``'s
    is LightningCLI's: check a ``fit`` command line with ``--print_config``)."""
    if name == "plot":
        from lightning_dfl.cli.plot import plot_parser

        return plot_parser()
    if name not in SUBCOMMANDS:
        raise ValueError(f"no parser for {name!r}; allowed: {', '.join(['plot', *SUBCOMMANDS])}")
    from jsonargparse import capture_parser

    return capture_parser(lambda: _subcommand(name, []))


def _run(args: list[str], policy: Policy) -> None:
    request = fit_help_request(args)
    if request is not None:
        sys.stdout.write(fit_help(request))
        raise SystemExit(0)  # as argparse's help
    if args[0] == "plot":
        from lightning_dfl.cli.plot import plot

        plot(args[1:])
        return
    from lightning_dfl.cli.config_files import (
        check_class_names,
        check_config_file,
        check_option_files,
        config_files,
        guard_yaml_loaders,
    )

    for path in config_files(args[1:]):  # before jsonargparse reads (and expands) them
        check_config_file(path)
    check_option_files(args[1:])  # a FIFO given to a class option would block the parser
    if args[0] == "fit":
        check_class_names(args[1:])  # a project's class name from another module: refused before it is imported
    guard_yaml_loaders()  # every YAML text it loads (inline configs, class options' files) is checked first
    with applied(policy):  # what a value may import (jsonargparse's denylist; in safe mode only the named packages)
        _parse_and_run(args)


def _parse_and_run(args: list[str]) -> None:
    if args[0] in SUBCOMMANDS:
        _subcommand(args[0], args[1:])
        return
    from lightning_dfl.cli.torch_pair import check_torch_pair

    check_torch_pair()  # a torchvision built for another torch fails in its import: one line, with the fix
    from lightning_dfl.cli.fit import FederatedCLI

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        FederatedCLI(args=args, parser_kwargs={"exit_on_error": False, "prog": PROG, "allow_abbrev": False})


def is_help_request(args: Sequence[str]) -> bool:
    """Whether the command line only asks for a text: the usage, ``--version``, a ``--help`` or a class's help."""
    return (not args or args[0] in ("--version", "-V")
            or any(a in ("-h", "--help") or CLASS_HELP.fullmatch(a) for a in args))


def _stdout_closed(code: int) -> NoReturn:
    """The reader of stdout went away (``lightning-dfl --help | head -1``): stop quietly with ``code``, the rest
    of the output going to devnull."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (replaced by a test's capture)
        pass
    raise SystemExit(code)


def show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
    """A warning as one line on stderr, ``lightning-dfl: warning: <message>`` (the category's name in place of
    ``warning`` when it is not a plain UserWarning), without the source path and line Python prints."""
    kind = "warning" if category is UserWarning else category.__name__
    try:
        (sys.stderr if file is None else file).write(f"{PROG}: {kind}: {' '.join(str(message).split())}\n")
    except (OSError, ValueError):  # stderr closed: the warning is lost, as Python's own would be
        pass


@contextlib.contextmanager
def _one_line_warnings(enabled: bool) -> Iterator[None]:
    """Within this block warnings are shown by :func:`show_warning` (with ``--debug``: Python's own format)."""
    if not enabled:
        yield
        return
    previous, warnings.showwarning = warnings.showwarning, show_warning
    try:
        yield
    finally:
        warnings.showwarning = previous


def _debug(args: list[str]) -> tuple[list[str], bool]:
    """``args`` without ``--debug``, and whether tracebacks are wanted (the flag or ``LIGHTNING_DFL_DEBUG``)."""
    env = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
    return [a for a in args if a != DEBUG_FLAG], env or DEBUG_FLAG in args


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``lightning-dfl`` console script: one line for bad input (exit code 2) and for a
    diverged run (3); a bug's traceback with where to report it (1). When stdout's reader closes it early it
    stops quietly: exit code 0 for a help or version text (the reader took what it wanted, whether or not the
    text was all written before it left), 1 for any other command (its output was cut short)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            with _one_line_warnings(enabled=not _debug(args)[1]):
                _main(args)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except BrokenPipeError:
        _stdout_closed(0 if is_help_request(_debug(args)[0]) else 1)


def _main(argv: Sequence[str] | None) -> None:
    args, debug = _debug(list(sys.argv[1:] if argv is None else argv))
    try:
        args, policy = strip_flags(args)
    except Exception as err:
        if debug:
            raise
        report(err)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    if args[0] in ("--version", "-V"):
        from lightning_dfl.cli.torch_pair import stack_versions

        print(f"{PROG} {version()}\n{stack_versions()}")
        return
    if args[0] not in COMMANDS:
        _command_error(args[0])
    try:
        _run(args, policy)
    except KeyboardInterrupt as err:
        if debug:
            raise
        interrupted(err)
    except BrokenPipeError:
        raise
    except Exception as err:
        if debug:
            raise
        report(err)


if __name__ == "__main__":
    main()

"""The command line: ``lightning-dfl fit --config configs/<file>.yaml`` through LightningCLI.

An error about the user's input (a config value, an unknown name, a path, a data set, a checkpoint, YAML),
raised by validation before the first round, ends the command with one line on stderr and exit code 2. A run
in which every client diverged ends with one line and exit code 3. Anything else, and any error raised inside
a round whatever its type, is a bug: its traceback, exit code 1 and a last line saying where to report it
(:mod:`lightning_dfl.errors`). ``--debug`` (anywhere on the command line) or
``LIGHTNING_DFL_DEBUG=1`` shows the traceback instead. Ctrl-C prints how to resume, not a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import re
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import DefaultHelpFormatter

from lightning_dfl.analysis import SUBCOMMANDS
from lightning_dfl.errors import DIVERGED_EXIT_CODE, RunDiverged, RunFileError, raised_in_round

# torch, Lightning and the project's modules that need them are imported where they are used (``fit`` in
# lightning_dfl.fit_cli), so that ``--help``, ``--version`` and the analysis subcommands start in a moment

PROG = "lightning-dfl"
DEBUG_FLAG = "--debug"
DEBUG_ENV = "LIGHTNING_DFL_DEBUG"
DEBUG_HINT = f"(run with {DEBUG_FLAG} for the traceback)"

#: exceptions that describe bad input (config values, names, paths, data, checkpoints, a federation too
#: large for the memory), not a bug; with Lightning's MisconfigurationException once Lightning is imported
#: (see :func:`user_errors`)
_INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, NotADirectoryError,
                                                  IsADirectoryError, PermissionError, argparse.ArgumentError,
                                                  MemoryError)


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that describe bad input: Lightning's MisconfigurationException too where Lightning was
    imported (without it loaded, none can have been raised, and the error path stays free of its import)."""
    exceptions = sys.modules.get("lightning.fabric.utilities.exceptions")
    extra = getattr(exceptions, "MisconfigurationException", None)
    return (*_INPUT_ERRORS, extra) if extra is not None else _INPUT_ERRORS


#: the classes of ``fit`` (torch and Lightning), imported on first use: ``lightning_dfl.cli.FederatedCLI``
_LAZY = {"FederatedCLI": "lightning_dfl.fit_cli", "FederatedArgumentParser": "lightning_dfl.fit_cli"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "USER_ERRORS":
        return user_errors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- help text --------------------------------------------------------------------------
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


def _allowed(kind: str) -> list[str]:
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
            return "one of: " + ", ".join(_allowed(kind))
        if not code_references and match["kind"] in _CODE_ROLES:
            return "\0"  # removed below, with the punctuation that introduced it
        return (match["lead"] or "") + (name if match["tilde"] else target)

    text = _ROLE.sub(role, text)
    text = re.sub(r"(?:[;,]\s*)?(?:\bsee\s+)?\0", "", text)
    text = re.sub(r"\(\s*\)", "", re.sub(r"\(\s*[;,]\s*", "(", text))
    return re.sub(r"``([^`]*)``", r"\1", text)


def first_sentence(text: str) -> str:
    """``text`` up to the end of its first sentence (a full stop outside brackets followed by a space)."""
    depth = 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if char == "." and depth <= 0 and text[i + 1:i + 2] in (" ", "\n") and not text[:i].endswith(("e.g", "i.e")):
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
            names = _allowed(kind) if kind else []
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


# -- errors -----------------------------------------------------------------------------
def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from (``__cause__``, else ``__context__``), outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return chain


def _frames(chain: Sequence[BaseException]) -> list[Any]:
    """The frames of every traceback in ``chain``, outermost first."""
    frames = []
    for err in chain:
        tb = err.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
    return frames


def _in_jsonargparse(err: BaseException) -> bool:
    """Whether ``err`` is one of jsonargparse's wrappers (raised in its code) rather than the original error."""
    frames = traceback.extract_tb(err.__traceback__)
    return isinstance(err, argparse.ArgumentError) or (
        bool(frames) and f"{os.sep}jsonargparse{os.sep}" in frames[-1].filename)


def _own_folders() -> tuple[str, ...]:
    """The folders of the project's packages (``lightning_dfl`` and its ``callbacks``, ``datamodules``),
    found without importing them (they import torch)."""
    from importlib.util import find_spec

    specs = (find_spec("lightning_dfl.callbacks"), find_spec("lightning_dfl.datamodules"))
    return (str(Path(__file__).parent) + os.sep,
            *(str(Path(s.origin).parent) + os.sep for s in specs if s is not None and s.origin))


def _is_validation(err: BaseException) -> bool:
    """A ``TypeError`` the project raised on purpose (``raise TypeError(...)`` in its own code), not a bug."""
    frames = traceback.extract_tb(err.__traceback__)
    return (isinstance(err, TypeError) and bool(frames) and frames[-1].filename.startswith(_own_folders())
            and (frames[-1].line or "").startswith("raise"))


def _is_device_setting(err: BaseException) -> bool:
    """An error of Lightning's accelerator/precision connector: a device (or its package) the machine lacks."""
    connectors = (f"fabric{os.sep}connector.py", f"connectors{os.sep}accelerator_connector.py")
    return isinstance(err, (RuntimeError, ImportError)) and any(
        frame.filename.endswith(connectors) for frame in traceback.extract_tb(err.__traceback__))


def _is_about_input(err: BaseException, parsing: bool) -> bool:
    """Whether ``err`` itself (not what wraps it) describes bad input; ``parsing``: jsonargparse wrapped it."""
    if isinstance(err, user_errors()) or _is_validation(err) or _is_device_setting(err):
        return True
    # while parsing: a class path naming a module that is not there, a YAML syntax error
    return parsing and (isinstance(err, ImportError) or type(err).__module__.startswith("yaml."))


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is about the user's input (config, names, paths, data, checkpoints, devices), not a bug.

    Decided by the outermost exception raised outside jsonargparse (jsonargparse wraps whatever a class's
    ``__init__`` raises, a bug too); an error of jsonargparse's own (a value it could not parse) is input.
    """
    chain = _chain(err)
    raised = [e for e in chain if not _in_jsonargparse(e)]
    if raised:
        return _is_about_input(raised[0], parsing=raised[0] is not err)
    return isinstance(err, (*user_errors(), TypeError))


def _option(chain: Sequence[BaseException], frames: Sequence[Any]) -> str | None:
    """The config key that was being parsed or instantiated: from jsonargparse's messages, else its frames."""
    keys = [k for e in chain for k in re.findall(r'Parser key "([^"]+)"', str(e))]
    if keys:
        return ".".join(dict.fromkeys(keys))
    option = next((o for e in chain if (o := getattr(e, "_lightning_dfl_option", None))), None)
    for frame in frames:
        for name in ("self", "component"):
            holder = frame.f_locals.get(name)
            dest = getattr(holder, "dest", None)
            if (isinstance(holder, (argparse.Action, argparse._ArgumentGroup)) and isinstance(dest, str)
                    and dest[:1].isalpha() and dest != "help"):
                option = dest
    return option


def _config_file(frames: Sequence[Any]) -> str | None:
    """The config file being read, if the error happened while reading one."""
    paths = [frame.f_locals.get("path") for frame in frames if frame.f_code.co_name == "parse_path"]
    return str(paths[-1]) if paths else None


#: what a class-valued option accepts by short name, for an unknown class
_CLASS_OPTIONS = {"trainer.algorithm": "algorithm",
                  "trainer.callbacks": ("RigL, PruningTimeVoting, PQIPruning (lightning_dfl.callbacks) or a Lightning "
                                        "callback's import path"),
                  "trainer.clock": "Clock (lightning_dfl.federation.loop.clock)"}


def _unknown_class(option: str | None, value: str) -> str:
    kind = _CLASS_OPTIONS.get((option or "").removesuffix(".help"), "")
    allowed = ", ".join(_allowed(kind)) if kind == "algorithm" else kind
    return f"unknown class {value!r}; " + (f"allowed: {allowed}" if allowed else "give a class name or import path")


def _null_class(option: str | None) -> str:
    """``class_path: null`` (a class option whose class is not named)."""
    kind = _CLASS_OPTIONS.get(option or "", "")
    allowed = ", ".join(_allowed(kind)) if kind == "algorithm" else kind
    fix = f"; allowed: {allowed}" if allowed else ""
    return f"class_path is null: name a class{fix} (or remove the option for its default)"


def _class_options(class_path: str) -> str:
    """``class_path``'s init arguments, for an option it does not accept."""
    import inspect

    module, _, name = class_path.rpartition(".")
    try:
        parameters = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    except Exception:  # only a hint: without it the message still names the refused option
        return ""
    names = [p for p, spec in parameters.items() if spec.kind not in (spec.VAR_POSITIONAL, spec.VAR_KEYWORD)]
    return f"; {class_path.rsplit('.', 1)[-1]} takes: {', '.join(names)}" if names else ""


def _suggest(given: Sequence[str], frames: Sequence[Any]) -> str:
    """'did you mean' for unknown options (``--data.batchsize`` or ``trainer.roundz``), from the refusing parser."""
    parsers = [f.f_locals["self"] for f in frames if isinstance(f.f_locals.get("self"), argparse.ArgumentParser)]
    for parser in list(parsers):  # a subcommand's options are checked by the main parser
        subcommands = getattr(parser, "_subcommands_action", None)
        parsers += list(getattr(subcommands, "_name_parser_map", {}).values())
    known = {o for p in parsers for o in p._option_string_actions if o.startswith("--")}
    close = []
    for option in given:
        dashes = "--" if option.startswith("--") else ""
        group, _, name = option.split("=", 1)[0].removeprefix("--").rpartition(".")
        siblings = {o.rpartition(".")[2]: o[2:] for o in known if o[2:].rpartition(".")[0] == group}
        close += [dashes + siblings[m] for m in difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)]
    return f" (did you mean {', '.join(close)}?)" if close else ""


def error_message(err: BaseException) -> str:
    """One line about a user error: the original message (not jsonargparse's wrappers), with its option."""
    chain = _chain(err)
    frames = _frames(chain)
    option = _option(chain, frames)
    config = _config_file(frames)
    texts = "\n".join(str(e) for e in chain)
    root = chain[-1]
    class_path = re.search(r"Problem with given class_path '([^']+)'", texts)
    import_path = re.search(r"Expected a dot import path string: (\S+)", texts)
    type_error = re.search(r"Expected an? <class '(\w+)'>\. Got value: (.*)", texts)
    own = [e for e in chain if not _in_jsonargparse(e)
           and (isinstance(e, user_errors()) or _is_validation(e) or _is_device_setting(e))]
    try:
        import yaml

        yaml_error = next((e for e in chain if isinstance(e, yaml.YAMLError)), None)
    except ImportError:  # pragma: no cover - jsonargparse needs PyYAML
        yaml_error = None
    if yaml_error is not None:
        mark = getattr(yaml_error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(p) for p in (getattr(yaml_error, "context", None), getattr(yaml_error, "problem", None))
                           if p) or str(yaml_error)
        message, option = f"YAML syntax error{where}: {problem}", None
    elif own:
        source = own[-1]
        message = str(source.args[0]) if isinstance(source, KeyError) and source.args else str(source)
        if isinstance(source, OSError) and source.filename and (message.startswith("[Errno")
                                                                 or str(source.filename) not in message):
            message = f"{source.strerror or message}: {str(source.filename)!r}"
        message = message.strip() or type(source).__name__
    elif (isinstance(root, (ImportError, AttributeError)) and class_path) or import_path:
        message = _unknown_class(option, (import_path or class_path)[1])  # type: ignore[index]
    elif type_error is not None:
        message = f"expected {type_error[1]}, got {type_error[2].strip()!r}"
    else:
        message = next((line.strip(" -") for line in str(root).splitlines() if line.strip(" -")), str(root).strip())
        if "not accepted" in message and class_path:
            message += _class_options(class_path[1])
        if re.fullmatch(r"argument of type 'NoneType' is not iterable", message) and "Subtypes:" in texts:
            message = _null_class(option)  # jsonargparse's own error on ``class_path: null``
        if message.startswith("unrecognized arguments"):
            given = [a for a in message.split(":", 1)[-1].split() if a.startswith("--")]
            message, option = message + _suggest(given, frames), None
        if "does not accept option" in message:
            message += _suggest(re.findall(r"option '([^']+)'", message)[-1:], frames)
        if message.startswith("Unexpected config"):
            message, option = "a config file must hold a mapping of options (key: value) at its top level", None
        message = re.sub(r'^Parser key "[^"]+":\s*', "", message)
    if option and not re.search(rf"(?<![\w.]){re.escape(option)}(?!\w)", message):
        message = f"{option}: {message}"
    if config and config not in message:
        message = f"{config}: {message}"
    return " ".join(message.split())


def _rank() -> int:
    """This process's global rank: 0 in a one-process run and in the process that launched the others (Lightning's
    ``rank_zero_only.rank``, set from the launcher's environment; 0 when Lightning was not imported)."""
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    rank = getattr(getattr(rank_zero, "rank_zero_only", None), "rank", 0)
    return rank if isinstance(rank, int) else 0


def _fail(message: str) -> NoReturn:
    """Bad input: one line, exit 2; with several processes (``--trainer.devices 2``) every process refuses, and
    only rank 0 (the launching process) prints the line."""
    if _rank() == 0:
        sys.stderr.write(f"{PROG}: error: {message} {DEBUG_HINT}\n")
    raise SystemExit(2)


#: the last line after a bug's traceback
REPORT_HINT = ("this is a bug in lightning-dfl, not a problem with your input: please report it to the "
               "lightning-dfl issue tracker with the traceback above, the command line, the config and the output "
               f"of '{PROG} --version'")


def _diverged(err: BaseException) -> BaseException | None:
    """The :class:`~lightning_dfl.errors.RunDiverged` in ``err``'s chain (every client diverged), if any."""
    return next((e for e in _chain(err) if isinstance(e, RunDiverged)), None)


def _stop(err: BaseException) -> NoReturn:
    """Every client diverged: a known condition of the training, explained in one line (not bad input, not a bug);
    printed by rank 0 only, as :func:`_fail`."""
    if _rank() == 0:
        sys.stderr.write(f"{PROG}: error: the run diverged: {' '.join(str(err).split())} {DEBUG_HINT}\n")
    raise SystemExit(getattr(err, "exit_code", DIVERGED_EXIT_CODE))


def _bug(err: BaseException) -> NoReturn:
    """A bug (any error raised inside a round, or one that is not about the input): its traceback, exit 1,
    and one last line saying where to report it."""
    traceback.print_exception(err)
    round_idx = raised_in_round(err)
    where = f" (raised in round {round_idx + 1}, metrics.csv's round {round_idx})" if round_idx is not None else ""
    sys.stderr.write(f"{PROG}: internal error{where}: {REPORT_HINT}\n")
    raise SystemExit(1)


def _interrupted(err: KeyboardInterrupt) -> NoReturn:
    """Ctrl-C / SIGTERM: what the trainer saved and the command that resumes (if it says), no traceback."""
    what = " ".join(str(err).split())
    hint = str(getattr(err, "resume_hint", "") or "").strip()
    sys.stderr.write(f"\n{PROG}: interrupted{': ' + what if what else ''}\n")
    if hint:
        sys.stderr.write(f"resume with: {hint}\n")
    raise SystemExit(getattr(err, "exit_code", 130))


def _debug(args: list[str]) -> tuple[list[str], bool]:
    """``args`` without ``--debug``, and whether tracebacks are wanted (the flag or ``LIGHTNING_DFL_DEBUG``)."""
    env = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
    return [a for a in args if a != DEBUG_FLAG], env or DEBUG_FLAG in args


def version() -> str:
    """The installed distribution's version (the package's ``__version__`` when not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("lightning-dfl")
    except PackageNotFoundError:
        from lightning_dfl import __version__

        return __version__


# -- entry point ------------------------------------------------------------------------
USAGE = """usage: lightning-dfl {fit,schedule,cost,curves,export,plot} ... [--debug] [--version]

  fit       train a federation: lightning-dfl fit --config configs/dispfl_digits.yaml (fit --help)
  schedule  DA-DPFL dynamic aggregation: parallelism and delay against M and N (Figs. 8-9)
  cost      C_total(theta) cost curves of finished runs (DA-DPFL Sec. VI-A5)
  curves    plot logged metrics against the round for finished runs (needs .[plots])
  export    a client's channel-pruned model as a smaller network, with its size, MACs and latency
  plot      figures of one run: lightning-dfl plot diagnostics RUN_DIR [--out DIR] (needs .[plots])

  --debug   show the full traceback of an error (also LIGHTNING_DFL_DEBUG=1)
  --version print the version
"""

COMMANDS = ("fit", *SUBCOMMANDS, "plot")

#: ``lightning-dfl plot KIND RUN_DIR``: the kinds of figures and what they show
PLOT_KINDS = {"diagnostics": "spectral gap, consensus distance, mask Jaccard and flips per round; the final "
                             "mask-Jaccard and bytes heatmaps; per-client accuracy"}


def _plot_parser() -> argparse.ArgumentParser:
    """The parser of ``lightning-dfl plot KIND RUN_DIR [--out DIR]``."""
    parser = argparse.ArgumentParser(
        prog=f"{PROG} plot", exit_on_error=False,
        description="Figures of one run (PNG files; needs matplotlib: pip install -e '.[plots]').",
        epilog="kinds: " + "; ".join(f"{k}: {v}" for k, v in PLOT_KINDS.items()))
    parser.add_argument("kind", help=f"what to plot; allowed: {', '.join(PLOT_KINDS)}")
    parser.add_argument("run_dir", help="the run folder (runs/<algorithm>/version_N)")
    parser.add_argument("--out", default=None, help="folder of the figures (default: RUN_DIR/diagnostics)")
    return parser


def _plot(args: list[str]) -> None:
    """``lightning-dfl plot diagnostics RUN_DIR [--out DIR]``: write a run's diagnostics figures."""
    parser = _plot_parser()
    if not args or args[0] in ("-h", "--help"):
        parser.print_help()
        return
    if args[0] not in PLOT_KINDS:
        raise ValueError(f"unknown plot kind {args[0]!r}; allowed: {', '.join(PLOT_KINDS)}")
    if len([a for a in args if not a.startswith("-")]) < 2:
        raise ValueError(f"plot {args[0]} needs a run folder: {PROG} plot {args[0]} runs/<algorithm>/version_N")
    ns = parser.parse_args(args)
    if ns.out is not None:
        from lightning_dfl.checks import check_output_path

        check_output_path("--out", ns.out)
    from lightning_dfl.plots import plot_diagnostics

    for path in plot_diagnostics(ns.run_dir, ns.out):
        print(f"figure: {path}")


def _command_error(first: str) -> NoReturn:
    """An unknown subcommand, or an option before any: name the subcommands, one line each."""
    if first.startswith("-"):
        message = f"the subcommand comes first ({PROG} fit {first} ...)"
    else:
        close = difflib.get_close_matches(first, COMMANDS, n=1)
        message = f"unknown subcommand {first!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
    listing = "\n".join(line for line in USAGE.splitlines() if re.match(r"  [a-z]", line))
    sys.stderr.write(f"{PROG}: error: {message}; allowed: {', '.join(COMMANDS)}\n{listing}\n")
    raise SystemExit(2)


#: ``$LIGHTNING_DFL_CACHE`` (the data cache's variable) values that turn caching off
_CACHE_OFF = ("0", "off", "false", "no", "none", "disable", "disabled")


def _help_cache() -> Path | None:
    """Where ``fit --help`` is kept: ``help/`` in ``$LIGHTNING_DFL_CACHE``, else ``~/.cache/lightning-dfl/help``."""
    root = os.environ.get("LIGHTNING_DFL_CACHE", "").strip()
    if root.lower() in _CACHE_OFF and root:
        return None
    return Path(root or "~/.cache/lightning-dfl").expanduser() / "help"


#: the libraries whose versions change what ``fit``'s help texts say
_HELP_LIBRARIES = ("lightning", "jsonargparse", "docstring-parser", "torch", "omegaconf")
#: ``fit``'s help texts kept in the package (``python -m lightning_dfl.help_texts`` writes them), at this width
KEPT_HELP = Path(__file__).with_name("help_texts.json")
KEPT_HELP_WIDTH = 80


def _library_versions() -> str:
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
    return f"python {sys.version_info[0]}.{sys.version_info[1]}|{_library_versions()}"


def help_source_key() -> str:
    """The project's sources, by content (equal in every clone of one commit): what ``fit``'s help texts are
    made of, with :func:`help_environment`."""
    import hashlib

    digest = hashlib.sha256()
    for folder in dict.fromkeys(_own_folders()):
        root = Path(folder)
        for path in sorted(root.rglob("*.py")):
            digest.update(f"|{root.name}/{path.relative_to(root).as_posix()}|".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def _help_key(request: str) -> str:
    """The user cache's key of a help text: the project's sources (their sizes and times), the versions of
    Python, lightning-dfl and the libraries that write the help, the terminal's width and the request."""
    import hashlib
    import shutil

    digest = hashlib.sha256(f"{sys.version}|{version()}|{shutil.get_terminal_size().columns}|{request}|"
                            f"{_library_versions()}".encode())
    for folder in dict.fromkeys(_own_folders()):
        for path in sorted(Path(folder).rglob("*.py")):
            stat = path.stat()
            digest.update(f"|{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def fit_help_request(args: Sequence[str]) -> str | None:
    """``fit --help`` or one class's help alone (``fit --trainer.algorithm.help=DADPFL``): the request as the
    help texts are kept (``"--help"``, ``"--trainer.algorithm.help=DADPFL"``); None for any other command."""
    if len(args) < 2 or args[0] != "fit":
        return None
    rest = list(args[1:])
    if rest in (["--help"], ["-h"]):
        return "--help"
    if len(rest) == 1 and _CLASS_HELP.fullmatch(rest[0]) and "=" in rest[0]:
        return rest[0]
    if len(rest) == 2 and _CLASS_HELP.fullmatch(rest[0]) and "=" not in rest[0] and not rest[1].startswith("-"):
        return f"{rest[0]}={rest[1]}"
    return None


def kept_help(request: str) -> str | None:
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
    if not isinstance(kept, dict) or kept.get("key") != help_source_key() or kept.get("environment") != \
            help_environment():
        return None
    text = (kept.get("texts") or {}).get(request)
    return text if isinstance(text, str) else None


def render_fit_help(request: str) -> str:
    """What ``lightning-dfl fit <request>`` prints (it imports torch and Lightning: seconds); a request that is
    no help (an unknown class) raises the command's error."""
    import io

    from lightning_dfl.fit_cli import FederatedCLI

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        try:
            FederatedCLI(args=["fit", request], parser_kwargs={"exit_on_error": False, "prog": PROG})
        except SystemExit as stop:
            if stop.code not in (0, None):
                raise
    return buffer.getvalue()


def fit_help(request: str = "--help") -> str:
    """The text of ``lightning-dfl fit <request>`` (``--help`` or a class's help): the one kept in the package
    when it was written for these sources; else written once (seconds) into the user's cache and read from there
    until a source file, a library or the terminal's width changes."""
    text = kept_help(request)
    if text is not None:
        return text
    folder = _help_cache()
    name = "fit" if request == "--help" else "class"
    path = folder / f"{name}-{_help_key(request)}.txt" if folder is not None else None
    if path is not None and path.is_file():
        return path.read_text()
    text = render_fit_help(request)
    if path is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if name == "fit":
                for old in folder.glob("fit-*.txt"):
                    old.unlink(missing_ok=True)
            temporary = folder / f".{path.name}.{os.getpid()}.tmp"
            temporary.write_text(text)
            os.replace(temporary, path)
        except OSError:  # a read-only or full cache: the help is still printed
            pass
    return text


def _subcommand(name: str, args: list[str]) -> None:
    """Run an analysis subcommand (``schedule``, ``cost``, ``curves``, ``export``) on its arguments."""
    from jsonargparse import CLI

    CLI(SUBCOMMANDS[name], args=args, exit_on_error=False, formatter_class=HelpFormatter, prog=f"{PROG} {name}")


def command_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of ``plot`` or an analysis subcommand, built without running anything (``fit``'s
    is LightningCLI's: check a ``fit`` command line with ``--print_config``)."""
    if name == "plot":
        return _plot_parser()
    if name not in SUBCOMMANDS:
        raise ValueError(f"no parser for {name!r}; allowed: {', '.join(['plot', *SUBCOMMANDS])}")
    from jsonargparse import capture_parser

    return capture_parser(lambda: _subcommand(name, []))


def _run(args: list[str]) -> None:
    request = fit_help_request(args)
    if request is not None:
        sys.stdout.write(fit_help(request))
        raise SystemExit(0)  # as argparse's help
    if args[0] == "plot":
        _plot(args[1:])
        return
    from lightning_dfl.config_files import check_config_file, config_files

    for path in config_files(args[1:]):  # before jsonargparse reads (and expands) them
        check_config_file(path)
    if args[0] in SUBCOMMANDS:
        _subcommand(args[0], args[1:])
        return
    from lightning_dfl.fit_cli import FederatedCLI

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        FederatedCLI(args=args, parser_kwargs={"exit_on_error": False, "prog": PROG})


#: a class's help in ``fit``: ``--trainer.algorithm.help=DADPFL`` or ``--trainer.algorithm.help DADPFL``
_CLASS_HELP = re.compile(r"--[\w.]+\.help(=.*)?")


def is_help_request(args: Sequence[str]) -> bool:
    """Whether the command line only asks for a text: the usage, ``--version``, a ``--help`` or a class's help."""
    return (not args or args[0] in ("--version", "-V")
            or any(a in ("-h", "--help") or _CLASS_HELP.fullmatch(a) for a in args))


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
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    if args[0] in ("--version", "-V"):
        print(f"{PROG} {version()}")
        return
    if args[0] not in COMMANDS:
        _command_error(args[0])
    try:
        _run(args)
    except KeyboardInterrupt as err:
        if debug:
            raise
        _interrupted(err)
    except BrokenPipeError:
        raise
    except Exception as err:
        if debug:
            raise
        diverged = _diverged(err)
        if diverged is not None:
            _stop(diverged)
        run_file = next((e for e in _chain(err) if isinstance(e, RunFileError)), None)
        if run_file is not None:  # a full disk, a read-only folder, a damaged CSV: in a round too, not a bug
            _fail(" ".join(str(run_file).split()))
        if raised_in_round(err) is None and is_user_error(err):
            _fail(error_message(err))
        _bug(err)


if __name__ == "__main__":
    main()

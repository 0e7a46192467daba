"""What went wrong, for the command line: bad input (one line, exit code 2), a diverged run (one line, exit code 3)
or a bug (its traceback, exit code 1, and where to report it).

Bad input is told apart by type: the exceptions of :func:`user_errors` (``ValueError`` and the project's
:class:`~lightning_dfl.errors.ConfigurationError` among them, which its argument checks raise), judged on the
outermost exception raised outside jsonargparse (which wraps whatever a class's ``__init__`` raises, a bug too);
an error of jsonargparse's own (a value it could not parse) and one of Lightning's accelerator connector (a
device the machine lacks) are input as well. Imports no torch.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from lightning_dfl.cli.help import PROG, allowed
from lightning_dfl.errors import (
    DIVERGED_EXIT_CODE,
    ConfigurationError,
    MissingExtra,
    RunDiverged,
    RunFileError,
    raised_in_round,
)

__all__ = ["DEBUG_ENV", "DEBUG_FLAG", "DEBUG_HINT", "REPORT_HINT", "error_message", "fail", "interrupted",
           "is_user_error", "report", "user_errors"]

DEBUG_FLAG = "--debug"
DEBUG_ENV = "LIGHTNING_DFL_DEBUG"
DEBUG_HINT = f"(run with {DEBUG_FLAG} for the traceback)"

#: exceptions that describe bad input (config values, names, paths, data, checkpoints, a federation too
#: large for the memory), not a bug; with Lightning's MisconfigurationException once Lightning is imported
#: (see :func:`user_errors`)
_INPUT_ERRORS: tuple[type[BaseException], ...] = (ConfigurationError, ValueError, FileNotFoundError,
                                                  NotADirectoryError, IsADirectoryError, PermissionError,
                                                  argparse.ArgumentError, MemoryError, MissingExtra)


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that describe bad input: Lightning's MisconfigurationException too where Lightning was
    imported (without it loaded, none can have been raised, and the error path stays free of its import)."""
    exceptions = sys.modules.get("lightning.fabric.utilities.exceptions")
    extra = getattr(exceptions, "MisconfigurationException", None)
    return (*_INPUT_ERRORS, extra) if extra is not None else _INPUT_ERRORS


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


def _is_device_setting(err: BaseException) -> bool:
    """An error of Lightning's accelerator/precision connector: a device (or its package) the machine lacks."""
    connectors = (f"fabric{os.sep}connector.py", f"connectors{os.sep}accelerator_connector.py")
    return isinstance(err, (RuntimeError, ImportError)) and any(
        frame.filename.endswith(connectors) for frame in traceback.extract_tb(err.__traceback__))


def _is_about_input(err: BaseException, parsing: bool) -> bool:
    """Whether ``err`` itself (not what wraps it) describes bad input; ``parsing``: jsonargparse wrapped it."""
    if isinstance(err, user_errors()) or _is_device_setting(err):
        return True
    # while parsing: a class path naming a module, or a name in a module, that is not there (a lazy package's
    # __getattr__ raises the AttributeError), a YAML syntax error
    return parsing and (isinstance(err, ImportError) or _is_missing_name(err)
                        or type(err).__module__.startswith("yaml."))


def _is_missing_name(err: BaseException) -> bool:
    """``module 'x' has no attribute 'Y'``: a class path naming something its module lacks."""
    return isinstance(err, AttributeError) and re.fullmatch(r"module '[\w.]+' has no attribute '\w+'", str(err)) \
        is not None


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


def _unknown_class(option: str | None, value: str, chain: Sequence[BaseException] = ()) -> str:
    kind = _CLASS_OPTIONS.get((option or "").removesuffix(".help"), "")
    names = ", ".join(allowed(kind)) if kind == "algorithm" else kind
    return (f"unknown class {value!r}; " + (f"allowed: {names}" if names else "give a class name or import path")
            + (_not_on_path(value) or _why_not_imported(value, chain)))


def _why_not_imported(value: str, chain: Sequence[BaseException]) -> str:
    """Why an import path ``value`` (``package.module.Class``) names no class, from the import's own error in
    ``chain`` (nothing is imported here): its module is not on Python's path, importing it failed (a module it
    imports is missing), or the module has no such class (its classes are named)."""
    module, _, name = value.rpartition(".")
    if not module:
        return ""
    failed = next((e for e in chain if isinstance(e, ImportError)), None)
    if isinstance(failed, ModuleNotFoundError) and failed.name and (module + ".").startswith(failed.name + "."):
        return f" (no module {failed.name!r} on Python's path: is it installed, or is its folder in PYTHONPATH?)"
    if failed is not None:
        return f" (importing {module!r} failed: {failed})"
    loaded = sys.modules.get(module)
    if loaded is None:
        return ""
    classes = sorted(n for n, v in vars(loaded).items() if isinstance(v, type) and v.__module__ == module)
    return f" (the module {module!r} has no {name!r}" + (f"; its classes: {', '.join(classes)})" if classes else ")")


def _not_on_path(value: str) -> str:
    """A hint when ``value``'s top module is a file or package in the working folder that Python cannot import
    (the ``lightning-dfl`` script does not put the working folder on its path); found without importing it."""
    top = value.split(".", 1)[0]
    if "." not in value or not top.isidentifier():
        return ""
    here = Path.cwd()
    if not ((here / f"{top}.py").is_file() or (here / top / "__init__.py").is_file()):
        return ""
    try:
        if importlib.util.find_spec(top) is not None:
            return ""
    except (ImportError, ValueError):
        pass
    return (f" (the module {top!r} is in the working folder {here} but not on Python's path: run with "
            f"PYTHONPATH=. or install it as a package)")


def _denied(path: str, entry: str, policy: Any) -> str:
    """A value naming an import path ``policy`` refuses (:mod:`lightning_dfl.cli.trust`)."""
    from lightning_dfl.cli.trust import SAFE_FLAG, TRUST_FLAG

    if policy is not None and policy.safe and entry == "*":
        return (f"{path!r} is refused: {policy.describe()} (add a module of yours with {TRUST_FLAG} MODULE; run "
                f"without {SAFE_FLAG} only a config you trust as you would a Python file)")
    return (f"{path!r} is refused: a config may not name {entry!r} (jsonargparse's import-path denylist: what runs "
            "commands or code, loads pickles or ends the process); write a Python callback for it instead")


def _null_class(option: str | None) -> str:
    """``class_path: null`` (a class option whose class is not named)."""
    kind = _CLASS_OPTIONS.get(option or "", "")
    names = ", ".join(allowed(kind)) if kind == "algorithm" else kind
    fix = f"; allowed: {names}" if names else ""
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
    denied = re.search(r"Importing '([^']+)' is not allowed, denied by the '([^']+)' entry", texts)
    own = [e for e in chain if not _in_jsonargparse(e)
           and (isinstance(e, user_errors()) or _is_device_setting(e))]
    try:
        import yaml

        yaml_error = next((e for e in chain if isinstance(e, yaml.YAMLError)), None)
    except ImportError:  # pragma: no cover - jsonargparse needs PyYAML
        yaml_error = None
    if yaml_error is not None and type(yaml_error).__name__ == "RepresenterError":  # writing, not reading
        value = yaml_error.args[1] if len(yaml_error.args) > 1 else yaml_error
        message = (f"the run's configuration cannot be saved as YAML (config.yaml): a default value {value!r} is not "
                   "a plain value (a number, string, list or mapping); give that option a plain value on the command "
                   "line or in the config")
        option = None
    elif yaml_error is not None:
        mark = getattr(yaml_error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(p) for p in (getattr(yaml_error, "context", None), getattr(yaml_error, "problem", None))
                           if p) or str(yaml_error)
        message, option = f"YAML syntax error{where}: {problem}", None
    elif denied is not None:
        policy = next((p for e in chain if (p := getattr(e, "_lightning_dfl_policy", None))), None)
        message = _denied(*denied.groups(), policy)
    elif own:
        source = own[-1]
        message = str(source.args[0]) if isinstance(source, KeyError) and source.args else str(source)
        if isinstance(source, OSError) and source.filename and (message.startswith("[Errno")
                                                                 or str(source.filename) not in message):
            message = f"{source.strerror or message}: {str(source.filename)!r}"
        message = message.strip() or type(source).__name__
    elif (isinstance(root, (ImportError, AttributeError)) and class_path) or import_path:
        message = _unknown_class(option, (import_path or class_path)[1], chain)  # type: ignore[index]
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


def _prints_here() -> bool:
    """Whether this process prints a one-line error: rank 0, and on each machine of a run over several machines
    the process that launched its others (local rank 0: ``LOCAL_RANK``, SLURM's ``SLURM_LOCALID``, unset before
    the launch), so that each machine's terminal gets the line once."""
    return _rank() == 0 or os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")).strip() == "0"


def fail(message: str) -> NoReturn:
    """Bad input: one line, exit 2; with several processes (``--trainer.devices 2``) every process refuses, and
    only rank 0 (the launching process; on several machines, each one's: :func:`_prints_here`) prints the line."""
    if _prints_here():
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
    printed as :func:`fail`'s line (rank 0, each machine's launching process)."""
    if _prints_here():
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


def interrupted(err: KeyboardInterrupt) -> NoReturn:
    """Ctrl-C / SIGTERM: what the trainer saved and the command that resumes (if it says), no traceback."""
    what = " ".join(str(err).split())
    hint = str(getattr(err, "resume_hint", "") or "").strip()
    sys.stderr.write(f"\n{PROG}: interrupted{': ' + what if what else ''}\n")
    if hint:
        sys.stderr.write(f"resume with: {hint}\n")
    raise SystemExit(getattr(err, "exit_code", 130))




def report(err: Exception) -> NoReturn:
    """End the command on ``err``: a diverged run in one line (exit 3); a run file that could not be written or
    read (a full disk, a damaged CSV: in a round too) and bad input refused before the first round in one line
    (exit 2); anything else, and any other error raised inside a round, as a bug (exit 1)."""
    diverged = _diverged(err)
    if diverged is not None:
        _stop(diverged)
    run_file = next((e for e in _chain(err) if isinstance(e, RunFileError)), None)
    if run_file is not None:
        fail(" ".join(str(run_file).split()))
    if raised_in_round(err) is None and is_user_error(err):
        fail(error_message(err))
    _bug(err)

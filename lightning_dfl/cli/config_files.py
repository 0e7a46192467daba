"""Config files (``--config FILE``) checked before jsonargparse reads them: size, alias expansion, duplicate keys.

PyYAML keeps an alias as a reference, so a "billion laughs" file of 2 KB composes in a moment, but every
consumer that walks or copies the value (jsonargparse, OmegaConf) expands it: minutes, then the memory.
A key given twice in one mapping is legal YAML whose second value silently replaces the first (a second
``trainer:`` section would drop the first one's settings). Both are refused here, in one line naming the
file, from the composed node graph (nothing is constructed). Pure Python (PyYAML comes with jsonargparse).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from lightning_dfl.files import check_regular_file

__all__ = ["CLASS_OPTIONS", "MAX_BYTES", "MAX_NODES", "check_class_names", "check_config_file", "check_option_files",
           "check_yaml_text", "config_files", "guard_yaml_loaders"]

#: the largest config file read (the project's configs are about 1 KB)
MAX_BYTES = 1 << 20
#: the most YAML nodes a config may hold once its aliases are expanded
MAX_NODES = 100_000


def config_files(args: Sequence[str]) -> Iterator[str]:
    """The files given to ``--config`` on a command line (``--config FILE`` and ``--config=FILE``)."""
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            yield args[i + 1]
        elif arg.startswith("--config="):
            yield arg.split("=", 1)[1]


def check_option_files(args: Sequence[str]) -> None:
    """Refuse an option's value that names something other than a regular file or a folder (a FIFO, a device, a
    socket), naming the option: jsonargparse would open it as a file (``--trainer.algorithm FILE``) and block or
    never end. Nothing is opened."""
    option = "a positional argument"
    for arg in args:
        if arg.startswith("--"):
            option, has_value, value = arg.partition("=")
            if not has_value:
                continue
        else:
            value = arg
        if value and _exists(value) and not os.path.isdir(value):
            check_regular_file(value, f"the file given to {option}")
        if not arg.startswith("--"):
            option = "a positional argument"


def check_config_file(path: str | os.PathLike) -> None:
    """Refuse a config file larger than :data:`MAX_BYTES`, one whose aliases expand to more than
    :data:`MAX_NODES` nodes, or one with a key given twice in one mapping (``ValueError`` naming the file
    and the key's lines), or a path that exists but is not a regular file (a folder, a FIFO, a device). A path that
    does not exist, or YAML that does not parse, is left to the parser."""

    file = Path(path)
    if not _exists(path):  # the parser says it does not exist, or reads it as an inline string: check that
        check_yaml_text(str(path), "the inline --config")
        return
    check_regular_file(file, "config file")  # a FIFO would block the parser, /dev/zero never end
    where = f"config file {str(path)!r}"
    size = file.stat().st_size
    if size > MAX_BYTES:
        raise ValueError(f"{where} is {size} bytes; a config may hold at most {MAX_BYTES} bytes (1 MiB)")
    try:
        text = file.read_text()
    except (UnicodeDecodeError, ValueError):
        return  # jsonargparse reports it
    check_yaml_text(text, where)


def _exists(path: str | os.PathLike) -> bool:
    """Whether ``path`` names something (a text too long, or holding a NUL, for a path names nothing)."""
    try:
        os.stat(path)
    except (OSError, ValueError):
        return False
    return True


def check_yaml_text(text: str, where: str) -> None:
    """Refuse YAML ``text`` (``where``: what it is, for the message) over :data:`MAX_BYTES`, whose aliases expand
    to more than :data:`MAX_NODES` nodes, or with a key given twice in one mapping; text that does not parse is
    left to the parser."""
    import yaml

    if len(text) > MAX_BYTES:
        raise ValueError(f"{where} is {len(text)} characters; a config may hold at most {MAX_BYTES} (1 MiB)")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, ValueError):
        return  # jsonargparse reports the syntax error with its line
    if root is None:
        return
    _check_expansion(root, where)
    _check_duplicates(root, where)


def guard_yaml_loaders() -> None:
    """Make jsonargparse check every YAML text it loads with :func:`check_yaml_text` first: an inline ``--config``
    string, a file given to a class option (``--trainer.algorithm FILE``), every value. Once per process; the
    YAML modes only (``yaml``, ``omegaconf``: the CLI's)."""
    from jsonargparse import get_loader, set_loader
    from jsonargparse._loaders_dumpers import get_loader_exceptions, loaders

    for mode in ("yaml", "omegaconf"):
        if mode != "yaml" and mode not in loaders:
            continue
        loader = get_loader(mode)
        if getattr(loader, "checks_yaml", False):
            continue

        def guarded(stream: str, *args: object, loader=loader, **kwargs: object) -> object:
            if isinstance(stream, str) and len(stream) > 1:  # a plain number or word cannot hold an alias
                check_yaml_text(stream, "a YAML value (an inline --config, or a file given to an option)")
            return loader(stream, *args, **kwargs)

        guarded.checks_yaml = True
        set_loader(mode, guarded, get_loader_exceptions(mode))


def _children(node: object) -> list:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expansion(root: object, where: str) -> None:
    """The node count with every alias expanded, computed once per distinct node (no expansion, no recursion)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[object, bool]] = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            sizes[key] = min(1 + sum(sizes[id(c)] for c in _children(node)), MAX_NODES + 1)
            continue
        if key in sizes:
            continue
        if key in on_path:  # a recursive alias (a node that contains itself): endless once expanded
            raise ValueError(f"{where} holds a recursive alias (a value that contains itself); "
                             "a config may not")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    if sizes[id(root)] > MAX_NODES:
        raise ValueError(f"{where} expands to more than {MAX_NODES} values once its aliases (*name) "
                         f"are resolved; a config may hold at most {MAX_NODES} (nested aliases, a 'billion laughs')")


def _check_duplicates(root: object, where: str) -> None:
    """A key given twice in one mapping: the second value would silently replace the first."""
    import yaml

    seen_nodes: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if key.value in lines:
                        raise ValueError(f"{where} gives the key {key.value!r} twice in one mapping "
                                         f"(lines {lines[key.value]} and {key.start_mark.line + 1}): the second "
                                         "would replace the first whole; give each key once (merge the two)")
                    lines[key.value] = key.start_mark.line + 1
        stack.extend(_children(node))


#: the class options of ``fit`` (a class name or import path, given whole or as ``.class_path``)
CLASS_OPTIONS = ("--trainer.algorithm", "--trainer.callbacks", "--trainer.clock")


def _registered_names() -> dict[str, str]:
    """The project's class names an option may take, with the public path of each."""
    from lightning_dfl.federation.algorithms import ALGORITHMS

    names = {ALGORITHMS.get(n).__name__: f"lightning_dfl.federation.algorithms.{ALGORITHMS.get(n).__name__}"
             for n in ALGORITHMS.names()}
    names.update({n: f"lightning_dfl.callbacks.{n}" for n in ("RigL", "PruningTimeVoting", "PQIPruning")})
    names["Clock"] = "lightning_dfl.federation.loop.clock.Clock"
    return names


def _class_values(args: Sequence[str]) -> Iterator[tuple[str, str]]:
    """``(where, import path)`` of each class given on the command line or as a ``class_path`` in a config file."""
    import yaml

    for i, arg in enumerate(args):
        option, has_value, value = arg.partition("=")
        option = option.removesuffix("+").removesuffix(".class_path")
        if option in CLASS_OPTIONS:
            if not has_value and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
            if value:
                yield option, value
    for path in config_files(args):
        try:
            text = Path(path).read_text() if _exists(path) else path
            stack = [yaml.safe_load(text)]
        except Exception:  # the parser names what is wrong with it
            continue
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if isinstance(node.get("class_path"), str):
                    yield f"class_path in {path if _exists(path) else 'the inline --config'}", node["class_path"]
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)


def check_class_names(args: Sequence[str]) -> None:
    """Refuse, before any module is imported, a class given by an import path whose last name is one of the
    project's classes (``DisPFL``, ``RigL``, ...) but whose module is not the project's (``this.DisPFL`` imported
    ``this``, and ran its top-level code, before the class was refused)."""
    names = None
    for where, value in _class_values(args):
        module, _, name = value.rpartition(".")
        if not module or module.split(".", 1)[0] == "lightning_dfl":
            continue
        names = _registered_names() if names is None else names
        if name in names:
            from lightning_dfl.errors import ConfigurationError

            raise ConfigurationError(f"{where}: {value!r} names the class {name} from the module {module!r}; {name} "
                                     f"is {names[name]} (give that path, or just {name}); a class of a project's name "
                                     "from another module is refused before that module is imported")

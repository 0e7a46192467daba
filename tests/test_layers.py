"""The layering as a contract (docs/architecture.md, DESIGN.md's layers): a module imports only from its own
layer's package or from the layers below it, never from a layer above nor from a sibling beside it. Every import
counts, those inside functions and under ``if TYPE_CHECKING:`` too.

Top to bottom: the command line and its tools; the federation's ``trainer``, ``loop``, ``algorithms``, then
``metrics``, ``exchange`` and ``store``; the Lightning-level pieces (the module, callbacks, data modules and the
papers' pure rules); ``sparse`` and ``models`` (pure PyTorch); the support modules (checks, seeding, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: installed package name -> its folder in the checkout
PACKAGES = {"lightning_dfl": ROOT / "lightning_dfl", "lightning_dfl.callbacks": ROOT / "callbacks",
            "lightning_dfl.datamodules": ROOT / "datamodules"}

#: top to bottom; a layer is one or more module prefixes
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("command line", ("lightning_dfl.cli", "lightning_dfl.plots", "lightning_dfl.export", "lightning_dfl.__main__")),
    ("trainer", ("lightning_dfl.federation.trainer",)),
    ("loop", ("lightning_dfl.federation.loop",)),
    ("algorithms", ("lightning_dfl.federation.algorithms",)),
    ("metrics", ("lightning_dfl.federation.metrics",)),
    ("exchange", ("lightning_dfl.federation.exchange",)),
    ("store", ("lightning_dfl.federation.store",)),
    ("lightning", ("lightning_dfl.module", "lightning_dfl.callbacks", "lightning_dfl.datamodules", "lightning_dfl.grouping",
                   "lightning_dfl.sampling", "lightning_dfl.cost", "lightning_dfl.pruning_time",
                   "lightning_dfl.gradient_noise")),
    ("pure torch", ("lightning_dfl.sparse", "lightning_dfl.models")),
    ("support", ("lightning_dfl.checks", "lightning_dfl.seeding", "lightning_dfl.stats", "lightning_dfl.deferred",
                 "lightning_dfl.transfers", "lightning_dfl.errors", "lightning_dfl.registry", "lightning_dfl.host_memory",
                 "lightning_dfl.allocator", "lightning_dfl.hooks", "lightning_dfl.state_field",
                 "lightning_dfl.files", "lightning_dfl.startup", "lightning_dfl.run_metrics")),
]
#: package faces that only re-export (importing them is importing what they name)
FACES = ("lightning_dfl", "lightning_dfl.federation")
#: layers whose modules are tools of one kind that may import each other
OPEN = ("command line", "support")
#: within these layers, each prefix is its own package: they may import each other only downwards in this list
ORDERED_WITHIN = {"pure torch": ("lightning_dfl.sparse", "lightning_dfl.models"),
                  "lightning": ("lightning_dfl.module", "lightning_dfl.callbacks", "lightning_dfl.datamodules",
                                "lightning_dfl.grouping", "lightning_dfl.sampling", "lightning_dfl.cost",
                                "lightning_dfl.pruning_time", "lightning_dfl.gradient_noise")}


def _module_name(package: str, folder: Path, path: Path) -> str:
    parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
    return ".".join([package, *parts])


def _imports() -> dict[str, set[str]]:
    """Every project module -> the project modules (or names in them) it imports, anywhere in its code."""
    found: dict[str, set[str]] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if package == "lightning_dfl" and path.relative_to(folder).parts[0] in ("callbacks", "datamodules"):
                continue  # not a folder of the checkout's lightning_dfl/
            name = _module_name(package, folder, path)
            here = name if path.name == "__init__.py" else name.rpartition(".")[0]
            targets: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                        base = f"{anchor}.{base}" if base else anchor
                    targets.update(f"{base}.{alias.name}" for alias in node.names)
                elif isinstance(node, ast.Import):
                    targets.update(alias.name for alias in node.names)
            found[name] = {t for t in targets if t == "lightning_dfl" or t.startswith("lightning_dfl.")}
    return found


def _layer(module: str) -> tuple[int, str, str] | None:
    """``(rank, layer, prefix)`` of the longest prefix that holds ``module`` (rank 0 is the top)."""
    best = None
    for rank, (layer, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[2])):
                best = (rank, layer, prefix)
    return best


def violations(imports: dict[str, set[str]]) -> list[str]:
    wrong = []
    for importer, targets in sorted(imports.items()):
        if importer in FACES:
            continue
        mine = _layer(importer)
        assert mine is not None, f"{importer} is in no layer: add it to tests/test_layers.py's LAYERS"
        for target in sorted(targets):
            if target in FACES or any(target == f"{face}.{name}" for face in FACES for name in ("__version__",)):
                continue
            theirs = _layer(target)
            if theirs is None:
                if target.rpartition(".")[0] in FACES:  # a name of a face: the face re-exports a lower module
                    wrong.append(f"{importer} imports {target}: import it from the module that defines it")
                continue
            if theirs[0] < mine[0] or (theirs[0] == mine[0] and theirs[2] != mine[2] and not _ordered(mine, theirs)):
                wrong.append(f"{importer} ({mine[1]}) imports {target} ({theirs[1]})")
    return wrong


def _ordered(mine: tuple[int, str, str], theirs: tuple[int, str, str]) -> bool:
    if mine[1] in OPEN:
        return True
    order = ORDERED_WITHIN.get(mine[1])
    return order is not None and order.index(theirs[2]) > order.index(mine[2])


def test_no_module_imports_a_layer_above_it_or_a_sibling():
    assert violations(_imports()) == []


def test_every_project_module_is_in_a_layer():
    unplaced = [m for m in _imports() if m not in FACES and _layer(m) is None]
    assert unplaced == []


def test_no_engine_module_imports_the_algorithm_base():
    """The loop asks an algorithm what it overrides (``Algorithm.overrides``) instead of importing the base class."""
    engine = {m: t for m, t in _imports().items() if m.startswith("lightning_dfl.federation.loop")}
    assert [(m, t) for m, ts in engine.items() for t in ts if t.startswith("lightning_dfl.federation.algorithms.base")] \
        == []


@pytest.mark.parametrize("importer, target, allowed", [
    ("lightning_dfl.federation.loop.executor", "lightning_dfl.federation.trainer.settings.RunSettings", False),
    ("lightning_dfl.federation.store.compact", "lightning_dfl.federation.exchange.messages.Message", False),
    ("lightning_dfl.federation.metrics.diagnostics", "lightning_dfl.federation.exchange.plan.RoundPlan", True),
    ("lightning_dfl.federation.exchange.plan", "lightning_dfl.federation.metrics.accounting.RoundAccounting", False),
    ("lightning_dfl.callbacks.rigl", "lightning_dfl.module.SparseClassifier", False),
    ("lightning_dfl.sparse.masks", "lightning_dfl.checks.check_int", True),
    ("lightning_dfl.federation.trainer.build", "lightning_dfl.federation.loop.clock.Clock", True),
    ("lightning_dfl.module", "lightning_dfl.callbacks.rigl.RigL", True),
    ("lightning_dfl.models.resnet", "lightning_dfl.sparse.masks.Masks", False),
    ("lightning_dfl.checks", "lightning_dfl.errors.ConfigurationError", True),
    ("lightning_dfl.federation.algorithms.dispfl", "lightning_dfl.federation.Algorithm", False),
])
def test_the_contract_catches_what_it_forbids(importer, target, allowed):
    """The checker itself: an upward, a sibling's and a face's import are caught; a downward one is not."""
    assert (violations({importer: {target}}) == []) is allowed

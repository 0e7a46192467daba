"""Every column a run writes to ``metrics.csv`` and ``clients.csv`` is named in the docs, and every metric the
docs' "Metrics" section names is one a run writes.

Two sources of names, both cheap: a few short real runs (digits, 2-3 rounds, small federations) of the
algorithms that between them log most families (DA-DPFL's voting and PQI, FedAvg-FT's fine-tuning and shared
model, Sub-FedAvg's subnetwork and pruning, PSFL's warm-up, structure and global test), and a scan of the
sources for the names the other algorithms log literally (``out["feddst/readjust"] = ...``, a dict returned by
``round_metrics``, ``ctx.report[...]``, ``trainer.log_metrics({...})``). A name is documented when a page of
``docs/`` names it in backticks (``acc/personal_mean|std`` names ``acc/personal_std`` too) and its family
(``acc``, ``prisam``, ...) is named in docs/command-line.md's "Metrics" section, where a family may point to its
page (``prisam/*``). A column without a family (``round``, ``bytes_sent``) must be named in that section itself.
"""

from __future__ import annotations

import ast
import csv
import re
from pathlib import Path

import pytest

from lightning_dfl.cli import FederatedCLI

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIGS = ROOT / "configs"
SOURCES = [*sorted((ROOT / "lightning_dfl").rglob("*.py")), *sorted((ROOT / "callbacks").glob("*.py"))]

A = "--trainer.algorithm.init_args."
#: (config, options): each run a few seconds; together they write every family but the ones the scan covers
RUNS = {
    # t* decided in round 2 (every score is below delta_pr): voting/*, pqi/*, sparsity/*, time/*
    "dadpfl": ("dadpfl_digits.yaml", ["--trainer.rounds=2", "--trainer.local_epochs=1", "--data.num_clients=6",
                                      f"{A}num_neighbors=2", f"{A}max_wait=2", f"{A}delta_pr=1e9"]),
    # acc/consensus_*, acc/finetune_*, acc/trained_*, flops/finetune_*
    "fedavg_ft": ("fedavg_ft_digits.yaml", ["--trainer.rounds=1", "--trainer.local_epochs=1", "--data.num_clients=6",
                                            f"{A}clients_per_round=3", "--trainer.dropout=0.2"]),
    # acc/subnetwork_*, acc/own_model_*, subfedavg/*, flops/check, clients.csv's subfedavg/*
    "subfedavg": ("subfedavg_digits.yaml", ["--trainer.rounds=2", "--data.num_clients=6", f"{A}clients_per_round=3",
                                            f"{A}headline=own_model"]),
    # psfl/* after its warm-up, acc/global, loss/global, time/warmup, time/to_target
    "psfl": ("psfl_digits.yaml", ["--trainer.rounds=3", "--data.num_clients=8", f"{A}clients_per_round=4",
                                  f"{A}warmup_rounds=2", f"{A}target_accuracy=0.01"]),
}

_NAME = re.compile(r"[a-z][a-z0-9_]*/[A-Za-z0-9_*|]+")
_METRIC = re.compile(r"^[a-z][a-z0-9_]*/[A-Za-z0-9_]+$")


def _expand(name: str) -> set[str]:
    """``fam/a_mean|std`` -> ``fam/a_mean``, ``fam/a_std``; ``fam/mean|std`` -> ``fam/mean``, ``fam/std``."""
    family, rest = name.split("/", 1)
    first, *others = rest.split("|")
    stem = first.rsplit("_", 1)[0] + "_" if "_" in first else ""
    return {f"{family}/{first}", *(f"{family}/{stem}{o}" for o in others if o)}


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _names(text: str) -> set[str]:
    """The ``family/name`` names (``|`` forms expanded, ``family/*`` kept) in ``text``'s backticks."""
    return {n for token in _backticked(text) for found in _NAME.findall(token) for n in _expand(found)}


def _metrics_section() -> str:
    text = (DOCS / "command-line.md").read_text()
    start = text.index("\n## Metrics\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _documented() -> tuple[set[str], set[str], set[str]]:
    """(every name the docs give, the families the Metrics section names, that section's backticked tokens)."""
    named = set().union(*(_names(p.read_text()) for p in sorted(DOCS.glob("*.md"))))
    section = _metrics_section()
    families = {n.split("/", 1)[0] for n in _names(section)}
    return named, families, set(_backticked(section))


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """The module's top-level ``NAME = "text"`` constants."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


#: the dicts a round's metrics are collected in, and the task report that becomes clients.csv's columns
_METRIC_BASES = {"out", "metrics", "_info", "_round_metrics"}
_REPORT_BASES = {"report"}
#: the functions whose returned dicts are (part of) a round's metrics
_METRIC_FUNCTIONS = {"round_metrics", "evaluate_round", "metrics", "own_models", "global_test_metrics",
                     "shared_model_metrics", "personal_spread", "end_round", "_close_round",
                     "on_federated_round_end"}


def _key(node: ast.AST, constants: dict[str, str]) -> str | None:
    """A dict key or subscript: a string, or a module constant naming one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return constants.get(node.id) if isinstance(node, ast.Name) else None


def _base(node: ast.AST) -> str | None:
    """``out`` of ``out[...]``, ``report`` of ``ctx.report[...]``."""
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)


def _dict_keys(node: ast.AST, constants: dict[str, str]) -> list[str]:
    if not isinstance(node, ast.Dict):
        return []
    return [k for k in (_key(k, constants) for k in node.keys if k is not None) if k]


def _scan(tree: ast.Module, metrics: set[str], report: set[str]) -> None:
    constants = _string_constants(tree)
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign) else []
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Subscript) and (k := _key(t.slice, constants)):
                    if _base(t.value) in _METRIC_BASES:
                        metrics.add(k)
                    elif _base(t.value) in _REPORT_BASES:
                        report.add(k)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "log_metrics" or (node.func.attr == "update" and _base(node.func.value) in _METRIC_BASES):
                metrics.update(k for a in node.args for k in _dict_keys(a, constants))
        if isinstance(node, ast.FunctionDef) and node.name in _METRIC_FUNCTIONS:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Return) and sub.value is not None:
                    metrics.update(_dict_keys(sub.value, constants))
                elif isinstance(sub, ast.Assign) and any(_base(t) in _METRIC_BASES for t in sub.targets):
                    metrics.update(_dict_keys(sub.value, constants))


def scanned_names() -> tuple[set[str], set[str]]:
    """(metric names, clients.csv names) the sources log literally."""
    metrics: set[str] = set()
    report: set[str] = set()
    for path in SOURCES:
        _scan(ast.parse(path.read_text()), metrics, report)
    return {m for m in metrics if _METRIC.match(m)}, report


def _header(path: Path) -> list[str]:
    with path.open(newline="") as f:
        return next(csv.reader(f))


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple[set[str], set[str]]]:
    """Per run: (metrics.csv's columns, clients.csv's columns)."""
    out = {}
    for name, (config, options) in RUNS.items():
        root = tmp_path_factory.mktemp(f"metrics_{name}")
        cli = FederatedCLI(args=["fit", "--config", str(CONFIGS / config), f"--trainer.default_root_dir={root}",
                                 "--trainer.enable_progress_bar=false", "--trainer.cpu_threads=1", *options])
        folder = Path(cli.trainer.log_dir)
        out[name] = set(_header(folder / "metrics.csv")), set(_header(folder / "clients.csv"))
    return out


def _undocumented(names: set[str]) -> list[str]:
    named, families, section = _documented()
    missing = []
    for n in sorted(names):
        if "/" in n:
            if n not in named or n.split("/", 1)[0] not in families:
                missing.append(n)
        elif n not in section:
            missing.append(n)
    return missing


def test_every_column_the_runs_write_is_documented(written):
    columns = set().union(*(m | c for m, c in written.values()))
    assert {"voting/t_star", "pqi/pruned_weights", "acc/finetune_mean", "acc/own_model_mean", "subfedavg/hamming",
            "psfl/W", "time/to_target", "bytes_sent", "round", "step"} <= columns  # the runs log what they are for
    assert not _undocumented(columns), (
        f"columns no page of docs/ names (add them to docs/command-line.md's 'Metrics' or the page its family "
        f"points to): {_undocumented(columns)}")


def test_every_name_the_sources_log_is_documented():
    metrics, report = scanned_names()
    assert len(metrics) >= 60 and {"feddst/readjust", "fedfomo/positive", "prisam/ari", "flops/validation",
                                    "acc/global"} <= metrics, sorted(metrics)  # the scan still finds them
    assert {"dfedsam/second_pass_samples", "kept_channels", "feddst/readjust_flops"} <= report, sorted(report)
    missing = _undocumented(metrics | report)
    assert not missing, f"logged names no page of docs/ names: {missing}"


def test_every_metric_the_metrics_section_names_is_written(written):
    """A name in docs/command-line.md's "Metrics" section that nothing writes is stale; a ``family/*`` there must
    have members."""
    metrics, report = scanned_names()
    logged = set().union(*(m | c for m, c in written.values())) | metrics | report
    stale = []
    for n in sorted(_names(_metrics_section())):
        family, rest = n.split("/", 1)
        if rest == "*" or rest.endswith("_*"):
            prefix = f"{family}/{rest[:-1]}"
            if not any(m.startswith(prefix) for m in logged):
                stale.append(n)
        elif n not in logged:
            stale.append(n)
    assert not stale, f"docs/command-line.md's 'Metrics' names what no run or source writes: {stale}"

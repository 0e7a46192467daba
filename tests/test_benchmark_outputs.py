"""Benchmark scripts write where ``--out`` says (the committed results by default) and say where."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, args, files", [
    ("precision", ["--root", "unused"], ["precision.md", "precision.json"]),
    ("batched_clients", [], ["batched_clients_cpu.md", "batched_clients_cpu.json"]),
])
def test_out_names_the_results_folder(tmp_path, monkeypatch, capsys, name, args, files):
    script = _script(name)
    committed = {p: p.stat().st_mtime_ns for p in (BENCHMARKS / "results").glob("*")}
    result = {"precision": "32-true", "images_per_s": 100.0, "wall_s": 1.0, "final_accuracy": 0.5, "best_accuracy": 0.5,
              "round_s": 1.0, "accuracy": 0.5}
    monkeypatch.setattr(script, "run", lambda *a, **k: dict(result))  # the measurement itself is not run here
    if hasattr(script, "cpu_bf16_flags"):
        monkeypatch.setattr(script, "cpu_bf16_flags", lambda: [])
    script.main([*args, "--out", str(tmp_path / "mine")])
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == sorted(files)
    assert f"wrote {tmp_path / 'mine' / files[0]}" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in (BENCHMARKS / "results").glob("*")} == committed


def test_round_phases_splits_a_round_into_timed_phases(tmp_path, monkeypatch):
    """The phase table of two digits rounds: every phase timed, their sum within the round's wall time, the
    SGD steps the largest share; the table goes where --out says and the run leaves no folder behind."""
    script = _script("round_phases")
    out = tmp_path / "phases.md"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["round_phases.py", "--config", str(BENCHMARKS.parent / "configs" / "dispfl_digits.yaml"),
                                     "--rounds", "2", "--out", str(out), "--", "--data.num_clients", "6",
                                     "--trainer.algorithm.num_neighbors", "2", "--trainer.diagnostics", "false"])
    script.main()
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| 1 ") or
            line.startswith("| 2 ")]
    assert len(rows) == 2
    for cells in rows:
        wall, *phases = (float(c) for c in cells[1:])
        named, other = phases[:-1], phases[-1]
        assert all(p >= 0 for p in named) and other >= -1e-6 and abs(sum(named) + other - wall) < 0.02
        assert phases[script.PHASES.index("local_train")] == max(named)  # the SGD steps dominate
    assert not list(tmp_path.glob("runs"))

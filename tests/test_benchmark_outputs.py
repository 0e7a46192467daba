"""Benchmark scripts write where ``--out`` says (the committed results by default) and say where."""

from __future__ import annotations

import importlib.util
import runpy
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, args, files", [
    ("precision", ["--root", "unused"], ["precision.md", "precision.json"]),
    ("batched_clients", [], ["batched_clients_cpu.md", "batched_clients_cpu.json"]),
    ("batched_memory", [], ["batched_memory_cpu.md", "batched_memory_cpu.json"]),
])
def test_out_names_the_results_folder(tmp_path, monkeypatch, capsys, name, args, files):
    script = _script(name)
    committed = {p: p.stat().st_mtime_ns for p in (BENCHMARKS / "results").glob("*")}
    result = {"precision": "32-true", "images_per_s": 100.0, "wall_s": 1.0, "final_accuracy": 0.5, "best_accuracy": 0.5,
              "round_s": 1.0, "accuracy": 0.5, "arch": "cnn_cifar", "clients": 4, "estimate_per_client": 2**20,
              "estimate": 2**22, "measured": 2**22}
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
    measured = script.main()
    printed = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| 1 ") or
               line.startswith("| 2 ")]
    assert len(printed) == len(measured) == 2
    for cells, (round_idx, wall, seconds, _, _) in zip(printed, measured):
        # the phases are timed inside the round, one at a time: they never add up to more than its wall time
        # (checked on the unrounded values: the printed cells, rounded to 0.01 s each, may not add up)
        assert set(seconds) <= set(script.PHASES[:-1]) and all(v >= 0 for v in seconds.values())
        assert sum(seconds.values()) <= wall + 1e-9  # (perf_counter differences: a few ulps of slack)
        assert seconds["local_train"] > 0 and seconds["aggregate"] > 0  # the SGD steps and aggregation were timed
        other = wall - sum(seconds.values())
        assert cells == [f" {round_idx + 1} ", f" {wall:.2f} "] + [f" {seconds.get(p, 0.0):.2f} " for p in script.PHASES[:-1]] \
            + [f" {other:.2f} "]
    assert not list(tmp_path.glob("runs"))


@pytest.mark.parametrize("batched", ["false", "true"])
def test_round_phases_counts_kernels_and_host_reads_on_the_accelerators_paths(tmp_path, monkeypatch, batched):
    """--count-ops --device-paths: per phase, the kernels a GPU would launch and the reads it would wait for;
    the SGD steps (serial, or the batched executor's) and the evaluations read nothing, the steps launch the
    most kernels."""
    script = _script("round_phases")
    out = tmp_path / "phases.md"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["round_phases.py", "--config", str(BENCHMARKS.parent / "configs" / "dispfl_digits.yaml"),
                                     "--rounds", "2", "--count-ops", "--device-paths", "--out", str(out), "--",
                                     "--data.num_clients", "6", "--trainer.algorithm.num_neighbors", "2",
                                     "--trainer.store", "compact", "--trainer.batched_clients", batched])
    script.main()
    text = out.read_text()
    assert "the accelerators' code paths" in text
    table = text[text.index("Kernels run"):]
    rows = [line.split("|")[2:-1] for line in table.splitlines() if line.startswith("| 2 ")]
    assert len(rows) == 1
    kernels, reads = zip(*((int(a.replace(",", "")) for a in cell.split("/")) for cell in rows[0]))
    phase = {name: i + 1 for i, name in enumerate(script.PHASES)}  # column 0 is the total
    assert kernels[0] == sum(kernels[1:]) and reads[0] == sum(reads[1:])
    assert reads[phase["local_train"]] == 0 and reads[phase["evaluate"]] == 0
    assert kernels[phase["local_train"]] == max(kernels[1:])


def test_op_counter_counts_kernels_not_markers_views_or_allocations():
    """What a GPU would launch: an SGD step's kernels (not ``torch.optim``'s profiler markers), no views or bare
    allocations; one read for ``item``."""
    script = _script("round_phases")
    timer = script.PhaseTimer(torch.device("cpu"))
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1, foreach=True)
    weight.grad = torch.ones(3)
    with script.OpCounter(timer):
        optimizer.step()  # wrapped in record_function: one multi-tensor add
        torch.empty(4).view(2, 2)
        assert weight.sum().item() == pytest.approx(2.7)
    assert timer.ops == {"other": 2} and timer.reads == {"other": 1}  # the add and the sum; the item


def _tiny_image_folder(root: Path, per_class: int) -> None:
    """``root/{train,test}/<class>/*.png``: 10 classes of 32x32 RGB images, each class its own colour."""
    from PIL import Image

    for half, n in (("train", per_class), ("test", 2)):
        for c in range(10):
            folder = root / half / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (32, 32), (25 * c, 10 * i, 255 - 25 * c)).save(folder / f"{i}.png")


def test_compare_psfl_runs_on_an_image_folder(tmp_path, capsys):
    """compare_psfl.py end to end on ``--dataset image_folder`` (the CIFAR-10 JPEG copy's layout), tiny: the
    fresh runs (warm-up, FedAvg, SFL) start without a checkpoint, the swept ones resume from the warm-up's,
    and the results go to ``--out``/``--name`` with the data set named in the report."""
    _tiny_image_folder(tmp_path / "cifar10-jpg", per_class=12)
    script = _script("compare_psfl")
    out = tmp_path / "res"
    script.main(["--dataset", "image_folder", "--root", str(tmp_path / "cifar10-jpg"), "--out", str(out),
                 "--name", "compare_psfl_cifar10", "--clients", "5", "--n0", "4", "--warmup-rounds", "2",
                 "--rounds-psfl", "2", "--rounds-fedavg", "2", "--rounds-sfl", "2", "--sweep", "1,2,4",
                 "--sampler-rounds", "5", "--batch-size", "4", "--local-steps", "1", "--test-samples", "1",
                 "--train-samples", "0", "--thresholds", "0.1,0.2"])
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"compare_psfl_cifar10{s}" for s in (".md", ".json", "_time.png", "_sweep.png"))
    md = (out / "compare_psfl_cifar10.md").read_text()
    assert md.startswith("# PSFL vs FedAvg vs SFL on CIFAR-10") and "3x32x32" in md
    assert "--dataset image_folder" in md
    assert f"wrote {out / 'compare_psfl_cifar10.md'}" in capsys.readouterr().out


def test_compare_psfl_sampler_planning_sees_the_observed_times():
    """The samplers' section plans rounds with ``PSFL`` itself, which records a round's observed times in
    ``round_metrics`` once the round ran: without that call every estimate stays 1 and the time-based
    sampler is no faster than the uniform one (N = 100, W = 5, S = 4: about 11.8 against 14.4)."""
    import argparse

    script = _script("compare_psfl")
    setting = argparse.Namespace(clients=100, n0=20, seed=0, warmup_rounds=5, kappa2_estimator="mean", target=0.6)
    row = script.simulate_samplers(setting, [(5, 4)], 200)["structures"]["5x4"]
    assert row["time"]["mean"] < 0.9 * row["uniform"]["mean"]


def test_step_time_times_the_batched_executors_own_training():
    """step_time.py --batched runs BatchedExecutor._train_together outside a federation (kept in step with it)."""
    import torch

    script = _script("step_time")
    assert script.time_batched(2, "cnn_cifar", torch.device("cpu"), batch=4, steps=1, warmup=1) > 0


def test_step_time_times_steps_replayed_from_graphs(monkeypatch):
    """step_time.py's ``-graphed`` settings replay the step through StepGraphs (here through the CPU stand-in for
    CUDA graphs): the timed steps are replays of one captured graph."""
    import torch
    from _graph_sim import SimulatedGraphs

    from lightning_dfl.federation.loop import step_graphs

    backends = []
    monkeypatch.setattr(step_graphs, "graph_backend", lambda device: backends.append(SimulatedGraphs()) or backends[-1])
    script = _script("step_time")
    assert script.time_setting("cl-fp32-graphed", "resnet18", torch.device("cpu"), batch=2, steps=2, warmup=1) > 0
    assert len(backends) == 1 and len(backends[0].graphs) == 1
    monkeypatch.setattr(step_graphs, "graph_backend", lambda device: None)
    with pytest.raises(ValueError, match="a CUDA graph needs a CUDA GPU, not cpu"):
        script.time_setting("cl-fp32-graphed", "resnet18", torch.device("cpu"), batch=2, steps=1, warmup=1)


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.stem)
def test_every_benchmark_imports_and_answers_help(path, monkeypatch, capsys):
    """Benchmarks run by hand, not in CI: at least each one imports (a moved name broke store_memory.py) and
    prints its usage (a helper module without a command line, such as interrupt.py, imports)."""
    if 'if __name__ == "__main__"' not in path.read_text():
        assert runpy.run_path(str(path), run_name=f"benchmark_{path.stem}")
        return
    monkeypatch.setattr("sys.argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(path), run_name="__main__")
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out

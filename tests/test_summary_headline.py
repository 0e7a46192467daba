"""The run's summary names its headline accuracy by what it is (personal, shared, global or subnetwork)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from lightning_dfl.cli import main
from lightning_dfl.federation import ALGORITHMS
from lightning_dfl.federation.metrics.report import HEADLINES, RunSummary, print_summary, progress_status

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _last_value(metrics_csv: Path, column: str) -> float:
    values = [row[column] for row in csv.DictReader(metrics_csv.open()) if row.get(column)]
    return float(values[-1])


@pytest.mark.parametrize("config, extra, metric, words", [
    ("psfl_digits.yaml", ["--data.num_clients=6", "--trainer.algorithm.init_args.clients_per_round=6",
                          "--trainer.algorithm.init_args.warmup_rounds=2"],
     "acc/global", "global model's accuracy, official test split"),
    ("dispfl_digits.yaml", ["--data.num_clients=4", "--trainer.algorithm.init_args.num_neighbors=2"],
     "acc/personal_mean", "mean personalized accuracy"),
    ("subfedavg_digits.yaml", ["--data.num_clients=4", "--trainer.algorithm.init_args.clients_per_round=2"],
     "acc/subnetwork_mean", "mean subnetwork accuracy"),
    ("fedavg_digits.yaml", ["--data.num_clients=4", "--trainer.algorithm.init_args.clients_per_round=2"],
     "acc/consensus_mean", "shared model's mean accuracy"),
], ids=["PSFL", "DisPFL", "SubFedAvg", "FedAvg"])
def test_the_summary_labels_its_headline_by_what_it_is(tmp_path, capsys, monkeypatch, config, extra, metric, words):
    monkeypatch.setenv("COLUMNS", "200")  # the table unwrapped
    main(["fit", "--config", str(CONFIGS / config), "--trainer.rounds=3", "--trainer.local_epochs=1",
          "--trainer.local_steps=null", f"--trainer.default_root_dir={tmp_path}", "--trainer.eval_every=1", *extra])
    out = capsys.readouterr().out
    (run,) = tmp_path.glob("*/version_0")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["headline_metric"] == metric and words in summary["headline"]
    assert summary["final_accuracy"] == pytest.approx(_last_value(run / "metrics.csv", metric))
    assert f"accuracy: {summary['headline']}" in " ".join(out.split())
    assert (metric == "acc/personal_mean") == ("personalized" in out)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_has_a_described_headline(name):
    assert ALGORITHMS.get(name).headline in HEADLINES


@pytest.mark.parametrize("headline", [HEADLINES[name][1] for name in sorted(HEADLINES)])
def test_no_summary_row_wraps_in_80_columns(headline):
    """Each row of the summary table is one line in an 80-column terminal, with a long run folder too; the
    accuracy's description is the caption under the table."""
    summary = RunSummary(algorithm="psfl", rounds=100, final_accuracy=0.9123, best_accuracy=0.9234, final_density=0.25,
                         flops_per_client_round=1.2e9, flops_total=4.5e12, busiest_mb_per_round=1.234,
                         busiest_mask_mb_per_round=0.1, mean_delay=1.5, wall_time_s=12.3,
                         log_dir="runs/resume_demo/psfl_sfl/version_10", label="PSFL (W = 4, S = 5, time)",
                         headline_metric="acc/global", headline=headline)
    console = Console(width=80, record=True, file=io.StringIO())
    print_summary(summary, console)
    text = console.export_text()
    rows = [line for line in text.splitlines() if line.startswith("│")]
    labels = [line.split("│")[1].strip() for line in rows]
    assert labels == ["accuracy, final round", "accuracy, best round", "density (mean over all clients)",
                      "training FLOPs per client per round", "training FLOPs, whole run",
                      "busiest node per round (values)", "busiest node per round (masks)", "mean delay (task units)"]
    assert "accuracy: " + headline in " ".join(text.split())
    assert "run folder: runs/resume_demo/psfl_sfl/version_10" in text.splitlines()


def test_the_summary_prints_the_run_folder_and_checkpoint_whole_in_a_narrow_terminal():
    """A path is never cut nor folded to fit the terminal: it is one line below the table, to copy; the title
    says the start-up before the rounds."""
    folder = "/home/someone/experiments/" + "a_long_folder_name/" * 6 + "dispfl/version_12"
    summary = RunSummary(algorithm="dispfl", rounds=40, final_accuracy=0.97, best_accuracy=0.971, final_density=0.5,
                         flops_per_client_round=5e8, flops_total=4e11, busiest_mb_per_round=1.2,
                         busiest_mask_mb_per_round=0.08, mean_delay=0.0, wall_time_s=48.14, log_dir=folder,
                         startup_s=8.23, checkpoint=folder + "/checkpoints/last.ckpt")
    console = Console(width=60, record=True, file=io.StringIO())
    print_summary(summary, console)
    lines = console.export_text().splitlines()
    assert f"run folder: {folder}" in lines
    assert f"checkpoint: {folder}/checkpoints/last.ckpt" in lines
    assert "dispfl: 40 rounds in 48.1 s (after 8.2 s of start-up)" in " ".join(" ".join(lines).split())


@pytest.mark.parametrize("metrics, shown", [
    ({"train/loss": 0.00036}, "loss 0.00036"), ({"train/loss": 2.30259}, "loss 2.3"),
    ({"acc/headline": 0.9123, "density/mean": 0.25, "train/loss": 0.0123456}, "acc 91.2%  density 0.250  loss 0.0123"),
])
def test_the_progress_bar_shows_the_loss_to_three_significant_digits(metrics, shown):
    assert progress_status(metrics) == shown


@pytest.mark.parametrize("config, extra, planned", [
    ("dispfl_digits.yaml", ["--data.num_clients=4", "--trainer.algorithm.init_args.num_neighbors=2"], 4),
    ("fedavg_digits.yaml", ["--data.num_clients=4", "--trainer.algorithm.init_args.clients_per_round=2"], 3),
], ids=["DisPFL", "FedAvg"])
def test_the_progress_bar_counts_the_tasks_inside_each_round(tmp_path, monkeypatch, config, extra, planned):
    """A long round is not a frozen bar: after each task the bar shows 'tasks k/n' of the round (FedAvg: two
    sampled clients and the server's task)."""
    from lightning_dfl.federation.metrics import report

    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(report.RoundBar, "tasks", lambda self, ended, total: seen.append((ended, total)))
    main(["fit", "--config", str(CONFIGS / config), "--trainer.rounds=2", "--trainer.local_epochs=1",
          f"--trainer.default_root_dir={tmp_path}", *extra])
    assert seen == [(k, planned) for k in range(1, planned + 1)] * 2


def test_the_round_bar_shows_the_tasks_then_the_round_metrics():
    from rich.progress import Progress

    from lightning_dfl.federation.metrics.report import RoundBar

    progress = Progress(console=Console(file=io.StringIO()))
    task = progress.add_task("rounds", total=3, status="")
    bar = RoundBar(progress, task)
    bar.tasks(7, 20)
    assert progress.tasks[0].fields["status"] == "tasks 7/20" and progress.tasks[0].completed == 0
    bar.advance({"acc/headline": 0.5})
    assert progress.tasks[0].fields["status"] == "acc 50.0%" and progress.tasks[0].completed == 1

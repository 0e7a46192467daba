"""The run's summary names its headline accuracy by what it is (personal, shared, global or subnetwork)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lightning_dfl.cli import main
from lightning_dfl.federation.algorithms import ALGORITHMS
from lightning_dfl.federation.report import HEADLINES

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
    assert f"{summary['headline']} (final)" in " ".join(out.split())
    assert (metric == "acc/personal_mean") == ("personalized" in out)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_has_a_described_headline(name):
    assert ALGORITHMS.get(name).headline in HEADLINES

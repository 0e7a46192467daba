"""The command line: LightningCLI fit with the federated trainer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dfl.cli import FederatedCLI

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _fit(tmp_path, config, *extra):
    return FederatedCLI(args=["fit", "--config", str(CONFIGS / config), "--trainer.rounds=1",
                              "--trainer.local_epochs=1", f"--trainer.default_root_dir={tmp_path}",
                              "--trainer.enable_progress_bar=false", "--data.num_clients=4",
                              "--trainer.algorithm.init_args.num_neighbors=2", *extra])


@pytest.mark.parametrize("config", ["dispfl_digits.yaml", "dpsgd_digits.yaml"])
def test_fit_writes_metrics_config_and_summary(tmp_path, config):
    cli = _fit(tmp_path, config)
    log_dir = Path(cli.trainer.log_dir)
    assert (log_dir / "metrics.csv").read_text().startswith(("acc", "comm", "density", "flops", "round", "samples", "time", "train"))
    assert "class_path" in (log_dir / "config.yaml").read_text()
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["rounds"] == 1 and 0.0 <= summary["final_accuracy"] <= 1.0


def test_every_digits_config_parses(tmp_path):
    for config in sorted(CONFIGS.glob("*.yaml")):
        cli = FederatedCLI(args=["--config", str(config)], run=False)
        assert cli.trainer.rounds >= 1 and cli.datamodule.hparams.num_clients >= 1


def test_bad_values_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match="M=4, K=4"):
        _fit(tmp_path, "dispfl_digits.yaml", "--trainer.algorithm.init_args.num_neighbors=4")
    with pytest.raises(ValueError, match="unknown dataset"):
        _fit(tmp_path, "dispfl_digits.yaml", "--data.dataset=imagenet42")


def test_print_config_and_module_entry_point(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lightning_dfl", "fit", "--config", str(CONFIGS / "dispfl_digits.yaml"),
                          "--print_config"], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert "lightning_dfl.federation.algorithms.DisPFL" in out and "num_neighbors: 4" in out


def test_schedule_subcommand_prints_parallelism_and_delay(capsys):
    from lightning_dfl.cli import main

    main(["schedule", "--num_clients=20", "--neighbors=[3]", "--max_waits=[0,null]", "--rounds=500"])
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith("3")]
    assert len(lines) == 2
    assert float(lines[0][2]) == 1.0 and float(lines[0][-1]) == 0.0  # N = 0: parallel, no delay
    assert float(lines[1][-1]) > 0.0  # N = M waits


def test_cost_subcommand_compares_finished_runs(tmp_path, capsys):
    from lightning_dfl.cli import main

    a = _fit(tmp_path / "a", "dispfl_digits.yaml")
    b = _fit(tmp_path / "b", "dpsgd_digits.yaml")
    capsys.readouterr()
    main(["cost", f"--runs=[{a.trainer.log_dir},{b.trainer.log_dir}]", "--thetas=[0.0,1.0]"])
    out = capsys.readouterr().out
    assert "theta" in out and "vs" in out
    with pytest.raises(SystemExit, match="2"):
        main(["cost", f"--runs=[{tmp_path / 'nope'}]"])
    assert "no metrics.csv" in capsys.readouterr().err


def test_top_level_usage_lists_subcommands(capsys):
    from lightning_dfl.cli import main

    main(["--help"])
    out = capsys.readouterr().out
    assert all(word in out for word in ("fit", "schedule", "cost"))


def test_per_client_rows_are_written(tmp_path):
    import csv

    cli = _fit(tmp_path, "dispfl_digits.yaml")
    rows = list(csv.DictReader((Path(cli.trainer.log_dir) / "clients.csv").open()))
    assert [int(r["client"]) for r in rows] == [0, 1, 2, 3]
    assert all(0.49 < float(r["density"]) < 0.51 and int(r["bytes_received"]) > 0 for r in rows)


@pytest.mark.parametrize("config,label", [
    ("beer_digits.yaml", "BEER (fresh minibatch)"),
    ("beer_digits_same_batch.yaml", "BEER"),
    ("gossipfl_digits.yaml", "GossipFL (ratio 0.5, 2 local epochs per gossip)"),
    ("gossipfl_digits_original.yaml", "GossipFL"),
])
def test_non_original_settings_are_labelled_in_the_summary(tmp_path, config, label):
    """BEER's fresh-minibatch difference and GossipFL's ratio 0.5 with epochs per gossip are working
    settings, not the original rules: results name them (summary.json's label); a config ships each
    original rule (optim/BEER.py's same minibatch; SAPS_FL's default, 99% of each tensor sent, and one SGD step
    per gossip)."""
    extra = ["--trainer.algorithm.init_args.num_neighbors=2"] if config.startswith("beer") else []
    cli = FederatedCLI(args=["fit", "--config", str(CONFIGS / config), "--trainer.rounds=1", "--trainer.eval_every=1",
                             f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
                             "--data.num_clients=4", *extra])
    summary = json.loads((Path(cli.trainer.log_dir) / "summary.json").read_text())
    assert summary["label"] == label == cli.trainer.algorithm.label()


def test_the_summary_names_the_checkpoint_and_the_start_up(tmp_path, capsys):
    """summary.json and the printed summary give the run's checkpoint (whole, to copy into --ckpt_path) and the
    start-up before the first round: more than nothing, less than this process has lived."""
    import time

    from lightning_dfl.startup import process_start

    cli = FederatedCLI(args=["fit", "--config", str(CONFIGS / "dispfl_digits.yaml"), "--trainer.rounds=2",
                             "--trainer.local_epochs=1", f"--trainer.default_root_dir={tmp_path}",
                             "--data.num_clients=4", "--trainer.algorithm.init_args.num_neighbors=2",
                             "--trainer.checkpoint_every=1"])
    log_dir = Path(cli.trainer.log_dir)
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["checkpoint"] == str(log_dir / "checkpoints" / "last.ckpt") and Path(summary["checkpoint"]).is_file()
    assert 0.0 < summary["startup_s"] < time.monotonic() - process_start()
    lines = capsys.readouterr().out.splitlines()
    assert f"run folder: {log_dir}" in lines and f"checkpoint: {summary['checkpoint']}" in lines
    assert f"(after {summary['startup_s']:.1f} s of start-up)" in " ".join(" ".join(lines).split())

"""Bad input that used to be accepted, ignored or reported as a bug: each is refused in one line (exit code 2)
naming the value and what is allowed, before any work (a survey of fit's options and the analysis subcommands)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_dfl.cli import main
from lightning_dfl.federation import FederatedTrainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _one_line(capsys, args: list[str]) -> str:
    """The error line of ``lightning-dfl ARGS``, asserted to be the only one, with exit code 2."""
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-dfl: error: "), err
    assert lines[0].endswith("(run with --debug for the traceback)"), err
    return lines[0]


@pytest.fixture
def no_training(monkeypatch):
    def run_round(self, *args, **kwargs):
        raise AssertionError("a round started: the bad input was not refused before training")

    monkeypatch.setattr(FederatedTrainer, "run_round", run_round)


@pytest.mark.parametrize(("config", "extra", "named"), [
    # FedAvg compared None with 1: a TypeError, reported as an internal error (exit code 1)
    ("fedavg_digits.yaml", ["--trainer.algorithm.init_args.clients_per_round=null"],
     ["clients_per_round must be an integer >= 1, got None"]),
    # 1e400 is read as inf, which BEER took for a step size
    ("beer_digits.yaml", ["--trainer.algorithm.init_args.eta=1e400"], ["eta must be a positive number", "got inf"]),
    # with a fixed structure (sequences) warmup_rounds was not checked at all
    ("psfl_digits.yaml", ["--trainer.algorithm.init_args.sequences=2", "--trainer.algorithm.init_args.warmup_rounds=-7"],
     ["warmup_rounds must be an integer >= 2 (or 0: none, with sequences set), got -7"]),
    # a distribution's setting under a distribution that does not read it was ignored
    ("dispfl_digits.yaml", ["--trainer.clock=Clock", "--trainer.clock.init_args.low=3",
                            "--trainer.clock.init_args.high=5"],
     ["trainer.clock", "low=3.0 applies to distribution 'uniform' only", "'fixed'"]),
    # Lightning ran float16 autocast on a CPU as bf16-mixed, with a warning (twice) and its "Using ..." line
    ("dispfl_digits.yaml", ["--trainer.precision=16-mixed", "--trainer.accelerator=cpu"],
     ["precision='16-mixed' is float16 autocast, which runs on a GPU only", "bf16-mixed or 32-true"]),
    ("dispfl_digits.yaml", ["--trainer.precision=16", "--trainer.accelerator=cpu"], ["precision='16'"]),
], ids=["fedavg_clients_per_round_null", "beer_eta_inf", "psfl_warmup_rounds_with_sequences", "clock_inert_low",
        "float16_autocast_on_a_cpu", "float16_autocast_as_16"])
def test_fit_refuses_in_one_line(tmp_path, capsys, no_training, config, extra, named):
    line = _one_line(capsys, ["fit", "--config", str(CONFIGS / config), "--trainer.rounds=1", "--trainer.logger=false",
                              "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}", *extra])
    for word in named:
        assert word in line, line


def test_the_constructors_refuse_what_they_ignored_and_keep_what_they_read():
    from lightning_dfl.federation.algorithms import BEER, PSFL, FedAvg
    from lightning_dfl.federation.loop.clock import Clock

    with pytest.raises(ValueError, match="clients_per_round must be an integer >= 1, got 2.5"):
        FedAvg(clients_per_round=2.5)
    with pytest.raises(ValueError, match=r"eta must be a positive number or None .* got nan"):
        BEER(eta=float("nan"))
    for bad in (1, -1, 2.5):
        with pytest.raises(ValueError, match=r"warmup_rounds must be an integer >= 2 \(or 0"):
            PSFL(clients_per_round=4, sequences=2, warmup_rounds=bad)
    assert PSFL(clients_per_round=4, sequences=2, warmup_rounds=0).warmup_rounds == 0  # its repr's value
    assert PSFL(clients_per_round=4, sequences=2, warmup_rounds=5).warmup_rounds == 0  # the default
    for kwargs, name in [({"mean": 7.0, "distribution": "uniform"}, "mean"), ({"std": 2.0}, "std"),
                         ({"values": (1, 2), "distribution": "normal"}, "values"), ({"high": 9.0}, "high")]:
        with pytest.raises(ValueError, match=rf"{name}=.* applies to distribution .* only"):
            Clock(**kwargs)
    Clock(distribution="uniform", low=1.0, high=2.0)
    Clock(distribution="normal", mean=3.0, std=0.5)
    Clock(distribution="discrete", values=[0.5, 1, 2, 4, 5])  # the default, as a YAML list
    Clock(distribution="exponential", mean=2.0, noise=0.2)


def test_resuming_with_fewer_rounds_than_the_checkpoint_holds_is_refused(tmp_path):
    """range(3, 1) ran nothing: the run ended with exit code 0 and summarized the checkpoint's 3 rounds."""
    from lightning_dfl.datamodules import FederatedDataModule
    from lightning_dfl.federation.algorithms import Local
    from lightning_dfl.module import SparseClassifier

    def trainer(rounds):
        return FederatedTrainer(algorithm=Local(), rounds=rounds, local_steps=1, logger=False, accelerator="cpu",
                                enable_progress_bar=False, default_root_dir=str(tmp_path), diagnostics=False,
                                checkpoint_every=1)

    def fit(t, ckpt_path=None):
        return t.fit(SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05),
                     FederatedDataModule(dataset="digits", num_clients=2, batch_size=16, test_samples_per_client=10),
                     ckpt_path=ckpt_path)

    first = trainer(3)
    fit(first)
    with pytest.raises(ValueError, match=r"rounds=1 is fewer than the 3 rounds the checkpoint .* holds: give rounds "
                                         r">= 3"):
        fit(trainer(1), first.checkpoint_path)
    resumed = trainer(3)  # as many as it holds: nothing to train, the saved rounds summarized
    fit(resumed, first.checkpoint_path)
    assert len(resumed.history) == 3


def _metrics_csv(folder: Path) -> Path:
    folder.mkdir()
    (folder / "metrics.csv").write_text("round,flops/train_per_client,comm/busiest_bytes,time/delay,acc/headline\n"
                                        "0,1e6,1000,0,0.5\n1,1e6,1000,0,0.6\n")
    return folder


@pytest.mark.parametrize(("args", "named"), [
    (["schedule", "--seed=-1", "--rounds=1"], ["seed must be an integer >= 0, got -1"]),  # numpy's line named nothing
    (["schedule", "--neighbors=[]"], ["--neighbors (M) must be a non-empty list"]),  # named schedule_table's argument
    (["schedule", "--max_waits=[]"], ["--max_waits (N) must be a non-empty list"]),
    (["cost", "--runs={run}", "--thetas=[]"], ["cost needs --thetas"]),  # printed a table of no rows, exit code 0
    # 100000 threads crashed OpenMP's runtime after the model was exported (libgomp: out of memory)
    (["export", "{run}/absent.ckpt", "--threads=100000", "--out={tmp}/c.pt2"],
     ["threads (at most the", "CPUs this process may use)", "got 100000"]),
    # argparse's own errors printed its usage and a line "lightning-dfl plot: error: ..."
    (["plot", "diagnostics", "{run}", "extra"], ["unrecognized arguments: extra"]),
    (["plot", "diagnostics", "--out", "{tmp}/figs"], ["the following arguments are required: run_dir"]),
], ids=["schedule_seed_negative", "schedule_neighbors_empty", "schedule_max_waits_empty", "cost_thetas_empty",
        "export_threads_beyond_the_cpus", "plot_extra_argument", "plot_missing_run_dir"])
def test_analysis_subcommands_refuse_in_one_line(tmp_path, capsys, args, named):
    run = _metrics_csv(tmp_path / "run")
    line = _one_line(capsys, [a.format(run=run, tmp=tmp_path) for a in args])
    for word in named:
        assert word in line, line
    assert not (tmp_path / "c.pt2").exists() and not (tmp_path / "figs").exists()

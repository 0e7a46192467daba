"""``cost``, ``curves`` and ``plot diagnostics`` read a run logged with TensorBoard (``--trainer.logger=tensorboard``)
as they read its CSV-logged twin (same settings, same seed): the same rounds and values, the values to 32 bits
(TensorBoard keeps scalars as float32); and a folder they cannot read is one line saying what is needed."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from lightning_dfl.cli import main
from lightning_dfl.cost import read_round_metrics, run_cost_curve
from lightning_dfl.run_metrics import EVENTS_GLOB, metrics_source

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
#: what differs between two runs of the same settings: the wall clock
WALL_CLOCK = ("time/wall_round_s",)


def _fit(root: Path, logger: str) -> Path:
    from lightning_dfl.cli import FederatedCLI

    cli = FederatedCLI(args=["fit", "--config", str(CONFIGS / "dispfl_digits.yaml"), "--trainer.rounds=2",
                             "--trainer.local_epochs=1", "--data.num_clients=4",
                             "--trainer.algorithm.init_args.num_neighbors=2", "--trainer.enable_progress_bar=false",
                             f"--trainer.logger={logger}", f"--trainer.default_root_dir={root}"])
    return Path(cli.trainer.log_dir)


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """(CSV run folder, TensorBoard run folder) of the same 2-round digits fit."""
    pytest.importorskip("tensorboard")
    root = tmp_path_factory.mktemp("twins")
    return _fit(root / "csv", "csv"), _fit(root / "tensorboard", "tensorboard")


def _columns(csv_run: Path) -> list[str]:
    header = (csv_run / "metrics.csv").read_text().splitlines()[0].split(",")
    return [c for c in header if c not in ("round", "step", *WALL_CLOCK)]


def _as_float32(value: float) -> float:
    return float(np.float32(value))


def test_the_tensorboard_run_holds_event_files_and_no_metrics_csv(twins):
    csv_run, tb_run = twins
    assert not (tb_run / "metrics.csv").exists() and list(tb_run.glob(EVENTS_GLOB))
    assert metrics_source(tb_run) == tb_run and metrics_source(csv_run) == csv_run / "metrics.csv"


def test_every_metric_of_every_round_is_the_csv_runs_to_32_bits(twins):
    csv_run, tb_run = twins
    columns = _columns(csv_run)
    assert {"acc/headline", "flops/train_per_client", "comm/busiest_bytes", "diag/spectral_gap"} <= set(columns)
    from_csv = read_round_metrics(csv_run, columns)
    from_tb = read_round_metrics(tb_run, columns)
    assert sorted(from_csv) == sorted(from_tb) == [0, 1]
    for r in from_csv:
        assert from_tb[r] == {c: _as_float32(v) for c, v in from_csv[r].items()}, r
    # the round is the step Lightning logged
    assert read_round_metrics(tb_run, ["round"], round_col="step") == {0: {"round": 0.0}, 1: {"round": 1.0}}


def test_cost_prints_the_same_table(twins, capsys):
    csv_run, tb_run = twins
    tables = {}
    events = next(tb_run.glob(EVENTS_GLOB))
    for name, run in (("csv", csv_run), ("tb", tb_run), ("event file", events)):
        main(["cost", f"--runs=[{run}]", "--thetas=[0.0,0.3,1.0]"])
        tables[name] = capsys.readouterr().out
    assert tables["tb"] == tables["csv"] == tables["event file"], tables
    a, b = run_cost_curve(csv_run, [0.0, 0.3, 1.0]), run_cost_curve(tb_run, [0.0, 0.3, 1.0])
    assert a.rounds == b.rounds == 2
    np.testing.assert_allclose(b.total, a.total, rtol=1e-6)
    assert (b.time, b.energy) == pytest.approx((a.time, a.energy), rel=1e-6)


def test_curves_draw_the_same_values(twins, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import lightning_dfl.plots as plots

    csv_run, tb_run = twins
    seen = []
    real = plots.plot_curves

    def spy(runs, metrics, path, title=None):
        seen.append(runs)
        return real(runs, metrics, path, title)

    monkeypatch.setattr(plots, "plot_curves", spy)
    metrics = "[acc/headline,density/mean,comm/busiest_bytes,train/loss]"
    main(["curves", f"--runs={tb_run}", f"--metrics={metrics}"])  # no --plot: into the run's folder
    assert f"figure: {tb_run / 'curves.png'}" in capsys.readouterr().out and (tb_run / "curves.png").is_file()
    main(["curves", f"--runs={csv_run}", f"--metrics={metrics}", f"--plot={csv_run / 'curves.png'}"])
    (tb_values,), (csv_values,) = seen[0].values(), seen[1].values()
    assert sorted(tb_values) == sorted(csv_values) == [0, 1]
    for r, values in csv_values.items():
        assert tb_values[r] == {m: _as_float32(v) for m, v in values.items()}


def test_plot_diagnostics_reads_the_same_series_and_files(twins, capsys):
    pytest.importorskip("matplotlib")
    from lightning_dfl.plots.diagnostics import DIAGNOSTICS_FIGURES, _read_diagnostics

    csv_run, tb_run = twins
    out = tb_run.parent / "figures"
    main(["plot", "diagnostics", str(tb_run), "--out", str(out)])
    printed = capsys.readouterr().out
    assert all(f"figure: {out / name}" in printed and (out / name).is_file() for name in DIAGNOSTICS_FIGURES)
    tb, csv = _read_diagnostics(tb_run), _read_diagnostics(csv_run)
    assert tb["series"].keys() == csv["series"].keys()
    for metric, (rounds, values) in csv["series"].items():
        assert tb["series"][metric] == (rounds, [_as_float32(v) for v in values]), metric
    assert tb["series"]["diag/spectral_gap"][0] == [0, 1]
    np.testing.assert_array_equal(tb["jaccard"], csv["jaccard"])
    np.testing.assert_array_equal(tb["bytes"], csv["bytes"])
    assert (tb["labels"], tb["accuracy"]) == (csv["labels"], csv["accuracy"])
    assert not any(math.isnan(v) for v in tb["accuracy"])


COMMANDS = {
    "cost": lambda run: ["cost", f"--runs=[{run}]"],
    "curves": lambda run: ["curves", f"--runs=[{run}]", f"--plot={run.parent / 'c.png'}"],
    "plot diagnostics": lambda run: ["plot", "diagnostics", str(run), "--out", str(run.parent / "out")],
}


def _one_line_error(args, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_tensorboard_run_without_tensorboard_says_what_to_install(tmp_path, monkeypatch, capsys, command):
    if command != "cost":
        pytest.importorskip("matplotlib")
    run = tmp_path / "dispfl" / "version_0"
    run.mkdir(parents=True)
    (run / "events.out.tfevents.1700000000.host.1.0").write_bytes(b"")  # never read: the import fails first
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    err = _one_line_error(COMMANDS[command](run), capsys)
    assert str(run) in err and "TensorBoard run" in err and "pip install -e '.[tensorboard]'" in err, err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_folder_without_metrics_names_what_is_needed(tmp_path, capsys, command):
    if command != "cost":
        pytest.importorskip("matplotlib")
    run = tmp_path / "dispfl" / "version_0"
    run.mkdir(parents=True)
    (run / "clients.csv").write_text("round,client\n0,0\n")
    err = _one_line_error(COMMANDS[command](run), capsys)
    assert str(run) in err and "no metrics.csv or TensorBoard event files (events.out.tfevents.*)" in err, err
    assert "runs/<algorithm>/version_N" in err, err


def test_the_tensorboard_logger_without_tensorboard_says_what_to_install(tmp_path, monkeypatch, capsys):
    """Before anything trains: one line with the install command, exit 2 (the optional extra is missing: bad
    set-up, not a bug)."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    err = _one_line_error(["fit", "--config", str(CONFIGS / "dispfl_digits.yaml"), "--trainer.logger=tensorboard",
                           "--trainer.rounds=1", f"--trainer.default_root_dir={tmp_path}"], capsys)
    assert "logger='tensorboard' needs TensorBoard: pip install -e '.[tensorboard]'" in err, err
    assert not list(tmp_path.rglob("metrics.csv")) and not list(tmp_path.rglob("events.out.tfevents.*"))

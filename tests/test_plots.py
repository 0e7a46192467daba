"""Figures: DA-DPFL Figs. 8-9 (schedule), Figs. 3-4 (cost) and metric curves, and their subcommands."""

import math
import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib")
Image = pytest.importorskip("PIL.Image")

import lightning_dfl.plots as plots  # noqa: E402
import lightning_dfl.plots.diagnostics as diagnostics_plots  # noqa: E402
from lightning_dfl.cli import main  # noqa: E402
from lightning_dfl.cost import CostCurve  # noqa: E402
from lightning_dfl.federation.algorithms.dadpfl_waits import schedule_table  # noqa: E402
from lightning_dfl.plots import (  # noqa: E402
    check_plot_path,
    plot_cost_curves,
    plot_curves,
    plot_schedule,
)

# CSVLogger layout: one row per logging call, empty cells for what that call did not log.
# acc/* is logged at evaluation rounds (0 and 2) only, the rest every round.
METRICS_CSV = """\
acc/headline,comm/busiest_bytes,density/mean,flops/train_per_client,round,step,time/delay
0.25,,,,0.0,0,
,1000000.0,0.5,8e12,0.0,0,2.0
,500000.0,0.4,4e12,1.0,1,1.0
0.5,,,,2.0,2,
,500000.0,0.3,4e12,2.0,2,0.0
"""


def _png(path):
    assert path.is_file() and path.stat().st_size > 0
    with Image.open(path) as img:
        assert img.format == "PNG"
        return img.size


def _curve(time, energy, thetas=(0.0, 0.5, 1.0)):
    th = np.asarray(thetas, dtype=float)
    return CostCurve(thetas=th, total=(1 - th) * time + th * energy, time=time, energy=energy, rounds=1)


def _run(folder, text=METRICS_CSV):
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_text(text)
    return folder


# --- plot functions -------------------------------------------------------------------------


def test_plot_schedule_writes_png_and_pdf(tmp_path):
    rows = schedule_table(12, [2, 4], [1, None], rounds=40, seed=0)
    out = plot_schedule(rows, tmp_path / "fig" / "schedule.png")  # creates the folder
    assert out == tmp_path / "fig" / "schedule.png"
    assert _png(out) == (1100, 450)  # 11 x 4.5 inches at 100 dpi
    pdf = plot_schedule(rows, tmp_path / "schedule.pdf", max_waits=[1, None])
    assert pdf.read_bytes().startswith(b"%PDF")


def test_plot_schedule_rejects_bad_rows(tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        plot_schedule([], tmp_path / "s.png")
    mixed = schedule_table(8, [2], [1], rounds=5) + schedule_table(9, [2], [1], rounds=5)
    with pytest.raises(ValueError, match=r"one \(num_clients, rounds, seed\).*\(8, 5, 0\), \(9, 5, 0\)"):
        plot_schedule(mixed, tmp_path / "s.png")
    with pytest.raises(ValueError, match=r"max_waits must be integers >= 0 or None.*-1"):
        plot_schedule(schedule_table(8, [2], [1], rounds=5), tmp_path / "s.png", max_waits=[-1])
    assert not (tmp_path / "s.png").exists()


def test_cost_curve_crossing_hand_computed():
    # (1 - t) 2 + t 1 = (1 - t) 1 + t 3  <=>  1 - t = 2 t  <=>  t = 1/3, where both cost 5/3.
    a, b = _curve(2.0, 1.0), _curve(1.0, 3.0)
    assert a.crossing(b) == pytest.approx(1 / 3)
    assert b.crossing(a) == pytest.approx(1 / 3)
    assert a.crossing(_curve(3.0, 2.0)) is None  # parallel
    assert a.crossing(a) is None  # equal
    assert _curve(2.0, 1.0).crossing(_curve(1.0, 0.5)) is None  # would meet at t = 2


def test_plot_cost_curves_writes_png(tmp_path):
    out = plot_cost_curves({"dadpfl": _curve(2.0, 1.0), "dispfl": _curve(1.0, 3.0), "fedavg": _curve(4.0, 4.0)},
                           tmp_path / "cost.png")
    assert _png(out) == (700, 450)
    with pytest.raises(ValueError, match="at least one"):
        plot_cost_curves({}, tmp_path / "empty.png")


def test_plot_curves_panel_grid_and_errors(tmp_path):
    runs = {"a": {0: {"acc": 0.1, "d": 0.5}, 1: {"d": 0.4}, 2: {"acc": 0.3, "d": 0.3}},
            "b": {0: {"acc": 0.2}, 1: {"acc": 0.4}}}
    assert _png(plot_curves(runs, ["acc", "d"], tmp_path / "two.png")) == (1000, 400)  # 2 panels of 5 x 4 in
    four = {"a": {r: {"w": r, "x": -r, "y": r * r, "z": 1.0} for r in range(5)}}
    assert _png(plot_curves(four, ["w", "x", "y", "z"], tmp_path / "four.png", title="t")) == (1500, 800)
    with pytest.raises(ValueError, match=r"no run logged 'e'"):
        plot_curves(runs, ["acc", "e"], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="distinct"):
        plot_curves(runs, ["acc", "acc"], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="at least one metric"):
        plot_curves(runs, [], tmp_path / "bad.png")


def test_check_plot_path_names_the_allowed_suffixes(tmp_path):
    assert check_plot_path(tmp_path / "a.PDF").suffix == ".PDF"
    with pytest.raises(ValueError, match=r"\.png.*got '\.txt'"):
        check_plot_path(tmp_path / "a.txt")
    with pytest.raises(ValueError, match="got ''"):
        check_plot_path(tmp_path / "noext")


def test_missing_matplotlib_says_how_to_install(monkeypatch, tmp_path, capsys):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"plots need matplotlib: pip install -e '\.\[plots\]'"):
        plot_cost_curves({"a": _curve(1.0, 2.0)}, tmp_path / "c.png")
    with pytest.raises(ImportError, match="plots need matplotlib"):  # before any simulation
        main(["--debug", "schedule", "--num_clients=6", "--neighbors=[2]", "--max_waits=[1]", "--rounds=5",
              f"--plot={tmp_path / 's.png'}"])
    assert capsys.readouterr().out == ""
    main(["schedule", "--num_clients=6", "--neighbors=[2]", "--max_waits=[1]", "--rounds=5"])  # tables need none
    assert "parallelism" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # without --debug: one line, bad set-up (2), not a bug (1)
        main(["plot", "diagnostics", str(tmp_path), "--out", str(tmp_path / "figures")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "plots need matplotlib: pip install -e '.[plots]'" in err, err
    assert "Traceback" not in err and "report" not in err, err


# --- subcommands ----------------------------------------------------------------------------


def test_schedule_subcommand_saves_figure(tmp_path, capsys):
    out = tmp_path / "schedule.png"
    main(["schedule", "--num_clients=10", "--neighbors=[2,3]", "--max_waits=[0,1,null]", "--rounds=30",
          f"--plot={out}"])
    assert f"figure: {out}" in capsys.readouterr().out
    assert _png(out) == (1100, 450)


def test_cost_subcommand_saves_figure(tmp_path, capsys):
    a = _run(tmp_path / "dadpfl" / "version_0")
    b = _run(tmp_path / "dispfl" / "version_0", METRICS_CSV.replace(",2.0\n", ",0.0\n").replace(",1.0\n", ",0.0\n"))
    out = tmp_path / "cost.png"
    main(["cost", f"--runs=[{a},{b / 'metrics.csv'}]", "--thetas=[0.0,0.5,1.0]", f"--plot={out}"])
    text = capsys.readouterr().out
    assert "dadpfl/version_0 vs dispfl/version_0" in text and f"figure: {out}" in text
    assert _png(out) == (700, 450)
    with pytest.raises(ValueError, match=r"\.png"):  # a bad suffix fails before the runs are read
        main(["--debug", "cost", f"--runs=[{a}]", f"--plot={tmp_path / 'cost.bmpx'}"])


def test_curves_subcommand_reads_csvlogger_rows(tmp_path, monkeypatch, capsys):
    a = _run(tmp_path / "x" / "dadpfl" / "version_0")
    b = _run(tmp_path / "y" / "dadpfl" / "version_0")  # same short name: labels fall back to the paths
    seen = {}
    real = plots.plot_curves

    def spy(runs, metrics, path, title=None):
        seen.update(runs=runs, metrics=metrics)
        return real(runs, metrics, path, title)

    monkeypatch.setattr(plots, "plot_curves", spy)
    out = tmp_path / "curves.png"
    main(["curves", f"--runs=[{a},{b / 'metrics.csv'}]", f"--plot={out}"])
    assert f"figure: {out}" in capsys.readouterr().out
    assert _png(out) == (1000, 400)
    # acc/headline (rounds 0, 2) and density/mean (rounds 0-2) both keep all their rounds.
    expected = {0: {"acc/headline": 0.25, "density/mean": 0.5}, 1: {"density/mean": 0.4},
                2: {"acc/headline": 0.5, "density/mean": 0.3}}
    assert seen["runs"] == {str(a): expected, str(b / "metrics.csv"): expected}
    assert seen["metrics"] == ["acc/headline", "density/mean"]


def test_curves_subcommand_errors(tmp_path):
    run = _run(tmp_path / "dadpfl" / "version_0")
    with pytest.raises(ValueError, match=r"no column\(s\) \['acc/nope'\]; its columns are \[.*'acc/headline'"):
        main(["--debug", "curves", f"--runs=[{run}]", "--metrics=[acc/nope]", f"--plot={tmp_path / 'c.png'}"])
    with pytest.raises(FileNotFoundError, match="no metrics.csv"):
        main(["--debug", "curves", f"--runs=[{tmp_path / 'nope'}]", f"--plot={tmp_path / 'c.png'}"])
    with pytest.raises(ValueError, match="curves needs --runs"):
        main(["--debug", "curves", f"--plot={tmp_path / 'c.png'}"])
    empty = _run(tmp_path / "empty" / "version_0", "round,acc/headline\n0,\n")
    with pytest.raises(ValueError, match="'acc/headline' column but no round with a value"):
        main(["--debug", "curves", f"--runs=[{empty}]", "--metrics=[acc/headline]", f"--plot={tmp_path / 'c.png'}"])
    assert not (tmp_path / "c.png").exists()


# --- units and ticks --------------------------------------------------------------------------


@pytest.mark.parametrize("reduce, over", [("sum", "summed over the run's rounds"), ("last", "final round")])
def test_the_cost_table_states_its_units(tmp_path, capsys, reduce, over):
    run = _run(tmp_path / "dadpfl" / "version_0")
    main(["cost", f"--runs=[{run}]", "--thetas=[0.0,1.0]", f"--reduce={reduce}"])
    first = capsys.readouterr().out.splitlines()[0]
    assert "time in s" in first and "energy in J" in first and over in first


def _visible(ticks, limits):
    low, high = sorted(limits)
    return [t for t in ticks if low <= t <= high]


def test_diagnostics_heatmaps_tick_whole_clients_and_plain_colour_labels():
    fig = plots.agg_figure(6.0, 5.0)
    ax = fig.subplots()
    matrix = np.random.default_rng(0).uniform(1e6, 3e6, (10, 10))
    np.fill_diagonal(matrix, 0)
    diagnostics_plots._draw_bytes(ax, fig, matrix)
    fig.canvas.draw()
    for ticks, limits in ((ax.get_xticks(), ax.get_xlim()), (ax.get_yticks(), ax.get_ylim())):
        visible = _visible(ticks, limits)
        assert len(visible) >= 3 and all(float(t).is_integer() for t in visible), visible
    bar = fig.axes[-1]
    labels = [t.get_text() for t in bar.yaxis.get_majorticklabels() + bar.yaxis.get_minorticklabels()]
    assert any(labels) and not any("times" in s or "10^" in s for s in labels), labels


def test_the_accuracy_histogram_counts_whole_clients():
    fig = plots.agg_figure(5.0, 4.0)
    ax = fig.subplots()
    diagnostics_plots._draw_accuracy(ax, list(np.linspace(0.4, 0.9, 7)))
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in _visible(ax.get_yticks(), ax.get_ylim()))


def test_the_accuracy_histograms_bars_have_edges():
    """Adjacent bars of equal height stay apart: each bar is drawn with a black edge of positive width."""
    fig = plots.agg_figure(5.0, 4.0)
    ax = fig.subplots()
    diagnostics_plots._draw_accuracy(ax, [0.40, 0.41, 0.45, 0.46, 0.50, 0.51, 0.55, 0.56, 0.9, 0.9])
    fig.canvas.draw()
    bars = [p for p in ax.patches if p.get_height() > 0]
    assert [p.get_height() for p in bars] == [4, 4, 2]  # two adjacent bars of equal height
    assert bars[0].get_x() + bars[0].get_width() == pytest.approx(bars[1].get_x())
    assert all(p.get_linewidth() == 0.8 and tuple(p.get_edgecolor()[:3]) == (0.0, 0.0, 0.0) for p in bars)


def test_gaps_within_1e_12_of_zero_are_shown_as_zero():
    """A gap of -8.9e-16 is drawn as 0; larger values and NaN are drawn as they are."""
    assert plots.display_value(-8.9e-16) == 0.0 and plots.display_value(1e-12) == 0.0
    assert plots.display_value(2e-12) == 2e-12 and plots.display_value(0.38) == 0.38
    assert math.isnan(plots.display_value(float("nan")))
    fig = plots.agg_figure(8.0, 4.0)
    ax_gap, ax_dist = fig.subplots(1, 2)
    series = {"diag/spectral_gap": ([1, 2, 3], [-8.9e-16, 4.4e-16, 0.0]),
              "diag/consensus_distance": ([1, 2, 3], [3.0, 2.0, 1.0]),
              "diag/consensus_distance_masked": ([1, 2, 3], [1.0, 0.5, 0.2])}
    diagnostics_plots._draw_mixing(ax_gap, ax_dist, series)
    assert list(ax_gap.lines[0].get_ydata()) == [0.0, 0.0, 0.0]
    fig.canvas.draw()
    assert "e-1" not in ax_gap.yaxis.get_offset_text().get_text()


def test_the_jaccard_colours_span_the_off_diagonal_values():
    """The colour limits are the pairs' range, the diagonal is masked out and the colour bar says so."""
    matrix = np.array([[1.0, 0.62, 0.70], [0.62, 1.0, 0.66], [0.70, 0.66, 1.0]])
    assert plots.jaccard_limits(matrix) == (0.62, 0.70)
    assert plots.jaccard_limits(np.ones((1, 1))) == (0.0, 1.0)
    low, high = plots.jaccard_limits(np.array([[1.0, 0.5], [0.5, 1.0]]))
    assert low < 0.5 < high
    fig = plots.agg_figure(6.0, 5.0)
    ax = fig.subplots()
    diagnostics_plots._draw_jaccard(ax, fig, {"jaccard": matrix, "labels": None, "groups": None})
    image = ax.images[0]
    assert image.get_clim() == (0.62, 0.70)
    assert np.isnan(np.diag(image.get_array().filled(np.nan))).all()
    assert "diagonal" in fig.axes[-1].get_ylabel()


def _overlap(a, b):
    return min(a.x1, b.x1) > max(a.x0, b.x0) and min(a.y1, b.y1) > max(a.y0, b.y0)


def test_placed_labels_overlap_neither_each_other_nor_the_markers():
    """Eight points in a tight cluster (compare_all's DFedSAM, Ditto, PSFL, FedFomo): every label is readable."""
    from matplotlib.text import Text

    fig = plots.agg_figure(6.0, 5.0)
    ax = fig.subplots()
    rng = np.random.default_rng(0)
    xs = list(100 * (1 + 0.2 * rng.random(8))) + [0.01, 500.0]
    ys = list(98.5 + 0.6 * rng.random(8)) + [92.0, 88.0]
    ax.scatter(xs, ys, s=55)
    ax.set(xscale="log", ylim=(87, 100))
    names = ["DFedSAM", "Ditto", "PSFL", "FedFomo", "DisPFL", "DA-DPFL", "DFedAvgM", "D-PSGD-FT", "Local", "BEER"]
    labels = plots.place_labels(ax, xs, ys, names)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(label, renderer) for label in labels]  # the text, not its leader line
    assert [label.get_text() for label in labels] == names
    assert not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    frame = ax.get_window_extent(renderer)
    half = 5.0 * fig.dpi / 72
    for box in boxes:
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
        for x, y in ax.transData.transform(np.column_stack([xs, ys])):
            assert not (box.x0 < x + half and x - half < box.x1 and box.y0 < y + half and y - half < box.y1)


# --- what a run folder's files may hold -----------------------------------------------------


def _matrix(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(",".join(map(str, row)) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(("name", "rows", "message"), [
    ("bytes.csv", [], "holds no header and no rows"),
    ("bytes.csv", [["sender", 0, 1]], "holds no rows"),
    ("bytes.csv", [["s", 0, 1], [0, 0, 5], [1, 1e308, 0]], "line 3, column 2 holds '1e+308'; allowed: a number in [0, "
                                                            "9.22337e+18]"),
    ("bytes.csv", [["s", 0, 1], [0, 0, 5], [1, "nan", 0]], "line 3, column 2 holds 'nan'; allowed: a number in"),
    ("bytes.csv", [["s", 0, 1], [0, 0, 5], [1, 3]], "line 3 has 1 values, expected 2"),
    ("bytes.csv", [["s", 0, 1], [0, 0, "x"], [1, 3, 0]], "line 2, column 3 holds 'x', not a number"),
    ("mask_jaccard.csv", [["c", 0, 1], [0, 1, 1.5], [1, 1.5, 1]], "holds '1.5'; allowed: a number in [0, 1] or nan"),
])
def test_a_diagnostics_matrix_is_checked_cell_by_cell(tmp_path, name, rows, message):
    from lightning_dfl.federation.metrics.diagnostics import read_matrix

    path = _matrix(tmp_path / name, rows)
    with pytest.raises(ValueError) as err:
        read_matrix(path)
    assert message in str(err.value) and str(path) in str(err.value), str(err.value)


def test_a_diagnostics_matrix_holds_what_was_written(tmp_path):
    from lightning_dfl.federation.metrics.diagnostics import read_matrix

    jaccard = read_matrix(_matrix(tmp_path / "mask_jaccard.csv", [["c", 0, 1], [0, 1, "nan"], [1, 0.25, 1]]))
    assert jaccard.shape == (2, 2) and jaccard[1, 0] == 0.25 and math.isnan(jaccard[0, 1])


def test_plot_diagnostics_of_a_bad_matrix_is_one_line(tmp_path, capsys):
    run = _run(tmp_path / "dispfl" / "version_0", "round,diag/spectral_gap\n0,0.5\n")
    _matrix(run / "diagnostics" / "bytes.csv", [["s", 0, 1], [0, 0, 5], [1, 1e308, 0]])
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "diagnostics", str(run), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and "1e+308" in err, err


def test_an_accuracy_histogram_of_nan_says_so():
    fig = plots.agg_figure(5.0, 4.0)
    ax = fig.subplots()
    diagnostics_plots._draw_accuracy(ax, [math.nan, math.nan])
    assert "every value is NaN" in ax.texts[0].get_text()
    ax = fig.subplots()
    with pytest.warns(UserWarning, match="1 of 3 clients' final accuracy is not a number"):
        diagnostics_plots._draw_accuracy(ax, [0.5, math.nan, 0.7])
    assert sum(p.get_height() for p in ax.patches) == 2


def test_curves_of_an_all_nan_metric_warn_and_take_one_run_alone(tmp_path, capsys):
    run = _run(tmp_path / "dispfl" / "version_0", "round,acc/headline\n0,nan\n1,nan\n")
    main(["curves", "--runs", str(run), "--metrics", "[acc/headline]", "--plot", str(tmp_path / "c.png")])
    assert "acc/headline is NaN in every round (a diverged run?)" in capsys.readouterr().err
    assert _png(tmp_path / "c.png")


def test_curves_without_plot_write_into_the_first_runs_folder(tmp_path, monkeypatch, capsys):
    """Not ./curves.png, where it replaced another figure unasked."""
    monkeypatch.chdir(tmp_path)
    a, b = _run(tmp_path / "a" / "dispfl" / "version_0"), _run(tmp_path / "b" / "dadpfl" / "version_0")
    main(["curves", f"--runs=[{a},{b}]"])
    assert f"figure: {a / 'curves.png'}" in capsys.readouterr().out
    assert _png(a / "curves.png") and not (tmp_path / "curves.png").exists()

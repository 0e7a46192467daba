"""Figures of the analysis subcommands (optional: needs ``pip install -e '.[plots]'``).

* :func:`plot_schedule`: DA-DPFL Figs. 8-9, parallelism and delay of dynamic aggregation
  against the neighbourhood size M, one line per maximum wait N (black: N = M) (:mod:`.dadpfl`).
* :func:`plot_cost_curves`: DA-DPFL Figs. 3-4, ``C_total(theta) = (1 - theta) C_time +
  theta C_energy`` (Sec. VI-A5) per run, with the points where two runs' curves cross (:mod:`.dadpfl`).
* :func:`plot_curves`: logged metrics (``acc/headline``, ``density/mean``, ...) against the
  round for several runs, one panel per metric (:mod:`.curves`).
* :func:`plot_diagnostics`: a run's diagnostics (spectral gap, consensus distance, mask overlap,
  bytes and mask-Jaccard heatmaps, per-client accuracy; ``lightning-dfl plot diagnostics RUN_DIR``)
  (:mod:`.diagnostics`).

What they share (:mod:`.canvas`): matplotlib is imported inside the functions and drawn on an Agg canvas (no
pyplot, so no global backend switch and no figure kept alive); the file format follows the path's suffix.
Every figure is ``DPI`` dots per inch, so its pixel size is fixed (see each function).
"""

from lightning_dfl.plots.canvas import DPI, agg_figure, check_plot_path, place_labels
from lightning_dfl.plots.curves import plot_curves
from lightning_dfl.plots.dadpfl import plot_cost_curves, plot_schedule
from lightning_dfl.plots.diagnostics import DIAGNOSTICS_FIGURES, display_value, jaccard_limits, plot_diagnostics

__all__ = ["DIAGNOSTICS_FIGURES", "DPI", "agg_figure", "check_plot_path", "display_value", "jaccard_limits",
           "place_labels", "plot_cost_curves", "plot_curves", "plot_diagnostics", "plot_schedule"]

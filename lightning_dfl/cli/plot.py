"""``lightning-dfl plot KIND RUN_DIR [--out DIR]``: the figures of one finished run (needs matplotlib)."""

from __future__ import annotations

import argparse
from typing import NoReturn

from lightning_dfl.cli.help import PROG

__all__ = ["PLOT_KINDS", "plot", "plot_parser"]

#: ``lightning-dfl plot KIND RUN_DIR``: the kinds of figures and what they show
PLOT_KINDS = {"diagnostics": "spectral gap, consensus distance, mask Jaccard and flips per round; the final "
                             "mask-Jaccard and bytes heatmaps; per-client accuracy"}


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose own errors (a missing argument, one it does not know) are raised as bad input, for
    the command line's one line (argparse prints its usage and a line of its own, even with ``exit_on_error=False``)."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def plot_parser() -> argparse.ArgumentParser:
    """The parser of ``lightning-dfl plot KIND RUN_DIR [--out DIR]``."""
    parser = _Parser(
        prog=f"{PROG} plot", exit_on_error=False, allow_abbrev=False,
        description="Figures of one run (PNG files; needs matplotlib: pip install -e '.[plots]').",
        epilog="kinds: " + "; ".join(f"{k}: {v}" for k, v in PLOT_KINDS.items()))
    parser.add_argument("kind", help=f"what to plot; allowed: {', '.join(PLOT_KINDS)}")
    parser.add_argument("run_dir", help="the run folder (runs/<algorithm>/version_N)")
    parser.add_argument("--out", default=None, help="folder of the figures (default: RUN_DIR/diagnostics)")
    return parser


def plot(args: list[str]) -> None:
    """``lightning-dfl plot diagnostics RUN_DIR [--out DIR]``: write a run's diagnostics figures."""
    parser = plot_parser()
    if not args or args[0] in ("-h", "--help"):
        parser.print_help()
        return
    if args[0] not in PLOT_KINDS:
        raise ValueError(f"unknown plot kind {args[0]!r}; allowed: {', '.join(PLOT_KINDS)}")
    if len([a for a in args if not a.startswith("-")]) < 2:
        raise ValueError(f"plot {args[0]} needs a run folder: {PROG} plot {args[0]} runs/<algorithm>/version_N")
    ns = parser.parse_args(args)
    if ns.out is not None:
        from lightning_dfl.checks import check_output_path

        check_output_path("--out", ns.out)
    from lightning_dfl.plots import plot_diagnostics

    for path in plot_diagnostics(ns.run_dir, ns.out):
        print(f"figure: {path}")

"""``python -m lightning_dfl`` runs the command line."""

from lightning_dfl.cli import main

main()

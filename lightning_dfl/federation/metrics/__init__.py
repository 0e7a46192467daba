"""What a run measures and reports: accounting, evaluation, diagnostics and the loggers' rows.

* :mod:`~.accounting`: per-round accuracy, density, FLOPs, bytes and simulated time;
* :mod:`~.evaluation`: accuracy on clients' personal test sets; :mod:`~.diagnostics`: why a run is slow to
  converge or personalizes badly; :mod:`~.report`: loggers, ``clients.csv``, the summary.
"""

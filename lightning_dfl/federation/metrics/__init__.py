"""What a run measures and reports: accounting, evaluation, diagnostics and the loggers' rows.

* :mod:`~.accounting`: per-round accuracy, density, FLOPs, bytes and simulated time;
* :mod:`~.evaluation`: accuracy on clients' personal test sets; :mod:`~.diagnostics`: why a run is slow to
  converge or personalizes badly, recorded and written to files, from the measures of :mod:`~.mixing` (the
  realized mixing matrix, its spectral gap) and :mod:`~.spread` (consensus distances, mask overlap);
  :mod:`~.report`: loggers, ``clients.csv``, the summary.
"""

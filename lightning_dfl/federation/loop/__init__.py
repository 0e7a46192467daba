"""The round loop: a round's exchanges, who takes part, the simulated clock and the executors that run a plan.

* :mod:`~.state`: :class:`FederationState`, the engine's record of a run; :mod:`~.worker`: the one worker module;
* :mod:`~.rounds`: a round's exchanges run in order (``run_exchanges``, ``RoundOutcome``);
* :mod:`~.planner`: who takes part (dropout, deadlines) and each exchange's plan; :mod:`~.clock`: simulated time;
* :mod:`~.executor` (serial), :mod:`~.sharded` (across processes), :mod:`~.batched` (``torch.func``) run a plan;
  :mod:`~.start_reads` follows its reads of start-of-round models; :mod:`~.step_graphs` replays CUDA graphs.
"""

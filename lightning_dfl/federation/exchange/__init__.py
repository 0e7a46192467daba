"""What nodes exchange and when: the round's plan, who hears whom, what travels, how models are combined.

* :mod:`~.plan`: :class:`RoundPlan` of :class:`Task` s with their :class:`Source` s and "after" edges;
* :mod:`~.schedule`: when each task starts and ends (the one timing rule);
* :mod:`~.topology`: each round's in-neighbours; :mod:`~.messages`: what travels and its bytes;
* :mod:`~.aggregation`: masked, weighted averaging.
"""

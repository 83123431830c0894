"""``kvevents demo``: a simulated engine, the router and a real trace, end to end.

* :mod:`~kvevents.demo.main`: the command and the run;
* :mod:`~kvevents.demo.procs`: the engine and router child processes;
* :mod:`~kvevents.demo.signals`: Ctrl-C and SIGTERM stop everything it started;
* :mod:`~kvevents.demo.replay`: the trace replayed through a routing policy;
* :mod:`~kvevents.demo.offline`: the same replay on simulated caches, for tuning weights;
* :mod:`~kvevents.demo.plane`: the event plane's counters, engine against router;
* :mod:`~kvevents.demo.report`, :mod:`~kvevents.demo.chart`: the tables and the chart.
"""

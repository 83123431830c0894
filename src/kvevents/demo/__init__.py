"""``kvevents demo``: a simulated engine, the router and a real trace, end to end.

* :mod:`~kvevents.demo.main`: the command and the run;
* :mod:`~kvevents.demo.procs`: the engine and router child processes;
* :mod:`~kvevents.demo.signals`: Ctrl-C and SIGTERM stop everything it started;
* :mod:`~kvevents.demo.replay`: the trace replayed through a routing policy;
* :mod:`~kvevents.demo.offline`: the same replay on simulated caches, for tuning weights;
* :mod:`~kvevents.demo.plane`: the event plane's counters, engine against router;
* :mod:`~kvevents.demo.report`, :mod:`~kvevents.demo.chart`: the tables and the chart;
* :mod:`~kvevents.demo.pd_main` (``--prefill-engines N --decode-engines M``): the same
  for disaggregated serving, KV-aware prefill choice against prefill ranks in turn; its
  processes (:mod:`~kvevents.demo.pd_fleet`), baseline (:mod:`~kvevents.demo.pd_baseline`),
  figures and output (:mod:`~kvevents.demo.pd_figures`, :mod:`~kvevents.demo.pd_report`).
"""

"""``kvevents bench``: one benchmark per part of the plane, results as JSON and a table.

* :mod:`~kvevents.bench.main`: the command, which runs the chosen benchmarks;
* :mod:`~kvevents.bench.report`: headline figures, the terminal table, docs/performance.md's table;
* :mod:`~kvevents.bench.publisher`, :mod:`~kvevents.bench.subscriber`,
  :mod:`~kvevents.bench.index`, :mod:`~kvevents.bench.engine`: the benchmarks themselves
  (routing quality comes from :mod:`kvevents.demo`).
"""

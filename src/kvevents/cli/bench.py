"""``kvevents bench``: the benchmarks, one JSON file and a table (see :mod:`kvevents.bench`)."""

from kvevents.bench.main import add_arguments, run

__all__ = ["add_arguments", "run"]

"""``kvevents demo``: the whole plane on a real trace (see :mod:`kvevents.demo`)."""

from kvevents.demo.main import add_arguments, run

__all__ = ["add_arguments", "run"]

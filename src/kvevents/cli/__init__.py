"""The top layer: the ``kvevents`` command, one module per subcommand.

* :mod:`~kvevents.cli.main`: the entry point, the shared error format and exit codes;
* :mod:`~kvevents.cli.engine`, :mod:`~kvevents.cli.router`, :mod:`~kvevents.cli.watch`,
  :mod:`~kvevents.cli.demo`, :mod:`~kvevents.cli.bench`, :mod:`~kvevents.cli.keygen`:
  the subcommands;
* :mod:`~kvevents.cli.engine_options`, :mod:`~kvevents.cli.router_options`: those two
  commands' options, in the groups ``--help`` shows;
* :mod:`~kvevents.cli.engine_args`: the options that describe an engine by hand;
* :mod:`~kvevents.cli.options`: what every command shares (its parser, help layout).

Serving HTTP (bind, announce a ready line, stop on a signal) is :mod:`kvevents.http.serving`,
a layer below, because the benchmarks' bare server serves the same way.
"""

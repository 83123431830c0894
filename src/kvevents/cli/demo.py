"""``kvevents demo``: the whole plane on a real trace (see :mod:`kvevents.demo`); with
``--prefill-engines N --decode-engines M``, disaggregated (:mod:`kvevents.demo.pd_main`)."""

from __future__ import annotations

import argparse

from kvevents.demo import main as one_pool
from kvevents.demo import pd_main

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    one_pool.add_arguments(parser)
    pd_main.add_pd_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if pd_main.pd_requested(args):
        return pd_main.run_pd(args)
    return one_pool.run(args)

"""``kvevents watch``: follow every KV-event stream of engines and endpoints.

::

    kvevents watch http://127.0.0.1:30000                        # every rank it advertises
    kvevents watch --engine http://10.0.0.5:8000 --kv-endpoint tcp://*:5557 --dp-size 2
    kvevents watch --endpoint tcp://10.0.0.5:5557 --replay-endpoint tcp://10.0.0.5:5600
    kvevents watch URL --jsonl | jq .                             # one JSON object per line

An engine URL alone is discovered (``/server_info``, or a vLLM's ``/kv_event_sources``);
others are described with ``--engine URL`` and the options after it, ``--engines-file``,
or ``--endpoint`` with its own ``--replay-endpoint``, ``--topic``, ``--name``,
``--block-size`` and ``--dp-rank`` (:mod:`kvevents.cli.engine_args`). Block sizes are
checked per stream (:mod:`kvevents.subscribe.block_sizes`); a mismatch is logged and shown,
and the batches are still shown. By default a live table shows per stream: status, last
seq, batches and blocks per second, lag, gaps, replayed, lost, resets, errors. ``--jsonl``
prints one object per line instead::

    {"worker": ..., "dp_rank": 0, "seq": 12, "ts": 1795975045.2, "events": [{"type": ...}, ...]}
    {"signal": "gap" | "loss" | "reset" | "unreachable", "worker": ..., "dp_rank": ..., ...}
    {"signal": "malformed", "worker": ..., "dp_rank": ..., "source": "live", "count": 2,
     "reason": ...}
    {"signal": "block_size_mismatch", "worker": ..., "dp_rank": ..., "expected": 16,
     "expected_from": ..., "observed": 32, "source": "events", "count": 1}

A CURVE stream whose handshake is refused shows the status ``refused`` and one
``unreachable`` signal saying why. ``--count N`` stops after N batches, ``--duration S``
after S seconds. Exit status 0, 2 for bad arguments, 130 on Ctrl-C. The flag is
``--jsonl``, not ``--json`` (accepted as an alias), because ``--json FILE`` in ``demo``
and ``bench`` writes a results file, while here the output is a stream on stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from typing import Any, TextIO

import msgspec

from kvevents.cli.engine_args import (
    add_engine_arguments,
    curve_options,
    endpoint_specs,
    engine_specs,
)
from kvevents.cli.options import add_log_level
from kvevents.cli.security import add_engine_client_arguments, engine_credentials
from kvevents.errors import ConfigError
from kvevents.subscribe.block_sizes import BlockSizeMismatch, BlockSizes
from kvevents.subscribe.engine_watcher import DiscoveryState
from kvevents.subscribe.items import Delivery, Signal
from kvevents.subscribe.subscriber import Subscriber
from kvevents.types import Holder, PositiveFloat, PositiveInt, bounded
from kvevents.wire.events import event_to_dict

__all__ = ["add_arguments", "batch_to_json", "run"]

_ENCODER = msgspec.json.Encoder()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "urls", nargs="*", metavar="URL", help="engine URLs (their /server_info is read)"
    )
    add_engine_arguments(parser, endpoints=True)
    parser.add_argument(
        "--jsonl", action="store_true", help="print one JSON object per line instead of a table"
    )
    # the older spelling, kept for scripts; hidden from --help
    parser.add_argument("--json", dest="jsonl", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--count", type=bounded(PositiveInt), metavar="N", help="stop after N batches"
    )
    parser.add_argument(
        "--duration", type=bounded(PositiveFloat), metavar="S", help="stop after S seconds"
    )
    parser.add_argument(
        "--replay-timeout",
        type=bounded(PositiveFloat),
        default=2.0,
        metavar="S",
        help="replay inactivity timeout",
    )
    add_engine_client_arguments(parser, "when reading the engines' /server_info")
    add_log_level(parser)


def batch_to_json(item: Delivery) -> bytes:
    """One delivery as the JSON line of ``--jsonl`` (without the newline)."""
    batch = item.batch
    return _ENCODER.encode(
        {
            "worker": item.holder.worker,
            "dp_rank": item.holder.dp_rank,
            "seq": item.seq,
            "ts": batch.ts,
            "events": [event_to_dict(e) for e in batch.events],
        }
    )


class _Checker:
    """Block sizes of the watched streams (configured sizes declared on first sight)."""

    def __init__(self, configured: dict[str, int]) -> None:
        self.sizes = BlockSizes(shared=False)
        self._configured = configured  # worker -> size
        self._declared: set[Holder] = set()
        self._reported: set[tuple[Holder, str, int]] = set()

    def check(self, item: Delivery) -> list[BlockSizeMismatch]:
        """Check one delivery; the mismatches seen for the first time."""
        holder = item.holder
        if holder not in self._declared:
            self._declared.add(holder)
            size = self._configured.get(holder.worker)
            if size is not None:
                self.sizes.declare(holder, size, "configured", f"configured for {holder.worker}")
        before = len(self.sizes.mismatches)
        self.sizes.check(holder, item.batch)
        if len(self.sizes.mismatches) == before:
            return []
        fresh = [m for k, m in self.sizes.mismatches.items() if k not in self._reported]
        self._reported.update(self.sizes.mismatches)
        return fresh


def _subscribe(args: argparse.Namespace) -> tuple[Subscriber, _Checker]:
    engines = engine_specs(args, args.urls)
    streams = endpoint_specs(args)
    configured = {s.worker: s.block_size for s in engines if s.block_size is not None}
    configured |= {s.worker: s.block_size for s in streams if s.block_size is not None}
    sub = Subscriber(
        replay_timeout=args.replay_timeout,
        http_credentials=engine_credentials(args),
        **curve_options(args),
    )
    try:
        for spec in engines:
            spec.follow(sub)
        for stream in streams:
            sub.add_stream(stream)
    except BaseException:
        sub.close()
        raise
    return sub, _Checker(configured)


def run(args: argparse.Namespace) -> int:
    if not args.urls and not args.entries and args.engines_file is None:
        raise ConfigError("give at least one engine URL, --engine, --engines-file or --endpoint")
    sub, checker = _subscribe(args)
    deadline = None if args.duration is None else time.monotonic() + args.duration
    with sub:
        if args.jsonl:
            return _run_json(sub, checker, sys.stdout, args.count, deadline)
        return _run_table(sub, checker, args.count, deadline)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _run_json(
    sub: Subscriber, checker: _Checker, out: TextIO, count: int | None, deadline: float | None
) -> int:
    stream = out.buffer if hasattr(out, "buffer") else None
    batches = 0
    try:
        while count is None or batches < count:
            item = sub.get(timeout=0.0)
            if item is None:
                out.flush()
                remaining = _remaining(deadline)
                if remaining is not None and remaining <= 0:
                    break
                item = sub.get(timeout=0.25 if remaining is None else min(0.25, remaining))
                if item is None:
                    continue
            if isinstance(item, Delivery):
                line = b"".join(_mismatch_line(m) + b"\n" for m in checker.check(item))
                line += batch_to_json(item)
                batches += 1
            else:
                line = _ENCODER.encode(item.to_dict())
            if stream is not None:
                stream.write(line + b"\n")
            else:
                out.write(line.decode() + "\n")
        out.flush()
    except BrokenPipeError:
        # the reader went away (e.g. `| head`): stop quietly, and keep Python's exit
        # flush from failing on the closed pipe too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
    return 0


def _mismatch_line(m: BlockSizeMismatch) -> bytes:
    return _ENCODER.encode({"signal": "block_size_mismatch", **msgspec.structs.asdict(m)})


def _run_table(
    sub: Subscriber, checker: _Checker, count: int | None, deadline: float | None
) -> int:
    from rich.console import Console, Group
    from rich.live import Live

    console = Console()
    if not console.is_terminal:  # piped: rich would assume 80 columns and squeeze the table
        console = Console(width=max(console.width, 160))
    recent: deque[Signal] = deque(maxlen=6)
    batches = 0
    next_draw = 0.0
    with Live(_render(sub, checker, recent), console=console, refresh_per_second=4) as live:
        while count is None or batches < count:
            remaining = _remaining(deadline)
            if remaining is not None and remaining <= 0:
                break
            item = sub.get(timeout=0.25 if remaining is None else max(0.0, min(0.25, remaining)))
            if isinstance(item, Delivery):
                batches += 1
                checker.check(item)
            elif item is not None:
                recent.append(item)
            now = time.monotonic()
            if now >= next_draw:
                live.update(_render(sub, checker, recent))
                next_draw = now + 0.25
        live.update(Group(_render(sub, checker, recent)))
    return 0


def _block_size(checker: _Checker, holder: Holder) -> str:
    observed = checker.sizes.observed.get(holder)
    expected = checker.sizes.expected(holder)
    if observed is None:
        return "-" if expected is None else str(expected[0])
    if expected is not None and observed != expected[0]:
        return f"{observed} != {expected[0]}!"
    return str(observed)


def _render(sub: Subscriber, checker: _Checker, recent: deque[Signal]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title="kvevents watch", title_justify="left")
    for name, justify in (
        ("worker", "left"),
        ("rank", "right"),
        ("status", "left"),
        ("block", "right"),
        ("last seq", "right"),
        ("batches/s", "right"),
        ("blocks/s", "right"),
        ("lag", "right"),
        ("age", "right"),
        ("gaps", "right"),
        ("replayed", "right"),
        ("lost", "right"),
        ("resets", "right"),
        ("errors", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    stats = sub.stats()
    for holder in sorted(stats):
        s = stats[holder]
        table.add_row(
            s.worker,
            str(s.dp_rank),
            s.status,
            _block_size(checker, holder),
            "-" if s.last_seq is None else str(s.last_seq),
            f"{s.batches_per_s:,.1f}",
            f"{s.blocks_per_s:,.0f}",
            "-" if s.lag_s is None else f"{s.lag_s * 1000:,.1f} ms",
            "-" if s.age_s is None else f"{s.age_s:,.1f} s",
            str(s.gaps),
            str(s.replayed),
            str(s.lost),
            str(s.resets),
            str(s.decode_errors + s.malformed),
        )
    for engine in sub.engines().values():
        if engine.state is not DiscoveryState.SUBSCRIBED:
            table.add_row(engine.url, "-", engine.state, *["-"] * 11)
    lines = [
        Text(f"{s.kind}: {_describe(s)}", style="red" if s.kind in ("loss", "reset") else "yellow")
        for s in recent
    ]
    lines += [
        Text(
            f"block size mismatch: {m.worker} rank {m.dp_rank} {m.source} say {m.observed}, "
            f"expected {m.expected} ({m.expected_from}); seen {m.count} times",
            style="red",
        )
        for m in checker.sizes.mismatches.values()
    ]
    return Group(table, *lines)


def _describe(signal: Signal) -> str:
    fields = signal.to_dict()
    fields.pop("signal")
    return ", ".join(f"{k}={v}" for k, v in fields.items() if v is not None)

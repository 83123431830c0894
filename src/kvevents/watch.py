"""``kvevents watch``: follow every KV-event stream of engines and endpoints.

::

    kvevents watch http://127.0.0.1:30000                        # every rank it advertises
    kvevents watch --endpoint tcp://10.0.0.5:5557 --replay-endpoint tcp://10.0.0.5:5600
    kvevents watch URL --json | jq .                              # one JSON object per line

``--replay-endpoint``, ``--topic``, ``--name`` and ``--dp-rank`` belong to the
``--endpoint`` before them. By default a live table shows, per stream: status, last seq,
batches and blocks per second, lag, gaps, replayed, lost, resets, errors. ``--json``
prints instead, one object per line::

    {"worker": ..., "dp_rank": 0, "seq": 12, "ts": 1795975045.2, "events": [{"type": ...}, ...]}
    {"signal": "gap" | "loss" | "reset" | "unreachable", "worker": ..., "dp_rank": ..., ...}

``--count N`` stops after N batches, ``--duration S`` after S seconds. Exit status 0,
2 for bad arguments, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from typing import Any, TextIO

import msgspec

from kvevents.discovery import StreamSpec
from kvevents.signals import Delivery, Signal
from kvevents.subscriber import Subscriber
from kvevents.wire import event_to_dict

__all__ = ["add_arguments", "batch_to_json", "run"]

_ENCODER = msgspec.json.Encoder()


class _EndpointAction(argparse.Action):
    """``--endpoint`` starts a new explicit stream; the options after it amend it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        streams: list[dict[str, Any]] = list(getattr(namespace, "streams", None) or [])
        if self.dest == "endpoint":
            streams.append({"endpoint": values})
        elif not streams:
            parser.error(f"{option_string} belongs to an --endpoint: give --endpoint first")
        else:
            key = self.dest
            if key in streams[-1]:
                parser.error(
                    f"{option_string} given twice for --endpoint {streams[-1]['endpoint']}"
                )
            streams[-1][key] = values
        namespace.streams = streams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "urls", nargs="*", metavar="URL", help="engine URLs (their /server_info is read)"
    )
    group = parser.add_argument_group("explicit streams (repeatable)")
    group.add_argument(
        "--endpoint",
        action=_EndpointAction,
        metavar="ADDR",
        help="live endpoint, e.g. tcp://H:5557",
    )
    group.add_argument(
        "--replay-endpoint",
        dest="replay_endpoint",
        action=_EndpointAction,
        metavar="ADDR",
        help="replay endpoint of the --endpoint before it",
    )
    group.add_argument("--topic", action=_EndpointAction, help="topic of the --endpoint before it")
    group.add_argument(
        "--name", action=_EndpointAction, help="worker name of the --endpoint before it"
    )
    group.add_argument(
        "--dp-rank",
        dest="dp_rank",
        action=_EndpointAction,
        type=int,
        help="rank of the --endpoint before it",
    )
    parser.set_defaults(streams=[])
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    parser.add_argument("--count", type=int, metavar="N", help="stop after N batches")
    parser.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    parser.add_argument(
        "--replay-timeout", type=float, default=2.0, metavar="S", help="replay inactivity timeout"
    )


def batch_to_json(item: Delivery) -> bytes:
    """One delivery as the JSON line of ``--json`` (without the newline)."""
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


def _specs(args: argparse.Namespace) -> list[StreamSpec]:
    specs = []
    for entry in args.streams:
        specs.append(
            StreamSpec.from_endpoint(
                entry["endpoint"],
                replay_endpoint=entry.get("replay_endpoint"),
                topic=entry.get("topic", ""),
                worker=entry.get("name"),
                dp_rank=entry.get("dp_rank", 0),
            )
        )
    return specs


def run(args: argparse.Namespace) -> int:
    if not args.urls and not args.streams:
        print("kvevents watch: give at least one engine URL or --endpoint", file=sys.stderr)
        return 2
    for name in ("count", "duration"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            print(f"kvevents watch: --{name} must be positive, got {value}", file=sys.stderr)
            return 2
    specs = _specs(args)
    deadline = None if args.duration is None else time.monotonic() + args.duration
    with Subscriber(engines=args.urls, streams=specs, replay_timeout=args.replay_timeout) as sub:
        if args.json:
            return _run_json(sub, sys.stdout, args.count, deadline)
        return _run_table(sub, args.count, deadline)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _run_json(sub: Subscriber, out: TextIO, count: int | None, deadline: float | None) -> int:
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
                line = batch_to_json(item)
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


def _run_table(sub: Subscriber, count: int | None, deadline: float | None) -> int:
    from rich.console import Console, Group
    from rich.live import Live

    console = Console()
    if not console.is_terminal:  # piped: rich would assume 80 columns and squeeze the table
        console = Console(width=max(console.width, 160))
    recent: deque[Signal] = deque(maxlen=6)
    batches = 0
    next_draw = 0.0
    with Live(_render(sub, recent), console=console, refresh_per_second=4) as live:
        while count is None or batches < count:
            remaining = _remaining(deadline)
            if remaining is not None and remaining <= 0:
                break
            item = sub.get(timeout=0.25 if remaining is None else max(0.0, min(0.25, remaining)))
            if isinstance(item, Delivery):
                batches += 1
            elif item is not None:
                recent.append(item)
            now = time.monotonic()
            if now >= next_draw:
                live.update(_render(sub, recent))
                next_draw = now + 0.25
        live.update(Group(_render(sub, recent)))
    return 0


def _render(sub: Subscriber, recent: deque[Signal]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title="kvevents watch", title_justify="left")
    for name, justify in (
        ("worker", "left"),
        ("rank", "right"),
        ("status", "left"),
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
        if engine.state != "subscribed":
            table.add_row(engine.url, "-", engine.state, *["-"] * 10)
    lines = [
        Text(f"{s.kind}: {_describe(s)}", style="red" if s.kind in ("loss", "reset") else "yellow")
        for s in recent
    ]
    return Group(table, *lines)


def _describe(signal: Signal) -> str:
    fields = signal.to_dict()
    fields.pop("signal")
    return ", ".join(f"{k}={v}" for k, v in fields.items() if v is not None)

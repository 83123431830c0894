"""The disaggregated demo's processes: prefill and decode engines, one router over both.

:class:`PDFleet` starts ``prefill`` engines with ``--disaggregation-mode prefill``
(bootstrap servers on OS-chosen ports), ``decode`` engines with ``--disaggregation-mode
decode``, each with the one-pool demo's engine options
(:func:`kvevents.demo.main.engine_args`), then ``kvevents router --prefill URL ...
--decode URL ...``, and waits until the router follows every rank of every engine.
Engines start one after another from the calling thread, so a signal during start-up
never leaves a process that :meth:`PDFleet.stop` does not know of.

It reads what the demo measures from the engines themselves: each rank's counters of
``/load`` (:meth:`PDFleet.counters`: prompt tokens admitted, tokens found cached). Between
two replays :meth:`PDFleet.flush` empties every cache and waits until the router's index
is empty with them; after one, :meth:`PDFleet.settle` waits until the router has applied
every batch each engine published and compares the index with each engine's caches
(:class:`~kvevents.demo.plane.Plane`, one per engine). :meth:`PDFleet.stop` stops the
router, then the engines and the ranks they started; it is idempotent.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from kvevents.demo.main import engine_args
from kvevents.demo.plane import EventCounts, Plane, Settled
from kvevents.demo.procs import Child
from kvevents.errors import KVEventsError

__all__ = ["Counts", "Holder", "PDFleet"]

Holder = tuple[str, int]
"""An engine's URL and one of its DP ranks."""
Counts = dict[Holder, tuple[int, int]]
"""Per rank: prompt tokens admitted, and of them the tokens found in its cache."""

_SETTLE_S = 30.0


class PDFleet:
    """The engines and the router of one P/D demo (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, router_extra: Sequence[str]) -> None:
        self.dp_size: int = args.dp_size
        self.startup_timeout: float = args.startup_timeout
        base = engine_args(args)
        prefill = [
            *base,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            "0",
        ]
        decode = [*base, "--disaggregation-mode", "decode"]
        self.prefill = [Child("engine", prefill) for _ in range(args.prefill_engines)]
        self.decode = [Child("engine", decode) for _ in range(args.decode_engines)]
        self.router = Child("router", ["--port", "0", "--workers", "1", *router_extra])
        self.prefill_urls: list[str] = []
        self.decode_urls: list[str] = []
        self.router_url = ""
        self.planes: dict[str, Plane] = {}

    @property
    def engines(self) -> list[Child]:
        return [*self.prefill, *self.decode]

    def start(self, say: Callable[[str], object] = print) -> None:
        """Start every engine, then the router; return once it follows every rank."""
        for role, children, urls in (
            ("prefill", self.prefill, self.prefill_urls),
            ("decode", self.decode, self.decode_urls),
        ):
            for child in children:
                urls.append(child.start(self.startup_timeout))
                say(f"{role} engine ready: {urls[-1]}")
        pools = [a for url in self.prefill_urls for a in ("--prefill", url)]
        pools += [a for url in self.decode_urls for a in ("--decode", url)]
        self.router.argv += pools
        self.router_url = self.router.start(self.startup_timeout)
        say(f"router ready: {self.router_url}")
        for child, url in zip(self.engines, [*self.prefill_urls, *self.decode_urls], strict=True):
            plane = self.planes[url] = Plane(url, self.router_url)
            child.adopt(plane.rank_pids())
        for plane in self.planes.values():
            plane.wait_subscribed(self.dp_size, self.startup_timeout)

    def prefill_ranks(self) -> list[Holder]:
        """Every rank of every prefill engine, in engine then rank order."""
        return [(url, rank) for url in self.prefill_urls for rank in range(self.dp_size)]

    def bootstrap(self) -> dict[str, tuple[str, int]]:
        """Each prefill engine's bootstrap server (host, port), from its ``/server_info``."""
        found: dict[str, tuple[str, int]] = {}
        for url in self.prefill_urls:
            response = self.planes[url].http.get(f"{url}/server_info")
            response.raise_for_status()
            port = response.json().get("disaggregation_bootstrap_port")
            if not isinstance(port, int):
                raise KVEventsError(
                    f"prefill engine {url} advertises no disaggregation_bootstrap_port in "
                    "/server_info: was it started with --disaggregation-mode prefill?"
                )
            found[url] = (urlsplit(url).hostname or "127.0.0.1", port)
        return found

    def counters(self) -> dict[str, Counts]:
        """Per pool (``prefill``, ``decode``), each rank's cumulative ``/load`` counters."""
        out: dict[str, Counts] = {}
        for pool, urls in (("prefill", self.prefill_urls), ("decode", self.decode_urls)):
            counts: Counts = {}
            for url in urls:
                for rank in self.planes[url].engine_load():
                    holder = (url, int(rank["dp_rank"]))
                    counts[holder] = (int(rank["prompt_tokens"]), int(rank["cached_tokens"]))
            out[pool] = counts
        return out

    def flush(self) -> None:
        """Flush every engine's caches; return once the router's index is empty too."""
        for plane in self.planes.values():
            plane.flush(timeout=_SETTLE_S)

    def settle(self) -> dict[str, Settled]:
        """Per engine URL: its caches against the router's index, once every batch is in."""
        return {url: plane.wait_settled(timeout=_SETTLE_S) for url, plane in self.planes.items()}

    def event_counts(self) -> EventCounts:
        """The event plane's figures summed over every engine."""
        each = [plane.event_counts() for plane in self.planes.values()]
        summed = {
            f.name: sum(getattr(c, f.name) for c in each) for f in dataclasses.fields(EventCounts)
        }
        # the router's applied events are one figure for every engine, not one per engine
        summed["events_applied"] = max((c.events_applied for c in each), default=0)
        return EventCounts(**summed)

    def pids(self) -> dict[str, Any]:
        return {
            "prefill": [c.pid for c in self.prefill],
            "decode": [c.pid for c in self.decode],
            "router": self.router.pid,
            "ranks": [pid for c in self.engines for pid in c.adopted],
        }

    def stop(self) -> None:
        """Stop the router, then every engine with its ranks. Idempotent."""
        for plane in self.planes.values():
            plane.close()
        self.router.stop()
        for child in self.engines:
            child.stop()

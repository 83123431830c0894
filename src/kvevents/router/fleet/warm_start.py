"""Warm restarts: start a router from a live peer's index (``kvevents router --peer URL``).

A router that starts empty rebuilds its index from the engines' replay buffers, which may
have wrapped or not exist. A peer router that kept running holds the same index, so a
restarted replica asks it first: ``GET /dump`` is the peer's snapshot
(:meth:`~kvevents.index.prefix_index.PrefixIndex.to_bytes`), carrying per stream the seq
of the last batch the peer applied; the replica adopts it and follows each stream from
there (:class:`~kvevents.subscribe.subscriber.Subscriber` ``resume``,
:meth:`kvevents.subscribe.stream.StreamTracker.start`).

Serving it (:func:`dump_bytes`): the peer copies its index on its event loop
(:meth:`~kvevents.index.prefix_index.PrefixIndex.freeze`, one consistent state, seqs
included) and encodes the copy on a worker thread, so it goes on routing meanwhile;
loading is a few C-level passes over columns (:mod:`kvevents.index.snapshot`).

Peers are tried in order, each with bounded timeouts; the first snapshot that loads, at
this router's block size, holding a rank this router follows, wins; none: the router
starts empty. A peer URL with credentials is refused (:func:`peer_url_problem`): a peer
is asked with the router's own ``--api-key``, and the URL shows in ``/workers``. An answer
is bounded before it is trusted: its size (``max_bytes``, :func:`snapshot_bytes_bound`)
against its ``Content-Length`` and what arrived, the whole download by ``total_timeout``.
Batches published between the snapshot and the subscription come back only through
replay; without it they are a ``Loss``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import httpx
import msgspec

from kvevents.http.auth import masked_url
from kvevents.index.prefix_index import DEFAULT_MAX_ENTRIES, PrefixIndex
from kvevents.types import Holder

__all__ = [
    "BYTES_PER_ENTRY",
    "WarmStart",
    "dump_bytes",
    "load_from_peers",
    "peer_url_problem",
    "snapshot_bytes_bound",
]

BYTES_PER_ENTRY = 64
"""Snapshot bytes allowed per index entry: a block's key, mask number, engine hash and its
key take about 30 in msgpack; twice that leaves room for copies and side groups."""
DEFAULT_TOTAL_TIMEOUT_S = 60.0


def snapshot_bytes_bound(max_entries: int) -> int:
    """The most bytes a peer's snapshot of an index of ``max_entries`` entries may take."""
    return max_entries * BYTES_PER_ENTRY + (1 << 20)


class _PastBound(Exception):
    """A peer's answer broke one of the bounds (the message names it)."""


log = logging.getLogger("kvevents.router")


class WarmStart(msgspec.Struct, frozen=True, kw_only=True):
    """How the index started (shown in ``/workers`` as ``warm_start``)."""

    peer: str | None
    """The peer whose snapshot was adopted; None: started empty."""
    blocks: int = 0
    streams: int = 0
    """Streams resumed at the peer's seq."""
    seconds: float = 0.0
    """Time spent asking peers, in all."""
    fetch_seconds: float = 0.0
    """Of which: the adopted peer's ``/dump`` answer (its encoding and the transfer)."""
    load_seconds: float = 0.0
    """Of which: decoding and loading that snapshot."""
    snapshot_bytes: int = 0
    errors: list[str] = []
    """Why each peer tried before (or instead of) the one adopted failed."""


def peer_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a ``--peer`` (it has credentials in it, or is not a URL), in
    a message that shows it without them; None: it can. Credentials are refused as in an
    engine's URL: a peer is asked with this router's ``--api-key`` (replicas share one),
    and the URL is shown in ``/workers`` and logged."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        return f"--peer {masked_url(url)}: not a URL ({exc}); write http://HOST:PORT"
    if parsed.userinfo:
        return (
            f"--peer {masked_url(url)}: credentials in a peer's URL are refused (it would be shown in "
            "/workers and the log); the peer is asked with this router's --api-key (or "
            "--api-key-file, KVEVENTS_API_KEY): write http://HOST:PORT"
        )
    return None


def load_from_peers(
    peers: Sequence[str],
    *,
    timeout: float = 5.0,
    client: httpx.Client | None = None,
    block_size: int | None = None,
    follows: Callable[[Holder], bool] | None = None,
    max_bytes: int | None = None,
    total_timeout: float = DEFAULT_TOTAL_TIMEOUT_S,
) -> tuple[PrefixIndex | None, WarmStart]:
    """The first peer's index that loads, and what happened; ``(None, ...)`` when none did.

    ``block_size``: this router's, when it has one (``--block-size``); a snapshot at
    another is skipped, and the next peer tried. ``follows``: whether this router follows
    a holder; the others are dropped from each snapshot, and one left with none is
    skipped too (:func:`_fit`). What is reported (blocks, streams) is what is left.
    ``max_bytes`` (default: :func:`snapshot_bytes_bound` of the default ``--max-entries``)
    and ``total_timeout`` bound each peer's answer (module docstring).
    """
    if max_bytes is None:
        max_bytes = snapshot_bytes_bound(DEFAULT_MAX_ENTRIES)
    started = time.monotonic()
    errors: list[str] = []
    own = client is None
    http = client or httpx.Client(timeout=httpx.Timeout(timeout))
    try:
        for url in peers:
            problem = peer_url_problem(url)
            if problem is not None:  # never asked, never shown with its credentials
                errors.append(problem)
                continue
            base = url.rstrip("/")
            try:
                asked = time.monotonic()
                content = _download(http, f"{base}/dump", max_bytes, asked + total_timeout)
                fetched = time.monotonic()
                index = PrefixIndex.from_bytes(content)
            except _PastBound as exc:
                errors.append(f"{base}: {exc}")
            except httpx.HTTPError as exc:
                errors.append(f"{base}: {type(exc).__name__}: {exc}")
            except ValueError as exc:
                errors.append(f"{base}: {exc}")
            else:
                why = _fit(index, block_size, follows)
                if why is not None:
                    errors.append(f"{base}: {why}")
                    continue
                loaded = time.monotonic()  # one reading: the total includes both parts
                info = WarmStart(
                    peer=base,
                    blocks=index.num_blocks,
                    streams=len(index.applied_seqs),
                    seconds=loaded - started,
                    fetch_seconds=fetched - asked,
                    load_seconds=loaded - fetched,
                    snapshot_bytes=len(content),
                    errors=errors,
                )
                log.info(
                    "warm start from peer %s: %d blocks, %d streams resumed at the peer's seq "
                    "(%d bytes fetched in %.3f s, loaded in %.3f s)",
                    base,
                    info.blocks,
                    info.streams,
                    info.snapshot_bytes,
                    info.fetch_seconds,
                    info.load_seconds,
                )
                return index, info
    finally:
        if own:
            http.close()
    for error in errors:
        log.warning("peer snapshot not loaded: %s", error)
    if peers:
        log.warning("no peer answered with an index snapshot: starting with an empty index")
    return None, WarmStart(peer=None, seconds=time.monotonic() - started, errors=errors)


def _download(http: httpx.Client, url: str, max_bytes: int, deadline: float) -> bytes:
    """``GET url``'s body, within ``max_bytes`` (claimed and received) and by ``deadline``
    (monotonic); :class:`_PastBound` names the bound a peer broke."""
    with http.stream("GET", url) as r:
        r.raise_for_status()
        claimed = r.headers.get("content-length")
        if claimed is not None and claimed.isdigit() and int(claimed) > max_bytes:
            raise _PastBound(
                f"its snapshot claims {int(claimed)} bytes, past the bound of {max_bytes} "
                "(--peer-max-bytes; by default what --max-entries entries take): not read"
            )
        chunks: list[bytes] = []
        received = 0
        for chunk in r.iter_bytes():
            received += len(chunk)
            if received > max_bytes:
                raise _PastBound(
                    f"its snapshot went past the bound of {max_bytes} bytes (--peer-max-bytes)"
                    " while it was read: dropped"
                )
            if time.monotonic() > deadline:
                raise _PastBound(
                    f"its snapshot did not arrive whole within the download's deadline "
                    f"({received} bytes read): dropped"
                )
            chunks.append(chunk)
        return b"".join(chunks)


def _fit(
    index: PrefixIndex, block_size: int | None, follows: Callable[[Holder], bool] | None
) -> str | None:
    """Fit a peer's decoded snapshot to this router: drop the holders it does not follow
    (another group's engines, ranks past those described here). Returns why the snapshot
    cannot be adopted (None: it can): at another block size its content keys, cut at
    its own, would match nothing; with no holder left, adopting it would only stop the
    next peer, which may have them, from being asked."""
    if block_size is not None and index.block_size not in (None, block_size):
        return (
            f"its snapshot is at block size {index.block_size}, this router keys requests at "
            f"{block_size}: its blocks would match nothing (give the replicas one block size)"
        )
    if follows is None:
        return None
    held = index.holders()
    for holder in held:
        if not follows(holder):
            index.remove_holder(holder)
    if held and not index.holders():
        engines = sorted({holder.worker for holder in held})
        return (
            f"its snapshot holds none of the ranks this router follows (only of "
            f"{', '.join(engines)}): nothing of it is usable"
        )
    return None


async def dump_bytes(index: PrefixIndex, applying: asyncio.Lock | None = None) -> bytes:
    """``index``'s snapshot as it is now, encoded off the event loop (the ``/dump`` answer).

    ``applying``: the lock the service holds while it applies an item in steps; the
    copy is made outside it, so it never holds half a batch.
    """
    if applying is None:
        return await asyncio.to_thread(index.freeze())
    async with applying:
        encode = index.freeze()
    return await asyncio.to_thread(encode)

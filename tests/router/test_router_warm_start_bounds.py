"""A warm start trusts its peer only within bounds: size claimed, size received, total time.

Each peer here is a real HTTP server on an OS-chosen loopback port that misbehaves in
one way; the router must skip it with an error naming the bound and adopt the next
peer's snapshot (or start empty), never reading more than the bound allows.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvevents import BlockStored, KVEventBatch
from kvevents.index.prefix_index import PrefixIndex
from kvevents.router.fleet.warm_start import load_from_peers, snapshot_bytes_bound
from kvevents.types import Holder

WORKER = "http://engine:8000"


def _snapshot() -> bytes:
    index = PrefixIndex(block_size=4)
    index.add_holder(Holder(WORKER, 0))
    stored = BlockStored(
        block_hashes=[1, 2],
        parent_block_hash=None,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=None,
        medium=None,
    )
    index.apply(Holder(WORKER, 0), KVEventBatch(ts=1.0, events=[stored]))
    return index.to_bytes()


@contextlib.contextmanager
def _peer(head: bytes, body_chunks: list[bytes], pause: float = 0.0) -> Iterator[str]:
    """A raw HTTP peer: answers any request with ``head`` then each chunk, ``pause`` s apart;
    counts what it managed to send in ``sent``."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent: list[int] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(10)
                    conn.recv(65536)
                    conn.sendall(head)
                    for chunk in body_chunks:
                        time.sleep(pause)
                        conn.sendall(chunk)
                        sent.append(len(chunk))

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def _ok_peer(snapshot: bytes) -> contextlib.AbstractContextManager[str]:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(snapshot)
    return _peer(head, [snapshot])


def test_a_peer_claiming_more_than_the_bound_is_skipped_unread_and_the_next_adopted() -> None:
    """A Content-Length past max_bytes is refused before any of the body is read."""
    good = _snapshot()
    claimed = b"HTTP/1.1 200 OK\r\nContent-Length: 1500000000\r\nConnection: close\r\n\r\n"
    with _peer(claimed, [b"x" * 65536] * 4) as huge, _ok_peer(good) as fine:
        index, warm = load_from_peers([huge, fine], max_bytes=1 << 20, timeout=5.0)
    assert index is not None and warm.peer == fine
    assert "claims 1500000000 bytes, past the bound of 1048576" in warm.errors[0]


def test_a_peer_sending_more_than_it_claimed_or_unframed_is_cut_at_the_bound() -> None:
    """A chunked answer without a length is read only up to max_bytes, then dropped."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    piece = b"x" * 32768
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    with _peer(head, [chunk] * 64) as endless:
        index, warm = load_from_peers([endless], max_bytes=100_000, timeout=5.0)
    assert index is None and warm.peer is None
    assert "went past the bound of 100000 bytes" in warm.errors[0]


@pytest.mark.slow
def test_a_peer_that_trickles_is_dropped_at_the_download_deadline() -> None:
    """Each read within the per-read timeout, the whole past total_timeout: skipped."""
    good = _snapshot()
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(good)
    pieces = [good[i : i + 8] for i in range(0, len(good), 8)]
    with _peer(head, pieces, pause=0.2) as slow:
        started = time.monotonic()
        index, warm = load_from_peers([slow], timeout=5.0, total_timeout=0.5)
    assert index is None
    assert "did not arrive whole within the download's deadline" in warm.errors[0]
    assert time.monotonic() - started < 5.0  # the total bound ended it, not the peer


def test_a_snapshot_within_the_bounds_is_adopted() -> None:
    """An ordinary snapshot under every bound loads, its size reported."""
    good = _snapshot()
    with _ok_peer(good) as fine:
        index, warm = load_from_peers([fine], max_bytes=len(good), total_timeout=5.0)
    assert index is not None and warm.snapshot_bytes == len(good)
    assert index.holders() == [Holder(WORKER, 0)]


@pytest.mark.parametrize("entries", [1, 16_000_000])
def test_the_default_bound_grows_with_max_entries(entries: int) -> None:
    """The byte bound is what that many entries can take, plus a fixed megabyte."""
    assert snapshot_bytes_bound(entries) == entries * 64 + (1 << 20)

"""Mooncake request traces, turned into token ids deterministically.

A Mooncake trace (kvcache-ai/Mooncake, ``FAST25-release/traces``) describes each
request by ``input_length`` and ``hash_ids``: one id per 512-token block of the prompt,
equal ids meaning equal prefix blocks. To replay it on an engine we need tokens, and
we need shared ids to become shared tokens:

* every hash id maps to a fixed run of 512 token ids, drawn from SHAKE-128 keyed by
  ``(seed, hash_id)`` (a seeded, portable generator: same tokens on every machine and
  Python version), two bytes per token, so ids are in ``0..65535``;
* a request's tokens are the runs of its hash ids in order, the last run cut so the
  total is ``input_length``.

Two requests sharing their first k hash ids therefore share their first ``512 * k``
tokens, and any engine page size that divides 512 sees exactly the reuse the trace
has. Converting a block costs one hash call and one array conversion in C.

The conversation trace ships with the package (``kvevents/data``, Apache-2.0, see the
README there); :func:`load_trace` reads it by default.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import msgspec

__all__ = [
    "BLOCK_TOKENS",
    "TraceRequest",
    "bundled_trace_path",
    "hash_id_tokens",
    "iter_trace",
    "load_trace",
    "request_tokens",
]

BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake traces."""


class TraceRequest(msgspec.Struct, frozen=True, gc=False):
    """One trace line: arrival ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


_DECODER = msgspec.json.Decoder(TraceRequest)


def bundled_trace_path() -> Path:
    """Path of the conversation trace shipped inside the package."""
    return Path(str(resources.files("kvevents") / "data" / "conversation_trace.jsonl"))


def iter_trace(path: str | Path | None = None, limit: int | None = None) -> Iterator[TraceRequest]:
    """Requests of a trace file (default: the bundled conversation trace), in file order.

    A malformed line raises ``ValueError`` naming the file and line number.
    """
    path = bundled_trace_path() if path is None else Path(path)
    with path.open("rb") as f:
        count = 0
        for lineno, line in enumerate(f, 1):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            try:
                req = _DECODER.decode(line)
            except msgspec.DecodeError as exc:
                raise ValueError(
                    f"{path}:{lineno}: not a Mooncake trace request ({exc}); expected "
                    '{"timestamp", "input_length", "output_length", "hash_ids"}'
                ) from None
            count += 1
            yield req


def load_trace(path: str | Path | None = None, limit: int | None = None) -> list[TraceRequest]:
    """All (or the first ``limit``) requests of a trace file; see :func:`iter_trace`."""
    return list(iter_trace(path, limit))


def hash_id_tokens(hash_id: int, *, seed: int = 0, block_tokens: int = BLOCK_TOKENS) -> array[int]:
    """The fixed run of ``block_tokens`` token ids that ``hash_id`` stands for."""
    raw = hashlib.shake_128(f"kvevents-trace:{seed}:{hash_id}".encode()).digest(2 * block_tokens)
    halves = array("H", raw)
    if sys.byteorder == "big":
        halves.byteswap()
    return array("I", halves)


def request_tokens(
    request: TraceRequest, *, seed: int = 0, block_tokens: int = BLOCK_TOKENS
) -> array[int]:
    """The token ids of a trace request: its hash ids' runs, cut to ``input_length``."""
    capacity = len(request.hash_ids) * block_tokens
    if not 0 <= request.input_length <= capacity:
        raise ValueError(
            f"trace request has input_length={request.input_length} but {len(request.hash_ids)} "
            f"hash ids cover at most {capacity} tokens ({block_tokens} per id)"
        )
    tokens = array("I")
    for hash_id in request.hash_ids:
        tokens.extend(hash_id_tokens(hash_id, seed=seed, block_tokens=block_tokens))
    del tokens[request.input_length :]
    return tokens

"""The native core's parts stated in plain Python: what each C loop must answer.

The extension (:mod:`kvevents.kernels`) is only ever an acceleration, so each of its parts
has a Python statement here, written for reading, not speed, that the tests and
``scripts/fuzz-native`` hold the C equal to on every input:

* :func:`parse_input_ids` is ``token_json.h``'s grammar of the plain body;
* :class:`MirrorModel` is ``MaskMirror`` as a dict (the index's own storage, its GPU tier),
  with its writes, match and ``not_held``;
* :func:`best_unmatched` is ``load_scan.h``'s pass, step for step, comparisons included
  (so the two agree on NaN and infinities too). It restates the cost rather than call
  :mod:`kvevents.router.decide.cost`: the router sits above this package in the layers,
  and the router's tests hold the scan's answers to ``score()``'s bit for bit.

The keys' reference is :func:`kvevents.wire.hashing.content_keys_per_block` (the xxhash
package), and the whole answers' is the router's own Python path. Nothing here runs on
a request: the Python fallbacks are those paths, not these statements.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = ["INPUT_IDS", "MirrorModel", "best_unmatched", "parse_input_ids"]

INPUT_IDS = b'"input_ids"'
"""The key a ``/route`` body's ids go by, quotes included."""

_WS = rb"[ \t\n\r]*"
_ID = rb"(?:0|[1-9][0-9]*)"
_IDS = rb"\[" + _WS + rb"(?:" + _ID + _WS + rb"(?:," + _WS + _ID + _WS + rb")*)?\]"


def parse_input_ids(body: bytes, lead: bytes = INPUT_IDS) -> tuple[list[int], int] | None:
    """The ids of a body whose first member is ``lead`` (the bytes between its ``{`` and
    the ``:``) holding a plain array of uint32 JSON integers, and the index of the ``,``
    or ``}`` after the array; None for any other body, or one whose last byte past
    whitespace is not ``}``."""
    if not body.rstrip(b" \t\n\r").endswith(b"}"):
        return None
    pattern = [
        _WS,
        rb"\{",
        _WS,
        re.escape(lead),
        _WS,
        rb":",
        _WS,
        rb"(",
        _IDS,
        rb")",
        _WS,
        rb"[,}]",
    ]
    found = re.compile(b"".join(pattern)).match(body)
    if found is None:
        return None
    ids = [int(x) for x in re.findall(rb"[0-9]+", found.group(1))]
    if any(x > 0xFFFFFFFF for x in ids):
        return None
    return ids, found.end() - 1


class MirrorModel:
    """``MaskMirror(words)`` as a dict of key -> GPU mask (``64 * words`` holder slots)."""

    def __init__(self, words: int = 1) -> None:
        self.words = words
        self.masks: dict[int, int] = {}

    def sync(self, keys: Sequence[int], ops: Sequence[int]) -> None:
        """Apply each op to its key: ``slot + 1`` sets that slot's bit, ``-(slot + 1)``
        clears it (a key left with none is dropped), 0 drops the key."""
        for key, op in zip(keys, ops, strict=True):
            if op == 0:
                self.masks.pop(key, None)
            elif op > 0:
                self.masks[key] = self.masks.get(key, 0) | 1 << (op - 1)
            elif key in self.masks:
                mask = self.masks[key] & ~(1 << (-op - 1))
                if mask:
                    self.masks[key] = mask
                else:
                    del self.masks[key]

    def rebuild(self, blocks: dict[int, int]) -> None:
        """Every mask of ``blocks``, cut to its GPU tier (the low ``64 * words`` bits)."""
        low = (1 << (64 * self.words)) - 1
        self.masks = {k: v & low for k, v in blocks.items() if v & low}

    def match(self, keys: Sequence[int], live: int) -> tuple[list[tuple[int, int]], int]:
        """``(segments, longest)``: the running AND of the keys' masks from ``live``, cut
        where it changes into ``(holders dropped, blocks they hold)``, and the longest
        prefix anyone holds (as :meth:`MaskTable._segments` answers over the dict)."""
        held, segments = live, []
        for j, key in enumerate(keys):
            still = held & self.masks.get(key, 0)
            if still != held:
                if j:
                    segments.append((held ^ still, j))
                held = still
                if not held:
                    return segments, j
        if keys and held:
            segments.append((held, len(keys)))
            return segments, len(keys)
        return segments, 0

    def not_held(self, keys: Sequence[int], slot: int) -> list[int]:
        """The keys whose mask lacks ``slot``'s bit, in order."""
        return [k for k in keys if not self.masks.get(k, 0) >> slot & 1]


def best_unmatched(
    slots: Sequence[int],
    table: Sequence[float],
    scale: float,
    n_blocks: float,
    load_weight: float,
    balance_weight: float,
    foreign_blocks: float,
    count: int,
) -> tuple[list[int], float]:
    """The positions (in ``slots``) of the best ``count`` candidates by load alone, as if
    none cached anything of a request of ``n_blocks`` blocks, best first, and the least
    recent work among the available ones (0.0 when none is). A slot's row in ``table``
    is (available, engine requests, requests in flight, blocks in flight, raw recent
    work, routed); the order is score()'s: unavailable last, then cost, pending, recent,
    routed and position, kept by insertion with these very comparisons."""
    rows = [table[6 * s : 6 * s + 6] for s in slots]
    least = math.inf
    for row in rows:
        if row[0] != 0.0 and row[4] * scale < least:
            least = row[4] * scale
    if least == math.inf:
        least = 0.0
    prefill = n_blocks if n_blocks > 0.0 else 0.0
    kept: list[tuple[tuple[float, ...], int]] = []
    count = min(count, len(rows))
    for i, (available, engine, inflight, blocks, raw, routed) in enumerate(rows):
        if count == 0:
            break
        foreign = engine - inflight
        pending = blocks + (foreign_blocks * foreign if foreign > 0.0 else 0.0)
        recent = raw * scale
        balance = recent - least if recent > least else 0.0
        cost = prefill + (load_weight * pending + balance_weight * balance)
        key = (0.0 if available != 0.0 else 1.0, cost, pending, recent, routed, float(i))
        if len(kept) == count and _before(kept[-1][0], key):
            continue
        at = len(kept) if len(kept) < count else count - 1
        while at > 0 and not _before(kept[at - 1][0], key):
            at -= 1
        if len(kept) == count:
            kept.pop()
        kept.insert(at, (key, i))
    return [i for _, i in kept], least


def _before(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """``load_key_before``: the first field that differs (``!=``) decides, by ``<``."""
    for x, y in zip(a, b, strict=True):
        if x != y:
            return x < y
    return False

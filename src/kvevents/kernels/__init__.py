"""Compiled kernels for the router's per-request work: parsing token ids, keying blocks.

A routing request of 2,048 tokens costs, in plain Python, about 110 us to decode its
``input_ids`` into ints, 30 us to turn them into an array and 40 us to hash its 128
blocks, one call per block: most of what one request costs the router. Two numba
kernels do that work in one call each, without a Python object per token or per block:

* :mod:`~kvevents.kernels.token_json` reads a body's leading ``"input_ids"`` array
  straight into uint32 (the plain case only; anything else decodes as before);
* :mod:`~kvevents.kernels.xxh3_chain` computes the chained content keys of every block
  (exactly :func:`kvevents.wire.hashing.content_keys`: XXH3-64, seeded by the block
  before), for blocks of 1 to 60 tokens; they come back as a :class:`KeyList`, which
  keeps the kernel's uint64 array beside the list;
* :mod:`~kvevents.kernels.block_table` matches such keys against a flat mirror of the
  index's block masks (:mod:`~kvevents.kernels.mask_mirror`), one compiled call instead
  of a dict lookup per block.

All are optional and only ever an acceleration: the answers are the same without them
(``tests/test_kernels.py`` checks every block size and random bodies against the plain
path, ``tests/test_mask_mirror.py`` the match against the dict's). They are off until
a process calls :func:`load` (the router does, in a thread, once its server accepts
requests; :func:`will_load` marks the wait). Importing numba costs about half a second
and compiling the kernels a few seconds the first time on a machine (numba caches the
machine code beside the modules, or in ``NUMBA_CACHE_DIR``). Engines and tools never
load them. ``KVEVENTS_KERNELS=0`` keeps them off; so does a numba that cannot be
imported (the reason is in :func:`status`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from array import array
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvevents.kernels.mask_mirror import MaskMirror

__all__ = ["Kernels", "KeyList", "load", "loaded", "status", "will_load"]

log = logging.getLogger(__name__)

_FEW_BLOCKS = 8
"""Below this many blocks the per-block loop is as fast as a kernel call."""


class KeyList(list[int]):
    """Content keys as computed by the kernel: a plain list, plus ``words``, the same keys
    as the kernel's uint64 array (what the compiled match reads). Never changed in place:
    ``words`` would then disagree with the list (a slice or copy is a plain list)."""

    __slots__ = ("words",)

    words: Any


class Kernels:
    """The loaded kernels, behind plain-Python signatures (arrays in, lists out)."""

    def __init__(self) -> None:
        import numpy as np

        from kvevents.kernels import token_json, xxh3_chain

        self._np = np
        self._chain = xxh3_chain.chain_keys
        self._secret = xxh3_chain.SECRET64
        self.max_block_tokens = xxh3_chain.MAX_BLOCK_TOKENS
        self._parse = token_json.parse_leading_input_ids
        self._key = token_json.INPUT_IDS_KEY
        from kvevents.kernels.mask_mirror import MaskMirror

        self._mirror_class = MaskMirror
        # Compile now (or load numba's cache): never on a request.
        keys = self.chain_keys(array("I", range(4 * _FEW_BLOCKS)), 4, 0)
        self.parse_input_ids(b'{"input_ids": [1, 2]}')
        warm = self.mirror()
        warm.rebuild({1: 1, 2: 3})
        warm.sync([2], [0])
        warm._grow(1)
        assert keys is not None
        warm.match(keys.words, 1)
        warm.not_held(keys.words, 0)

    def mirror(self) -> MaskMirror:
        """A new, empty mirror of an index's block masks (:mod:`~kvevents.kernels.mask_mirror`)."""
        return self._mirror_class()

    def chain_keys(self, tokens: array[int], block_size: int, parent: int) -> KeyList | None:
        """Content keys of ``tokens`` (an ``array("I")``), or None when this is not a case
        the kernel takes (a block past 60 tokens, or too few blocks to gain anything)."""
        if not 0 < block_size <= self.max_block_tokens or len(tokens) < _FEW_BLOCKS * block_size:
            return None
        np = self._np
        words = np.frombuffer(tokens, dtype=np.uint32)
        chained = self._chain(words, block_size, np.uint64(parent), self._secret)
        keys = KeyList(chained.tolist())
        keys.words = chained
        return keys

    def parse_input_ids(
        self, body: bytes, lead: bytes | None = None
    ) -> tuple[array[int], int] | None:
        """The ids of a body that starts with a plain ``"input_ids"`` array, and the
        index of the ``,`` or ``}`` after it; None for any other body.

        ``lead``: instead of ``"input_ids"``, the bytes the body has between its ``{``
        (and whitespace) and the ``:`` of the array wanted, ending with that array's
        key; the caller must check that the key is a member of the object itself
        (:func:`kvevents.router.completion_body.token_prompt` does)."""
        np = self._np
        key = self._key if lead is None else np.frombuffer(lead, dtype=np.uint8).copy()
        # bytes() keeps the one type the kernel was compiled for (a no-op on bytes)
        ids, end = self._parse(np.frombuffer(bytes(body), dtype=np.uint8), key)
        if end < 0:
            return None
        tokens = array("I")
        tokens.frombytes(ids.tobytes())
        return tokens, int(end)


_kernels: Kernels | None = None
_NOT_LOADED = "off: not loaded in this process"
_status = _NOT_LOADED
_lock = threading.Lock()


def loaded() -> Kernels | None:
    """The kernels when some caller has loaded them in this process, else None."""
    return _kernels


def status() -> str:
    """``compiled``, ``waiting`` (to load, see :func:`will_load`), ``loading``, or
    ``off: <why>`` (for /workers and /metrics)."""
    return _status


def will_load() -> None:
    """Say that this process will call :func:`load` soon (status ``waiting``)."""
    global _status
    with _lock:
        if _kernels is None and _status == _NOT_LOADED:
            _status = "waiting"


def load() -> Kernels | None:
    """Load (compiling on first use on this machine) and turn on the kernels; None when
    they are off (``KVEVENTS_KERNELS=0``, no numba, a big-endian host)."""
    global _kernels, _status
    with _lock:
        if _kernels is not None:
            return _kernels
        if os.environ.get("KVEVENTS_KERNELS", "1") == "0":
            _status = "off: KVEVENTS_KERNELS=0"
            return None
        if sys.byteorder != "little":  # the kernels read tokens as little-endian words
            _status = "off: a big-endian host"
            return None
        _status = "loading"
        try:
            kernels = Kernels()
        except Exception as exc:  # no numba, or one that cannot compile here
            _status = f"off: {type(exc).__name__}: {exc}"
            log.warning("compiled kernels are off, the plain path serves: %s", _status)
            return None
        _kernels, _status = kernels, "compiled"
        return kernels

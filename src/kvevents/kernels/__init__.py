"""Compiled kernels for the router's per-request work: parsing token ids, keying blocks.

A routing request of 2,048 tokens costs, in plain Python, about 110 us to decode its
``input_ids`` into ints, 30 us to turn them into an array and 40 us to hash its 128
blocks, one call per block: most of what one request costs the router. Two numba
kernels do that work in one call each, without a Python object per token or per block:

* :mod:`~kvevents.kernels.token_json` reads a body's leading ``"input_ids"`` array
  straight into uint32 (the plain case only; anything else decodes as before);
* :mod:`~kvevents.kernels.xxh3_chain` computes the chained content keys of every block
  (exactly :func:`kvevents.wire.hashing.content_keys`: XXH3-64, seeded by the block
  before), for blocks of 1 to 60 tokens; they come back as an ``array("Q")``, which
  the compiled match reads in place and Python reads as ints only when it must;
* :mod:`~kvevents.kernels.block_table` matches such keys against a flat mirror of the
  index's block masks (:mod:`~kvevents.kernels.mask_mirror`), one compiled call instead
  of a dict lookup per block.
* :mod:`~kvevents.kernels.load_scan` picks the best holders by load from the router's
  load table (:mod:`kvevents.router.decide.load_board`), one call instead of a Python step
  per holder when every request changes the loads (relayed requests).

Beside them, :mod:`~kvevents.kernels.native` loads a C extension (built at install when a
compiler is there) that answers a plain ``/route`` whole in one call, reading the
mirror these kernels keep.

All are optional and only ever an acceleration: the answers are the same without them
(``tests/test_kernels.py`` checks every block size and random bodies against the plain
path, ``tests/test_mask_mirror.py`` the match against the dict's). They are off until
a process calls :func:`load` (the router does, in a thread, once its server accepts
requests; :func:`will_load` marks the wait). Importing numba costs about half a second
and compiling the kernels a few seconds the first time on a machine (numba caches the
machine code beside the modules, or in ``NUMBA_CACHE_DIR``). Engines and tools never
load them. ``KVEVENTS_KERNELS=0`` keeps them off; so does a numba that cannot be
imported (the reason is in :func:`status`). Loading them sets ``OPENBLAS_NUM_THREADS=1``
unless it is set or NumPy is already imported (:func:`will_load` does it on the main
thread, before the router loads them in a worker thread): nothing here does linear
algebra, and NumPy's OpenBLAS would otherwise start a thread per core in every router
process.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from array import array
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvevents.kernels.mask_mirror import MaskMirror, WideMaskMirror

__all__ = ["Kernels", "load", "loaded", "status", "will_load"]

log = logging.getLogger(__name__)

_FEW_BLOCKS = 8
"""Below this many blocks the per-block loop is as fast as a kernel call."""


class Kernels:
    r"""The loaded kernels, behind plain-Python signatures (``array``\ s in and out).

    Every call passes ``bytes`` and ``array.array`` objects straight to the kernels
    (numba reads their buffers in place) and the kernels write into arrays the caller
    holds, answering plain ints: a call makes no NumPy array. Measured with callgrind
    on the router's ``/route`` (2,048 tokens), that glue had cost more instructions than
    the kernels' own work: making the arrays, boxing the ones returned, a ``np.uint64``
    per call and turning 128 keys into Python ints.
    """

    def __init__(self) -> None:
        from kvevents.kernels import load_scan, token_json, xxh3_chain
        from kvevents.kernels.mask_mirror import MaskMirror, WideMaskMirror, signed64

        self._chain = xxh3_chain.chain_keys_into
        self._secret = xxh3_chain.SECRET64
        self._signed64 = signed64
        self.max_block_tokens = xxh3_chain.MAX_BLOCK_TOKENS
        self._parse = token_json.parse_input_ids_into
        self._key = bytes(token_json.INPUT_IDS_KEY)
        self._mirror_class = MaskMirror
        self._wide_mirror_class = WideMaskMirror
        self._best_unmatched = load_scan.best_unmatched
        self._local = threading.local()
        """Per thread, the ``array("I")`` a body's ids are parsed into (see :meth:`parse_input_ids`)."""
        # Compile now (or load numba's cache): never on a request.
        keys = self.chain_keys(array("I", range(4 * _FEW_BLOCKS)), 4, (1 << 64) - 1)
        self.parse_input_ids(b'{"input_ids": [1, 2]}')
        self.parse_input_ids(b'{"prompt": [1, 2]}', b'"prompt"')
        warm = self.mirror()
        warm.rebuild({1: 1, 2: 3})
        warm.sync([2, 3, 3, 2], array("q", [1, 2, -2, 0]))
        warm._grow(1)
        assert keys is not None
        warm.match(keys, 1)
        warm.match(keys, (1 << 64) - 1)
        warm.not_held(keys, 0)
        wide = self.mirror(2)  # compiled now too: not when a 65th holder joins
        wide.rebuild({1: 1, 2: 3 << 64})
        wide.sync([2, 3, 3, 2], array("q", [70, 2, -2, 0]))
        wide._grow(1)
        wide.match(keys, (1 << 128) - 1)
        wide.not_held(keys, 70)
        self.best_unmatched(array("q", [0, 1]), array("d", bytes(96)), 1.0, 8.0, 0.1, 0.05, 8.0, 1)

    def mirror(self, words: int = 1) -> MaskMirror | WideMaskMirror:
        """A new, empty mirror of an index's block masks (:mod:`~kvevents.kernels.mask_mirror`)
        for ``64 * words`` holder slots."""
        return self._mirror_class() if words == 1 else self._wide_mirror_class(words)

    def chain_keys(self, tokens: array[int], block_size: int, parent: int) -> array[int] | None:
        """Content keys of ``tokens`` (an ``array("I")``) as an ``array("Q")``, or None
        when this is not a case the kernel takes (a block past 60 tokens, or too few
        blocks to gain anything)."""
        if not 0 < block_size <= self.max_block_tokens or len(tokens) < _FEW_BLOCKS * block_size:
            return None
        keys = array("Q", bytes(8 * (len(tokens) // block_size)))
        self._chain(tokens, block_size, self._signed64(parent), self._secret, keys)
        return keys

    def best_unmatched(
        self,
        slots: array[int],
        table: array[float],
        scale: float,
        n_blocks: float,
        load_weight: float,
        balance_weight: float,
        foreign_blocks: float,
        count: int,
    ) -> tuple[list[int], float]:
        """The positions of the best ``count`` candidates by load alone, best first,
        and the least recent work among the available ones
        (:func:`~kvevents.kernels.load_scan.best_unmatched`; ``slots`` an ``array("q")``,
        ``table`` the board's ``array("d")``)."""
        out = array("q", bytes(8 * count))
        kept, least = self._best_unmatched(  # floats all: one compiled signature
            slots,
            table,
            float(scale),
            float(n_blocks),
            float(load_weight),
            float(balance_weight),
            float(foreign_blocks),
            out,
        )
        return out[:kept].tolist(), least

    def parse_input_ids(
        self, body: bytes, lead: bytes | None = None
    ) -> tuple[array[int], int] | None:
        """The ids of a body that starts with a plain ``"input_ids"`` array, and the
        index of the ``,`` or ``}`` after it; None for any other body.

        ``lead``: instead of ``"input_ids"``, the bytes the body has between its ``{``
        (and whitespace) and the ``:`` of the array wanted, ending with that array's
        key; the caller must check that the key is a member of the object itself
        (:func:`kvevents.router.prompts.completion_body.token_prompt` does)."""
        if type(body) is not bytes:  # the one type the kernel was compiled for
            body = bytes(body)
        # The ids go into this thread's buffer, grown to the most the body can hold, and
        # leave it as one copy of exactly those read. A body too large to keep a buffer
        # for (4 MiB of ids: a 2 MiB body) gets one of its own, freed with it.
        room = len(body) // 2 + 1
        into: array[int] | None = getattr(self._local, "ids", None)
        if into is None or len(into) < room:
            into = array("I", bytes(4 * max(room, 4096)))
            if room <= _KEPT_IDS:
                self._local.ids = into
        count, end = self._parse(body, self._key if lead is None else lead, into)
        if end < 0:
            return None
        return into[:count], end


_KEPT_IDS = 1 << 20
"""The most token ids a thread's parse buffer keeps between requests."""

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
    """Say that this process will call :func:`load` soon (status ``waiting``); call it
    from the main thread."""
    global _status
    _one_blas_thread()
    with _lock:
        if _kernels is None and _status == _NOT_LOADED:
            _status = "waiting"


def _one_blas_thread() -> None:
    """numba imports NumPy, whose OpenBLAS starts a thread per core (less one) that the
    kernels never use; idle, they still wake now and then, in every router process. Set
    from the main thread only: changing the environment while another thread reads it
    is not safe in C."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


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
        if threading.current_thread() is threading.main_thread():
            _one_blas_thread()  # else will_load() did, on the main thread
        try:
            kernels = Kernels()
        except Exception as exc:  # no numba, or one that cannot compile here
            _status = f"off: {type(exc).__name__}: {exc}"
            log.warning("compiled kernels are off, the plain path serves: %s", _status)
            return None
        _kernels, _status = kernels, "compiled"
        return kernels

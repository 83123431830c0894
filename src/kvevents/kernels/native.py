"""The C extension ``_native``: a plain ``/route`` or ``/query``, or a relayed request's choice, in one call.

A ``/route`` of 2,048 tokens costs the router about 13 us past parsing its body, spread
over some 85 Python calls (keying, the compiled match's wrappers, the ranking, the
answer's JSON): most of what separates it from a server that only parses. The
extension does that whole answer in one call for the plain request (token ids, no
other member) while the loads hold still, byte for byte what the Python path answers:

* the chained XXH3-64 keys of every block (blocks of 1 to 60 tokens, as
  :mod:`~kvevents.kernels.xxh3_chain`);
* the match against the index's mirror of GPU masks (:mod:`~kvevents.kernels.mask_mirror`,
  one word: up to 64 holder slots), and against the same mirror of the predictions'
  masks when the router holds predictions (a block counts where either holds it);
* every candidate's score as :class:`~kvevents.router.decide.scoring.Ranking` computes it,
  from a plan of the ranking's figures (:mod:`kvevents.router.decide.native_route` makes it);
* the answer's JSON, numbers written as msgspec writes them; a float msgspec would
  write in exponent form (below 1e-4 or from 1e16) answers None instead, and the
  caller takes the Python path.

``/query`` is the same call without the scores (its answer lists every holder's match).
A relayed request (``/v1/completions``: every one changes the loads, so no ranking is
kept) has its holder chosen in one call too, ``board_choice``: the keys, both matches
and every candidate's score read from the load board's table, as
:func:`~kvevents.router.decide.load_board.board_top_scores` scores them (the best, or the
best few for a recorded ``/route``); the decision is then made in Python from their
figures.

It is built at install when a C compiler and Python's headers are there
(``setup.py``: an optional extension) and is only ever an acceleration: without it,
with ``KVEVENTS_NATIVE=0``, or for any other request, the Python path answers
(``tests/router/test_native_route.py`` checks both answer alike). It reads the mirrors the
numba kernels keep, so it is used only while those are loaded too.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

__all__ = ["ABI", "load", "status"]

ABI = 3
"""The version of the extension's calls this code makes (``_native.c``'s ``ABI``)."""

_module: ModuleType | None = None
_status = "off: not loaded in this process"


def load() -> ModuleType | None:
    """The extension module, or None when it is off (the reason is in :func:`status`)."""
    global _module, _status
    if _module is not None:
        return _module
    if os.environ.get("KVEVENTS_NATIVE", "1") == "0":
        _status = "off: KVEVENTS_NATIVE=0"
        return None
    if sys.byteorder != "little":  # it hashes tokens as their bytes
        _status = "off: a big-endian host"
        return None
    try:
        from kvevents.kernels import _native
    except ImportError as exc:
        _status = f"off: not built at install (no C compiler?): {exc}"
        return None
    built = getattr(_native, "ABI", None)
    if built != ABI:  # an in-place build left from another version of the source
        _status = (
            f"off: the built extension is of another version (ABI {built}, this code {ABI}): "
            "build it again (pip install .)"
        )
        return None
    _module, _status = _native, "built"
    return _module


def status() -> str:
    """``built`` or ``off: <why>`` (for /workers)."""
    return _status

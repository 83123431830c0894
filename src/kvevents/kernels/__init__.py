"""The native core: the router's per-request work in C, behind the Python that specifies it.

What a routing request costs past its HTTP parse is loops over thousands of token ids and
a hundred-odd blocks. One C extension, ``_native`` (``_native.c``, one header per
concern), runs them:

* ``parse_input_ids`` reads a body's leading plain token-id array into an ``array("I")``
  (``token_json.h``; anything else is decoded whole by msgspec, which words every error);
* ``chain_keys`` computes the chained content keys, exactly
  :func:`kvevents.wire.hashing.content_keys`, for blocks of up to ``MAX_BLOCK_TOKENS``
  tokens (``xxh3.h``); longer blocks are keyed with the xxhash package;
* ``MaskMirror`` mirrors the index's block masks in a flat hash table the index keeps in
  sync, and matches a request's keys in one call (``block_table.h``, ``mask_mirror.h``);
* ``best_unmatched`` picks the best holders from the load board's table (``load_scan.h``);
* ``route_answer``, ``query_answer`` and ``board_choice`` answer a plain ``/route`` or
  ``/query``, or choose a relayed request's holder, whole
  (:mod:`kvevents.router.decide.native_route`).

Invariants: every native call answers exactly what the Python path answers (the same
keys, ids, holders and answer bytes) or declines (None) and the Python path answers;
:mod:`~kvevents.kernels.spec` states the parts in Python, and the tests and
``scripts/fuzz-native`` (under AddressSanitizer and UBSan) hold the two equal. Importing
the extension is the whole load: nothing is compiled or cached at run time. Without it,
or with ``KVEVENTS_KERNELS=0``, :func:`loaded` is None and :func:`status` says why
(:mod:`~kvevents.kernels.native`); the answers are the same.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Protocol

from kvevents.kernels import native

__all__ = ["Kernels", "MaskMirror", "calls", "load", "loaded", "status"]


class MaskMirror(Protocol):
    """An index's GPU masks in the core's flat table (``MaskMirror`` in ``_native.pyi``)."""

    @property
    def words(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def grown(self) -> int: ...
    @property
    def rebuilds(self) -> int: ...
    def sync(self, keys: list[int], ops: array[int], /) -> None: ...
    def rebuild(self, blocks: dict[int, int], /) -> None: ...
    def match(self, keys: array[int], live: int, /) -> tuple[list[tuple[int, int]], int]: ...
    def not_held(self, keys: array[int], slot: int, /) -> list[int]: ...
    def items(self) -> list[tuple[int, int]]: ...


_Mirror = MaskMirror


class Kernels(Protocol):
    """What the callers use of the extension (the module itself; see ``_native.pyi``)."""

    MAX_BLOCK_TOKENS: int
    ROW_STRIDE: int

    @property
    def MaskMirror(self) -> Callable[[int], _Mirror]:
        """A new, empty mirror for ``64 * words`` holder slots."""

    def parse_input_ids(
        self, body: bytes, lead: bytes | None = None, /
    ) -> tuple[array[int], int] | None: ...

    def chain_keys(
        self, tokens: array[int], block_size: int, parent: int, /
    ) -> array[int] | None: ...

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
        /,
    ) -> tuple[list[int], float]: ...

    def calls(self) -> dict[str, int]: ...


def _found() -> tuple[Kernels | None, str]:
    module, why = native.find()
    if module is None:
        return None, why
    from kvevents.kernels import _native

    return _native, "compiled"


_kernels, _status = _found()


def loaded() -> Kernels | None:
    """The native core, or None when it is off (the reason is in :func:`status`)."""
    return _kernels


def load() -> Kernels | None:
    """:func:`loaded`: importing this package loads the core; kept for callers that ask."""
    return _kernels


def status() -> str:
    """``compiled`` (the core answers) or ``off: <why>`` (for /workers and /metrics)."""
    return _status


def calls() -> dict[str, int]:
    """Calls the core answered in this process, per kind (``parse``, ``keys``, ``sync``,
    ``match``, ``not_held``, ``scan``, ``route``, ``query``, ``choice``); empty when it
    is off (for /workers)."""
    return {} if _kernels is None else _kernels.calls()

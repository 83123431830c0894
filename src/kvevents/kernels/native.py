"""Loading the native core (``_native``), and saying what it answers in this process.

The extension is built at install when a C compiler and Python's headers are there
(``setup.py``: an optional extension). Importing it is its whole load: nothing is
compiled or cached at run time, so a read-only install answers natively from its first
request. Two switches turn it off, for comparison and as an escape hatch:

* ``KVEVENTS_KERNELS=0``: the whole core (every request parsed, keyed and matched in
  Python; :func:`find` answers None);
* ``KVEVENTS_NATIVE=0``: only the calls that answer a plain request whole
  (``route_answer``, ``query_answer``, ``board_choice``; :func:`load` is None), the parts
  stay on.

Without the extension, on a big-endian host (it hashes tokens as their bytes) or with an
extension built from other source (an in-place build left behind: :data:`ABI` differs),
the Python path answers; :func:`status` says why, for ``/workers``.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

__all__ = ["ABI", "built", "find", "load", "status"]

ABI = 5
"""The version of the extension's calls this code makes (``_native.c``'s ``ABI``)."""

_module: ModuleType | None = None
_status = "off: not loaded in this process"


def _imported() -> tuple[ModuleType | None, str]:
    """The extension as built, or None and why not."""
    try:
        from kvevents.kernels import _native
    except ImportError as exc:
        return None, f"off: not built at install (no C compiler?): {exc}"
    made = getattr(_native, "ABI", None)
    if made != ABI:
        return None, (
            f"off: the built extension is of another version (ABI {made}, this code {ABI}): "
            "build it again (pip install .)"
        )
    return _native, "loaded"


def built() -> bool:
    """Whether this install has the extension, of this code's version (on or off)."""
    return _imported()[0] is not None


def find() -> tuple[ModuleType | None, str]:
    """The extension for every native call and ``loaded``, or None and ``off: <why>``
    when the core is off (see the module docstring)."""
    if os.environ.get("KVEVENTS_KERNELS", "1") == "0":
        return None, "off: KVEVENTS_KERNELS=0"
    if sys.byteorder != "little":
        return None, "off: a big-endian host"
    return _imported()


def load() -> ModuleType | None:
    """The extension for the whole-request calls, or None when they are off (the reason
    is in :func:`status`)."""
    global _module, _status
    if _module is not None:
        return _module
    module, _status = find()
    if module is not None and os.environ.get("KVEVENTS_NATIVE", "1") == "0":
        module, _status = None, "off: KVEVENTS_NATIVE=0"
    _module = module
    return module


def status() -> str:
    """``loaded`` or ``off: <why>``, for the whole-request calls (for /workers)."""
    return _status

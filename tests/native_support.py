"""The native core for tests: required wherever a C compiler could build it.

A test of the native core skips only on a machine with no C compiler (the install then
goes on without the extension, and the Python path answers); anywhere else a core that
is off is a failure, so that a broken build never passes as a skipped one.

:class:`NativeSwitch` is the core's process-wide state: whether it is on (read from
``KVEVENTS_KERNELS`` when :mod:`kvevents.kernels` is imported) and the whole-request
calls :func:`kvevents.kernels.native.load` keeps once loaded (``KVEVENTS_NATIVE``). The
conftest puts it back after every test, so which path a test takes never depends on the
tests before it. It reads private names, for src offers no reset; a rename there fails
here by name rather than leaving the state unrestored.
"""

from __future__ import annotations

import shutil
import sysconfig
from dataclasses import dataclass
from types import ModuleType

import pytest

from kvevents import kernels
from kvevents.kernels import native

__all__ = ["NativeSwitch", "compiler", "native_core"]

_STATE = ((kernels, ("_kernels", "_status")), (native, ("_module", "_status")))
"""Where the switch lives: module, then its process-wide attributes."""


def compiler() -> str | None:
    """The C compiler Python's build would use, if it is on this machine."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) or shutil.which("cc") or shutil.which("gcc")


def native_core() -> kernels.Kernels:
    """The loaded core; skips the test where no compiler could have built it."""
    core = kernels.loaded()
    if core is None:
        if compiler() is None:
            pytest.skip(f"no C compiler here, so no native core: {kernels.status()}")
        pytest.fail(f"a C compiler is here but the native core is off: {kernels.status()}")
    return core


@dataclass(frozen=True)
class NativeSwitch:
    """The native core's process-wide state at one moment (see the module docstring)."""

    values: tuple[tuple[ModuleType, str, object], ...]

    @classmethod
    def read(cls) -> NativeSwitch:
        """The state now; fails naming the attribute if src no longer has it."""
        values = []
        for module, names in _STATE:
            for name in names:
                if not hasattr(module, name):
                    raise AssertionError(
                        f"{module.__name__}.{name} is gone: tests/native_support.py resets the "
                        "native core's switch through it; name its new place in _STATE"
                    )
                values.append((module, name, getattr(module, name)))
        return cls(tuple(values))

    def restore(self) -> None:
        """Put the state back as it was read."""
        for module, name, value in self.values:
            setattr(module, name, value)

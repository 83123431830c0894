"""The native core for tests: required wherever a C compiler could build it.

A test of the native core skips only on a machine with no C compiler (the install then
goes on without the extension, and the Python path answers); anywhere else a core that
is off is a failure, so that a broken build never passes as a skipped one.
"""

from __future__ import annotations

import shutil
import sysconfig

import pytest

from kvevents import kernels

__all__ = ["compiler", "native_core"]


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

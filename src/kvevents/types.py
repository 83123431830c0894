"""The small value types every layer shares: who holds a cache, an engine hash, and the
numeric bounds of settings.

They live at the bottom so that the index and the router can name a holder without
knowing about sockets, and the wire can name a hash without knowing about holders.

The bounds are ``Annotated`` types carrying a :class:`msgspec.Meta` constraint, declared
here once: library objects check their settings against them (:func:`check_bound`),
and the command line parses its options with them (:func:`bounded`), so a bound and
its wording cannot drift apart. Each Meta's ``description`` is the
wording of the error message ("must be <description>").
"""

from __future__ import annotations

import argparse
import enum
import sys
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple, TypeVar, get_args

import msgspec

__all__ = [
    "Hash",
    "Holder",
    "NonNegativeFloat",
    "NonNegativeInt",
    "Port",
    "PositiveFiniteFloat",
    "PositiveFloat",
    "PositiveInt",
    "StrEnum",
    "bound_description",
    "bounded",
    "check_bound",
]

T = TypeVar("T")


class StrEnum(str, enum.Enum):
    """An enum whose members are their string values: they compare equal to, print as,
    and encode to JSON (msgspec, ``json``) as the plain string, so a state can become an
    enum without changing any output. (:class:`enum.StrEnum` needs Python 3.11.)"""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


PositiveInt = Annotated[int, msgspec.Meta(ge=1, description="an integer >= 1")]
"""A count or size that cannot be zero: block size, ranks, blocks, requests."""
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0, description="an integer >= 0")]
"""An index that may be zero: a rank."""
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0, description="a number >= 0")]
"""A weight or a number of seconds that may be zero."""
PositiveFloat = Annotated[float, msgspec.Meta(gt=0, description="a number > 0")]
"""A rate, an interval or a timeout that must be above zero (``inf`` allowed)."""
PositiveFiniteFloat = Annotated[
    float, msgspec.Meta(gt=0, le=sys.float_info.max, description="a finite number > 0")
]
"""A positive number that must also be finite (a half-life)."""
Port = Annotated[
    int, msgspec.Meta(ge=0, le=65535, description="a port in 0..65535 (0: the OS picks)")
]
"""A TCP port; 0 asks the OS for a free one."""


def bound_description(bound: Any) -> str:
    """The wording of ``bound``'s constraint, e.g. ``"an integer >= 1"``."""
    meta = get_args(bound)[1]
    return str(meta.description)


def check_bound(value: T, bound: Any, name: str) -> T:
    """``value`` when it satisfies ``bound`` (one of this module's Annotated types); else
    ValueError ``"{name}={value!r} must be <description>"``. NaN satisfies no bound."""
    try:
        msgspec.convert(value, bound)
    except msgspec.ValidationError:
        raise ValueError(f"{name}={value!r} must be {bound_description(bound)}") from None
    return value


Hash = int | bytes
"""An engine block hash: int (signed or unsigned 64-bit) or 32 raw bytes."""


class Holder(NamedTuple):
    """One KV cache: the engine (URL or given name) and the data-parallel rank."""

    worker: str
    dp_rank: int


def bounded(bound: Any) -> Callable[[str], Any]:
    """An argparse ``type`` parsing an option's text into ``bound`` (an Annotated int or
    float of this module), refusing values outside it with the bound's wording."""
    base = get_args(bound)[0]
    wording = bound_description(bound)

    def parse(text: str) -> Any:
        try:
            return msgspec.convert(base(text), bound)
        except (ValueError, msgspec.ValidationError):
            raise argparse.ArgumentTypeError(f"{text}: must be {wording}") from None

    return parse

"""The public surface: one sorted __all__ in kvevents, every name importable."""

from __future__ import annotations

import kvevents


def test_all_is_sorted_and_unique() -> None:
    """kvevents.__all__ is sorted and has no duplicates, so additions are reviewed in place."""
    assert list(kvevents.__all__) == sorted(set(kvevents.__all__))


def test_every_exported_name_exists() -> None:
    """Every name in __all__ is an attribute of the package."""
    missing = [name for name in kvevents.__all__ if not hasattr(kvevents, name)]
    assert missing == []


def test_exported_objects_say_where_they_live() -> None:
    """Every exported class and function lives in a kvevents module (nothing re-exported from elsewhere)."""
    for name in kvevents.__all__:
        module = getattr(getattr(kvevents, name), "__module__", "kvevents")
        assert module.startswith("kvevents"), (name, module)

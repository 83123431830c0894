"""The public surface: one sorted __all__ in kvevents, every name importable."""

from __future__ import annotations

import importlib
import importlib.metadata
import types
import typing

import kvevents
import kvevents.errors


def test_all_is_sorted_and_unique() -> None:
    """kvevents.__all__ is sorted and has no duplicates, so additions are reviewed in place."""
    assert list(kvevents.__all__) == sorted(set(kvevents.__all__))


def test_every_exported_name_exists() -> None:
    """Every name in __all__ is an attribute of the package."""
    missing = [name for name in kvevents.__all__ if not hasattr(kvevents, name)]
    assert missing == []


def test_exported_objects_say_where_they_live() -> None:
    """Every exported class and function lives in a kvevents module (nothing re-exported
    from elsewhere); an exported type alias (a union) is made of kvevents classes or builtins."""
    for name in kvevents.__all__:
        obj = getattr(kvevents, name)
        if isinstance(obj, types.UnionType) or typing.get_origin(obj) is typing.Union:
            for member in typing.get_args(obj):
                assert member.__module__.startswith(("kvevents", "builtins")), (name, member)
            continue
        module = getattr(obj, "__module__", "kvevents")
        assert module.startswith("kvevents"), (name, module)


def test_the_names_a_user_needs_are_exported() -> None:
    """The item type of Subscriber.get, Router.begin's ticket, namespace_key and every error
    class of kvevents.errors are part of the public surface."""
    for name in ("Item", "Ticket", "namespace_key", "RouterNotReadyError"):
        assert name in kvevents.__all__
    errors = {
        name
        for name, obj in vars(kvevents.errors).items()
        if isinstance(obj, type) and issubclass(obj, BaseException)
    }
    assert errors <= set(kvevents.__all__)


def test_internals_live_in_their_subpackage() -> None:
    """Deployment helpers and bookkeeping types are not top-level names, but are still
    importable from their subpackage."""
    moved = {
        "kvevents.transport.endpoints": [
            "Endpoint",
            "PortPlan",
            "RankEndpoints",
            "free_port_range",
        ],
        "kvevents.subscribe": ["BlockSizeMismatch", "BlockSizes", "EngineStatus", "StreamStats"],
    }
    for module_name, names in moved.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert name not in kvevents.__all__
            assert hasattr(module, name), (module_name, name)


def test_version_comes_from_the_package_metadata() -> None:
    """kvevents.__version__ is the installed distribution's version, not a second copy."""
    assert kvevents.__version__ == importlib.metadata.version("kvevents")

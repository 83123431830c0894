"""Which engine serves which model, LoRA adapters included: the router's model catalog.

Each engine's models come, in this order of preference, from

1. ``model`` in its description (``--engine URL --model NAME[,NAME]``, or an engines
   file): base models only;
2. its ``GET /v1/models`` (vLLM and SGLang): every entry's ``id``, an entry whose
   ``parent`` names another model being a LoRA adapter of it;
3. its ``GET /server_info``: the simulated engine's ``served_model_names`` and
   ``lora_modules`` (``null`` names: it takes any model), else SGLang's
   ``served_model_name``.

An engine none of these tells about is a candidate for every request, so a router where
no engine has model information behaves as if models did not exist. A request's
``model`` (:meth:`Router.candidates <kvevents.router.decide.router.Router.candidates>`):
none, every engine; a served model, the engines serving it plus those without
information; a model no engine serves, with every engine's models known,
:class:`UnknownModelError` (404, listing the models); an adapter's name, the engines
serving it, and the request is keyed under the adapter (``lora=<name>``), as the engines'
events key its blocks (``lora_name`` in every ``BlockStored``). A vLLM that sends only
``lora_id`` keys an adapter by a number ``/v1/models`` does not list: its adapters'
blocks never match (a miss, never a wrong hit).

The router's ``GET /v1/models`` answers the union (:meth:`ModelCatalog.v1_models`) in
vLLM's shape, each model once, with the first engine's ``owned_by``, ``root`` and
``parent``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from kvevents.errors import KVEventsError

__all__ = [
    "EngineModels",
    "ModelCard",
    "ModelCatalog",
    "UnknownModelError",
    "models_from_names",
    "models_from_server_info",
    "models_from_v1_models",
]


class UnknownModelError(KVEventsError):
    """A request named a model no engine behind the router serves (answered 404)."""

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(
            f"The model `{model}` does not exist: the engines behind this router serve "
            f"{', '.join(served) or 'no model'}; see GET /v1/models"
        )
        self.model = model
        self.served = served


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    """One model an engine serves, as a ``/v1/models`` entry describes it."""

    id: str
    owned_by: str = "kvevents"
    root: str | None = None
    parent: str | None = None
    """The base model of a LoRA adapter; None for a base model."""
    max_model_len: int | None = None


class EngineModels(msgspec.Struct, frozen=True, kw_only=True):
    """The models one engine serves and where the router read them."""

    cards: tuple[ModelCard, ...]
    source: str
    """``described``, ``/v1/models`` or ``/server_info``."""

    def names(self) -> list[str]:
        return [c.id for c in self.cards]


def models_from_names(names: Iterable[str], source: str = "described") -> EngineModels | None:
    """Base models named by hand (``--model``); None for no names."""
    cards = tuple(ModelCard(id=n, root=n) for n in dict.fromkeys(names) if n)
    return EngineModels(cards=cards, source=source) if cards else None


def models_from_v1_models(body: Any) -> EngineModels | None:
    """An engine's ``GET /v1/models`` answer; None when it lists no usable model."""
    data = body.get("data") if isinstance(body, Mapping) else None
    if not isinstance(data, list):
        return None
    cards: dict[str, ModelCard] = {}
    for entry in data:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("id"), str):
            continue
        name = entry["id"]
        parent = entry.get("parent")
        length = entry.get("max_model_len")
        cards.setdefault(
            name,
            ModelCard(
                id=name,
                owned_by=str(entry.get("owned_by") or "unknown"),
                root=entry["root"] if isinstance(entry.get("root"), str) else None,
                parent=parent if isinstance(parent, str) and parent != name else None,
                max_model_len=length if isinstance(length, int) else None,
            ),
        )
    return EngineModels(cards=tuple(cards.values()), source="/v1/models") if cards else None


def models_from_server_info(info: Any) -> EngineModels | None:
    """The models a ``/server_info`` names (the simulated engine's, or SGLang's); None if none."""
    if not isinstance(info, Mapping):
        return None
    if "served_model_names" in info and info["served_model_names"] is None:
        return None  # a simulated engine started without model flags: it takes any model
    names = info.get("served_model_names")
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        single = info.get("served_model_name")
        names = [single] if isinstance(single, str) else []
    if not names:
        return None
    root = info.get("model_path")
    root = root if isinstance(root, str) else names[0]
    cards = [ModelCard(id=n, owned_by="sglang", root=root) for n in dict.fromkeys(names)]
    loras = info.get("lora_modules")
    for entry in loras if isinstance(loras, list) else ():
        if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            path = entry.get("path")
            cards.append(
                ModelCard(
                    id=entry["name"],
                    root=path if isinstance(path, str) else None,
                    parent=names[0],
                )
            )
    return EngineModels(cards=tuple(cards), source="/server_info")


class ModelCatalog:
    """Per worker (engine), the models it serves; see the module docstring.

    ``version`` grows with every change, so a caller may cache what it derives from it.
    """

    def __init__(self) -> None:
        self.by_worker: dict[str, EngineModels] = {}
        self.version = 0

    @property
    def known(self) -> bool:
        """True when at least one engine's models are known."""
        return bool(self.by_worker)

    def set(self, worker: str, models: EngineModels | None) -> bool:
        """Record (None: forget) ``worker``'s models; True when that changed them."""
        if self.by_worker.get(worker) == models:
            return False
        if models is None:
            del self.by_worker[worker]
        else:
            self.by_worker[worker] = models
        self.version += 1
        return True

    def names(self) -> list[str]:
        """Every model some engine serves, sorted."""
        return sorted({c.id for m in self.by_worker.values() for c in m.cards})

    def serves(self, worker: str, model: str) -> bool:
        """Whether ``worker`` may take a request for ``model`` (True without information)."""
        models = self.by_worker.get(worker)
        return models is None or any(c.id == model for c in models.cards)

    def adapter(self, model: str) -> bool:
        """Whether some engine lists ``model`` as a LoRA adapter (an entry with a parent)."""
        return any(
            c.id == model and c.parent is not None for m in self.by_worker.values() for c in m.cards
        )

    def v1_models(self) -> dict[str, Any]:
        """The union of every engine's models, in vLLM's ``/v1/models`` shape."""
        created = int(time.time())
        seen: dict[str, ModelCard] = {}
        for models in self.by_worker.values():
            for card in models.cards:
                seen.setdefault(card.id, card)
        data: list[dict[str, Any]] = [
            {
                "id": c.id,
                "object": "model",
                "created": created,
                "owned_by": c.owned_by,
                "root": c.root,
                "parent": c.parent,
                "max_model_len": c.max_model_len,
                "permission": [],
            }
            for c in sorted(seen.values(), key=lambda c: c.id)
        ]
        return {"object": "list", "data": data}

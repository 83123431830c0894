"""The models a simulated engine serves: its served names and its LoRA adapters, as vLLM has them.

``--served-model-name A --served-model-name B`` (or ``A,B``) serves one base model under
every name, the first being the one answers report (default :data:`DEFAULT_MODEL_NAME`);
``--lora-modules name=path ...`` adds adapters (the path is only reported: no weights),
with ids 1, 2, ... in the order given, as vLLM's ``lora_int_id``.

:meth:`ServedModels.resolve` maps a request's ``model`` (absent: the base model): a
served name is the base model, an adapter's name that adapter, anything else raises
:class:`UnknownModel` (404 in OpenAI's shape, listing what is served). An engine started
with neither flag is not :attr:`~ServedModels.configured`: it takes any ``model`` as its
base model and its ``/server_info`` says ``served_model_names: null``, so a router treats
it as a candidate for every model.

What each side sees: ``GET /v1/models`` in vLLM's shape (:meth:`ServedModels.v1_models`);
``/server_info``'s ``served_model_name``, ``served_model_names`` and ``lora_modules``; and
an adapter request's KV events carry ``lora_name`` and ``lora_id`` (and, with the vLLM
hash scheme, the adapter's name in every block's ``extra_keys``, :mod:`kvevents.engine.cache`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvevents.errors import ConfigError, KVEventsError

__all__ = [
    "DEFAULT_MODEL_NAME",
    "LoraModule",
    "ServedModels",
    "UnknownModel",
    "lora_keys",
    "parse_lora_modules",
    "parse_served_model_names",
]

DEFAULT_MODEL_NAME = "kvevents-sim"
"""The served name when ``--served-model-name`` is not given."""


class UnknownModel(KVEventsError):
    """A request named a model this engine does not serve (answered 404)."""


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One adapter: the name requests give as ``model``, its path, its integer id."""

    name: str
    path: str
    id: int


def lora_keys(lora: LoraModule) -> dict[str, Any]:
    """What :meth:`kvevents.engine.cache.PrefixCache.admit` takes to run under ``lora``."""
    return {"lora_name": lora.name, "lora_id": lora.id}


def parse_served_model_names(values: Sequence[str] | None) -> tuple[str, ...]:
    """``--served-model-name`` values (each may be a comma list), duplicates dropped;
    none given: :data:`DEFAULT_MODEL_NAME`."""
    names: list[str] = []
    for value in values or ():
        for name in value.split(","):
            name = name.strip()
            if not name:
                raise ConfigError(
                    f"--served-model-name {value!r} holds an empty name; give names like "
                    "--served-model-name llama,llama-8b"
                )
            if name not in names:
                names.append(name)
    return tuple(names) or (DEFAULT_MODEL_NAME,)


def parse_lora_modules(values: Sequence[str] | None) -> tuple[LoraModule, ...]:
    """``--lora-modules name=path ...`` values as adapters with ids 1, 2, ... in order."""
    modules: list[LoraModule] = []
    for value in values or ():
        name, sep, path = value.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ConfigError(
                f"--lora-modules {value!r} is not name=path; write e.g. "
                "--lora-modules sql-lora=/models/sql-lora (the path may be a dummy)"
            )
        if any(m.name == name for m in modules):
            raise ConfigError(f"--lora-modules names the adapter {name!r} twice; name each once")
        modules.append(LoraModule(name=name, path=path, id=len(modules) + 1))
    return tuple(modules)


@dataclass(frozen=True)
class ServedModels:
    """The engine's served names (the first is the base model's name) and its adapters."""

    names: tuple[str, ...] = (DEFAULT_MODEL_NAME,)
    loras: tuple[LoraModule, ...] = ()
    configured: bool = False
    """True when names or adapters were given: only they are served. False: any
    ``model`` is the base model (see the module docstring)."""

    def __post_init__(self) -> None:
        if not self.names:
            raise ConfigError("an engine serves at least one model name")
        clash = sorted({m.name for m in self.loras} & set(self.names))
        if clash:
            raise ConfigError(
                f"--lora-modules {', '.join(clash)}: an adapter cannot share a name with "
                "--served-model-name; rename the adapter"
            )

    @property
    def base(self) -> str:
        """The name answers report for base-model requests."""
        return self.names[0]

    def all_names(self) -> list[str]:
        """Every name a request may give: the served names, then the adapters."""
        return [*self.names, *(m.name for m in self.loras)]

    def resolve(self, model: Any) -> LoraModule | None:
        """The adapter ``model`` names, None for the base model; :class:`UnknownModel` else."""
        if model is None or model in self.names:
            return None
        if not self.configured:
            return None
        for module in self.loras:
            if module.name == model:
                return module
        raise UnknownModel(
            f"The model `{model}` does not exist: this engine serves {', '.join(self.all_names())}"
        )

    def v1_models(self, max_model_len: int) -> dict[str, Any]:
        """``GET /v1/models`` in vLLM's shape."""
        created = int(time.time())

        def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "kvevents",
                "root": root,
                "parent": parent,
                "max_model_len": max_model_len,
                "permission": [],
            }

        data = [card(name, self.base, None) for name in self.names]
        data += [card(m.name, m.path, self.base) for m in self.loras]
        return {"object": "list", "data": data}

    def server_info(self) -> dict[str, Any]:
        """The ``/server_info`` fields describing the models."""
        return {
            "served_model_name": self.base,
            "served_model_names": list(self.names) if self.configured else None,
            "lora_modules": [{"name": m.name, "path": m.path, "id": m.id} for m in self.loras],
        }

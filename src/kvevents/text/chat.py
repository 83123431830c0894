"""The simulated engine's chat template: OpenAI chat messages to one prompt string.

Real engines render ``messages`` with the model's Jinja chat template; the simulated
engine has one fixed template, small enough to state here::

    <|system|>\\nYou are terse.<|end|>\\n<|user|>\\nHi<|end|>\\n<|assistant|>\\n

Each message is ``<|{role}|>\\n{content}<|end|>\\n``; ``add_generation_prompt`` (the
default) appends ``<|assistant|>\\n``; ``continue_final_message`` leaves the last
message open (no ``<|end|>``) so the model continues it. Setting both is refused, as
vLLM refuses it.

The property that makes prefix caching (and so KV-aware routing) work for
conversations holds: the prompt of turn k, followed by the assistant's reply and the
next user message, is the prompt of turn k + 1, so each turn starts with the blocks the
previous one left cached.

``content`` is a string, ``null`` (an assistant turn that only called tools), or a list
of OpenAI content parts of type ``text``, joined with no separator. Anything else is a
:class:`ChatError` that names the message and the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvevents.errors import KVEventsError

__all__ = ["ChatError", "render_chat"]

_GENERATION_PROMPT = "<|assistant|>\n"
_END = "<|end|>\n"


class ChatError(KVEventsError, ValueError):
    """The messages cannot be rendered; the message says which one and why."""


def render_chat(
    messages: Any, *, add_generation_prompt: bool = True, continue_final_message: bool = False
) -> str:
    """The prompt for ``messages`` (see the module docstring); ChatError for bad input."""
    if add_generation_prompt and continue_final_message:
        raise ChatError(
            "add_generation_prompt and continue_final_message cannot both be true: "
            "set add_generation_prompt to false to continue the final message"
        )
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects")
    parts: list[str] = []
    last = len(messages) - 1
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatError(f"messages[{i}].role must be a non-empty string")
        text = _content_text(message.get("content"), i)
        parts.append(f"<|{role}|>\n{text}")
        if not (continue_final_message and i == last):
            parts.append(_END)
    if add_generation_prompt:
        parts.append(_GENERATION_PROMPT)
    return "".join(parts)


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ChatError(
                    f"messages[{index}].content[{j}] must be a text part "
                    '{"type": "text", "text": "..."}; the simulated engine reads text only'
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ChatError(f"messages[{index}].content must be a string, null, or a list of text parts")

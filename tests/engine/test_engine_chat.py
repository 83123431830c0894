"""Chat: the simulated engine's template, /v1/chat/completions and /tokenize with messages."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from engine_support import Engine, stream_events

from kvevents.text.chat import ChatError, render_chat

KV_CONFIG = {"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}

SYSTEM = {"role": "system", "content": "You are terse."}


def test_template_renders_each_message_then_the_generation_prompt() -> None:
    """Messages become <|role|>\\ncontent<|end|>\\n, with <|assistant|>\\n appended by default."""
    text = render_chat([SYSTEM, {"role": "user", "content": "Hi"}])
    assert text == "<|system|>\nYou are terse.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    assert render_chat([{"role": "user", "content": parts}], add_generation_prompt=False) == (
        "<|user|>\nHello<|end|>\n"
    )
    open_ended = render_chat(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert open_ended == "<|user|>\nHi<|end|>\n<|assistant|>\nHel"


def test_each_turn_extends_the_previous_turns_prompt() -> None:
    """Turn k's prompt is a prefix of turn k+1's: the property prefix caching relies on."""
    turn1 = [SYSTEM, {"role": "user", "content": "What is a KV cache?"}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "Saved keys."},
        {"role": "user", "content": "Why?"},
    ]
    assert render_chat(turn2).startswith(render_chat(turn1))


@pytest.mark.parametrize(
    ("messages", "flags", "message"),
    [
        ([], {}, "non-empty list"),
        ("hi", {}, "non-empty list"),
        (["hi"], {}, "messages[0] must be an object"),
        ([{"content": "x"}], {}, "messages[0].role"),
        ([{"role": "user", "content": 5}], {}, "messages[0].content must be"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "messages[0].content[0]"),
        ([SYSTEM], {"continue_final_message": True}, "cannot both be true"),
    ],
)
def test_bad_messages_are_refused_naming_the_field(
    messages: Any, flags: dict[str, bool], message: str
) -> None:
    """Each malformed conversation raises ChatError naming the message and field at fault."""
    with pytest.raises(ChatError, match=re.escape(message)):
        render_chat(messages, **flags)


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine(["--dp-size", "2", "--page-size", "4", "--max-blocks", "256"], KV_CONFIG)


def test_chat_completion_reuses_the_previous_turn_on_the_same_rank(engine: Engine) -> None:
    """A second turn sent to the same rank reports the first turn's prompt pages as cached."""
    turn1 = [SYSTEM, {"role": "user", "content": "Name three prime numbers, please."}]
    first = engine.http.post(
        "/v1/chat/completions",
        json={"messages": turn1, "max_tokens": 2},
        headers={"X-data-parallel-rank": "1"},
    )
    assert first.status_code == 200, first.text
    answer = first.json()
    assert answer["object"] == "chat.completion" and answer["dp_rank"] == 1
    assert answer["choices"][0]["message"]["role"] == "assistant"
    prompt_tokens = len(render_chat(turn1).encode())
    assert answer["usage"]["prompt_tokens"] == prompt_tokens
    reply = answer["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}]
    second = engine.http.post(
        "/v1/chat/completions",
        json={"messages": turn2, "max_completion_tokens": 1},
        headers={"X-data-parallel-rank": "1"},
    )
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == prompt_tokens // 4 * 4  # every full page of turn 1
    assert second.json()["usage"]["completion_tokens"] == 1


def test_chat_streaming_sends_the_role_then_one_delta_per_token(engine: Engine) -> None:
    """A streamed chat answer opens with the assistant role, then deltas, usage and [DONE]."""
    request = {
        "messages": [{"role": "user", "content": "stream please"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, chunks = stream_events(engine.http, "/v1/chat/completions", request)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:4]]
    assert deltas == ["a", "b", "c"]
    assert chunks[3]["choices"][0]["finish_reason"] == "length"
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["completion_tokens"] == 3


def test_tokenize_takes_messages_as_vllm_does(engine: Engine) -> None:
    """/tokenize with messages renders the template (generation prompt unless told otherwise)."""
    messages = [{"role": "user", "content": "count me"}]
    for flags in ({}, {"add_generation_prompt": False}):
        answer = engine.http.post("/tokenize", json={"messages": messages, **flags}).json()
        assert answer["tokens"] == list(render_chat(messages, **flags).encode())
        assert answer["count"] == len(answer["tokens"])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": []}, "non-empty list"),
        (
            {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"},
            "true or false",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
    ],
)
def test_bad_chat_requests_are_400_in_openai_shape(
    engine: Engine, body: dict[str, Any], message: str
) -> None:
    """Malformed chat bodies answer 400 with OpenAI's error object naming the field."""
    for path in ("/v1/chat/completions", "/tokenize"):
        if path == "/tokenize" and "max_tokens" in body:
            continue
        response = engine.http.post(path, json=body)
        assert response.status_code == 400
        assert message in response.json()["error"]["message"]

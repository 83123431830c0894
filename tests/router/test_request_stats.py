"""What the router reads of an engine's answer for its metrics: prompt and cached tokens."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvevents.router.serve.request_stats import engine_usage, engine_usage_of_json

_ANSWERS = [
    (
        {
            "id": "cmpl-1",
            "choices": [{"index": 0, "text": "a long answer " * 50, "logprobs": None}],
            "usage": {"prompt_tokens": 2048, "prompt_tokens_details": {"cached_tokens": 2032}},
        },
        (2048, 2032),
    ),
    ({"usage": {"prompt_tokens": 5, "prompt_tokens_details": None}}, None),  # vLLM without details
    ({"prompt_tokens": 4, "cached_tokens": 2, "text": "x"}, (4, 2)),  # /generate
    ({"meta_info": {"prompt_tokens": 4, "cached_tokens": 1}, "text": "x"}, (4, 1)),  # SGLang
    ({"usage": None, "prompt_tokens": 4, "cached_tokens": 2}, (4, 2)),
    ({"usage": {"prompt_tokens": "5"}, "prompt_tokens": 4, "cached_tokens": 2}, None),
    ({"choices": []}, None),
    ([1, 2], None),
    ("text", None),
]


@pytest.mark.parametrize(("answer", "usage"), _ANSWERS)
def test_usage_read_from_the_json_text_equals_the_decoded_answers(
    answer: object, usage: tuple[int, int] | None
) -> None:
    text = json.dumps(answer).encode()
    assert engine_usage(msgspec.json.decode(text)) == usage
    assert engine_usage_of_json(text) == usage


@pytest.mark.parametrize("text", [b"", b"{not json", b'{"usage": {"prompt_tokens": 1}'])
def test_an_answer_that_is_not_json_has_no_usage(text: bytes) -> None:
    assert engine_usage_of_json(text) is None

"""The relay's completions fast path reads exactly what decoding the whole body reads.

:func:`kvevents.router.prompts.completion_body.token_prompt` is only an acceleration: for every
body it takes, its token ids and fields must equal those of the whole decode
(``prompts_of`` on the decoded dict); every body it does not take gives None, so the
relay decodes it whole and refuses it in the same words as before.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvevents import kernels
from kvevents.router.prompts.completion_body import RelayFields, _beside_the_prompt, token_prompt
from kvevents.router.serve.relay_answer import OpenAIError
from kvevents.router.serve.relay_body import _with_rank, prompts_of

U32 = 2**32 - 1


@pytest.fixture(scope="module", autouse=True)
def compiled() -> kernels.Kernels:
    loaded = kernels.load()
    assert loaded is not None, f"the kernels did not load: {kernels.status()}"
    return loaded


def _whole(raw: bytes) -> tuple[list[int], RelayFields]:
    body = msgspec.json.decode(raw)
    (prompt,) = prompts_of(body)
    assert isinstance(prompt, list)
    return prompt, RelayFields.of(body)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, U32), min_size=1, max_size=300),
    model=st.none() | st.text(max_size=8) | st.integers(),
    salt=st.none() | st.text(max_size=8),
    stream=st.none() | st.booleans() | st.integers(0, 1),
    extra=st.dictionaries(
        st.text(max_size=6).filter(lambda k: k not in {"prompt", "model", "cache_salt", "stream"}),
        json_values,
        max_size=3,
    ),
    indent=st.sampled_from([None, 1]),
)
def test_token_prompt_equals_the_whole_decode(
    ids: list[int], model: Any, salt: Any, stream: Any, extra: dict[str, Any], indent: int | None
) -> None:
    doc: dict[str, Any] = {**extra, "model": model, "prompt": ids, "max_tokens": 1}
    if salt is not None:
        doc["cache_salt"] = salt
    if stream is not None:
        doc["stream"] = stream
    raw = json.dumps(doc, indent=indent).encode()
    fast = token_prompt(raw)
    assert fast is not None
    tokens, fields = fast
    want_tokens, want_fields = _whole(raw)
    assert list(tokens) == want_tokens
    assert fields == want_fields
    beside = _beside_the_prompt(kernels.loaded(), raw)  # the usual case's own path
    # an escape (json.dumps writes them for text), or "prompt" as a value before the key
    # (a model or salt named "prompt"): it may decline, and the body is read the slower way
    if b"\\u" in raw or raw.count(b'"prompt"') > 1:
        assume(beside is not None)
    assert beside is not None
    assert list(beside[0]) == want_tokens and beside[1] == want_fields


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "text is tokenized by the whole path"}',
        b'{"prompt": [[1, 2], [3]]}',  # a batch
        b'{"prompt": ["a", "b"]}',
        b'{"prompt": []}',
        b'{"prompt": [1, -2]}',
        b'{"prompt": [1, 4294967296]}',
        b'{"prompt": [1.5]}',
        b'{"prompt": [1, 2e3]}',
        b'{"prompt": [01]}',
        b'{"prompt": [1, true]}',
        b'{"prompt": {"a": 1}}',
        b'{"prompt": null}',
        b'{"model": "m"}',  # no prompt
        b'{"meta": {"prompt": [9]}}',  # a "prompt" array, but not the body's own
        b'{"prompt": [9], "prompt": 0}',  # the last prompt counts: not a list
        b'{"prompt": [9], "pr\\u006fmpt": 0}',  # the same, its key escaped
        b'{"prompt": [1, 2]',  # not JSON
        b'[{"prompt": [1]}]',  # not an object
        b'{"prompt": [1, 2], "model": }',
        b"",
    ],
)
def test_bodies_it_does_not_take_go_to_the_whole_decode(raw: bytes) -> None:
    assert token_prompt(raw) is None


def test_the_whole_decode_refuses_what_the_fast_path_leaves() -> None:
    """The words come from the whole path (a negative id, an empty list)."""
    for raw in (b'{"prompt": [1, -2]}', b'{"prompt": []}'):
        assert token_prompt(raw) is None
        with pytest.raises(OpenAIError, match="prompt"):
            prompts_of(msgspec.json.decode(raw))


def test_a_repeated_prompt_key_reads_as_the_whole_decode_reads_it() -> None:
    raw = b'{"prompt": [1, 2, 3], "prompt": [7, 8]}'
    fast = token_prompt(raw)
    assert fast is not None
    assert list(fast[0]) == _whole(raw)[0] == [7, 8]  # the last one, as a dict keeps it
    assert token_prompt(b'{"prompt": [1, 2, 3], "prompt": "text"}') is None


@pytest.mark.parametrize(
    "raw",
    [
        b'{"meta": {"prompt": [9]}, "prompt": [1, 2]}',  # a nested "prompt" first
        b'{"x": "\\"prompt", "prompt": [1, 2]}',  # a string ending in "prompt
        b'{"suffix": "a \\"prompt\\"", "prompt": [1, 2]}',
        b'{"prompt": [9], "pr\\u006fmpt": [1, 2]}',  # the same key again, escaped
        b'{"prompt": [9], "prompt": [1, 2]}',
        b'{"prompt": [9], "x": {"prompt": 0}, "prompt": [1, 2]}',
        b' \n{ "prompt" : [1, 2] , "model": "m"}\n',
    ],
)
def test_the_text_search_for_the_prompt_never_reads_another_member(raw: bytes) -> None:
    """The kernel reads the array after the first ``"prompt"`` in the text: where that
    is not the object's own prompt, the body is read the slower way, and both give the
    whole decode's ids (or neither takes it)."""
    beside = _beside_the_prompt(kernels.loaded(), raw)
    fast = token_prompt(raw)
    assert fast is not None
    want = _whole(raw)
    assert (list(fast[0]), fast[1]) == want
    if beside is not None:
        assert (list(beside[0]), beside[1]) == want


@pytest.mark.parametrize(
    "raw",
    [
        b'{"x": "\\"prompt": [1, 2], "y": 1}',  # not JSON, though the array parses
        b'{"prompt": [1, 2], "model": }',
        b'{"prompt": [1, 2],, "model": "m"}',
        b'{"prompt": [1, 2]] }',
    ],
)
def test_a_body_that_is_not_json_is_never_taken(raw: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(raw)
    assert _beside_the_prompt(kernels.loaded(), raw) is None
    assert token_prompt(raw) is None


def test_with_rank_decodes_the_body_itself_when_it_must() -> None:
    """The fast path passes no decoded body: a body naming a rank key is decoded then."""
    raw = b'{"prompt": [1, 2], "data_parallel_rank": 3}'
    assert msgspec.json.decode(_with_rank(raw, None, 1, True)) == {
        "prompt": [1, 2],
        "routed_dp_rank": 1,
    }
    plain = b'{"prompt": [1, 2]} '
    assert _with_rank(plain, None, 2, False) == b'{"prompt": [1, 2],"routed_dp_rank":2}'


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": [1, 2], "routed_dp_rank": 3}',
        b'{"prompt": [1, 2], "data_parallel_rank": null}',
        b'{"prompt": [1, 2], "routed\\u005fdp_rank": 3}',  # the same key, escaped
        b'{"prompt": [1, 2], "data_parallel_ran\\u006b": 0}',
    ],
)
def test_a_named_rank_is_seen_however_spelled_and_the_body_rewritten(raw: bytes) -> None:
    """Appending the rank to a body naming one would give a repeated key (each engine
    then reads its own): both decoders see the rank key, and the body is rewritten."""
    fast = token_prompt(raw)
    assert fast is not None and fast[1].names_rank
    assert _whole(raw)[1].names_rank
    sent = _with_rank(raw, None, 1, fast[1].names_rank)
    assert sent.count(b"rank") == 1
    assert msgspec.json.decode(sent) == {"prompt": [1, 2], "routed_dp_rank": 1}


def test_without_kernels_nothing_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_kernels", None)
    assert token_prompt(b'{"prompt": [1, 2]}') is None

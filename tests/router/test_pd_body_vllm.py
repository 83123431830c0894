"""vLLM's P/D legs spliced into the client's bytes mean exactly the legs rebuilt from its decode.

A spliced leg may repeat a member the leg overrides (``stream``, ``max_tokens``,
``max_completion_tokens``, ``kv_transfer_params``); a JSON parser that keeps the last of
repeated keys (Python's ``json``, which vLLM's server uses, and msgspec, which ours
uses) must then read the leg :func:`vllm_prefill_body` / :func:`vllm_decode_body`
build, members in the same order. A body with a member the prefill leg removes is not
spliced. Pure functions, no sockets.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import kernels
from kvevents.router.serve.pd_body import (
    PlainFields,
    read_plain,
    transfer_params,
    vllm_decode_bytes,
    vllm_prefill_bytes,
)
from kvevents.router.serve.pd_legs import vllm_decode_body, vllm_prefill_body

U32 = 2**32 - 1
OVERRIDDEN = ("stream", "max_tokens", "max_completion_tokens", "kv_transfer_params")
DROPPED = ("stream_options", "min_tokens")


@pytest.fixture(scope="module", autouse=True)
def compiled() -> kernels.Kernels:
    loaded = kernels.load()
    assert loaded is not None, f"the kernels did not load: {kernels.status()}"
    return loaded


def _fields(raw: bytes) -> PlainFields:
    read = read_plain(raw, b'"prompt"')
    assert read is not None
    return read[1]


def _read(leg: bytes) -> str:
    """A leg as the engine reads it (the last of repeated keys, at the first one's place),
    written out canonically so that types count (``1`` is not ``1.0`` nor ``true``)."""
    python = json.dumps(json.loads(leg))
    assert json.dumps(msgspec.json.decode(leg)) == python  # our engine reads it alike
    return python


def test_a_plain_body_gets_its_overrides_appended_after_its_own_members() -> None:
    """The client's ``max_tokens`` and ``stream`` stay in its bytes and the leg's come
    after them, so they win; the leg reads as the rebuilt one, member order included."""
    raw = b'{"model": "m", "prompt": [5, 6, 7], "max_tokens": 16, "stream": true}'
    prefill = vllm_prefill_bytes(raw, _fields(raw))
    assert prefill.startswith(raw[:-1])
    assert prefill.count(b'"max_tokens"') == 2 and prefill.count(b'"stream"') == 2
    assert _read(prefill) == json.dumps(vllm_prefill_body(json.loads(raw)))


def test_members_already_as_the_leg_sets_them_are_not_repeated() -> None:
    """``"stream": false``, ``"max_tokens": 1`` and ``"max_completion_tokens": 1`` are
    what the prefill leg sets: left where the client put them, not appended."""
    raw = b'{"prompt": [1], "stream": false, "max_tokens": 1, "max_completion_tokens": 1}'
    prefill = vllm_prefill_bytes(raw, _fields(raw))
    for key in (b'"stream"', b'"max_tokens"', b'"max_completion_tokens"'):
        assert prefill.count(key) == 1, key
    assert _read(prefill) == json.dumps(vllm_prefill_body(json.loads(raw)))


@pytest.mark.parametrize("key", DROPPED)
def test_a_member_the_prefill_removes_means_the_prefill_is_rebuilt(key: str) -> None:
    """Appending cannot remove a member: a body with ``stream_options`` or ``min_tokens``
    (however its key is spelled) is marked for the rebuild."""
    assert _fields(json.dumps({"prompt": [1], key: None}).encode()).vllm_drops
    assert not _fields(b'{"prompt": [1], "max_tokens": 3}').vllm_drops


@pytest.mark.parametrize(
    ("answer", "params"),
    [
        (b'{"id": "x", "kv_transfer_params": {"remote_host": "h"}}', b'{"remote_host": "h"}'),
        (b'{"kv_transfer_params": null, "choices": []}', b""),
        (b'{"choices": []}', b""),
        (b"[1, 2]", b""),  # JSON, not an object: no parameters, as the dict path reads it
        (b'{"kv_transfer_params": 1, "kv_transfer_params": [2]}', b"[2]"),  # the last one
    ],
)
def test_transfer_params_are_the_answers_own_json(answer: bytes, params: bytes) -> None:
    """The prefill answer's ``kv_transfer_params`` as it came; nothing when it has none."""
    assert transfer_params(answer) == params


@pytest.mark.parametrize("answer", [b"{not json", b"[1, 2", b'{"kv_transfer_params": }'])
def test_an_answer_that_is_not_json_is_an_error(answer: bytes) -> None:
    """An answer that is not JSON raises, as the whole decode does (the relay words it)."""
    with pytest.raises(msgspec.DecodeError):
        transfer_params(answer)


def test_a_decode_leg_without_parameters_is_the_clients_body_as_it_came() -> None:
    """No ``kv_transfer_params`` answered (a connector sharing storage): the client's bytes."""
    raw = b'{"prompt": [1, 2], "kv_transfer_params": {"mine": 1}} '
    assert vllm_decode_bytes(raw, b"") is raw


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
member_values = st.sampled_from([1, 1.0, True, False, None, 0, 16]) | json_values
member_keys = st.sampled_from(["model", "n", "x", *OVERRIDDEN, *DROPPED]) | st.text(max_size=6)


@settings(max_examples=400, deadline=None)
@given(
    ids=st.lists(st.integers(0, U32), min_size=1, max_size=100),
    extra=st.lists(st.tuples(member_keys, member_values), max_size=6),
    before=st.integers(0, 6),
    indent=st.sampled_from([None, 1]),
    answer=st.none()
    | st.just([1])
    | st.dictionaries(st.sampled_from(["id", "x"]), json_values)
    | st.fixed_dictionaries({"kv_transfer_params": st.none() | json_values}),
)
def test_spliced_vllm_legs_read_as_the_rebuilt_legs(
    ids: list[int],
    extra: list[tuple[str, Any]],
    before: int,
    indent: int | None,
    answer: Any,
) -> None:
    """Any body read plain, its members given any values and any of them repeated: a
    prefill leg spliced (when nothing is to be removed) and a decode leg spliced with any
    prefill answer read, as the engine reads them, the legs rebuilt from the decode."""
    pairs = [(k, v) for k, v in extra if k != "prompt"]
    pairs.insert(min(before, len(pairs)), ("prompt", ids))
    text = ",".join(f"{json.dumps(k)}: {json.dumps(v, indent=indent)}" for k, v in pairs)
    raw = ("{" + text + "}").encode()
    read = read_plain(raw, b'"prompt"')
    if read is None:  # an escape in the text: the whole decode
        assert b"\\u" in raw
        return
    tokens, fields = read
    assert list(tokens) == ids
    doc = json.loads(raw)  # the relay's whole decode reads repeated keys the same way
    assert fields.vllm_drops == any(k in doc for k in DROPPED)
    if not fields.vllm_drops:
        prefill = vllm_prefill_bytes(raw, fields)
        assert _read(prefill) == json.dumps(vllm_prefill_body(doc))
    answered = json.dumps(answer).encode()
    decode = vllm_decode_bytes(raw, transfer_params(answered))
    assert _read(decode) == json.dumps(vllm_decode_body(doc, json.loads(answered)))

"""The P/D relay's plain bodies: read without decoding the prompt, legs spliced into bytes.

What :func:`plain_request` reads must be what the whole decode reads, and a spliced leg
must decode to exactly the dict leg :func:`sglang_legs` builds (same members, same
order); every body it cannot read that way must be left to the whole decode. Pure
functions, no sockets.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import kernels
from kvevents.router.serve.bodies import pinned_bytes, spliced
from kvevents.router.serve.pd_body import PlainFields, read_plain, sglang_leg_bytes
from kvevents.router.serve.pd_legs import pinned_body, sglang_legs
from kvevents.router.serve.pd_read import PDRequest, plain_request
from kvevents.router.serve.pd_request import Endpoint
from kvevents.router.serve.relay_answer import OpenAIError

U32 = 2**32 - 1
LEG_KEYS = (
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "stream_options",
)


@pytest.fixture(scope="module", autouse=True)
def compiled() -> kernels.Kernels:
    loaded = kernels.load()
    assert loaded is not None, f"the kernels did not load: {kernels.status()}"
    return loaded


def _legs(raw: bytes, rooms: int | list[int] = 77) -> tuple[bytes, bytes]:
    read = read_plain(raw, b'"prompt"')
    assert read is not None
    return sglang_leg_bytes(
        raw, read[1], host="10.0.0.5", port=8998, rooms=rooms, prefill_rank=1, decode_rank=3
    )


def _dict_legs(raw: bytes, rooms: int | list[int] = 77) -> tuple[dict[str, Any], dict[str, Any]]:
    return sglang_legs(
        json.loads(raw), host="10.0.0.5", port=8998, rooms=rooms, prefill_rank=1, decode_rank=3
    )


def _items(leg: bytes | dict[str, Any]) -> Any:
    """A JSON object's members as its text gives them, in order, a repeated one twice
    (a leg given as a dict: as it encodes)."""
    raw = json.dumps(leg).encode() if isinstance(leg, dict) else leg
    return json.loads(raw, object_pairs_hook=list)


def test_a_plain_completion_is_read_and_its_legs_spliced_as_the_dict_legs() -> None:
    """Ids and members are read; each spliced leg decodes to the dict leg, member order
    included, with the client's bytes kept as they came."""
    raw = b'{"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}'
    read = read_plain(raw, b'"prompt"')
    assert read is not None
    tokens, fields = read
    assert list(tokens) == [5, 6, 7] and fields.model == "m" and not fields.leg_keys
    prefill, decode = _legs(raw)
    want_prefill, want_decode = _dict_legs(raw)
    assert _items(prefill) == _items(want_prefill)
    assert _items(decode) == _items(want_decode)
    assert prefill.startswith(raw[:-1]) and decode.startswith(raw[:-1])


def test_a_stream_of_false_stays_where_the_client_put_it() -> None:
    """``"stream": false`` is what the prefill leg sets anyway: spliced, not repeated."""
    raw = b'{"prompt": [1, 2], "stream": false, "n": 2}'
    prefill, decode = _legs(raw, rooms=[8, 9])
    assert prefill.count(b'"stream"') == 1 and decode.count(b'"stream"') == 1
    want_prefill, want_decode = _dict_legs(raw, rooms=[8, 9])
    assert _items(prefill) == _items(want_prefill)
    assert _items(decode) == _items(want_decode)


@pytest.mark.parametrize("key", LEG_KEYS)
def test_a_member_the_legs_set_or_drop_means_the_legs_are_rebuilt(key: str) -> None:
    """Splicing would repeat a member (each engine reads its own of two): any member a
    leg sets or drops, and a stream other than false, makes the relay rebuild the legs."""
    raw = json.dumps({"prompt": [1, 2], key: 1}).encode()
    read = read_plain(raw, b'"prompt"')
    assert read is not None and read[1].leg_keys
    request = plain_request("completions", raw)
    assert request is not None and not request.spliced_legs
    for stream in (b"true", b"null", b"0", b'"no"'):
        fields = read_plain(b'{"prompt": [1], "stream": %s}' % stream, b'"prompt"')
        assert fields is not None and fields[1].leg_keys, stream


def test_a_rank_named_makes_the_decode_alone_rebuilt_and_none_spliced() -> None:
    """The decode serving alone gets ``routed_dp_rank`` appended, unless the body names
    a rank key: then the dict path replaces it."""
    raw = b'{"prompt": [1, 2], "max_tokens": 1} \n'
    assert msgspec.json.decode(pinned_bytes(raw, 4)) == pinned_body(json.loads(raw), 4)
    request = plain_request("completions", raw)
    assert request is not None and request.spliced_alone
    named = plain_request("completions", b'{"prompt": [1, 2], "data_parallel_rank": 0}')
    assert named is not None and not named.spliced_alone


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "text is tokenized by the whole path"}',
        b'{"prompt": [[1, 2], [3]]}',  # a batch
        b'{"prompt": []}',
        b'{"prompt": [1, -2]}',
        b'{"prompt": [1, 4294967296]}',
        b'{"prompt": [9], "prompt": [1]}',  # repeated: the whole decode says which counts
        b'{"prompt": [9], "pr\\u006fmpt": [1]}',  # the same, its key escaped
        b'{"prompt": [1], "routed\\u005fdp_rank": 0}',  # any escape: the whole decode
        b'{"meta": {"prompt": [9]}, "model": "m"}',  # no prompt of its own
        b'{"prompt": [1, 2], "model": }',  # not JSON
        b'[{"prompt": [1]}]',
        b"",
    ],
)
def test_bodies_it_does_not_take_are_decoded_whole(raw: bytes) -> None:
    assert read_plain(raw, b'"prompt"') is None
    assert plain_request("completions", raw) is None


def test_chats_and_generates_that_are_not_plain_are_decoded_whole() -> None:
    """A chat is rendered from its messages; a ``/generate`` with text or messages, or
    with ids under another key, is read by the whole path, which words any refusal."""
    assert plain_request("chat", b'{"messages": [], "prompt": [1]}') is None
    for raw in (
        b'{"input_ids": [1, 2], "text": "both given"}',
        b'{"input_ids": [1, 2], "messages": []}',
        b'{"text": "hello"}',
        b'{"input_ids": [[1, 2], [3]]}',
    ):
        assert plain_request("generate", raw) is None, raw


def test_a_plain_generate_is_read_as_the_whole_path_reads_it() -> None:
    """``/generate``: ids, samples from ``sampling_params.n``, the stream only when it is
    ``true``, ``lora_path`` before ``lora``, input logprobs asked for, extra keys of its
    one prompt; a ``text`` of null is no text."""
    raw = (
        b'{"input_ids": [3, 4, 5], "text": null, "sampling_params": {"n": 2}, "stream": "yes",'
        b' "lora_path": "a1", "lora": "b2", "return_logprob": true, "extra_keys": [[1]]}'
    )
    request = plain_request("generate", raw)
    assert request is not None
    assert [list(p) for p in request.prompts] == [[3, 4, 5]]
    assert (request.samples, request.stream, request.lora) == (2, False, "a1")
    assert request.logprob and request.extra_keys == [[1]] and not request.batched
    assert request.body == json.loads(raw)  # decoded when a leg must be rebuilt


def test_a_plain_completion_reads_samples_and_stream_as_the_whole_path() -> None:
    """``n`` (null: one) and ``stream`` read as the engines read it (lax booleans)."""
    request = plain_request("completions", b'{"prompt": [1], "n": null, "stream": "on"}')
    assert request is not None and request.samples == 1 and request.stream
    request = plain_request("completions", b'{"prompt": [1], "n": 3, "cache_salt": "s"}')
    assert request is not None and request.samples == 3 and not request.stream
    assert request.salt == "s" and request.model is None
    with pytest.raises(OpenAIError, match="n must be an integer >= 1"):
        plain_request("completions", b'{"prompt": [1], "n": 0}')


def test_spliced_appends_before_the_closing_brace() -> None:
    assert spliced(b'{"a": 1}\r\n', b',"b":2') == b'{"a": 1,"b":2}'


def test_without_kernels_nothing_is_read_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_kernels", None)
    assert read_plain(b'{"prompt": [1, 2]}', b'"prompt"') is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, U32), min_size=1, max_size=200),
    extra=st.dictionaries(
        st.sampled_from(["model", "max_tokens", "n", "x", *LEG_KEYS]) | st.text(max_size=6),
        json_values,
        max_size=4,
    ),
    stream=st.sampled_from(["absent", False, True, None, 0]),
    before=st.booleans(),
    indent=st.sampled_from([None, 1]),
    rooms=st.integers(0, 2**63 - 1) | st.lists(st.integers(0, 2**63 - 1), max_size=3),
)
def test_spliced_legs_decode_to_the_dict_legs(
    ids: list[int],
    extra: dict[str, Any],
    stream: Any,
    before: bool,
    indent: int | None,
    rooms: int | list[int],
) -> None:
    """Any body read plain whose members allow splicing gives legs equal, member for
    member and in order (none repeated), to the dict legs; any other is left to them."""
    extra.pop("prompt", None)
    extra.pop("stream", None)
    if stream != "absent":
        extra["stream"] = stream
    doc = {**extra, "prompt": ids} if before else {"prompt": ids, **extra}
    raw = json.dumps(doc, indent=indent).encode()
    read = read_plain(raw, b'"prompt"')
    if read is None:  # an escape, or "prompt" written before the key: the whole decode
        assert b"\\u" in raw or raw.count(b'"prompt"') > 1
        return
    tokens, fields = read
    assert list(tokens) == ids
    spliceable_stream = stream == "absent" or stream is False  # not 0: it is no JSON false
    assert fields.leg_keys == (any(k in doc for k in LEG_KEYS) or not spliceable_stream)
    if fields.leg_keys:
        return
    prefill, decode = sglang_leg_bytes(
        raw, fields, host="h", port=1, rooms=rooms, prefill_rank=2, decode_rank=0
    )
    want = sglang_legs(doc, host="h", port=1, rooms=rooms, prefill_rank=2, decode_rank=0)
    assert (_items(prefill), _items(decode)) == (_items(want[0]), _items(want[1]))
    assert json.loads(pinned_bytes(raw, 5)) == pinned_body(doc, 5)


def test_plain_fields_ignore_unknown_members() -> None:
    assert msgspec.json.decode(b'{"zzz": [1, {"a": 2}]}', type=PlainFields) == PlainFields()


@pytest.mark.parametrize(
    ("endpoint", "members", "asks"),
    [
        ("completions", {"prompt_logprobs": 0}, True),
        ("completions", {"prompt_logprobs": 5}, True),
        ("completions", {"prompt_logprobs": None}, False),
        ("completions", {"echo": True, "logprobs": 0}, True),
        ("completions", {"echo": True}, False),
        ("completions", {"echo": False, "logprobs": 2}, False),
        ("completions", {"logprobs": 2}, False),
        ("chat", {"prompt_logprobs": 1}, True),
        ("chat", {"echo": True, "logprobs": True}, False),
        ("generate", {"prompt_logprobs": 1, "return_logprob": True}, False),
    ],
)
def test_a_request_asking_for_its_prompts_logprobs_is_told_apart(
    endpoint: Endpoint, members: dict[str, object], asks: bool
) -> None:
    """``prompt_logprobs`` (0 included) on either OpenAI route, or a completion's ``echo``
    with ``logprobs``, asks for the prompt's logprobs, read alike from a plain body and a
    decoded one; /generate's are ``return_logprob``'s, apart."""
    key = {"completions": "prompt", "chat": "messages", "generate": "input_ids"}[endpoint]
    value = [{"role": "user", "content": "hi"}] if endpoint == "chat" else [1, 2, 3]
    body = {key: value, **members}
    raw = msgspec.json.encode(body)
    whole = PDRequest(endpoint, raw, body, [[1, 2, 3]], batched=False, samples=1, stream=False)
    assert whole.prompt_logprobs is asks
    plain = plain_request(endpoint, raw)
    if endpoint != "chat":
        assert plain is not None and plain.prompt_logprobs is asks

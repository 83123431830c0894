"""The wire format: both encodings, golden bytes, captured engine messages, frames."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, WireError, wire
from wire_samples import SAMPLE_FILES, load_wire_samples

STORED = BlockStored(
    block_hashes=[11, -22],
    parent_block_hash=None,
    token_ids=[1, 2, 3, 4],
    block_size=2,
    lora_id=None,
    medium="GPU",
)
REMOVED = BlockRemoved(block_hashes=[11], medium="CPU_PINNED")
CLEARED = AllBlocksCleared()

# Expected bytes written out by hand from the msgpack spec, so that a change in field
# order, tagging or nil omission shows up here.
GOLDEN_MAP = {
    "stored": bytes.fromhex(
        "87"  # map of 7: the tag and six fields (nil extras omitted, nil core fields kept, as SGLang)
        "a474797065ab426c6f636b53746f726564"  # "type": "BlockStored"
        "ac626c6f636b5f686173686573920bea"  # "block_hashes": [11, -22]
        "b1706172656e745f626c6f636b5f68617368c0"  # "parent_block_hash": nil
        "a9746f6b656e5f6964739401020304"  # "token_ids": [1, 2, 3, 4]
        "aa626c6f636b5f73697a6502"  # "block_size": 2
        "a76c6f72615f6964c0"  # "lora_id": nil
        "a66d656469756da3475055"  # "medium": "GPU"
    ),
    "removed": bytes.fromhex(
        "83a474797065ac426c6f636b52656d6f766564"
        "ac626c6f636b5f68617368657391" + "0b" + "a66d656469756daa4350555f50494e4e4544"
    ),
    "cleared": bytes.fromhex("81a474797065b0416c6c426c6f636b73436c6561726564"),
}
GOLDEN_ARRAY = {
    "stored": bytes.fromhex("97ab426c6f636b53746f726564920beac0940102030402c0a3475055"),
    "removed": bytes.fromhex("93ac426c6f636b52656d6f766564910baa4350555f50494e4e4544"),
    "cleared": bytes.fromhex("91b0416c6c426c6f636b73436c6561726564"),
}
EVENTS = {"stored": STORED, "removed": REMOVED, "cleared": CLEARED}
BATCH_HEAD = bytes.fromhex("93cb3ff8000000000000")  # [1.5, ...


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_map_encoding_golden_bytes(name: str) -> None:
    """Each event in a batch encodes as a tagged map with exactly the expected bytes."""
    batch = KVEventBatch(ts=1.5, events=[EVENTS[name]], data_parallel_rank=3)
    expected = BATCH_HEAD + b"\x91" + GOLDEN_MAP[name] + b"\x03"
    assert wire.encode_batch(batch) == expected
    assert wire.decode_batch(expected) == batch


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_array_encoding_golden_bytes(name: str) -> None:
    """Each event encodes positionally, trailing nil extras omitted, and decodes back."""
    batch = KVEventBatch(ts=1.5, events=[EVENTS[name]], data_parallel_rank=3)
    expected = BATCH_HEAD + b"\x91" + GOLDEN_ARRAY[name] + b"\x03"
    assert wire.encode_batch(batch, encoding="array") == expected
    assert wire.decode_batch(expected) == batch


def test_two_element_batch_from_older_publishers_decodes() -> None:
    """An older publisher's [ts, events] batch decodes with rank None, in both encodings."""
    for event in (GOLDEN_MAP["cleared"], GOLDEN_ARRAY["cleared"]):
        payload = bytes.fromhex("92cb3ff8000000000000") + b"\x91" + event
        assert wire.decode_batch(payload) == KVEventBatch(ts=1.5, events=[CLEARED])


def test_rank_keywords_of_both_engines() -> None:
    """SGLang's attn_dp_rank= and vLLM's data_parallel_rank= build the same batch; both names read it."""
    a = KVEventBatch(ts=1.0, events=[], attn_dp_rank=2)
    b = KVEventBatch(ts=1.0, events=[], data_parallel_rank=2)
    assert a == b and a.attn_dp_rank == 2 and a.data_parallel_rank == 2
    with pytest.raises(TypeError, match="not both"):
        KVEventBatch(ts=1.0, events=[], attn_dp_rank=1, data_parallel_rank=1)


def test_short_and_long_positional_events() -> None:
    """Positional events missing trailing fields take defaults; extra trailing fields are ignored."""
    short = msgspec.msgpack.encode([2.0, [["BlockStored", [5]], ["BlockRemoved", [5]]], 0])
    batch = wire.decode_batch(short)
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [5]
    assert stored.token_ids == [] and stored.medium is None and stored.parent_block_hash is None
    assert isinstance(removed, BlockRemoved) and removed.medium is None
    long = msgspec.msgpack.encode(
        [2.0, [["BlockRemoved", [5], "GPU", 0, "future", 1], ["AllBlocksCleared", 9]], 1]
    )
    batch = wire.decode_batch(long)
    assert batch.events == [BlockRemoved(block_hashes=[5], medium="GPU", group_idx=0), CLEARED]


def test_unknown_map_keys_and_omitted_nil_fields() -> None:
    """Map events with unknown keys decode (keys ignored), and omitted nil fields take defaults."""
    payload = msgspec.msgpack.encode(
        [
            3.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "token_ids": [7, 8],
                    "block_size": 2,
                    "new": 1,
                },
                {"type": "BlockRemoved", "block_hashes": [1], "later": {"x": 1}},
            ],
        ]
    )
    stored, removed = wire.decode_batch(payload).events
    assert stored == BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[7, 8],
        block_size=2,
        lora_id=None,
        medium=None,
    )
    assert removed == BlockRemoved(block_hashes=[1])


def test_mixed_encodings_in_one_batch() -> None:
    """A batch mixing a tagged map and a positional event decodes both."""
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "AllBlocksCleared"}, ["BlockRemoved", [b"\x01" * 32], "CPU"]], 0]
    )
    assert wire.decode_batch(payload).events == [
        CLEARED,
        BlockRemoved(block_hashes=[b"\x01" * 32], medium="CPU"),
    ]


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0, [[7, 1]]])],
    ids=["empty", "invalid-byte", "map-batch", "untagged-event"],
)
def test_garbage_payload_is_a_wire_error(payload: bytes) -> None:
    """Bytes that are not a batch raise WireError (a ValueError) naming the payload size."""
    with pytest.raises(WireError, match="not a KV-event batch"):
        wire.decode_batch(payload)


def test_hash_to_int_folds_signed_unsigned_and_bytes() -> None:
    """Signed int64 and its unsigned twin fold to one value; bytes fold to their last 8 bytes."""
    assert wire.hash_to_int(-1) == 2**64 - 1
    assert wire.hash_to_int(2**64 - 1) == 2**64 - 1
    assert wire.hash_to_int(b"\x00" * 24 + (5).to_bytes(8, "big")) == 5


@pytest.mark.parametrize("sample", SAMPLE_FILES)
def test_every_captured_message_decodes(sample: str) -> None:
    """Every live and replayed message captured from SGLang and vLLM decodes, field for field."""
    seen = 0
    for record in load_wire_samples(sample):
        frames = record["frames"]
        if record["kind"] == "live":
            msg = wire.parse_live_frames(frames)
            payload = msg.payload
        else:
            reply = wire.parse_replay_reply(frames)
            if reply.is_end:
                assert reply.payload == b"" and reply.topic == b""
                continue
            payload = reply.payload
        batch = wire.decode_batch(payload)
        # field for field: the decoded structs carry exactly what the engine sent
        raw = msgspec.msgpack.decode(payload)
        assert batch.ts == raw[0] and batch.data_parallel_rank == raw[2]
        for event, raw_event in zip(batch.events, raw[1], strict=True):
            assert type(event).__name__ == raw_event["type"]
            for key, value in raw_event.items():
                if key != "type":
                    assert getattr(event, key) == value, (record["after"], key)
        seen += 1
    assert seen > 0


def test_sglang_payloads_reencode_to_the_same_bytes() -> None:
    """Our map encoding of every captured SGLang batch equals SGLang's bytes exactly."""
    for record in load_wire_samples("sglang-0.5.23.jsonl"):
        payload = record["frames"][-1]
        if payload:
            assert wire.encode_batch(wire.decode_batch(payload)) == payload, record["after"]


def test_sglang_sample_live_frames_rebuild_exactly() -> None:
    """live_frames() rebuilds SGLang's captured [topic, seq, payload] frames byte for byte."""
    for record in load_wire_samples("sglang-0.5.23.jsonl"):
        if record["kind"] == "live":
            msg = wire.parse_live_frames(record["frames"])
            assert wire.live_frames(msg.topic, msg.seq, msg.payload) == record["frames"]


def test_replay_frames() -> None:
    """Replay request, 4-frame and 3-frame replies and the end marker pack and unpack."""
    assert wire.replay_request_frames(5) == [b"", (5).to_bytes(8, "big")]
    identity, start = wire.parse_replay_request([b"id", b"", (7).to_bytes(8, "big")])
    assert (identity, start) == (b"id", 7)
    four = wire.parse_replay_reply(wire.replay_reply_frames(b"kv", 9, b"p"))
    assert (four.topic, four.seq, four.payload, four.is_end) == (b"kv", 9, b"p", False)
    three = wire.parse_replay_reply([b"", (9).to_bytes(8, "big"), b"p"])
    assert (three.topic, three.seq, three.payload) == (None, 9, b"p")
    assert wire.parse_replay_reply(wire.replay_end_frames()).is_end


@pytest.mark.parametrize(
    "frames",
    [[b"id"], [b"id", b"", b"123"], [b"id", b"x", b"\x00" * 8], [b"id", b"", b"\x00" * 8, b"more"]],
    ids=["no-seq", "short-seq", "no-delimiter", "extra-frame"],
)
def test_malformed_replay_request_keeps_identity(frames: list[bytes]) -> None:
    """A malformed replay request is a WireError that still carries the peer identity."""
    with pytest.raises(WireError) as info:
        wire.parse_replay_request(frames)
    assert info.value.identity == b"id"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "frames", [[b"t", b"\x00" * 8], [b"t", b"\x00" * 7, b"p"], [b"t", b"\x00" * 8, b"p", b"x"]]
)
def test_malformed_live_frames(frames: list[bytes]) -> None:
    """Live messages with the wrong frame count or a bad seq length are WireErrors."""
    with pytest.raises(WireError):
        wire.parse_live_frames(frames)


# --- property tests -------------------------------------------------------------------

hashes = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1), st.binary(min_size=32, max_size=32)
)
opt_str = st.none() | st.text(max_size=8)
stored_events = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, max_size=4),
    parent_block_hash=st.none() | hashes,
    token_ids=st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=16),
    block_size=st.integers(min_value=1, max_value=64),
    lora_id=st.none() | st.integers(min_value=0, max_value=1000),
    medium=st.sampled_from([None, "GPU", "CPU", "CPU_PINNED", "DISK"]),
    cache_salt=opt_str,
    session_id=opt_str,
    lora_name=opt_str,
    group_idx=st.none() | st.integers(min_value=0, max_value=8),
    kv_cache_spec_kind=opt_str,
)
removed_events = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, max_size=4),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    group_idx=st.none() | st.integers(min_value=0, max_value=8),
)
batches = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(st.one_of(stored_events, removed_events, st.just(CLEARED)), max_size=5),
    data_parallel_rank=st.none() | st.integers(min_value=0, max_value=1024),
)


@given(batches, st.sampled_from(["map", "array"]))
def test_round_trip(batch: KVEventBatch, encoding: str) -> None:
    """Any batch survives encode then decode unchanged, in both encodings."""
    assert wire.decode_batch(wire.encode_batch(batch, encoding=encoding)) == batch  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_seq_round_trip(seq: int) -> None:
    """Sequence numbers are 8 bytes big-endian and read back unchanged."""
    frame = wire.encode_seq(seq)
    assert len(frame) == 8 and wire.decode_seq(frame) == seq


def _positional_stored(*tail: object) -> bytes:
    event = ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU", *tail]
    return msgspec.msgpack.encode([1.0, [event], 0])


def test_positional_stores_are_read_in_their_engines_field_order() -> None:
    """After ``medium`` vLLM's positional BlockStored has lora_name, extra_keys,
    group_idx, ...; SGLang's cache_salt, session_id, lora_name: each is read in its own
    order (vLLM's were read in SGLang's: an adapter's name became a cache salt, and a
    group_idx failed the whole batch)."""
    (vllm,) = wire.decode_batch(_positional_stored("sql", [None, ["img"]], 0, "full")).events
    assert (vllm.lora_name, vllm.extra_keys, vllm.group_idx, vllm.cache_salt) == (
        "sql",
        [None, ["img"]],
        0,
        None,
    )
    assert vllm.kv_cache_spec_kind == "full"
    (plain,) = wire.decode_batch(_positional_stored(None, None, 0)).events
    assert (plain.group_idx, plain.lora_name, plain.cache_salt) == (0, None, None)
    (lone,) = wire.decode_batch(_positional_stored("sql")).events
    assert (lone.lora_name, lone.cache_salt) == (None, "sql")  # ambiguous: read as it was
    (sglang,) = wire.decode_batch(_positional_stored("salt", "session", "sql")).events
    assert (sglang.cache_salt, sglang.session_id, sglang.lora_name) == ("salt", "session", "sql")
    (named,) = wire.decode_batch(_positional_stored(None, None, "sql")).events
    assert (named.lora_name, named.cache_salt, named.group_idx) == ("sql", None, None)


def test_stores_no_positional_layout_holds_are_encoded_as_maps() -> None:
    """A store with fields of both engines, or vLLM's lora_name alone (which would read as
    SGLang's cache_salt), goes as a tagged map in an "array" batch, and comes back equal."""
    base = dict(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2)
    both = BlockStored(**base, lora_id=None, medium=None, cache_salt="s", group_idx=0)
    salted = BlockStored(**base, lora_id=None, medium=None, cache_salt="s")
    named = BlockStored(**base, lora_id=None, medium=None, lora_name="sql")
    batch = KVEventBatch(ts=1.0, events=[both, salted, named], data_parallel_rank=0)
    raw = wire.encode_batch(batch, encoding="array")
    kinds = [type(e).__name__ for e in msgspec.msgpack.decode(raw)[1]]
    assert kinds == ["dict", "list", "dict"]
    assert wire.decode_batch(raw) == batch


def test_an_unknown_event_type_is_left_out_and_named_not_the_batch_lost() -> None:
    """A newer engine's event type (map or array) beside known ones: the known events
    decode, the unknown one is left out and its type named (the whole batch was a
    WireError, which the router takes as a loss and clears the holder for)."""
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockRemoved", "block_hashes": [5]},
                {"type": "KVCacheResized", "blocks": 9},
                ["BlockPinned", [5]],
                ["AllBlocksCleared"],
            ],
            0,
        ]
    )
    unknown: list[str] = []
    batch = wire.decode_batch(payload, unknown)
    assert batch.events == [BlockRemoved(block_hashes=[5]), CLEARED]
    assert unknown == ["KVCacheResized", "BlockPinned"]
    broken = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": "x"}], 0])
    with pytest.raises(WireError):  # a known type that is malformed still fails
        wire.decode_batch(broken, unknown)

"""The compiled kernels answer exactly as the plain path: keys, token ids, and errors.

:mod:`kvevents.kernels` is only ever an acceleration, so every test here compares the
kernel with the plain Python it replaces, on random and on hand-picked inputs.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from array import array

import msgspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import kernels
from kvevents.router.prompts.token_body import BadRequest, TokensBody, decode_tokens_body
from kvevents.wire.hashing import content_keys, content_keys_per_block

U32 = 2**32 - 1


@pytest.fixture(scope="module")
def compiled() -> kernels.Kernels:
    loaded = kernels.load()
    assert loaded is not None, f"the kernels did not load: {kernels.status()}"
    assert kernels.status() == "compiled"
    return loaded


def _xxh3_chain(tokens: array[int], block_size: int, parent: int) -> list[int]:
    """The definition, spelled out: XXH3-64 of each block's bytes, seeded by the last key."""
    data, step, key, out = tokens.tobytes(), 4 * block_size, parent, []
    for start in range(0, len(data) - step + 1, step):
        key = xxhash.xxh3_64_intdigest(data[start : start + step], key)
        out.append(key)
    return out


@pytest.mark.parametrize("block_size", range(1, 61))
def test_chain_keys_equal_xxh3_for_every_block_size_it_takes(
    compiled: kernels.Kernels, block_size: int
) -> None:
    rng = random.Random(block_size)
    for parent in (0, 1, 2**64 - 1, rng.getrandbits(64)):
        n = block_size * rng.randrange(8, 40) + rng.randrange(block_size)  # a partial tail
        tokens = array("I", [rng.choice((0, U32, rng.getrandbits(32))) for _ in range(n)])
        keys = compiled.chain_keys(tokens, block_size, parent)
        assert keys is not None and keys.typecode == "Q"
        assert keys.tolist() == _xxh3_chain(tokens, block_size, parent)


def test_chain_keys_leave_what_they_do_not_take_to_the_loop(compiled: kernels.Kernels) -> None:
    """Blocks past 60 tokens (XXH3's long inputs) and short requests are not theirs."""
    tokens = array("I", range(64 * 10))
    assert compiled.chain_keys(tokens, 64, 0) is None
    assert compiled.chain_keys(array("I", range(16 * 7)), 16, 0) is None
    # content_keys answers the same either way
    for size in (16, 64):
        assert content_keys(tokens, size) == content_keys_per_block(tokens, size)
        assert content_keys(tokens, size) == _xxh3_chain(tokens, size, 0)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, U32), max_size=600),
    block_size=st.integers(1, 70),
    parent=st.integers(0, 2**64 - 1),
)
def test_content_keys_with_kernels_equal_the_per_block_loop(
    compiled: kernels.Kernels, tokens: list[int], block_size: int, parent: int
) -> None:
    assert content_keys(tokens, block_size, parent) == content_keys_per_block(
        tokens, block_size, parent
    )


Outcome = tuple[str, object, object]


def _outcome(raw: bytes) -> Outcome:
    try:
        tokens, body = decode_tokens_body(raw, chat=False)
    except BadRequest as exc:
        return ("refused", str(exc), None)
    return ("decoded", None if tokens is None else list(tokens), body)


def _outcome_without_kernels(raw: bytes) -> Outcome:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "_kernels", None)
        assert kernels.loaded() is None
        return _outcome(raw)


def _same(raw: bytes) -> Outcome:
    """The outcome with the kernels, asserted equal to the one without."""
    with_kernels = _outcome(raw)
    without = _outcome_without_kernels(raw)
    # the compiled path hands the ids apart: compare the rest of the body
    if with_kernels[0] == without[0] == "decoded":
        assert with_kernels[1] == without[1], raw
        assert isinstance(with_kernels[2], TokensBody) and isinstance(without[2], TokensBody)
        assert msgspec.structs.replace(with_kernels[2], input_ids=None) == (
            msgspec.structs.replace(without[2], input_ids=None)
        ), raw
    else:
        assert with_kernels == without, raw
    return with_kernels


def _fast(compiled: kernels.Kernels, raw: bytes) -> tuple[list[int], int] | None:
    parsed = compiled.parse_input_ids(raw)
    return None if parsed is None else (parsed[0].tolist(), parsed[1])


ids_lists = st.lists(st.integers(0, U32), max_size=300)
spaces = st.sampled_from(["", " ", "\n", "\t ", "\r\n  "])


@settings(max_examples=300, deadline=None)
@given(ids=ids_lists, sep=spaces, pad=spaces, record=st.booleans(), top=st.integers(1, 9))
def test_parse_reads_any_plain_ids_array_as_msgspec_does(
    compiled: kernels.Kernels, ids: list[int], sep: str, pad: str, record: bool, top: int
) -> None:
    array_text = "[" + pad + ("," + sep).join(map(str, ids)) + pad + "]"
    tail = f',{sep}"record": {json.dumps(record)}, "top": {top}' if record else ""
    raw = f'{pad}{{{pad}"input_ids"{pad}:{sep}{array_text}{pad}{tail}}}{pad}'.encode()
    parsed = _fast(compiled, raw)
    assert parsed is not None, raw  # the plain case: the kernel reads it
    assert parsed[0] == ids
    assert _same(raw)[:2] == ("decoded", ids)


# Ids of every width, so that the 8-byte reader meets numbers of 1 to 10 digits (ids
# drawn from 0..2**32 - 1 alone are nearly all 9 or 10 digits long).
ids_of_any_width = st.lists(
    st.integers(0, 10).flatmap(lambda d: st.integers(0, min(10**d, U32))), max_size=200
)


@settings(max_examples=300, deadline=None)
@given(ids=ids_of_any_width, sep=st.sampled_from([",", ", ", " , ", ",\n  ", ",\t"]))
def test_parse_reads_ids_of_every_width_and_any_separator(
    compiled: kernels.Kernels, ids: list[int], sep: str
) -> None:
    raw = ('{"input_ids": [' + sep.join(map(str, ids)) + '], "top": 2}').encode()
    assert _fast(compiled, raw) == (ids, raw.index(b"]") + 1)


@settings(max_examples=500, deadline=None)
@given(
    ids=ids_of_any_width.filter(bool),
    at=st.integers(0, 10**6),
    byte=st.integers(0, 255),
)
def test_parse_of_a_body_with_one_byte_changed_is_what_the_whole_decode_says(
    compiled: kernels.Kernels, ids: list[int], at: int, byte: int
) -> None:
    """Any byte (a sign, a dot, a letter, a byte above 0x7F, a second comma...) written
    anywhere in the array: the kernel must read exactly what msgspec reads, or give up."""
    raw = bytearray(('{"input_ids": [' + ", ".join(map(str, ids)) + "]}").encode())
    raw[14 + at % (len(raw) - 15)] = byte  # inside the array, "[" to "]"
    _same(bytes(raw))


def test_every_byte_value_after_a_digit_ends_the_number_as_json_says(
    compiled: kernels.Kernels,
) -> None:
    """Each of the 256 byte values right after a number's digits (inside one 8-byte
    read): only a digit continues it, and only what JSON allows there is read."""
    for byte in range(256):
        for head in (b"1", b"12", b"1234567"):
            raw = b'{"input_ids": [' + head + bytes([byte]) + b", 3, 4, 5, 6, 7, 8]}"
            _same(raw)
            parsed = _fast(compiled, raw)
            if parsed is not None:
                assert byte in b"0123456789, \t\r\n]", (byte, raw)


@pytest.mark.parametrize("width", range(1, 12))
def test_ids_near_the_body_end_and_leading_zeros_at_every_width(
    compiled: kernels.Kernels, width: int
) -> None:
    """The last bytes of a body are read digit by digit (no 8-byte read past its end);
    a leading zero is refused at every width, whichever reader meets it."""
    big = int("9" * width)
    for ids in ([big], [1, big], [big] * 5):
        raw = ('{"input_ids": [' + ",".join(map(str, ids)) + "]}").encode()
        _same(raw)
        if big <= U32:
            assert _fast(compiled, raw) == (ids, len(raw) - 1)
    if width > 1:
        zero_led = "0" + "1" * (width - 1)
        for text in (f"[{zero_led}]", f"[{zero_led}, 1, 2, 3, 4, 5]", f"[7, {zero_led}, 2, 3]"):
            raw = ('{"input_ids": ' + text + ', "record": true}').encode()
            assert _fast(compiled, raw) is None, raw
            _same(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"input_ids": [01]}',  # a leading zero: not JSON
        b'{"input_ids": [1.0]}',
        b'{"input_ids": [1e3]}',
        b'{"input_ids": [-1]}',
        b'{"input_ids": [4294967296]}',
        b'{"input_ids": [99999999999999999999999]}',
        b'{"input_ids": [1,]}',
        b'{"input_ids": [1,,2]}',
        b'{"input_ids": [1 2]}',
        b'{"input_ids": [1], }',
        b'{"input_ids": [1]} }',
        b'{"input_ids": [1]} x',
        b'{"input_ids": [1], "input_ids": [2]}',  # msgspec keeps the last
        b'{"input_ids": [1], "text": "hi"}',
        b'{"input_ids": [1], "top": 0}',
        b'{"input_ids": [1], "record": "yes"}',
        b'{"input_ids": [1], "messages": []}',
        b'{"input_ids": [[1]]}',
        b'{"input_ids": null}',
        b'{"input_ids": "abc"}',
        b'{"input_ids": [1, 2',
        b'{"input_ids": [1, 2]',
        b'{"input_ids" [1]}',
        b'{"input_idsx": [1]}',
        b'{"text": "a", "input_ids": [1]}',
        b'{"input_ids": [1], "extra_keys": "x"}',
        b'{"input_ids": [1, 2], "lora": "a", "cache_salt": "s", "model": "m"}',
        b'{"input_ids": [1], "unknown": {"deep": [1, 2, {"x": null}]}}',
        b'{"input_ids": [1], "text": null}',
        b"[1, 2]",
        b"",
        b"{}",
    ],
)
def test_bodies_off_the_plain_case_answer_as_without_kernels(
    compiled: kernels.Kernels, raw: bytes
) -> None:
    """The kernel gives up on anything but the plain case, and the body then decodes
    whole: the same ids, body or error (its words too) as a process without kernels."""
    _same(raw)


def test_a_body_that_fails_in_the_rest_is_worded_by_the_whole_decode(
    compiled: kernels.Kernels,
) -> None:
    with pytest.raises(BadRequest, match=r"Expected `int` >= 1.*\$\.top"):
        decode_tokens_body(b'{"input_ids": [1, 2], "top": 0}')
    with pytest.raises(BadRequest, match=r"every token id must be an int in 0\.\.4294967295"):
        decode_tokens_body(b'{"input_ids": [1, 4294967296]}')


def test_status_names_the_state() -> None:
    assert kernels.status() in {"compiled", "loading"} or kernels.status().startswith("off: ")


_LOAD_IN_A_THREAD = (
    "import threading\n"
    "kernels.will_load()\n"  # the router's way: will_load on the main thread, then a thread
    "loader = threading.Thread(target=kernels.load)\n"
    "loader.start()\n"
    "loader.join()\n"
    "assert kernels.loaded() is not None, kernels.status()\n"
    # the joined thread can stay listed in /proc a moment while the OS ends it; an
    # OpenBLAS thread never goes away, so waiting for the count to settle hides none
    "import os, time\n"
    "for _ in range(300):\n"
    "    if len(os.listdir('/proc/self/task')) == 1 or not os.path.isdir('/proc/self/task'):\n"
    "        break\n"
    "    time.sleep(0.01)\n"
)


@pytest.mark.parametrize(
    ("given_env", "in_thread", "expected"),
    [(None, False, "1 1"), (None, True, "1 1"), ("2", False, "2 2")],
)
def test_loading_keeps_numpy_to_one_blas_thread_unless_told_otherwise(
    given_env: str | None, in_thread: bool, expected: str
) -> None:
    """A fresh process: loading the kernels imports NumPy, whose OpenBLAS would start a
    thread per core; it starts none unless OPENBLAS_NUM_THREADS asks for them."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given_env is not None:
        env["OPENBLAS_NUM_THREADS"] = given_env
    load = (
        _LOAD_IN_A_THREAD if in_thread else "assert kernels.load() is not None, kernels.status()\n"
    )
    script = (
        "import os\n"
        "from kvevents import kernels\n"
        + load
        + "import numpy.linalg\n"  # OpenBLAS is loaded by now: its threads, if any, run
        + "print(os.environ['OPENBLAS_NUM_THREADS'], len(os.listdir('/proc/self/task')))\n"
    )
    if not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2:
        expected = expected.split()[0]  # the env alone: no /proc, or one core (no threads)
        script = script.replace(", len(os.listdir('/proc/self/task'))", "")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected


def test_a_huge_body_is_parsed_without_the_thread_keeping_its_buffer(
    compiled: kernels.Kernels,
) -> None:
    """A 4 MiB body of ids parses whole, but the thread's kept parse buffer stays the
    size of the largest ordinary body (it grew to two bytes per body byte, for good)."""
    ids = [7] * 2_000_000
    raw = b'{"input_ids": [' + b",".join(b"7" for _ in ids) + b"]}"
    small = _fast(compiled, b'{"input_ids": [1, 2, 3]}')
    assert small is not None
    kept = len(compiled._local.ids)
    parsed = _fast(compiled, raw)
    assert parsed is not None and parsed[0] == ids
    assert len(compiled._local.ids) == kept <= kernels._KEPT_IDS

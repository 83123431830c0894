"""The native core answers exactly as the plain path: keys, token ids, loads and errors.

:mod:`kvevents.kernels` is only ever an acceleration, so every test here compares a
native part with the plain Python it replaces (:mod:`kvevents.kernels.spec`, the xxhash
package, msgspec's whole decode), on random and on hand-picked inputs.
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
import subprocess
import sys
from array import array

import msgspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import kernels
from kvevents.kernels import spec
from kvevents.router.prompts.token_body import BadRequest, TokensBody, decode_tokens_body
from kvevents.wire.hashing import content_keys, content_keys_per_block
from native_support import native_core

U32 = 2**32 - 1


@pytest.fixture(scope="module")
def compiled() -> kernels.Kernels:
    core = native_core()
    assert kernels.status() == "compiled"
    return core


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
    """Blocks past 60 tokens (XXH3's long inputs) are not theirs; short requests are."""
    tokens = array("I", range(64 * 10))
    assert compiled.chain_keys(tokens, 64, 0) is None
    short = compiled.chain_keys(array("I", range(16 * 2 + 3)), 16, 0)
    assert short is not None and short.tolist() == _xxh3_chain(array("I", range(35)), 16, 0)
    empty = compiled.chain_keys(array("I", range(15)), 16, 0)
    assert empty is not None and len(empty) == 0
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
    """The outcome with the native core, asserted equal to the one without; and the
    native parse asserted equal to its statement in Python (:mod:`kvevents.kernels.spec`)."""
    core = kernels.loaded()
    assert core is not None
    parsed = core.parse_input_ids(raw)
    assert (None if parsed is None else (parsed[0].tolist(), parsed[1])) == (
        spec.parse_input_ids(raw)
    ), raw
    with_kernels = _outcome(raw)
    without = _outcome_without_kernels(raw)
    # the native path hands the ids apart: compare the rest of the body
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


@pytest.mark.slow
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


@settings(max_examples=400, deadline=None)
@given(
    data=st.binary(max_size=40),
    ids=st.lists(st.integers(0, 2**33), max_size=20),
    spaces=st.lists(st.sampled_from(["", " ", "\n", "\t", "\r"]), min_size=6, max_size=6),
    lead=st.sampled_from([b'"input_ids"', b'"prompt"', b'"model": "m", "prompt"', b""]),
)
def test_parse_of_any_bytes_is_its_python_statement(
    compiled: kernels.Kernels, data: bytes, ids: list[int], spaces: list[str], lead: bytes
) -> None:
    """Random bytes, and arrays of ids (some past uint32) with whitespace anywhere and
    random bytes around them, with any lead: the native parse reads exactly what
    :func:`kvevents.kernels.spec.parse_input_ids` reads, and gives up where it does."""
    a, b, c, d, e, f = (x.encode() for x in spaces)
    array_text = b"[" + b + (c + b"," + d).join(str(i).encode() for i in ids) + e + b"]"
    for raw in (
        data,
        b"{" + a + lead + b + b":" + c + array_text + d + b"}" + f,
        b"{" + lead + b":" + array_text + data + b"}",
        b"{" + lead + b":" + array_text[: len(data) % (len(array_text) + 1)] + b"}",
    ):
        got = compiled.parse_input_ids(raw, lead)
        assert (None if got is None else (got[0].tolist(), got[1])) == spec.parse_input_ids(
            raw, lead
        ), raw


def test_a_huge_body_is_parsed_whole_and_the_next_small_one_too(
    compiled: kernels.Kernels,
) -> None:
    """A 4 MiB body of ids (past the parse buffer kept between calls) parses whole, and
    the bodies before and after it parse as they would alone."""
    small = b'{"input_ids": [1, 2, 3]}'
    assert _fast(compiled, small) == ([1, 2, 3], len(small) - 1)
    ids = [7] * 2_000_000
    raw = b'{"input_ids": [' + b",".join(b"7" for _ in ids) + b"]}"
    parsed = _fast(compiled, raw)
    assert parsed is not None and parsed[0] == ids
    assert _fast(compiled, small) == ([1, 2, 3], len(small) - 1)


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda k: k.chain_keys(array("I", [1, 2]), 0, 0), ValueError, "block_size=0"),
        (lambda k: k.chain_keys(array("I", [1, 2]), 4, -1), OverflowError, None),
        (lambda k: k.chain_keys(array("Q", [1, 2]), 1, 0), TypeError, "4-byte items"),
        (lambda k: k.chain_keys(b"\0" * 8, 1, 0), TypeError, "4-byte items"),
        (lambda k: k.parse_input_ids("{}"), TypeError, None),
        (lambda k: k.parse_input_ids(b"{}", 5), TypeError, None),
        (
            lambda k: k.best_unmatched(array("q", [1]), array("d", [0.0] * 6), 1.0, 1, 1, 1, 1, 1),
            ValueError,
            "not a row of the table",
        ),
        (
            lambda k: k.best_unmatched(array("q", [-1]), array("d", [0.0] * 6), 1.0, 1, 1, 1, 1, 1),
            ValueError,
            "not a row of the table",
        ),
        (
            lambda k: k.best_unmatched(array("q", [0]), array("d", [0.0] * 6), 1.0, 1, 1, 1, 1, -1),
            ValueError,
            "must not be negative",
        ),
        (
            lambda k: k.best_unmatched(array("q", [0]), array("d", [0.0] * 6), "x", 1, 1, 1, 1, 1),
            TypeError,
            None,
        ),
    ],
)
def test_bad_arguments_are_refused_with_an_error_naming_them(
    compiled: kernels.Kernels, call: object, error: type[Exception], words: str | None
) -> None:
    """Every native call checks what it reads (sizes, types, ranges) and refuses the rest
    with a Python error, never reading past a buffer."""
    with pytest.raises(error, match=words):
        call(compiled)  # type: ignore[operator]


def _board(rows: list[tuple[float, ...]]) -> array[float]:
    return array("d", [x for row in rows for x in row])


floats = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 2.0, 0.5, math.inf, -math.inf, math.nan, 1e300, 5e-324]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(0, 20).map(float),
)
rows = st.tuples(st.sampled_from([0.0, 1.0, math.nan]), floats, floats, floats, floats, floats)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(
    table=st.lists(rows, min_size=1, max_size=12),
    picks=st.lists(st.integers(0, 11), max_size=24),
    figures=st.tuples(floats, floats, floats, floats, floats),
    count=st.integers(0, 30),
)
def test_the_load_scan_is_its_python_statement_on_any_numbers(
    compiled: kernels.Kernels,
    table: list[tuple[float, ...]],
    picks: list[int],
    figures: tuple[float, float, float, float, float],
    count: int,
) -> None:
    """Any loads, NaN and infinities among them, any candidates (repeated too) and any
    count: the native scan keeps the same positions, in the same order, and the same
    least recent work (bit for bit) as :func:`kvevents.kernels.spec.best_unmatched`."""
    slots = array("q", [p % len(table) for p in picks])
    board = _board(table)
    got = compiled.best_unmatched(slots, board, *figures, count)
    expected = spec.best_unmatched(slots, board, *figures, count)
    assert got[0] == expected[0]
    assert _bits(got[1]) == _bits(expected[1])


@pytest.mark.slow
def test_the_core_is_one_import_and_no_numpy_or_numba() -> None:
    """A fresh process routes a request natively from its first one: importing kvevents
    loads the core, nothing is compiled, and neither NumPy nor numba is imported."""
    script = (
        "import sys\n"
        "from array import array\n"
        "from kvevents import Holder, Router, kernels\n"
        "from kvevents.kernels import native\n"
        "router = Router(block_size=4)\n"
        "router.add_holder(Holder('http://e', 0))\n"
        "router.route(array('I', range(64)), top=1)\n"
        "print(kernels.status(), native.status(), kernels.calls()['choice'] == 1,\n"
        "      'numpy' in sys.modules, 'numba' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVEVENTS_")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["compiled", "loaded", "True", "False", "False"]


@pytest.mark.slow
def test_kvevents_kernels_0_turns_the_core_off_and_the_answers_stay() -> None:
    """``KVEVENTS_KERNELS=0``: the core is off and says so, and the keys are the same."""
    script = (
        "from kvevents import kernels\n"
        "from kvevents.kernels import native\n"
        "from kvevents.wire.hashing import content_key_array\n"
        "keys = content_key_array(list(range(40)), 4)\n"
        "print(kernels.status(), '|', kernels.loaded(), '|', native.load(), '|', list(keys))\n"
    )
    env = {**os.environ, "KVEVENTS_KERNELS": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    status, loaded, module, keys = done.stdout.strip().split(" | ")
    assert (status, loaded, module) == ("off: KVEVENTS_KERNELS=0", "None", "None")
    assert keys == str(content_keys_per_block(list(range(40)), 4))

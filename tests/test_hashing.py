"""Engine hash schemes: SGLang's page chain and vLLM's sha256_cbor chain."""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvevents import content_keys, sglang_block_hashes, vllm_block_hashes
from kvevents.wire.hashing import (
    SGLangPageHash,
    VLLMSha256CborHash,
    get_hash_scheme,
    tokens_to_array,
    vllm_none_hash,
)

tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=64)


def test_sglang_vector_from_design() -> None:
    """SGLang's page hash of tokens 1..6 with page 2 equals the vector in docs/architecture.md §3."""
    assert sglang_block_hashes([1, 2, 3, 4, 5, 6], 2) == [
        3817746824117602890,
        -4216701448867210342,
        5371148316746243504,
    ]


def test_sglang_hash_is_sha256_of_parent_digest_and_le_tokens() -> None:
    """Each SGLang page digest is SHA-256 over the parent digest then little-endian uint32 tokens."""
    first = hashlib.sha256(struct.pack("<3I", 7, 8, 70000)).digest()
    second = hashlib.sha256(first + struct.pack("<3I", 1, 2, 3)).digest()
    scheme = SGLangPageHash()
    assert scheme.page_digests(tokens_to_array([7, 8, 70000, 1, 2, 3, 9]), 3) == [first, second]
    assert scheme.event_hash(second) == struct.unpack(">q", second[:8])[0]


def _cbor_head(major: int, n: int) -> bytes:
    """Canonical CBOR head, written out by hand (independent of cbor2)."""
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise AssertionError(n)


def test_vllm_sha256_cbor_vector_computed_by_hand() -> None:
    """vLLM's block hash is sha256 of canonical CBOR (parent or NONE_HASH, tokens, None), low 64 bits."""
    seed = "1234"
    none_hash = hashlib.sha256(_cbor_head(3, len(seed)) + seed.encode()).digest()
    assert vllm_none_hash(seed) == none_hash
    tokens = [5, 100, 1000, 70000, 2**32 - 1, 0, 23, 24]
    parent = none_hash
    expected = []
    for block in (tokens[:4], tokens[4:]):
        body = _cbor_head(4, 3) + _cbor_head(2, 32) + parent + _cbor_head(4, len(block))
        body += b"".join(_cbor_head(0, t) for t in block) + b"\xf6"
        parent = hashlib.sha256(body).digest()
        expected.append(int.from_bytes(parent, "big") & (2**64 - 1))
    assert vllm_block_hashes(tokens, 4, seed=seed) == expected


def test_vllm_hash_depends_on_seed_and_random_without_one() -> None:
    """Different seeds, or no seed (random NONE_HASH), give different vLLM hashes."""
    tokens = list(range(16))
    assert vllm_block_hashes(tokens, 4, seed="0") == vllm_block_hashes(tokens, 4, seed="0")
    assert vllm_block_hashes(tokens, 4, seed="0") != vllm_block_hashes(tokens, 4, seed="1")
    assert vllm_block_hashes(tokens, 4, seed=None) != vllm_block_hashes(tokens, 4, seed=None)


def test_vllm_scheme_without_cbor2_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without cbor2 installed, the vLLM scheme fails with a message naming kvevents[vllm-hash]."""
    monkeypatch.setitem(sys.modules, "cbor2", None)
    with pytest.raises(ImportError, match=r"kvevents\[vllm-hash\]"):
        VLLMSha256CborHash(seed="0")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sglang", "vllm"])
@given(tokens=tokens_st, split=st.integers(min_value=0, max_value=16), page=st.integers(1, 5))
def test_chain_continues_from_parent_digest(
    name: str, tokens: list[int], split: int, page: int
) -> None:
    """Hashing a page-aligned suffix from its parent's digest continues the whole chain."""
    scheme = get_hash_scheme(name, seed="7")
    whole = scheme.page_digests(tokens_to_array(tokens), page)
    cut = min(split, len(whole))
    head = scheme.page_digests(tokens_to_array(tokens[: cut * page]), page)
    parent = head[-1] if head else None
    tail = scheme.page_digests(tokens_to_array(tokens[cut * page :]), page, parent)
    assert head + tail == whole
    assert len(whole) == len(tokens) // page


def test_partial_trailing_page_gets_no_hash() -> None:
    """Only full pages are hashed; a trailing partial page is ignored by every scheme."""
    for name in ("sglang", "vllm"):
        scheme = get_hash_scheme(name)
        assert len(scheme.page_digests(tokens_to_array(list(range(11))), 4)) == 2
        assert scheme.page_digests(tokens_to_array([1, 2, 3]), 4) == []
    assert len(content_keys(list(range(11)), 4)) == 2


def test_bad_inputs_are_named() -> None:
    """An unknown scheme, a bad page size or a negative token id is refused with a clear message."""
    with pytest.raises(ValueError, match="hash scheme 'md5' is unknown"):
        get_hash_scheme("md5")
    with pytest.raises(ValueError, match="page_size=0"):
        SGLangPageHash().page_digests(array("I", [1]), 0)
    with pytest.raises(ValueError, match="uint32"):
        tokens_to_array([1, -2])

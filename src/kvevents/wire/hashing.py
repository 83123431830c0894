"""Block hashes: our own chained content key, and the engines' hash schemes.

Content key
-----------
The content key is what the index and the router key blocks by. It is computed from
token ids alone, so a router and a request agree on it without sharing any seed with
an engine: ``key(block i) = xxh3_64(tokens of block i as little-endian uint32, seed=key(block i-1))``
with ``ROOT_KEY`` as the seed of the first block. Chaining by seed costs no
concatenation, and xxh3 runs at memory speed, so keying a request is one C call per
block after a single conversion of the whole token list to bytes. In a process that
has the native core (:mod:`kvevents.kernels`), a request's whole chain is one call
instead, with the same keys.

Engine hashes
-------------
A simulated engine must put the hashes a real engine would send on the wire, so both
schemes are reproduced exactly (docs/architecture.md, The wire):

* **SGLang** (:class:`SGLangPageHash`): per page, SHA-256 over the previous page's
  32-byte digest (absent for the first page) followed by the page's tokens as
  little-endian uint32; the event hash is the first 8 digest bytes read as a signed
  big-endian int64.
* **vLLM** ``sha256_cbor`` (:class:`VLLMSha256CborHash`): per block,
  ``sha256(cbor2.dumps((parent_digest or NONE_HASH, tuple(tokens), extra_keys),
  canonical=True))``; the event hash is the low 64 bits of the digest, unsigned.
  ``NONE_HASH`` is ``sha256_cbor(PYTHONHASHSEED)`` when a seed is set and 32 random bytes
  otherwise, so two vLLM processes agree only when their seeds do. ``cbor2`` is an
  optional dependency (the ``kvevents[vllm-hash]`` extra), imported on first use.

Both are a chain: a page's digest depends on every page before it, so one digest names a
whole prefix. Every scheme hashes a whole request with one C call per page after a single
conversion of the token list (no Python loop per token).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import xxhash

from kvevents import kernels

__all__ = [
    "HASH_SCHEMES",
    "ROOT_KEY",
    "HashScheme",
    "SGLangPageHash",
    "VLLMSha256CborHash",
    "content_key_array",
    "content_keys",
    "content_keys_per_block",
    "get_hash_scheme",
    "sglang_block_hashes",
    "tokens_to_array",
    "tokens_to_bytes",
    "vllm_block_hashes",
    "vllm_none_hash",
]

ROOT_KEY = 0
"""Seed of the first block's content key (the parent of a chain with no parent)."""

_xxh3 = xxhash.xxh3_64_intdigest


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes, converted in C (no Python loop per token)."""
    arr = token_ids if isinstance(token_ids, array) else array("I", token_ids)
    if arr.itemsize != 4:
        arr = array("I", arr)
    data = arr.tobytes()
    if array("I", [1]).tobytes()[0] != 1:  # big-endian host
        swapped = array("I", data)
        swapped.byteswap()
        data = swapped.tobytes()
    return data


def content_keys(
    token_ids: Sequence[int], block_size: int, parent_key: int = ROOT_KEY
) -> list[int]:
    """Chained content keys of every *full* block of ``token_ids``.

    A trailing partial block gets no key (engines cache and publish only full blocks).
    ``parent_key`` continues a chain whose earlier blocks were keyed already.
    """
    keys = content_key_array(token_ids, block_size, parent_key)
    # the native array as ints, or the per-block loop's list as it is
    return keys.tolist() if isinstance(keys, array) else cast("list[int]", keys)


def content_key_array(
    token_ids: Sequence[int], block_size: int, parent_key: int = ROOT_KEY
) -> Sequence[int]:
    """:func:`content_keys` as a request is keyed: an ``array("Q")`` when the native
    core keys them (the native match reads it in place, and its ints are made only
    if Python reads them), else the list."""
    if block_size <= 0:
        raise ValueError(f"content_keys: block_size={block_size} must be a positive int")
    compiled = kernels.loaded()
    if compiled is not None:
        arr = token_ids if isinstance(token_ids, array) else array("I", token_ids)
        if arr.itemsize == 4:
            keys = compiled.chain_keys(arr, block_size, parent_key)
            if keys is not None:
                return keys
        token_ids = arr
    return content_keys_per_block(token_ids, block_size, parent_key)


def content_keys_per_block(
    token_ids: Sequence[int], block_size: int, parent_key: int = ROOT_KEY
) -> list[int]:
    """:func:`content_keys` one xxhash call per block (what the native core must equal)."""
    data = tokens_to_bytes(token_ids)
    step = 4 * block_size
    keys: list[int] = []
    append = keys.append
    xxh3 = _xxh3
    key = parent_key
    # Hot on the router's every request: slicing bytes (a 64-byte copy) beats a memoryview
    # slice, and a positional seed beats a keyword.
    for start in range(0, len(data) - step + 1, step):
        key = xxh3(data[start : start + step], key)
        append(key)
    return keys


# --- engine hash schemes -------------------------------------------------------------


def tokens_to_array(token_ids: Sequence[int]) -> array[int]:
    """Token ids as an ``array("I")`` (converted in C; returned as is when it already is one)."""
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids
    try:
        return array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in 0..{2**32 - 1} (uint32): {exc}") from None


def _check_page_size(page_size: int, who: str) -> None:
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"{who}: page_size={page_size!r} must be a positive int")


class HashScheme(Protocol):
    """How an engine names its cached pages.

    ``page_digests`` returns one digest per *full* page of ``tokens`` (a trailing
    partial page gets none), chained from ``parent`` (the digest of the page before
    ``tokens[0]``, or None at the start of a sequence). ``event_hash`` turns a digest
    into the integer the engine sends in its events.
    """

    name: str

    def page_digests(
        self, tokens: array[int], page_size: int, parent: bytes | None = None
    ) -> list[bytes]: ...

    def event_hash(self, digest: bytes) -> int: ...


class SGLangPageHash:
    """SGLang's page-chain hash (see the module docstring). Stateless; one SHA-256 per page."""

    name = "sglang"

    def page_digests(
        self, tokens: array[int], page_size: int, parent: bytes | None = None
    ) -> list[bytes]:
        _check_page_size(page_size, "SGLangPageHash.page_digests")
        data = memoryview(tokens_to_bytes(tokens))
        step = 4 * page_size
        digests = []
        sha256 = hashlib.sha256
        for start in range(0, len(data) - step + 1, step):
            h = sha256(parent) if parent is not None else sha256()
            h.update(data[start : start + step])
            parent = h.digest()
            digests.append(parent)
        return digests

    def event_hash(self, digest: bytes) -> int:
        """First 8 digest bytes as a signed big-endian int64, as SGLang sends it."""
        return int.from_bytes(digest[:8], "big", signed=True)

    def __repr__(self) -> str:
        return "SGLangPageHash()"


def _cbor2() -> Any:
    try:
        import cbor2
    except ImportError:
        raise ImportError(
            "vLLM's sha256_cbor hash needs the cbor2 package: pip install 'kvevents[vllm-hash]'"
        ) from None
    return cbor2


def vllm_none_hash(seed: str | None) -> bytes:
    """vLLM's ``NONE_HASH``: ``sha256_cbor(seed)``, or 32 random bytes when ``seed`` is None.

    vLLM takes the seed from ``PYTHONHASHSEED``; pass the same string to reproduce the
    hashes of an engine started with it.
    """
    if seed is None:
        return os.urandom(32)
    return hashlib.sha256(_cbor2().dumps(seed, canonical=True)).digest()


class VLLMSha256CborHash:
    """vLLM's ``sha256_cbor`` block-hash chain (see the module docstring).

    ``seed`` plays the part of ``PYTHONHASHSEED`` (None: a random ``NONE_HASH``, as vLLM
    does without the variable). ``extra_keys`` is hashed into every block, as vLLM does
    for LoRA or multimodal requests; None for plain text.
    """

    name = "vllm"

    def __init__(self, seed: str | None = "0", extra_keys: tuple[Any, ...] | None = None):
        self._dumps: Callable[..., bytes] = _cbor2().dumps
        self.seed = seed
        self.none_hash = vllm_none_hash(seed)
        self.extra_keys = extra_keys

    def page_digests(
        self, tokens: array[int], page_size: int, parent: bytes | None = None
    ) -> list[bytes]:
        _check_page_size(page_size, "VLLMSha256CborHash.page_digests")
        tokens = tokens_to_array(tokens)
        dumps, sha256, extra = self._dumps, hashlib.sha256, self.extra_keys
        digests = []
        for start in range(0, len(tokens) - page_size + 1, page_size):
            block = tuple(tokens[start : start + page_size])
            parent_digest = parent if parent is not None else self.none_hash
            parent = sha256(dumps((parent_digest, block, extra), canonical=True)).digest()
            digests.append(parent)
        return digests

    def block_digest(
        self, block: Sequence[int], parent: bytes | None, extra_keys: tuple[Any, ...] | None
    ) -> bytes:
        """One block's digest with ``extra_keys`` of its own (a multimodal block, the
        first block's cache salt) in place of the scheme's."""
        parent_digest = parent if parent is not None else self.none_hash
        return hashlib.sha256(
            self._dumps((parent_digest, tuple(block), extra_keys), canonical=True)
        ).digest()

    def event_hash(self, digest: bytes) -> int:
        """The low 64 bits of the digest, unsigned, as vLLM sends it in int-hash mode."""
        return int.from_bytes(digest[-8:], "big")

    def __repr__(self) -> str:
        return f"VLLMSha256CborHash(seed={self.seed!r})"


HASH_SCHEMES = ("sglang", "vllm")
"""Names accepted by :func:`get_hash_scheme`."""


def get_hash_scheme(name: str, *, seed: str | None = "0") -> HashScheme:
    """The scheme called ``name`` (``"sglang"`` or ``"vllm"``); ``seed`` applies to vLLM."""
    if name == "sglang":
        return SGLangPageHash()
    if name == "vllm":
        return VLLMSha256CborHash(seed=seed)
    raise ValueError(f"hash scheme {name!r} is unknown: use one of {', '.join(HASH_SCHEMES)}")


def sglang_block_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """SGLang's event hashes of every full page of ``token_ids``."""
    scheme = SGLangPageHash()
    return [
        scheme.event_hash(d) for d in scheme.page_digests(tokens_to_array(token_ids), page_size)
    ]


def vllm_block_hashes(
    token_ids: Sequence[int], block_size: int, *, seed: str | None = "0"
) -> list[int]:
    """vLLM's ``sha256_cbor`` event hashes (int mode) of every full block of ``token_ids``."""
    scheme = VLLMSha256CborHash(seed=seed)
    digests = scheme.page_digests(tokens_to_array(token_ids), block_size)
    return [scheme.event_hash(d) for d in digests]

"""The simulated engine's built-in byte-level tokenizer.

One token per UTF-8 byte: token id = byte value (0..255). It needs no vocabulary file,
is lossless, and gives the same ids to the same text everywhere, which is all a
simulated engine and its tests need. Decoding keeps ids below 256 and replaces invalid
UTF-8 with U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """``encode(text) -> list[int]`` and ``decode(ids) -> str``, one token per UTF-8 byte."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        data = bytes(t for t in token_ids if 0 <= t < 256)
        return data.decode("utf-8", errors="replace")

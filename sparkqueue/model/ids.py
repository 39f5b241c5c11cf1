"""Identifiers: message ids and lock tokens."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

TOKEN_LENGTH = 36
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)
_DASHES = (8, 13, 18, 23)
_TOKEN_HEX = np.array([i for i in range(TOKEN_LENGTH) if i not in _DASHES])  # where the 32 hex digits of a token go
_SEQ_HEX = _TOKEN_HEX[:16]  # the digits that spell the sequence number
_NIBBLE = np.full(256, 255, np.uint8)  # ASCII -> hex digit value; 255 for anything else
for _i, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _NIBBLE[_c] = 10 + _i


def new_ids(n: int) -> list[str]:
    """n random UUID4 strings, generated in bulk (uuid.uuid4() per id costs more than the rest of a send)."""
    raw = bytearray(os.urandom(16 * n))
    for i in range(n):
        raw[16 * i + 6] = (raw[16 * i + 6] & 0x0F) | 0x40  # version 4
        raw[16 * i + 8] = (raw[16 * i + 8] & 0x3F) | 0x80  # RFC 4122 variant
    h = raw.hex()
    return [
        f"{h[j : j + 8]}-{h[j + 8 : j + 12]}-{h[j + 12 : j + 16]}-{h[j + 16 : j + 20]}-{h[j + 20 : j + 32]}"
        for j in range(0, 32 * n, 32)
    ]


def lock_tokens(seqs: pa.Array | pa.ChunkedArray) -> pa.StringArray:
    """Fresh lock tokens, UUID-shaped: the first 64 bits are the message's sequence number, the rest random.

    Embedding the sequence number lets a bare token (a DataFrame column of tokens, say) find its
    row without a scan; the random half makes every delivery's token different. Built as one
    buffer (no Python object per token): a receive of many thousand messages mints them in bulk.
    """
    values = np.asarray(pc.cast(seqs, pa.int64()).to_numpy(zero_copy_only=False), dtype=">u8")
    n = len(values)
    raw = np.empty((n, 16), np.uint8)
    raw[:, :8] = values.view(np.uint8).reshape(n, 8)
    raw[:, 8:] = np.frombuffer(os.urandom(8 * n), np.uint8).reshape(n, 8)
    nibbles = np.empty((n, 32), np.uint8)
    nibbles[:, 0::2] = raw >> 4
    nibbles[:, 1::2] = raw & 0x0F
    chars = np.full((n, TOKEN_LENGTH), ord("-"), np.uint8)
    chars[:, _TOKEN_HEX] = _HEX_DIGITS[nibbles]
    offsets = np.arange(0, TOKEN_LENGTH * (n + 1), TOKEN_LENGTH, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(chars.tobytes()))


def sequences_of_tokens(tokens: pa.Array | pa.ChunkedArray) -> pa.Int64Array:
    """Per token, the sequence number it was issued for; null where it is not a sparkqueue token (vectorized)."""
    tokens = pc.cast(tokens.combine_chunks() if isinstance(tokens, pa.ChunkedArray) else tokens, pa.string())
    n = len(tokens)
    shaped = pc.fill_null(pc.equal(pc.binary_length(tokens), TOKEN_LENGTH), False)
    picked = tokens.filter(shaped)
    m = len(picked)
    out = np.zeros(n, np.int64)
    ok = np.zeros(n, bool)
    if m:
        offsets = np.frombuffer(picked.buffers()[1], np.int32)[picked.offset : picked.offset + m + 1]
        data = np.frombuffer(picked.buffers()[2], np.uint8)[offsets[0] : offsets[-1]].reshape(m, TOKEN_LENGTH)
        digits = _NIBBLE[data[:, _SEQ_HEX]]
        good = (digits < 16).all(axis=1)
        packed = np.ascontiguousarray((digits[:, 0::2] << 4) | (digits[:, 1::2] & 0x0F))  # 8 bytes per token, big-endian
        value = packed.view(">u8").reshape(m).astype(np.int64)
        where = np.flatnonzero(shaped.to_numpy(zero_copy_only=False))
        out[where] = value
        ok[where] = good
    return pa.array(out, pa.int64(), mask=~ok)


class TokenItems(Sequence[tuple[int, str]]):
    """(sequence_number, lock_token) settle items held as two Arrow arrays side by side.

    A settle of many messages (a DataFrame's, in Spark tasks) passes its arrays as they are: the
    settle path works on arrays, and making a Python tuple per item on the way cost more than
    the rest of its bookkeeping. Indexing or iterating still gives tuples.
    """

    def __init__(self, seqs: pa.Int64Array, tokens: pa.StringArray) -> None:
        if len(seqs) != len(tokens):
            raise ValueError(f"{len(seqs)} sequence numbers for {len(tokens)} lock tokens")
        self.seqs = seqs
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.seqs)

    @overload
    def __getitem__(self, i: int) -> tuple[int, str]: ...

    @overload
    def __getitem__(self, i: slice) -> TokenItems: ...

    def __getitem__(self, i: int | slice) -> tuple[int, str] | TokenItems:
        if isinstance(i, slice):
            return TokenItems(self.seqs[i], self.tokens[i])
        return self.seqs[i].as_py(), self.tokens[i].as_py()

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return zip(self.seqs.to_pylist(), self.tokens.to_pylist(), strict=True)


def item_arrays(items: Sequence[tuple[int, str]]) -> tuple[pa.Int64Array, pa.StringArray]:
    """(sequence_number, lock_token) items as two arrays, side by side (TokenItems' own, as they are)."""
    if isinstance(items, TokenItems):
        return items.seqs, items.tokens
    return pa.array([s for s, _ in items], pa.int64()), pa.array([t for _, t in items], pa.string())

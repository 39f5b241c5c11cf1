"""Identifiers: message ids and lock tokens."""

from __future__ import annotations

import os


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


def lock_tokens(seqs: list[int]) -> list[str]:
    """Fresh lock tokens, UUID-shaped: the first 64 bits are the message's sequence number, the rest random.

    Embedding the sequence number lets a bare token (a DataFrame column of tokens, say) find its
    row without a scan; the random half makes every delivery's token different.
    """
    h = os.urandom(8 * len(seqs)).hex()
    out = []
    for i, seq in enumerate(seqs):
        s = f"{seq:016x}"
        r = h[16 * i : 16 * i + 16]
        out.append(f"{s[:8]}-{s[8:12]}-{s[12:16]}-{r[:4]}-{r[4:16]}")
    return out


def sequence_of_token(token: str) -> int | None:
    """The sequence number a lock token was issued for, or None when it is not a sparkqueue token."""
    if not isinstance(token, str) or len(token) != 36:
        return None
    try:
        return int(token[:8] + token[9:13] + token[14:18], 16)
    except ValueError:
        return None

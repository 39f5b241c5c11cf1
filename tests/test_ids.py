"""Lock tokens (model.ids): UUID-shaped, unique per delivery, and carrying their message's sequence number."""

from __future__ import annotations

import re
import uuid

import pyarrow as pa
import pytest

from sparkqueue.model.ids import TokenItems, item_arrays, lock_tokens, sequences_of_tokens

UUID_SHAPE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def test_tokens_are_uuid_shaped_fresh_and_carry_the_sequence_number() -> None:
    seqs = [0, 1, (15 << 48) | 123_456, (1 << 62) + 7]
    first, second = lock_tokens(pa.array(seqs, pa.int64())), lock_tokens(pa.chunked_array([seqs], pa.int64()))
    assert all(UUID_SHAPE.match(t) for t in first.to_pylist())
    assert all(str(uuid.UUID(t)) == t for t in first.to_pylist())
    assert not set(first.to_pylist()) & set(second.to_pylist())  # every delivery gets a new token
    assert sequences_of_tokens(first).to_pylist() == seqs == sequences_of_tokens(second).to_pylist()


def test_foreign_and_malformed_tokens_have_no_sequence_number() -> None:
    good = lock_tokens(pa.array([42], pa.int64()))[0].as_py()
    values = [None, "", "not-a-token", good[:-1], "zzzzzzzz-0000-0000-0000-000000000000", good.upper(), good]
    got = sequences_of_tokens(pa.array(values, pa.string()).slice(0))
    assert got.to_pylist() == [None, None, None, None, None, 42, 42]
    assert sequences_of_tokens(pa.array(["x" * 36, None], pa.string())).to_pylist() == [None, None]


def test_parsing_follows_slices_and_chunks() -> None:
    tokens = lock_tokens(pa.array(range(10), pa.int64()))
    chunked = pa.chunked_array([tokens.slice(2, 3), pa.array(["nope"]), tokens.slice(7)])
    assert sequences_of_tokens(chunked).to_pylist() == [2, 3, 4, None, 7, 8, 9]


def test_token_items_are_the_pairs_their_arrays_hold_and_pass_the_arrays_as_they_are() -> None:
    """TokenItems reads as a sequence of (sequence_number, lock_token) pairs; item_arrays hands back its own arrays."""
    seqs = pa.array([5, 7, 9], pa.int64())
    tokens = lock_tokens(seqs)
    items = TokenItems(seqs, tokens)
    pairs = list(zip([5, 7, 9], tokens.to_pylist(), strict=True))
    assert len(items) == 3 and list(items) == pairs
    assert items[1] == pairs[1] and items[-1] == pairs[-1]
    assert list(items[1:]) == pairs[1:]
    got_seqs, got_tokens = item_arrays(items)
    assert got_seqs is seqs and got_tokens is tokens  # no Python tuple per item on the way
    plain_seqs, plain_tokens = item_arrays(pairs)
    assert plain_seqs.equals(seqs) and plain_tokens.equals(tokens)
    with pytest.raises(ValueError, match="2 sequence numbers for 3 lock tokens"):
        TokenItems(seqs.slice(1), tokens)
